// The blocking shared by the batch-invariant linear kernels (linear.cpp, linear_bf16.cpp,
// linear_int8.cpp): y[M, N] = x[M, K] @ w.T with w packed once into panels of 64 columns.
//
// A kernel consumes k in steps of kPack elements (1: fp32 FMAs, 2: bf16 pair dot products,
// 4: int8 quad dot products); a panel holds, per k step, 64 columns x kPack values, so the
// packed weight is [P, steps, 64 * kPack] with steps = ceil(K / kPack). A tile is up to 6 rows
// x 4 vectors of 16 columns with its accumulators in registers; steps run in blocks whose
// slice of the panel stays in L1 (a few rows) or L2 (many rows) while every row tile passes
// over it, the partial sums waiting in y (fp32 or int32, exact) between blocks. The next block
// is prefetched while a block's tiles run, a few lines a k step.
//
// Every y[m, n] is one chain of dot-product steps over k in order, whatever M, the row, column
// or k blocking, vector tails or the thread count (threads split the columns): row m of the
// result is bitwise the same whatever other rows share the call.
//
// An epilogue may take each unit of columns (kUnitVectors vectors, handed to one thread whole)
// once a row block's sums over them are complete, while they are still in cache.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace linear_tiles {

constexpr int64_t kLanes = 16;  // columns per vector
constexpr int64_t kPanel = 64;  // columns per panel
constexpr int64_t kPanelVectors = kPanel / kLanes;
constexpr int kMaxRows = 6;                     // rows per tile: 6 x 4 accumulators
constexpr int64_t kBlockBytes = 24 * 1024;      // one k block of a panel: fits L1
// From kWideRows rows on, a block is up to kWideBlockBytes, read from L2 by each row tile: a
// block's tiles then store and reload their sums a third as often (a panel of K = 576 is one
// block). On the 2-core AMD EPYC host with AVX-512 and AVX512-BF16 (2026-12-05, the engine's
// steps, 2 threads, weights on 2 MiB pages, the sizes alternated step by step in one process,
// medians of 6-27 steps; whole step ms at 24 / 64 / 96 / 128 KiB): a 256-token prefill step
// 150.7 / 148.7 / 147.0 / 148.2, 64 decodes 64.9 / 64.4 / 63.8 / 63.6, but 16 decodes 16.8 /
// 17.2 / 17.1 / 17.5 and 1 decode 10.8 / 10.6 / 11.0 / 11.1; 32 decodes 30.7 at 24 and 96.
// The fp32 and int8 kernels on their own (30 layers' weights, 10 rounds): 96 KiB +3-4% at
// 64 and 256 rows. Kernels that stream their panel rows themselves (kFetchesAhead) keep
// kBlockBytes.
constexpr int64_t kWideRows = 32;
constexpr int64_t kWideBlockBytes = 96 * 1024;
constexpr int64_t kRowBlockBytes = 512 * 1024;  // x rows kept in L2 across the panels
// Every tile of a block fetches its share of the next block's lines into L2, a line or a few
// each k step (fetch_step), so a panel streams from memory at an even pace while the block's
// tiles run, and the next block's first tile finds its lines in L2. Before (2026-12-02), a tile
// fetched its whole share at once as it started, and only from 8 tiles on: fewer rows left the
// stream to the hardware prefetcher, which idles while the second and later tiles run from L1.
// On the 2-core AMD EPYC host with AVX-512 and AVX512-BF16 (2026-12-04, the engine's decode
// steps, 2 threads, the two alternated step by step in one process, medians of 51-96 steps;
// matmul ms per step): bf16 16 rows 21.6 -> 17.1, 64 rows 54.2 -> 52.9, 1 row 11.5 -> 11.4, a
// prefill step of 256 tokens 162.8 -> 163.6; fp32 16 rows 33.4 -> 30.3, 64 rows 100.3 -> 96.7,
// 1 row 21.4 -> 20.9; W8A8 whole steps 31.5 -> 31.7 (16 rows), 92.0 -> 90.8 (64), 9.3 -> 8.8
// (1). Kernels whose passes stream their panel rows themselves (kFetchesAhead: the AVX2
// build's, linear.cpp) fetch nothing here; a build with neither AVX2 nor AVX-512 fetches as
// above, not measured on such a CPU.

template <typename K>
constexpr bool fetches_ahead() {
  if constexpr (requires { K::kFetchesAhead; }) {
    return K::kFetchesAhead;
  } else {
    return false;
  }
}

struct Step {
  int64_t kc, ldx, ldy;  // k steps of this block; row strides of x and y (in elements)
  bool first;            // the block starts at k = 0: accumulators start from zero
  // The tile's share of the next block's lines, fetched into L2 a few a k step (fetch_step).
  const char* fetch = nullptr;
  int64_t fetch_lines = 0, fetch_per_step = 0;
};

// In a tile's k loop: step k's lines of the tile's share of the next block.
[[gnu::always_inline]] inline void fetch_step(const Step& s, int64_t k) {
  for (int64_t j = k * s.fetch_per_step, e = std::min(s.fetch_lines, j + s.fetch_per_step);
       j < e; ++j) {
    __builtin_prefetch(s.fetch + j * 64, 0, 2);  // prefetcht1
  }
}

// Kernel: X, W, Acc types; kPack; tile<MR, NV>(x, w, y, step, last) computing one k block of
// MR rows against NV vectors of a panel (the last vector holding `last` columns).
template <typename K>
using TileFn = void (*)(const typename K::X*, const typename K::W*, typename K::Acc*,
                        const Step&, int64_t);

template <typename K, int MR>
constexpr TileFn<K> kRowTiles[kPanelVectors] = {&K::template tile<MR, 1>, &K::template tile<MR, 2>,
                                                &K::template tile<MR, 3>,
                                                &K::template tile<MR, 4>};

template <typename K>
constexpr const TileFn<K>* kTiles[kMaxRows] = {kRowTiles<K, 1>, kRowTiles<K, 2>, kRowTiles<K, 3>,
                                               kRowTiles<K, 4>, kRowTiles<K, 5>, kRowTiles<K, 6>};

// The plain product: no epilogue, units of one vector.
struct NoEpilogue {
  static constexpr int64_t kUnitVectors = 1;
  void operator()(int64_t, int64_t, int64_t) const {}
};

// y [M, N] (row stride N) over x [M, steps * kPack] (row stride ldx) and w packed
// [ceil(N / 64), steps, 64 * kPack]; epilogue(m0, m1, unit) once rows [m0, m1) of a unit
// are summed.
template <typename K, typename Epilogue = NoEpilogue>
void run(const typename K::X* x, int64_t ldx, const typename K::W* w, typename K::Acc* y,
         int64_t M, int64_t N, int64_t steps, const Epilogue& epilogue = {}) {
  constexpr int64_t unit = Epilogue::kUnitVectors;
  constexpr int64_t pack = K::kPack;
  constexpr int64_t step_bytes = kPanel * pack * sizeof(typename K::W);
  const int64_t block_bytes =
      M >= kWideRows && !fetches_ahead<K>() ? kWideBlockBytes : kBlockBytes;
  const int64_t block = std::max<int64_t>(1, block_bytes / step_bytes);
  const int64_t block_lines = block * step_bytes / 64;
  const int64_t vectors = (N + kLanes - 1) / kLanes;
  const int64_t all_steps = (vectors + kPanelVectors - 1) / kPanelVectors * steps;  // of w
  const int64_t row_bytes = steps * pack * static_cast<int64_t>(sizeof(typename K::X));
  const int64_t row_block =
      std::max<int64_t>(kMaxRows, kRowBlockBytes / row_bytes / kMaxRows * kMaxRows);
  // Enough multiply-adds per task (~256K) that a thread is worth waking, in whole units.
  const int64_t grain =
      (std::max<int64_t>(1, (1 << 18) / (std::min(M, row_block) * steps * pack * kLanes)) +
       unit - 1) / unit;
  at::parallel_for(0, (vectors + unit - 1) / unit, grain, [&](int64_t u0, int64_t u1) {
    const int64_t v0 = u0 * unit, v1 = std::min(vectors, u1 * unit);
    for (int64_t m0 = 0; m0 < M; m0 += row_block) {
      const int64_t m1 = std::min(M, m0 + row_block);
      for (int64_t v = v0; v < v1;) {
        const int64_t nv = std::min(v1, (v / kPanelVectors + 1) * kPanelVectors) - v;
        const int64_t n0 = v * kLanes;
        const int64_t last = std::min(N - n0 - (nv - 1) * kLanes, kLanes);
        const typename K::W* panel =
            w + ((v / kPanelVectors) * steps * kPanel + (v % kPanelVectors) * kLanes) * pack;
        for (int64_t k0 = 0; k0 < steps; k0 += block) {
          const Step s{std::min(block, steps - k0), ldx, N, k0 == 0};
          // the block after this one in memory (this panel's next, or the next panel's first)
          const int64_t next_step = (v / kPanelVectors) * steps + k0 + s.kc;
          const char* next = reinterpret_cast<const char*>(w + next_step * kPanel * pack);
          const int64_t tiles = (m1 - m0 + kMaxRows - 1) / kMaxRows;
          const bool fetch = !fetches_ahead<K>() && next_step < all_steps;
          int64_t line = 0, tile = 0;
          Step t = s;
          for (int64_t m = m0; m < m1; m += kMaxRows) {
            const int64_t mr = std::min<int64_t>(kMaxRows, m1 - m);
            if (fetch) {  // this tile's share of the next block's lines
              const int64_t until = block_lines * ++tile / tiles;
              t.fetch = next + line * 64;
              t.fetch_lines = until - line;
              t.fetch_per_step = (t.fetch_lines + s.kc - 1) / s.kc;
              line = until;
            }
            kTiles<K>[mr - 1][nv - 1](x + m * ldx + k0 * pack, panel + k0 * kPanel * pack,
                                      y + m * N + n0, t, last);
          }
        }
        v += nv;
        if constexpr (unit > 1) {
          if (v % unit == 0 || v == v1) epilogue(m0, m1, (v - 1) / unit);
        }
      }
    }
  });
}

}  // namespace linear_tiles
