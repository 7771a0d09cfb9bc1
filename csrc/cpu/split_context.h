// A row's long context in parts: where the cuts fall, and the parts' results merged into the
// row's. paged_attention.cpp attends each part with its kernel (attention_fp32.h or
// attention_bf16.h), which hands back the part's output normalized within the part and its top
// score and sum of weights per head.
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "vec_math.h"

namespace split_context {

// A row's context longer than kSplit tokens is attended in parts, cut at the multiples of
// kSplit: each part's softmax and V by attend_heads, then the parts merged by their top scores
// and sums. The cut depends on the row's context alone, so a row has the same bits whether its
// parts run on one thread (many rows) or spread over all of them (a few long rows).
constexpr int64_t kSplit = 512;

struct Span {
  int64_t first, context;
};

inline int64_t part_count(const Span& row) {
  return (row.context - 1) / kSplit - row.first / kSplit + 1;
}

inline Span part_of(const Span& row, int64_t part) {
  const int64_t begin = (row.first / kSplit + part) * kSplit;
  return {std::max(row.first, begin), std::min(row.context, begin + kSplit)};
}

// One head's output from the results of its `count` parts (parts: [part][heads][d], each
// normalized within its part; stats: [part][heads][2], the part's top score and sum of
// weights): the parts weighted by sum * exp(top - the highest top), in order.
template <typename T>
void merge_parts(T* out, const float* parts, const float* stats, int64_t count, int64_t heads,
                 int64_t d) {
  float top = -INFINITY, total = 0.f;
  for (int64_t i = 0; i < count; ++i) top = std::max(top, stats[i * heads * 2]);
  const auto weight = [&](int64_t i) {
    return stats[i * heads * 2 + 1] * std::exp(stats[i * heads * 2] - top);
  };
  for (int64_t i = 0; i < count; ++i) total += weight(i);
  for (int64_t c = 0; c < d; c += 16) {
    const __mmask16 lanes = vec_math::lanes_below(d - c);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < count; ++i) {
      acc = _mm512_fmadd_ps(_mm512_set1_ps(weight(i) / total),
                            _mm512_maskz_loadu_ps(lanes, parts + i * heads * d + c), acc);
    }
    vec_math::store16(out + c, acc, lanes);
  }
}

}  // namespace split_context

#endif
