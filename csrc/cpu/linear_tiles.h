// The blocking shared by the batch-invariant linear kernels (linear.cpp, linear_bf16.cpp,
// linear_int8.cpp): y[M, N] = x[M, K] @ w.T with w packed once into panels of 64 columns.
//
// A kernel consumes k in steps of kPack elements (1: fp32 FMAs, 2: bf16 pair dot products,
// 4: int8 quad dot products); a panel holds, per k step, 64 columns x kPack values, so the
// packed weight is [P, steps, 64 * kPack] with steps = ceil(K / kPack). A tile is up to 6 rows
// x 4 vectors of 16 columns with its accumulators in registers; steps run in blocks whose
// slice of the panel stays in L1 while every row tile passes over it, the partial sums
// waiting in y (fp32 or int32, exact) between blocks. With many rows, the next block is
// prefetched while a block's tiles run.
//
// Every y[m, n] is one chain of dot-product steps over k in order, whatever M, the row or
// column blocking, vector tails or the thread count (threads split the columns): row m of
// the result is bitwise the same whatever other rows share the call.
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
constexpr int64_t kRowBlockBytes = 512 * 1024;  // x rows kept in L2 across the panels
// From this many row tiles a block's sweep prefetches the next block into L2, its lines shared
// out over the tiles: a block's arithmetic is then long enough to hide the fetch, which the
// first tile of the next block would otherwise wait on. Fewer rows leave it to the hardware
// prefetcher, which streams the panels best when the arithmetic is short. (2026-12-02, the
// 2-core host with full-width AVX-512, bf16, 2 threads, a whole model step, medians of 6
// rounds alternated: 64 decodes 49.3 -> 47.2 ms, 128 decodes 91.9 -> 88.0; from 2 tiles on,
// 16 decodes were slower, 15.6-17.5 -> 19.8-22.2 in 3 rounds.) Without AVX-512 a tile runs
// as four passes over its panel's block (linear.cpp), long enough from 2 tiles on (2026-12-03,
// an AVX2-only host, bf16, 2 threads, a whole decode step, medians of 121 steps, 8 -> 2
// alternated: 16 decodes 125.0 / 127.9 / 106.2 / 103.5 -> 102.1 / 108.1 / 91.1 / 89.4 ms,
// 8 decodes 75.4 / 76.2 / 61.6 / 68.2 -> 71.5 / 68.8 / 64.2 / 54.1; from 1 tile on, one
// decode was slower, 23.7 / 28.9 / 24.4 -> 27.8 / 30.7 / 31.6). Since then the AVX2 passes
// stream their panel rows themselves (kFetchesAhead, linear.cpp), which beat the burst; a build
// with neither AVX-512 nor AVX2 keeps it from 2 tiles on.
#ifdef __AVX512F__
constexpr int64_t kFetchTiles = 8;
#else
constexpr int64_t kFetchTiles = 2;
#endif

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
};

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
  constexpr int64_t block = std::max<int64_t>(1, kBlockBytes / step_bytes);
  constexpr int64_t block_lines = block * step_bytes / 64;
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
          const bool fetch = !fetches_ahead<K>() && next_step < all_steps && tiles >= kFetchTiles;
          int64_t line = 0, tile = 0;
          for (int64_t m = m0; m < m1; m += kMaxRows) {
            const int64_t mr = std::min<int64_t>(kMaxRows, m1 - m);
            if (fetch) {  // this tile's share of the next block's lines
              for (const int64_t until = block_lines * ++tile / tiles; line < until; ++line) {
                __builtin_prefetch(next + line * 64, 0, 2);  // prefetcht1
              }
            }
            kTiles<K>[mr - 1][nv - 1](x + m * ldx + k0 * pack, panel + k0 * kPanel * pack,
                                      y + m * N + n0, s, last);
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
