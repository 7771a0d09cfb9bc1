// Paged attention for one query head on a CPU with AVX2 and FMA but no AVX-512 (8 fp32 lanes),
// over an fp32, bf16 or fp16 cache with head_dim a multiple of 8: paged_attention.cpp's
// attend_one, vectorized. A head's arithmetic depends on nothing but its own q and context:
//   scores: q (times the scale) . k as 8 lanes of multiply-adds over d, eight keys at a time,
//           each key's lanes summed by reduce_add8's fixed tree; soft-capped if asked;
//   softmax: exact, e^(s - top) with exp8, weights under 2^-64 as 0, summed in 8 lanes then
//           sum8's tree;
//   output: V accumulated in fp32 over the tokens in order, 64 dims (8 registers) at a time,
//           then times 1 / sum.
#pragma once

#include "vec_math_avx2.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#include <cmath>
#include <vector>

#include "paged_layout.h"

namespace attention_avx2 {

using paged_kv::Layout;
using vec_math::load8;

constexpr int64_t kKeys = 8;          // keys scored together: one reduce_add8
constexpr int64_t kChunkVectors = 8;  // V dims (in vectors of 8) kept in registers at a time

inline bool takes(int64_t head_dim) { return head_dim % 8 == 0 && head_dim <= 512; }

// The cache row of token t of one KV head (K; V is l.v_offset further).
template <typename T>
inline const T* token_row(const T* cache, const int64_t* table, const Layout& l, int64_t t,
                          int64_t kv_head) {
  return cache + table[t / l.block_size] * l.block_stride + (t % l.block_size) * l.token_stride +
         kv_head * l.head_dim;
}

// acc[0, CV) += sum over tokens [first, context) of p[t - first] * V_t[c0, c0 + 8 CV), in order.
template <int CV, typename T>
inline void accumulate_v(float* out, const T* v_cache, const int64_t* table, const Layout& l,
                         int64_t kv_head, const float* p, int64_t first, int64_t context,
                         int64_t c0, float inv) {
  __m256 acc[CV];
#pragma GCC unroll 8
  for (int i = 0; i < CV; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t t = first; t < context;) {  // one run of tokens inside one block
    const int64_t offset = t % l.block_size, n = std::min(l.block_size - offset, context - t);
    const T* v = token_row(v_cache, table, l, t, kv_head) + c0;
    for (int64_t j = 0; j < n; ++j) {
      const __m256 w = _mm256_set1_ps(p[t - first + j]);
      const T* row = v + j * l.token_stride;
#pragma GCC unroll 8
      for (int i = 0; i < CV; ++i) acc[i] = _mm256_fmadd_ps(w, load8(row + 8 * i), acc[i]);
    }
    t += n;
  }
  const __m256 scale = _mm256_set1_ps(inv);
#pragma GCC unroll 8
  for (int i = 0; i < CV; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], scale));
}

template <typename T>
void attend_one(const T* q_in, T* out, const T* cache, const int64_t* table, int64_t first,
                int64_t context, int64_t kv_head, const Layout& l, float scale, float softcap,
                std::vector<float>& scores) {
  const int64_t d = l.head_dim, vectors = d / 8, n = context - first;
  alignas(32) float q[512], result[512];
  for (int64_t i = 0; i < d; ++i) q[i] = static_cast<float>(q_in[i]) * scale;
  scores.resize((n + kKeys - 1) / kKeys * kKeys);
  for (int64_t t0 = first; t0 < context; t0 += kKeys) {
    const T* keys[kKeys];  // past the context: the last token again, its score not kept
    for (int64_t j = 0; j < kKeys; ++j) {
      keys[j] = token_row(cache, table, l, std::min(t0 + j, context - 1), kv_head);
    }
    __m256 acc[kKeys];
#pragma GCC unroll 8
    for (int64_t j = 0; j < kKeys; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t v = 0; v < vectors; ++v) {
      const __m256 qv = _mm256_load_ps(q + 8 * v);
#pragma GCC unroll 8
      for (int64_t j = 0; j < kKeys; ++j) {
        acc[j] = _mm256_fmadd_ps(qv, load8(keys[j] + 8 * v), acc[j]);
      }
    }
    _mm256_storeu_ps(scores.data() + (t0 - first), vec_math::reduce_add8(acc));
  }
  float* s = scores.data();
  if (softcap > 0.f) {
    for (int64_t t = 0; t < n; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
  }
  for (int64_t t = n; t < static_cast<int64_t>(scores.size()); ++t) s[t] = -INFINITY;
  __m256 highest = _mm256_set1_ps(-INFINITY);
  for (int64_t t = 0; t < n; t += 8) highest = _mm256_max_ps(highest, _mm256_loadu_ps(s + t));
  const __m256 top = _mm256_set1_ps(vec_math::max8(highest)), tiny = _mm256_set1_ps(0x1p-64f);
  __m256 total = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; t += 8) {  // the -inf lanes past n give 0
    __m256 e = vec_math::exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), top));
    e = _mm256_and_ps(e, _mm256_cmp_ps(e, tiny, _CMP_GE_OQ));
    _mm256_storeu_ps(s + t, e);
    total = _mm256_add_ps(total, e);
  }
  const float inv = 1.f / vec_math::sum8(total);
  const T* v_cache = cache + l.v_offset;
  for (int64_t c = 0; c < vectors; c += kChunkVectors) {
    const int64_t c0 = 8 * c;
    switch (std::min(kChunkVectors, vectors - c)) {
#define SPLITSERVE_CHUNK(CV)                                                               \
  case CV:                                                                                 \
    accumulate_v<CV>(result + c0, v_cache, table, l, kv_head, s, first, context, c0, inv); \
    break;
      SPLITSERVE_CHUNK(1)
      SPLITSERVE_CHUNK(2)
      SPLITSERVE_CHUNK(3)
      SPLITSERVE_CHUNK(4)
      SPLITSERVE_CHUNK(5)
      SPLITSERVE_CHUNK(6)
      SPLITSERVE_CHUNK(7)
      SPLITSERVE_CHUNK(8)
#undef SPLITSERVE_CHUNK
    }
  }
  for (int64_t i = 0; i < d; ++i) out[i] = static_cast<T>(result[i]);
}

}  // namespace attention_avx2
#endif
