// Stacked LoRA products (lora_products.h): one call per fused matrix adds every row's adapter
// product, for all the adapters of a step (as punica's SGMV, or vLLM's sgmv shrink/expand,
// gathered by slot index on a CPU).
//
// The rows of each slot are taken together (a counting sort of the slot indices), so an
// adapter's panels are read from memory once per step and from cache for its other rows.
//   shrink: u[t, m, j] = sum over k of x[t, k] * a[s, m, j, k], one k-ordered FMA chain per
//           element (16 ranks a vector, x[t, k] broadcast: no horizontal sums);
//   expand: y[t, n] += sum over j < rank of u[t, m(n), j] * b[s, n, j], one j-ordered chain,
//           added to y once (y's dtype rounds once, as torch's add).
// A work item is one slot's rows (up to a block of them): its shrink, then its expand, so the
// threads meet once a call (a call of prompt rows; a decode step's calls run on one thread).
// The loops prefetch the panels 2 KB ahead of where they read: a decode step's panels come
// from memory in short runs, where the hardware prefetcher starts late (measured: a decode
// step's 120 calls, 16 rows over 8 adapters, cache flushed between layers, on a loaded
// machine: 9.5-10.5 ms with, 11.2-21.7 ms without).
// Items go to the threads in contiguous runs of about equal cost (the weights they read and
// the multiply-adds). Which rows share the call, how they are
// tiled (rows, and two panels side by side) and which thread takes them change no bit of a
// row's result: it is batch-invariant, as the base's linear.cpp.
#include "lora_products.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
constexpr int kRowTile = 4;        // rows whose chains run side by side (8 for one panel alone)
constexpr int64_t kRowBlock = 32;  // rows of one work item (one slot's panels from cache)
// An item's cost, to share the items out: per weight element, the rows it multiplies plus
// kLoadCost (reading it from memory: decodes read a slot's panels for one or two rows).
constexpr int64_t kLoadCost = 8;
// Multiply-adds per thread below which fewer threads take the call: a decode step's call is
// ~1M (8 adapters' panels streamed once, ~30 us on one thread), less than what waking a
// thread, or, on a loaded machine, waiting at the barrier for one that was descheduled,
// costs (measured: 16 rows x 8 adapters, a step's 120 calls, 3.8 ms on one thread against
// 7.6 ms on two at load average 15); prompt rows are worth both.
constexpr int64_t kTaskMacs = int64_t{1} << 21;
// Bytes ahead of the one being read that the loops prefetch: a slot's panels are short runs
// (a few KB each, slot after slot), which the hardware prefetcher takes up only after a few
// misses, and again at every 4 KB page; a decode step reads them from memory (the base's
// weights went through the cache since the last step).
constexpr int64_t kPrefetchBytes = 2048;

template <typename W>
inline void prefetch_ahead(const W* p) {
  __builtin_prefetch(reinterpret_cast<const char*>(p) + kPrefetchBytes);
}

#ifdef __AVX512F__

using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vload(const c10::BFloat16* p) {  // bf16 is the upper half of an fp32
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline Vec vfma(float x, Vec w, Vec acc) { return _mm512_fmadd_ps(_mm512_set1_ps(x), w, acc); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
// y[0, count) += acc's lanes, once each (fp32: one masked add)
inline void add_into(float* y, Vec acc, int64_t count) {
  const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
  _mm512_mask_storeu_ps(y, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, y), acc));
}

#else  // portable: the same chain per element, vectorized across the lanes by the compiler

struct Vec {
  float v[kLanes];
};
inline Vec vzero() { return Vec{}; }
template <typename W>
inline Vec vload(const W* p) {
  Vec r;
  for (int64_t l = 0; l < kLanes; ++l) r.v[l] = static_cast<float>(p[l]);
  return r;
}
inline Vec vfma(float x, Vec w, Vec acc) {
#pragma omp simd
  for (int64_t l = 0; l < kLanes; ++l) acc.v[l] = std::fma(x, w.v[l], acc.v[l]);
  return acc;
}
inline void vstore(float* p, Vec v) { std::memcpy(p, v.v, sizeof(v.v)); }

#endif

template <typename Y>
inline void add_into(Y* y, Vec acc, int64_t count) {  // bf16 (or portable): y's rounding per lane
  float sum[kLanes];
  vstore(sum, acc);
  for (int64_t l = 0; l < count; ++l) y[l] = static_cast<Y>(static_cast<float>(y[l]) + sum[l]);
}

// A column panel of the matrix: its module and its columns [first, first + count).
struct Panel {
  int64_t module, first, count;
};

// One work item: rows [begin, end) of the sorted order, all of slot `slot`; its multiply-adds
// and its cost (the threads' shares).
struct Item {
  int64_t slot, begin, end, macs, cost;
};

struct Shapes {
  int64_t modules, rank_panels, K, col_panels, N;
  int64_t ranks_width() const { return rank_panels * kLanes; }  // u's ranks per module
};

// u of ROWS rows for PARTS of a slot's A panels: dst[p * ROWS + r] gets row r's 16 ranks.
template <int ROWS, int PARTS, typename X, typename W>
void shrink_tile(const X* const* xr, const W* const* panel, int64_t K, float* const* dst) {
  Vec acc[PARTS][ROWS];
  for (int p = 0; p < PARTS; ++p) {
    for (int r = 0; r < ROWS; ++r) acc[p][r] = vzero();
  }
  for (int64_t k = 0; k < K; ++k) {
    for (int p = 0; p < PARTS; ++p) {
      prefetch_ahead(panel[p] + k * kLanes);
      const Vec w = vload(panel[p] + k * kLanes);
      for (int r = 0; r < ROWS; ++r) acc[p][r] = vfma(static_cast<float>(xr[r][k]), w, acc[p][r]);
    }
  }
  for (int p = 0; p < PARTS; ++p) {
    for (int r = 0; r < ROWS; ++r) vstore(dst[p * ROWS + r], acc[p][r]);
  }
}

// y += u · B for ROWS rows and PARTS column panels of one module (u's rank entries shared):
// dst[p * ROWS + r] is row r's first column of panel p.
template <int ROWS, int PARTS, typename W, typename Y>
void expand_tile(const float* const* ur, const W* const* panel, int64_t rank, Y* const* dst,
                 const int64_t* count) {
  Vec acc[PARTS][ROWS];
  for (int p = 0; p < PARTS; ++p) {
    for (int r = 0; r < ROWS; ++r) acc[p][r] = vzero();
  }
  for (int64_t j = 0; j < rank; ++j) {
    for (int p = 0; p < PARTS; ++p) {
      prefetch_ahead(panel[p] + j * kLanes);
      const Vec w = vload(panel[p] + j * kLanes);
      for (int r = 0; r < ROWS; ++r) acc[p][r] = vfma(ur[r][j], w, acc[p][r]);
    }
  }
  for (int p = 0; p < PARTS; ++p) {
    for (int r = 0; r < ROWS; ++r) add_into(dst[p * ROWS + r], acc[p][r], count[p]);
  }
}

// ROWS rows of PARTS panels: up to 4 rows of two panels, up to 8 of one (8 chains at most)
template <int PARTS, typename X, typename W>
void shrink_rows(int rows, const X* const* xr, const W* const* panel, int64_t K,
                 float* const* dst) {
  switch (rows) {
    case 1: return shrink_tile<1, PARTS>(xr, panel, K, dst);
    case 2: return shrink_tile<2, PARTS>(xr, panel, K, dst);
    case 3: return shrink_tile<3, PARTS>(xr, panel, K, dst);
    case 4: return shrink_tile<4, PARTS>(xr, panel, K, dst);
  }
  if constexpr (PARTS == 1) {
    switch (rows) {
      case 5: return shrink_tile<5, 1>(xr, panel, K, dst);
      case 6: return shrink_tile<6, 1>(xr, panel, K, dst);
      case 7: return shrink_tile<7, 1>(xr, panel, K, dst);
      default: return shrink_tile<8, 1>(xr, panel, K, dst);
    }
  }
}

template <int PARTS, typename W, typename Y>
void expand_rows(int rows, const float* const* ur, const W* const* panel, int64_t rank,
                 Y* const* dst, const int64_t* count) {
  switch (rows) {
    case 1: return expand_tile<1, PARTS>(ur, panel, rank, dst, count);
    case 2: return expand_tile<2, PARTS>(ur, panel, rank, dst, count);
    case 3: return expand_tile<3, PARTS>(ur, panel, rank, dst, count);
    default: return expand_tile<4, PARTS>(ur, panel, rank, dst, count);
  }
}

// The shrink of one item: u of its rows, for every rank panel its slot uses: two panels side
// by side over tiles of 4 rows, a panel left over alone over tiles of 8 (8 chains either way;
// each panel stays in cache over the item's rows).
template <typename X, typename W>
void shrink(const X* x, int64_t ldx, const W* a, const int32_t* rank_of, const Shapes& sh,
            const int64_t* order, const Item& it, float* u) {
  const int64_t K = sh.K, R = sh.ranks_width();
  std::vector<int64_t> parts;  // m * rank_panels + p, for the panels with ranks
  for (int64_t m = 0; m < sh.modules; ++m) {
    const int64_t used = (rank_of[it.slot * sh.modules + m] + kLanes - 1) / kLanes;
    for (int64_t p = 0; p < used; ++p) parts.push_back(m * sh.rank_panels + p);
  }
  const W* slot_a = a + it.slot * sh.modules * sh.rank_panels * K * kLanes;
  for (size_t i = 0; i < parts.size(); i += 2) {
    const int tile = parts.size() - i >= 2 ? 2 : 1;
    const int64_t row_tile = tile == 2 ? kRowTile : 2 * kRowTile;
    const W* panel[2];
    int64_t column[2];  // where each panel's 16 ranks sit in a row of u
    for (int q = 0; q < tile; ++q) {
      const int64_t part = parts[i + q], m = part / sh.rank_panels, p = part % sh.rank_panels;
      panel[q] = slot_a + part * K * kLanes;
      column[q] = m * R + p * kLanes;
    }
    for (int64_t r0 = it.begin; r0 < it.end; r0 += row_tile) {
      const int rows = static_cast<int>(std::min<int64_t>(row_tile, it.end - r0));
      const X* xr[2 * kRowTile];
      float* dst[2 * kRowTile];
      for (int r = 0; r < rows; ++r) xr[r] = x + order[r0 + r] * ldx;
      for (int q = 0; q < tile; ++q) {
        for (int r = 0; r < rows; ++r) {
          dst[q * rows + r] = u + (r0 + r) * sh.modules * R + column[q];
        }
      }
      if (tile == 2) {
        shrink_rows<2>(rows, xr, panel, K, dst);
      } else {
        shrink_rows<1>(rows, xr, panel, K, dst);
      }
    }
  }
}

// The expand of one item: its rows' products added to y, two column panels of a module at
// a time.
template <typename W, typename Y>
void expand(Y* y, int64_t ldy, const W* b, const int32_t* rank_of, const Shapes& sh,
            const std::vector<Panel>& panels, const int64_t* order, const Item& it,
            const float* u) {
  const int64_t R = sh.ranks_width();
  const W* slot_b = b + it.slot * sh.col_panels * R * kLanes;
  for (int64_t r0 = it.begin; r0 < it.end; r0 += kRowTile) {
    const int rows = static_cast<int>(std::min<int64_t>(kRowTile, it.end - r0));
    for (int64_t c = 0; c < sh.col_panels;) {
      const Panel& pn = panels[c];
      const int64_t rank = rank_of[it.slot * sh.modules + pn.module];
      const bool pair = c + 1 < sh.col_panels && panels[c + 1].module == pn.module;
      const int tile = pair ? 2 : 1;
      if (rank > 0) {
        const float* ur[kRowTile];
        for (int r = 0; r < rows; ++r) ur[r] = u + ((r0 + r) * sh.modules + pn.module) * R;
        const W* panel[2];
        Y* dst[2 * kRowTile];
        int64_t count[2];
        for (int q = 0; q < tile; ++q) {
          panel[q] = slot_b + (c + q) * R * kLanes;
          count[q] = panels[c + q].count;
          for (int r = 0; r < rows; ++r) {
            dst[q * rows + r] = y + order[r0 + r] * ldy + panels[c + q].first;
          }
        }
        if (pair) {
          expand_rows<2>(rows, ur, panel, rank, dst, count);
        } else {
          expand_rows<1>(rows, ur, panel, rank, dst, count);
        }
      }
      c += tile;
    }
  }
}

// The items' runs, one a task, of about equal cost: cut[i] .. cut[i + 1].
std::vector<int64_t> runs(const std::vector<Item>& items) {
  int64_t total = 0, macs = 0;
  for (const Item& it : items) {
    total += it.cost;
    macs += it.macs;
  }
  const int64_t tasks = std::max<int64_t>(
      1, std::min({static_cast<int64_t>(at::get_num_threads()),
                   static_cast<int64_t>(items.size()), macs / kTaskMacs}));
  std::vector<int64_t> cut(tasks + 1, static_cast<int64_t>(items.size()));
  cut[0] = 0;
  int64_t sum = 0, task = 1;
  for (size_t i = 0; i < items.size() && task < tasks; ++i) {
    sum += items[i].cost;
    while (task < tasks && sum * tasks >= total * task) cut[task++] = static_cast<int64_t>(i) + 1;
  }
  return cut;
}

template <typename F>
void with_weight_type(const torch::Tensor& w, F&& f) {
  if (w.scalar_type() == torch::kFloat) {
    f(w.data_ptr<float>());
  } else {
    f(w.data_ptr<c10::BFloat16>());
  }
}

}  // namespace

void lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor slots, torch::Tensor a,
              torch::Tensor b, torch::Tensor ranks, torch::Tensor bounds, int64_t interleave) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "x: [T, K]; y: [T, N]");
  TORCH_CHECK(a.dim() == 5 && b.dim() == 4 && a.size(4) == kLanes && b.size(3) == kLanes,
              "a: [S, M, P, K, 16]; b: [S, C, 16 P, 16]");
  const Shapes sh{a.size(1), a.size(2), a.size(3), b.size(1), y.size(1)};
  const int64_t S = a.size(0), T = x.size(0);
  TORCH_CHECK(x.size(1) == sh.K && b.size(0) == S && b.size(2) == sh.ranks_width(),
              "a, b and x do not fit one another");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.scalar_type() == b.scalar_type() &&
                  (a.scalar_type() == torch::kFloat || a.scalar_type() == torch::kBFloat16),
              "a and b: contiguous, float32 or bfloat16 alike");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16,
              "x: float32 or bfloat16");
  TORCH_CHECK(y.scalar_type() == torch::kFloat || y.scalar_type() == torch::kBFloat16,
              "y: float32 or bfloat16");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "x and y: unit column stride");
  TORCH_CHECK(slots.scalar_type() == torch::kInt && slots.is_contiguous() && slots.numel() == T,
              "slots: [T] int32");
  TORCH_CHECK(ranks.scalar_type() == torch::kInt && ranks.is_contiguous() &&
                  ranks.numel() == S * sh.modules,
              "ranks: [S, M] int32");
  TORCH_CHECK(bounds.scalar_type() == torch::kLong && bounds.is_contiguous() &&
                  bounds.numel() == sh.modules + 1,
              "bounds: [M + 1] int64, contiguous");
  const int32_t* slot_of = slots.data_ptr<int32_t>();
  const int32_t* rank_of = ranks.data_ptr<int32_t>();
  const int64_t* edge = bounds.data_ptr<int64_t>();
  TORCH_CHECK(edge[0] == 0 && edge[sh.modules] == sh.N, "bounds must span y's columns");

  const int64_t width = sh.N / sh.modules;  // each module's, where they are interleaved
  TORCH_CHECK(interleave >= 0, "interleave: 0 or a positive turn");
  if (interleave > 0) {
    TORCH_CHECK(interleave % kLanes == 0 && sh.N % sh.modules == 0 && width % interleave == 0,
                "interleave: a multiple of 16 dividing every module's columns");
    for (int64_t m = 0; m < sh.modules; ++m) {
      TORCH_CHECK(edge[m + 1] - edge[m] == width, "interleave: modules of equal width");
    }
  }
  // y's column of module m's column n (n from edge[m]): n, or in an interleaved y, its block
  // of `interleave` columns after those of the block before it in every module
  const auto column = [&](int64_t m, int64_t n) {
    if (interleave <= 0) return n;
    const int64_t own = n - edge[m];
    return own / interleave * interleave * sh.modules + m * interleave + own % interleave;
  };
  std::vector<Panel> panels;
  for (int64_t m = 0; m < sh.modules; ++m) {
    for (int64_t n = edge[m]; n < edge[m + 1]; n += kLanes) {
      panels.push_back({m, column(m, n), std::min(kLanes, edge[m + 1] - n)});
    }
  }
  TORCH_CHECK(static_cast<int64_t>(panels.size()) == sh.col_panels,
              "b's column panels do not fit bounds");

  // rows of each slot together, in row order within a slot (a counting sort)
  std::vector<int64_t> count(S + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t s = slot_of[t];
    TORCH_CHECK(s >= -1 && s < S, "slot ", s, " of row ", t, " is not one of ", S);
    if (s >= 0) ++count[s + 1];
  }
  for (int64_t s = 0; s < S; ++s) count[s + 1] += count[s];
  std::vector<int64_t> order(count[S]);
  std::vector<int64_t> fill(count.begin(), count.end() - 1);
  for (int64_t t = 0; t < T; ++t) {
    if (slot_of[t] >= 0) order[fill[slot_of[t]]++] = t;
  }

  // one item a block of a slot's rows, if the slot changes this matrix at all
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s) {
    int64_t elements = 0;  // of the slot's panels the call reads (A's, then B's)
    for (int64_t m = 0; m < sh.modules; ++m) {
      const int64_t rank = rank_of[s * sh.modules + m];
      TORCH_CHECK(rank >= 0 && (rank + kLanes - 1) / kLanes <= sh.rank_panels,
                  "a rank above the slots' panels");
      elements += (rank + kLanes - 1) / kLanes * sh.K * kLanes;
    }
    for (const Panel& pn : panels) elements += rank_of[s * sh.modules + pn.module] * kLanes;
    if (elements == 0) continue;
    for (int64_t begin = count[s]; begin < count[s + 1]; begin += kRowBlock) {
      const int64_t end = std::min(begin + kRowBlock, count[s + 1]);
      items.push_back({s, begin, end, elements * (end - begin),
                       elements * (end - begin + kLoadCost)});
    }
  }
  if (items.empty()) return;
  const std::vector<int64_t> cut = runs(items);
  const int64_t tasks = static_cast<int64_t>(cut.size()) - 1;

  std::vector<float> u(order.size() * sh.modules * sh.ranks_width());
  const auto run = [&](auto* x_ptr, auto* y_ptr, auto* a_ptr, auto* b_ptr) {
    at::parallel_for(0, tasks, 1, [&](int64_t first, int64_t last) {
      for (int64_t i = cut[first]; i < cut[last]; ++i) {
        shrink(x_ptr, x.stride(0), a_ptr, rank_of, sh, order.data(), items[i], u.data());
        expand(y_ptr, y.stride(0), b_ptr, rank_of, sh, panels, order.data(), items[i], u.data());
      }
    });
  };
  const auto with_y = [&](auto* x_ptr) {
    with_weight_type(a, [&](auto* a_ptr) {
      const auto* b_ptr = reinterpret_cast<decltype(a_ptr)>(b.data_ptr());
      if (y.scalar_type() == torch::kFloat) {
        run(x_ptr, y.data_ptr<float>(), a_ptr, b_ptr);
      } else {
        run(x_ptr, y.data_ptr<c10::BFloat16>(), a_ptr, b_ptr);
      }
    });
  };
  if (x.scalar_type() == torch::kFloat) {
    with_y(x.data_ptr<float>());
  } else {
    with_y(x.data_ptr<c10::BFloat16>());
  }
}
