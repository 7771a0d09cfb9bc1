// Paged attention on CPU: one work item per (query row, head), scores in a thread-local
// buffer (over the row's sliding window, when the layer has one; soft-capped for Gemma 2),
// exact softmax in float32, V accumulated in float32. Items of one row and KV group
// are adjacent, so a thread reuses the group's K/V from its cache across the query heads.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops.h"

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
