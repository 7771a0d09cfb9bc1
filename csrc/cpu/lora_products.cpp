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
// Which rows share the call, how they are tiled and which thread takes them change no bit of
// a row's result: it is batch-invariant, as the base's linear.cpp.
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
constexpr int kRowTile = 4;        // rows whose accumulators share a weight vector's load
constexpr int64_t kRowBlock = 32;  // rows of one work item (one slot's panel from cache)
// Multiply-adds below which a call runs on one thread: a step's decodes are tens of
// microseconds of work a matrix, less than waking the other threads (and, on a loaded
// machine, than waiting at the barrier for one that was descheduled).
constexpr int64_t kParallelWork = int64_t{1} << 22;

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

// One work item: rows [begin, end) of the sorted order, all of slot `slot`; `part` is the
// module's rank panel (shrink) or the column panel (expand).
struct Item {
  int64_t slot, part, begin, end;
};

// A column panel of the matrix: its module and its columns [first, first + count).
struct Panel {
  int64_t module, first, count;
};

struct Shapes {
  int64_t modules, rank_panels, K, col_panels, N;
  int64_t ranks_width() const { return rank_panels * kLanes; }  // u's ranks per module
};

// Items per task: all of them (one thread) for a small call.
int64_t grain(const std::vector<Item>& items, int64_t work) {
  return work < kParallelWork ? std::max<int64_t>(1, items.size()) : 1;
}

template <typename X, typename W>
void shrink(const X* x, int64_t ldx, const W* a, const Shapes& sh,
            const std::vector<int64_t>& order, const std::vector<Item>& items, float* u,
            int64_t work) {
  const int64_t K = sh.K, R = sh.ranks_width();
  const int64_t n = static_cast<int64_t>(items.size());
  at::parallel_for(0, n, grain(items, work), [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const Item& it = items[i];
      const int64_t m = it.part / sh.rank_panels, p = it.part % sh.rank_panels;
      const W* panel = a + ((it.slot * sh.modules + m) * sh.rank_panels + p) * K * kLanes;
      for (int64_t r0 = it.begin; r0 < it.end; r0 += kRowTile) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowTile, it.end - r0));
        const X* xr[kRowTile];
        Vec acc[kRowTile];
        for (int r = 0; r < kRowTile; ++r) {
          xr[r] = x + order[r0 + std::min(r, rows - 1)] * ldx;
          acc[r] = vzero();
        }
        for (int64_t k = 0; k < K; ++k) {
          const Vec w = vload(panel + k * kLanes);
#pragma GCC unroll 4
          for (int r = 0; r < kRowTile; ++r) acc[r] = vfma(static_cast<float>(xr[r][k]), w, acc[r]);
        }
        for (int r = 0; r < rows; ++r) {
          vstore(u + ((r0 + r) * sh.modules + m) * R + p * kLanes, acc[r]);
        }
      }
    }
  });
}

template <typename W, typename Y>
void expand(Y* y, int64_t ldy, const W* b, const int32_t* ranks, const Shapes& sh,
            const std::vector<Panel>& panels, const std::vector<int64_t>& order,
            const std::vector<Item>& items, const float* u, int64_t work) {
  const int64_t R = sh.ranks_width();
  const int64_t n = static_cast<int64_t>(items.size());
  at::parallel_for(0, n, grain(items, work), [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const Item& it = items[i];
      const Panel& pn = panels[it.part];
      const int64_t rank = ranks[it.slot * sh.modules + pn.module];
      const W* panel = b + (it.slot * sh.col_panels + it.part) * R * kLanes;
      for (int64_t r0 = it.begin; r0 < it.end; r0 += kRowTile) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowTile, it.end - r0));
        const float* ur[kRowTile];
        Vec acc[kRowTile];
        for (int r = 0; r < kRowTile; ++r) {
          ur[r] = u + ((r0 + std::min(r, rows - 1)) * sh.modules + pn.module) * R;
          acc[r] = vzero();
        }
        for (int64_t j = 0; j < rank; ++j) {
          const Vec w = vload(panel + j * kLanes);
#pragma GCC unroll 4
          for (int r = 0; r < kRowTile; ++r) acc[r] = vfma(ur[r][j], w, acc[r]);
        }
        for (int r = 0; r < rows; ++r) {
          float sum[kLanes];
          vstore(sum, acc[r]);
          Y* yr = y + order[r0 + r] * ldy + pn.first;
          for (int64_t l = 0; l < pn.count; ++l) {
            yr[l] = static_cast<Y>(static_cast<float>(yr[l]) + sum[l]);
          }
        }
      }
    }
  });
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
              torch::Tensor b, torch::Tensor ranks, torch::Tensor bounds) {
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
  TORCH_CHECK(bounds.scalar_type() == torch::kLong && bounds.numel() == sh.modules + 1,
              "bounds: [M + 1] int64");
  const int32_t* slot_of = slots.data_ptr<int32_t>();
  const int32_t* rank_of = ranks.data_ptr<int32_t>();
  const auto bounds_c = bounds.contiguous();
  const int64_t* edge = bounds_c.data_ptr<int64_t>();
  TORCH_CHECK(edge[0] == 0 && edge[sh.modules] == sh.N, "bounds must span y's columns");

  std::vector<Panel> panels;
  for (int64_t m = 0; m < sh.modules; ++m) {
    for (int64_t n = edge[m]; n < edge[m + 1]; n += kLanes) {
      panels.push_back({m, n, std::min(kLanes, edge[m + 1] - n)});
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

  std::vector<Item> shrinks, expands;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t begin = count[s]; begin < count[s + 1]; begin += kRowBlock) {
      const int64_t end = std::min(begin + kRowBlock, count[s + 1]);
      for (int64_t m = 0; m < sh.modules; ++m) {
        const int64_t used = (rank_of[s * sh.modules + m] + kLanes - 1) / kLanes;
        TORCH_CHECK(used <= sh.rank_panels, "a rank above the slots' panels");
        for (int64_t p = 0; p < used; ++p) {
          shrinks.push_back({s, m * sh.rank_panels + p, begin, end});
        }
      }
      for (int64_t c = 0; c < sh.col_panels; ++c) {
        if (rank_of[s * sh.modules + panels[c].module] > 0) expands.push_back({s, c, begin, end});
      }
    }
  }
  if (expands.empty()) return;
  // multiply-adds of the whole call (rows are whole items' rows at most)
  const int64_t R = sh.ranks_width();
  const int64_t work =
      static_cast<int64_t>(order.size()) * (sh.modules * R * sh.K + sh.col_panels * R * kLanes);

  std::vector<float> u(order.size() * sh.modules * sh.ranks_width());
  const auto run = [&](auto* x_ptr, auto* y_ptr) {
    with_weight_type(a, [&](auto* a_ptr) {
      shrink(x_ptr, x.stride(0), a_ptr, sh, order, shrinks, u.data(), work);
    });
    with_weight_type(b, [&](auto* b_ptr) {
      expand(y_ptr, y.stride(0), b_ptr, rank_of, sh, panels, order, expands, u.data(), work);
    });
  };
  const auto with_y = [&](auto* x_ptr) {
    if (y.scalar_type() == torch::kFloat) {
      run(x_ptr, y.data_ptr<float>());
    } else {
      run(x_ptr, y.data_ptr<c10::BFloat16>());
    }
  };
  if (x.scalar_type() == torch::kFloat) {
    with_y(x.data_ptr<float>());
  } else {
    with_y(x.data_ptr<c10::BFloat16>());
  }
}
