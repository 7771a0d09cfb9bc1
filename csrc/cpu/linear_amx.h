// Batch-invariant linear on AMX tiles: y[M, N] = x[M, K] @ w.T over the kernels' group layout,
// [P, groups, 64 * pack] with groups a multiple of 16 (the packing pads K with zeros): bf16
// pairs (linear_bf16.cpp, fp32 sums) or int8 quads (linear_int8.cpp, int32 sums).
//
// A tile of y is 16 rows x one 64-column panel, summed over the k steps in order, 16 groups a
// step (amx_tiles.h): every y[m, n] is the same sequence of tile instructions over its own
// row of x whatever M, the row blocking or the thread count (threads split the panels), so a
// row's result is bitwise the same in any batch. Every row count takes this path where the
// tiles run, one row alone included: its 15 zero rows cost arithmetic, which a single row
// has to spare, and no other kernel's rounding is mixed in.
//
// x must hold whole tiles: rows padded to a multiple of 16 and groups * pack columns (zeros
// past K). Rows past M and columns past N are summed into a scratch tile and dropped.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "amx_tiles.h"
#include "linear_tiles.h"

namespace linear_amx {

using linear_tiles::kPanel;

// Tiles: amx::HardwareTiles<Kind> or amx::EmulatedTiles<Kind>. epilogue(m0, m1, unit) as in
// linear_tiles::run, a unit being one panel or (a wider epilogue's) several whole panels.
template <typename Tiles, typename Epilogue = linear_tiles::NoEpilogue>
void run(const typename Tiles::X* x, int64_t ldx, const typename Tiles::W* w,
         typename Tiles::Acc* y, int64_t M, int64_t N, int64_t groups,
         const Epilogue& epilogue = {}) {
  using X = typename Tiles::X;
  using W = typename Tiles::W;
  using Acc = typename Tiles::Acc;
  static_assert(Epilogue::kUnitVectors == 1 ||
                Epilogue::kUnitVectors % linear_tiles::kPanelVectors == 0);
  constexpr int64_t unit =  // panels of an epilogue's unit
      std::max<int64_t>(1, Epilogue::kUnitVectors / linear_tiles::kPanelVectors);
  constexpr int64_t pack = 4 / sizeof(X);       // k values per group (of 4 bytes)
  constexpr int64_t panel_row = kPanel * pack;  // w's elements per group of a panel
  const int64_t panels = (N + kPanel - 1) / kPanel, steps = groups / amx::kGroups;
  const int64_t row_bytes = groups * 4;
  const int64_t row_block = std::max<int64_t>(
      amx::kRows, linear_tiles::kRowBlockBytes / row_bytes / amx::kRows * amx::kRows);
  // Enough multiply-adds per task (~256K) that a thread is worth waking, in whole units.
  const int64_t grain =
      std::max<int64_t>(1, (1 << 18) / (std::min(M, row_block) * groups * pack * kPanel * unit));
  at::parallel_for(0, (panels + unit - 1) / unit, grain, [&](int64_t u0, int64_t u1) {
    Tiles tiles;  // this thread's tile state
    alignas(64) Acc edge[amx::kRows * kPanel];  // a tile that runs past M or N
    for (int64_t m0 = 0; m0 < M; m0 += row_block) {
      const int64_t m1 = std::min(M, m0 + row_block);
      for (int64_t u = u0; u < u1; ++u) {
        for (int64_t p = u * unit; p < std::min(panels, (u + 1) * unit); ++p) {
          const auto* panel = w + p * groups * panel_row;
          const int64_t n0 = p * kPanel, columns = std::min(kPanel, N - n0);
          for (int64_t m = m0; m < m1; m += amx::kRows) {
            tiles.zero();
            for (int64_t s = 0; s < steps; ++s) {
              tiles.step(x + m * ldx + s * amx::kGroups * pack, ldx * sizeof(X),
                         panel + s * amx::kGroups * panel_row, panel_row * sizeof(W));
            }
            const int64_t rows = std::min(amx::kRows, m1 - m);
            if (rows == amx::kRows && columns == kPanel) {
              tiles.store(y + m * N + n0, N * sizeof(Acc));
              continue;
            }
            tiles.store(edge, kPanel * sizeof(Acc));
            for (int64_t r = 0; r < rows; ++r) {
              std::memcpy(y + (m + r) * N + n0, edge + r * kPanel, columns * sizeof(Acc));
            }
          }
        }
        if constexpr (Epilogue::kUnitVectors > 1) epilogue(m0, m1, u);
      }
    }
  });
}

}  // namespace linear_amx
