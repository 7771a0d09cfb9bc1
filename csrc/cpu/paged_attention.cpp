// Paged attention on CPU: one work item per (query row, head), scores in a thread-local
// buffer (over the row's sliding window, when the layer has one; soft-capped for Gemma 2),
// exact softmax in float32, V accumulated in float32. Items of one row and KV group
// are adjacent, so a thread reuses the group's K/V from its cache across the query heads.
// With AVX-512, fp32 and bf16 caches take attend_heads below instead (a row's heads by KV
// group, vectorized over d); fp16, or a build without AVX-512, takes attend_one.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec_math.h"

namespace {

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

template <typename T>
inline void axpy(float* acc, float p, const T* v, int64_t d) {
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) acc[i] += p * static_cast<float>(v[i]);
}

struct Layout {
  int64_t block_size, block_stride, token_stride, v_offset, head_dim;
};

// One query head of one row over the paged context tokens [first, context) in `table`.
template <typename T>
void attend_one(const T* q_in, T* out, const T* cache, const int64_t* table, int64_t first,
                int64_t context, int64_t kv_head, const Layout& l, float scale, float softcap,
                std::vector<float>& scores) {
  const int64_t d = l.head_dim;
  float q[512], acc[512];
  for (int64_t i = 0; i < d; ++i) q[i] = static_cast<float>(q_in[i]) * scale;
  scores.resize(context - first);
  float top = -INFINITY;
  for (int64_t t = first; t < context;) {  // one run of tokens inside one block
    const int64_t offset = t % l.block_size, n = std::min(l.block_size - offset, context - t);
    const T* k = cache + table[t / l.block_size] * l.block_stride + offset * l.token_stride +
                 kv_head * d;
    for (int64_t j = 0; j < n; ++j) {
      float s = dot(q, k + j * l.token_stride, d);
      if (softcap > 0.f) s = softcap * std::tanh(s / softcap);
      scores[t - first + j] = s;
      top = std::max(top, s);
    }
    t += n;
  }
  float total = 0.f;
  for (int64_t t = 0; t < context - first; ++t) {
    scores[t] = std::exp(scores[t] - top);
    total += scores[t];
  }
  std::fill(acc, acc + d, 0.f);
  for (int64_t t = first; t < context;) {
    const int64_t offset = t % l.block_size, n = std::min(l.block_size - offset, context - t);
    const T* v = cache + table[t / l.block_size] * l.block_stride + offset * l.token_stride +
                 l.v_offset + kv_head * d;
    for (int64_t j = 0; j < n; ++j) axpy(acc, scores[t - first + j], v + j * l.token_stride, d);
    t += n;
  }
  const float inv = 1.f / total;
  for (int64_t i = 0; i < d; ++i) out[i] = static_cast<T>(acc[i] * inv);
}

#ifdef __AVX512F__

// The AVX-512 path (fp32 and bf16 caches): the G = heads / kv_heads query heads of a KV
// group are computed together, so each K vector is loaded
// (and widened) once for all G. A head's arithmetic is the same whatever the batch or the
// threads: q.k over d as 16 lanes reduced by a fixed tree, times the scale; exact softmax
// with vec_math::exp16, summed in 16 lanes then a fixed tree; V accumulated in fp32 over the
// tokens in order.
constexpr int64_t kChunk = 64;  // head dims per pass over V: 4 vectors in registers

// One fixed tree over the 16 lanes (halves, then quarters, then within 128 bits).
inline float lane_sum(__m512 v) { return _mm512_reduce_add_ps(v); }

// KV heads [kv_begin, kv_end) of one query row, each with its G = heads / kv_heads query
// heads. K is read token by token across those KV heads (one contiguous run of each token's
// row, which the hardware prefetcher follows: decode rows read K and V from memory, not
// cache); the scores, softmax and V are then per KV head, V from the cache lines K's pass
// brought in.
template <int G, typename T>
void attend_heads(const T* q_in, T* out, const T* cache, const int64_t* table, int64_t first,
                  int64_t context, int64_t kv_begin, int64_t kv_end, const Layout& l,
                  float scale, float softcap, std::vector<float>& scores,
                  std::vector<float>& q) {
  using vec_math::lanes_below;
  using vec_math::load16;
  const int64_t d = l.head_dim, n = context - first, vectors = (d + 15) / 16;
  const int64_t padded = (n + 15) / 16 * 16, groups = kv_end - kv_begin;
  scores.resize(groups * G * padded);
  q.resize(groups * G * vectors * 16);
  for (int64_t h = 0; h < groups * G; ++h) {  // the query heads, widened once
    for (int64_t v = 0; v < vectors; ++v) {
      _mm512_storeu_ps(q.data() + (h * vectors + v) * 16,
                       load16(q_in + h * d + v * 16, lanes_below(d - v * 16)));
    }
  }
  for (int64_t t = first; t < context;) {  // one run of tokens inside one block
    const int64_t offset = t % l.block_size, run = std::min(l.block_size - offset, context - t);
    const T* row = cache + table[t / l.block_size] * l.block_stride + offset * l.token_stride;
    for (int64_t j = 0; j < run; ++j, row += l.token_stride) {
      for (int64_t kh = 0; kh < groups; ++kh) {
        const T* k = row + (kv_begin + kh) * d;
        const float* qk = q.data() + kh * G * vectors * 16;
        __m512 acc[G];
        for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
        for (int64_t v = 0; v < vectors; ++v) {
          const __m512 kv = load16(k + v * 16, lanes_below(d - v * 16));
          for (int g = 0; g < G; ++g) {
            acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qk + (g * vectors + v) * 16), kv, acc[g]);
          }
        }
        for (int g = 0; g < G; ++g) {
          float s = lane_sum(acc[g]) * scale;
          if (softcap > 0.f) s = softcap * std::tanh(s / softcap);
          scores[(kh * G + g) * padded + t - first + j] = s;
        }
      }
    }
    t += run;
  }
  for (int64_t h = 0; h < groups * G; ++h) {
    float* s = scores.data() + h * padded;
    const __m512 top = _mm512_set1_ps(*std::max_element(s, s + n));
    __m512 total = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = lanes_below(n - i);
      __m512 e = vec_math::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), top));
      // weights below 2^-64 (a score 44 under the top) count as 0: no denormal products in V
      e = _mm512_maskz_mov_ps(m & _mm512_cmp_ps_mask(e, _mm512_set1_ps(0x1p-64f), _CMP_GE_OQ), e);
      _mm512_storeu_ps(s + i, e);
      total = _mm512_add_ps(total, e);
    }
    const float inv = 1.f / lane_sum(total);
    for (int64_t i = 0; i < n; i += 16) {  // fold 1 / total into the weights
      _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(inv)));
    }
  }
  for (int64_t kh = 0; kh < groups; ++kh) {
    const float* p_of = scores.data() + kh * G * padded;
    for (int64_t c = 0; c < d; c += kChunk) {  // 64 dims of the group's heads per pass
      const int64_t cv = std::min<int64_t>(4, (d - c + 15) / 16);
      __m512 acc[G][4];
      for (int g = 0; g < G; ++g) {
        for (int v = 0; v < 4; ++v) acc[g][v] = _mm512_setzero_ps();
      }
      for (int64_t t = first; t < context;) {
        const int64_t offset = t % l.block_size,
                      run = std::min(l.block_size - offset, context - t);
        const T* v_row = cache + table[t / l.block_size] * l.block_stride +
                         offset * l.token_stride + l.v_offset + (kv_begin + kh) * d + c;
        for (int64_t j = 0; j < run; ++j, v_row += l.token_stride) {
          __m512 vv[4];
          for (int64_t v = 0; v < cv; ++v) {
            vv[v] = load16(v_row + v * 16, lanes_below(d - c - v * 16));
          }
          for (int g = 0; g < G; ++g) {
            const __m512 p = _mm512_set1_ps(p_of[g * padded + t - first + j]);
            for (int64_t v = 0; v < cv; ++v) acc[g][v] = _mm512_fmadd_ps(p, vv[v], acc[g][v]);
          }
        }
        t += run;
      }
      T* o = out + kh * G * d + c;
      for (int g = 0; g < G; ++g) {
        for (int64_t v = 0; v < cv; ++v) {
          vec_math::store16(o + g * d + v * 16, acc[g][v], lanes_below(d - c - v * 16));
        }
      }
    }
  }
}

// Work items: whole rows when there are enough of them for the threads (each row's K read
// in one pass), else (row, KV head) pairs. The arithmetic of a head is the same either way.
template <int G, typename T>
void attend_items(T* out, const T* q, const T* cache, const int64_t* tables, int64_t width,
                  const int64_t* table_of, const int64_t* context_of, int64_t rows,
                  int64_t heads, int64_t kv_heads, const Layout& layout, float scale,
                  int64_t window, float softcap) {
  const int64_t d = layout.head_dim;
  const int64_t split = rows >= 4 * at::get_num_threads() ? 1 : kv_heads;  // items per row
  at::parallel_for(0, rows * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, q_buffer;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / split, part = item % split, context = context_of[r];
      const int64_t first = window > 0 ? std::max<int64_t>(0, context - window) : 0;
      const int64_t kv_begin = part * kv_heads / split, kv_end = (part + 1) * kv_heads / split;
      const int64_t head0 = r * heads + kv_begin * G;
      attend_heads<G>(q + head0 * d, out + head0 * d, cache, tables + table_of[r] * width, first,
                      context, kv_begin, kv_end, layout, scale, softcap, scores, q_buffer);
    }
  });
}

#endif

// The whole call through attend_heads, for the types and group sizes it takes; false (nothing
// done) for the others.
template <typename T>
bool attend_groups(T* out, const T* q, const T* cache, const int64_t* tables, int64_t width,
                   const int64_t* table_of, const int64_t* context_of, int64_t rows, int64_t heads,
                   int64_t kv_heads, const Layout& layout, double scale, int64_t window,
                   double softcap) {
#ifdef __AVX512F__
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    const float sc = static_cast<float>(scale), cap = static_cast<float>(softcap);
    switch (heads / kv_heads) {
#define SPLITSERVE_GROUP(G)                                                                  \
  case G:                                                                                    \
    attend_items<G>(out, q, cache, tables, width, table_of, context_of, rows, heads, kv_heads, \
                    layout, sc, window, cap);                                                \
    return true;
      SPLITSERVE_GROUP(1)
      SPLITSERVE_GROUP(2)
      SPLITSERVE_GROUP(3)
      SPLITSERVE_GROUP(4)
      SPLITSERVE_GROUP(5)
      SPLITSERVE_GROUP(6)
      SPLITSERVE_GROUP(7)
      SPLITSERVE_GROUP(8)
#undef SPLITSERVE_GROUP
      default:
        return false;
    }
  }
#endif
  return false;
}

}  // namespace

void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor cache,
                     torch::Tensor block_tables, torch::Tensor row_table,
                     torch::Tensor row_context, double scale, int64_t window,
                     double softcap) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5, "q: [T, heads, d]; cache: 5-d");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && cache.is_contiguous() &&
                  block_tables.is_contiguous(),
              "q, out, cache and block_tables must be contiguous");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, out and cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 &&
                  row_table.scalar_type() == torch::kInt64 &&
                  row_context.scalar_type() == torch::kInt64,
              "block tables, row_table and row_context must be int64");
  const int64_t rows = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t block_size = cache.size(1), kv_heads = cache.size(3);
  TORCH_CHECK(cache.size(2) == 2 && cache.size(4) == d && d <= 512, "cache shape or head_dim");
  TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(row_table.numel() == rows && row_context.numel() == rows, "one entry per row");
  const int64_t width = block_tables.dim() == 2 ? block_tables.size(1) : 0;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* table_of = row_table.data_ptr<int64_t>();
  const int64_t* context_of = row_context.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(table_of[r] >= 0 && table_of[r] < block_tables.size(0), "row_table out of range");
    TORCH_CHECK(context_of[r] >= 1 && context_of[r] <= width * block_size,
                "row_context beyond the block table");
  }
  const Layout layout{block_size, block_size * 2 * kv_heads * d, 2 * kv_heads * d, kv_heads * d,
                      d};
  const int64_t q_per_kv = heads / kv_heads;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
        const scalar_t* q_ptr = q.data_ptr<scalar_t>();
        scalar_t* out_ptr = out.data_ptr<scalar_t>();
        const scalar_t* cache_ptr = cache.data_ptr<scalar_t>();
        if (attend_groups(out_ptr, q_ptr, cache_ptr, tables, width, table_of, context_of, rows,
                          heads, kv_heads, layout, scale, window, softcap)) {
          return;
        }
        at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
          std::vector<float> scores;
          for (int64_t item = begin; item < end; ++item) {
            const int64_t r = item / heads, h = item % heads, context = context_of[r];
            const int64_t first = window > 0 ? std::max<int64_t>(0, context - window) : 0;
            attend_one(q_ptr + item * d, out_ptr + item * d, cache_ptr,
                       tables + table_of[r] * width, first, context, h / q_per_kv, layout,
                       static_cast<float>(scale), static_cast<float>(softcap), scores);
          }
        });
      });
}
