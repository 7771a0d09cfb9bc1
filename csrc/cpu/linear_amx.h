// Batch-invariant bf16 linear on AMX tiles: y[M, N] = x[M, K] @ w.T over linear_bf16.cpp's
// pair layout, [P, pairs, 128] with pairs a multiple of 16 (the packing pads K with zeros).
//
// A tile of y is 16 rows x one 64-column panel, summed over the k steps in order, 16 pairs a
// step (amx_tiles.h): every y[m, n] is the same sequence of tile instructions over its own
// row of x whatever M, the row blocking or the thread count (threads split the panels), so a
// row's result is bitwise the same in any batch. Every row count takes this path where the
// tiles run, one row alone included: its 15 zero rows cost arithmetic, which a single row
// has to spare, and no other kernel's rounding is mixed in.
//
// x must hold whole tiles: rows padded to a multiple of 16 and pairs * 2 columns (zeros
// past K). Rows past M and columns past N are summed into a scratch tile and dropped.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "amx_tiles.h"
#include "linear_tiles.h"

namespace linear_amx {

using amx::bf16;
using linear_tiles::kPanel;

// Tiles: amx::HardwareTiles or amx::EmulatedTiles. epilogue(m0, m1, unit) as in
// linear_tiles::run, a unit being one panel or (a wider epilogue's) several whole panels.
template <typename Tiles, typename Epilogue = linear_tiles::NoEpilogue>
void run(const bf16* x, int64_t ldx, const bf16* w, float* y, int64_t M, int64_t N,
         int64_t pairs, const Epilogue& epilogue = {}) {
  static_assert(Epilogue::kUnitVectors == 1 ||
                Epilogue::kUnitVectors % linear_tiles::kPanelVectors == 0);
  constexpr int64_t unit =  // panels of an epilogue's unit
      std::max<int64_t>(1, Epilogue::kUnitVectors / linear_tiles::kPanelVectors);
  constexpr int64_t panel_row = kPanel * 2;  // bf16 per pair of a panel: 64 columns' pairs
  const int64_t panels = (N + kPanel - 1) / kPanel, steps = pairs / amx::kPairs;
  const int64_t row_bytes = pairs * 2 * static_cast<int64_t>(sizeof(bf16));
  const int64_t row_block = std::max<int64_t>(
      amx::kRows, linear_tiles::kRowBlockBytes / row_bytes / amx::kRows * amx::kRows);
  // Enough multiply-adds per task (~256K) that a thread is worth waking, in whole units.
  const int64_t grain =
      std::max<int64_t>(1, (1 << 18) / (std::min(M, row_block) * pairs * 2 * kPanel * unit));
  at::parallel_for(0, (panels + unit - 1) / unit, grain, [&](int64_t u0, int64_t u1) {
    Tiles tiles;  // this thread's tile state
    alignas(64) float edge[amx::kRows * kPanel];  // a tile that runs past M or N
    for (int64_t m0 = 0; m0 < M; m0 += row_block) {
      const int64_t m1 = std::min(M, m0 + row_block);
      for (int64_t u = u0; u < u1; ++u) {
        for (int64_t p = u * unit; p < std::min(panels, (u + 1) * unit); ++p) {
          const bf16* panel = w + p * pairs * panel_row;
          const int64_t n0 = p * kPanel, columns = std::min(kPanel, N - n0);
          for (int64_t m = m0; m < m1; m += amx::kRows) {
            tiles.zero();
            for (int64_t s = 0; s < steps; ++s) {
              tiles.step(x + m * ldx + s * amx::kPairs * 2, ldx * sizeof(bf16),
                         panel + s * amx::kPairs * panel_row, panel_row * sizeof(bf16));
            }
            const int64_t rows = std::min(amx::kRows, m1 - m);
            if (rows == amx::kRows && columns == kPanel) {
              tiles.store(y + m * N + n0, N * sizeof(float));
              continue;
            }
            tiles.store(edge, kPanel * sizeof(float));
            for (int64_t r = 0; r < rows; ++r) {
              std::memcpy(y + (m + r) * N + n0, edge + r * kPanel, columns * sizeof(float));
            }
          }
        }
        if constexpr (Epilogue::kUnitVectors > 1) epilogue(m0, m1, u);
      }
    }
  });
}

}  // namespace linear_amx
