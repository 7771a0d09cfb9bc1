// Batch-invariant linear on AMX tiles: y[M, N] = x[M, K] @ w.T over the kernels' group layout,
// [P, groups, 64 * pack] with groups a multiple of 16 (the packing pads K with zeros): bf16
// pairs (linear_bf16.cpp, fp32 sums) or int8 quads (linear_int8.cpp, int32 sums).
//
// A block of y is 32 rows x half a 64-column panel (2 x 2 tiles) where 32 rows remain, else 16
// rows x the whole panel (1 x 4), summed over the k steps in order, 16 groups a step
// (amx_tiles.h): every y[m, n] is the same sequence of tile instructions over its own row of x
// whatever M, the block shape, the row blocking or the thread count (threads split the
// panels), so a row's result is bitwise the same in any batch. Every row count takes this path
// where the tiles run, one row alone included: its 15 zero rows cost arithmetic, which a
// single row has to spare, and no other kernel's rounding is mixed in.
//
// x must hold whole tiles: rows padded to a multiple of 16 and groups * pack columns (zeros
// past K). Rows past M and columns past N are summed into a scratch block and dropped; half a
// panel wholly past N is skipped.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "amx_tiles.h"
#include "linear_tiles.h"

namespace linear_amx {

using linear_tiles::kPanel;

// One block of kTall row tiles (rows [m, m + 16 * kTall) of x at `x`, ldx elements a row)
// against kPanel / kTall columns of a panel (`b`: their first group; `panel_row` elements a
// group), over `steps` k steps, into y (ldy elements a row): `rows` x `columns` of it, through
// `edge` when that is less than the whole block.
template <int64_t kTall, typename Tiles>
void block(Tiles& tiles, const typename Tiles::X* x, int64_t ldx, const typename Tiles::W* b,
           int64_t panel_row, int64_t steps, typename Tiles::Acc* y, int64_t ldy, int64_t rows,
           int64_t columns, typename Tiles::Acc* edge) {
  using Acc = typename Tiles::Acc;
  constexpr int64_t pack = 4 / sizeof(typename Tiles::X), width = kPanel / kTall;
  tiles.zero();
  for (int64_t s = 0; s < steps; ++s) {
    tiles.template step<kTall>(x + s * amx::kGroups * pack, ldx * sizeof(*x),
                               b + s * amx::kGroups * panel_row, panel_row * sizeof(*b));
  }
  if (rows == amx::kRows * kTall && columns == width) {
    tiles.template store<kTall>(y, ldy * sizeof(Acc));
    return;
  }
  tiles.template store<kTall>(edge, width * sizeof(Acc));
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(y + r * ldy, edge + r * width, columns * sizeof(Acc));
  }
}

// Tiles: amx::HardwareTiles<Kind> or amx::EmulatedTiles<Kind>. epilogue(m0, m1, unit) as in
// linear_tiles::run, a unit being one panel or (a wider epilogue's) several whole panels.
template <typename Tiles, typename Epilogue = linear_tiles::NoEpilogue>
void run(const typename Tiles::X* x, int64_t ldx, const typename Tiles::W* w,
         typename Tiles::Acc* y, int64_t M, int64_t N, int64_t groups,
         const Epilogue& epilogue = {}) {
  using X = typename Tiles::X;
  using Acc = typename Tiles::Acc;
  static_assert(Epilogue::kUnitVectors == 1 ||
                Epilogue::kUnitVectors % linear_tiles::kPanelVectors == 0);
  constexpr int64_t unit =  // panels of an epilogue's unit
      std::max<int64_t>(1, Epilogue::kUnitVectors / linear_tiles::kPanelVectors);
  constexpr int64_t pack = 4 / sizeof(X);       // k values per group (of 4 bytes)
  constexpr int64_t panel_row = kPanel * pack;  // w's elements per group of a panel
  const int64_t panels = (N + kPanel - 1) / kPanel, steps = groups / amx::kGroups;
  const int64_t row_bytes = groups * 4;
  constexpr int64_t pair = 2 * amx::kRows;  // a row block holds whole 2 x 2 blocks
  const int64_t row_block =
      std::max<int64_t>(pair, linear_tiles::kRowBlockBytes / row_bytes / pair * pair);
  // Enough multiply-adds per task (~256K) that a thread is worth waking, in whole units.
  const int64_t grain =
      std::max<int64_t>(1, (1 << 18) / (std::min(M, row_block) * groups * pack * kPanel * unit));
  at::parallel_for(0, (panels + unit - 1) / unit, grain, [&](int64_t u0, int64_t u1) {
    Tiles tiles;  // this thread's tile state
    alignas(64) Acc edge[amx::kRows * kPanel];  // a block that runs past M or N
    for (int64_t m0 = 0; m0 < M; m0 += row_block) {
      const int64_t m1 = std::min(M, m0 + row_block);
      for (int64_t u = u0; u < u1; ++u) {
        for (int64_t p = u * unit; p < std::min(panels, (u + 1) * unit); ++p) {
          const auto* panel = w + p * groups * panel_row;
          const int64_t n0 = p * kPanel, half = kPanel / 2;
          int64_t m = m0;
          for (; m1 - m > amx::kRows; m += pair) {  // 2 x 2 blocks, each half panel
            for (int64_t n = n0; n < std::min(N, n0 + kPanel); n += half) {
              block<2>(tiles, x + m * ldx, ldx, panel + (n - n0) * pack, panel_row, steps,
                       y + m * N + n, N, std::min(pair, m1 - m),
                       std::min(half, N - n), edge);
            }
          }
          if (m < m1) {  // 16 rows or fewer left: 1 x 4
            block<1>(tiles, x + m * ldx, ldx, panel, panel_row, steps, y + m * N + n0, N,
                     m1 - m, std::min(kPanel, N - n0), edge);
          }
        }
        if constexpr (Epilogue::kUnitVectors > 1) epilogue(m0, m1, u);
      }
    }
  });
}

}  // namespace linear_amx
