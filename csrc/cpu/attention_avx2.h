// Paged attention on a CPU with AVX2 and FMA but no AVX-512 (8 fp32 lanes), over an fp32,
// bf16 or fp16 cache with head_dim a multiple of 8: paged_attention.cpp's attend_one,
// vectorized. A head's arithmetic depends on nothing but its own q and context:
//   scores: q (times the scale) . k as 8 lanes of multiply-adds over d, eight keys at a time
//           from the span's first token, each key's lanes summed by reduce_add8's fixed tree;
//           soft-capped if asked (over a bf16 cache each 16 dims go as their even dims, then
//           their odd ones: one load, a shift and a mask, in-lane; a last 8 in order);
//   softmax: exact, e^(s - top) with exp8, weights under 2^-64 as 0, summed in 8 lanes then
//           sum8's tree;
//   output: V accumulated in fp32 over the tokens in order, 64 dims (8 registers) at a time,
//           then times 1 / sum.
// attend_heads takes a tile of keys over all of a row's heads when rows are many (a prefill of
// 256 rows took 20-30% less time than head by head), a single head when rows are fewer than
// two a thread; a head's arithmetic is the same either way.
// Memory: a decode step reads every row's context from memory. When a thread's items are whole
// rows of a 16-bit cache, the rows of the tile two on are fetched into L2 while a tile's keys
// are scored (in shares over its score calls), and a row's last two tiles fetch the first two
// of the thread's next row, as attention_bf16.h does. On the 2-core AMD EPYC AVX2 host, bf16
// cache, 30 layers, rounds alternated in one process (`bench attention`'s step): one thread,
// 64 rows x 192 tokens 67-108 -> 46-62 ms, 16 x 1024 105-149 -> 70-87; two threads 56-68 ->
// 27-35, 16 x 1024 72-79 -> 46-66. An fp32 cache (twice the lines a token), and items of one
// head (a few rows: 1-3 x 512-1024 tokens), gained nothing measurable, so they fetch nothing.
#pragma once

#include "vec_math_avx2.h"

#ifdef SPLITSERVE_AVX2
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "paged_layout.h"

namespace attention_avx2 {

using paged_kv::Layout;
using vec_math::load8;

constexpr int64_t kKeys = 8;          // keys scored together: one reduce_add8
constexpr int64_t kChunkVectors = 8;  // V dims (in vectors of 8) kept in registers at a time
constexpr int64_t kAhead = 2;         // tiles: the rows fetched are those of the tile two on

inline bool takes(int64_t head_dim) { return head_dim % 8 == 0 && head_dim <= 512; }

// A thread's buffers, reused across its work items.
template <typename T>
struct Scratch {
  std::vector<const T*> tokens;  // [n rounded up to 8]: the token rows
  std::vector<float> q;          // [heads][d]: q times the scale
  std::vector<float> scores;     // [heads][n rounded up to 8]: scores, then weights
};

// rows[i]: the cache row (K of every KV head, then V) of token first + i, for i < context - first.
template <typename T>
void token_rows(const T* cache, const int64_t* table, const Layout& l, int64_t first,
                int64_t context, const T** rows) {
  for (int64_t t = first; t < context;) {  // one run of tokens inside one block
    const int64_t offset = t % l.block_size, run = std::min(l.block_size - offset, context - t);
    const T* row = cache + table[t / l.block_size] * l.block_stride + offset * l.token_stride;
    for (int64_t j = 0; j < run; ++j) rows[t - first + j] = row + j * l.token_stride;
    t += run;
  }
}

// s.tokens: the rows of the tokens [first, context), the last one repeated up to the next tile
// (padding keys' scores are not kept), then kAhead tiles of rows only fetched: the upcoming
// context's first ones (none: the last row again).
template <typename T>
void gather_tokens(Scratch<T>& s, const T* cache, const int64_t* table, const Layout& l,
                   int64_t first, int64_t context, const paged_kv::Context& upcoming) {
  const int64_t n = context - first, padded = (n + kKeys - 1) / kKeys * kKeys;
  s.tokens.resize(padded + kAhead * kKeys);
  token_rows(cache, table, l, first, context, s.tokens.data());
  std::fill(s.tokens.begin() + n, s.tokens.end(), s.tokens[n - 1]);
  if (upcoming.table != nullptr) {
    token_rows(cache, upcoming.table, l, upcoming.first,
               std::min(upcoming.context, upcoming.first + kAhead * kKeys),
               s.tokens.data() + padded);
  }
}

// Share `call` of `calls` of the lines of a tile's 8 token rows (`lines` each), fetched into L2.
template <typename T>
inline void fetch_share(const T* const* rows, int64_t lines, int64_t call, int64_t calls) {
  const int64_t all = kKeys * lines;
  for (int64_t f = all * call / calls; f < all * (call + 1) / calls; ++f) {
    _mm_prefetch(reinterpret_cast<const char*>(rows[f / lines]) + (f % lines) * 64, _MM_HINT_T1);
  }
}

// Whether a cache of T is read 16 dims at a time as two fp32 vectors, the even dims and the odd
// ones (vec_math::load_interleaved16: one load, a shift and a mask, all in-lane, where load8's
// zero-extension crosses 128-bit lanes). q is split the same way (split_q). On the 2-core AMD
// EPYC AVX2 host, bf16, 30 layers, 6 rounds alternated in one process (`bench attention`'s
// step, medians): one thread, 64 rows x 192 tokens 41.6 -> 36.5 ms, 16 x 1024 56.9 -> 51.2;
// two threads 21.7 -> 19.6, 16 x 1024 30.5 -> 28.0, 16 x 192 5.6 -> 5.2.
template <typename T>
constexpr bool splits_pairs() {
  return std::is_same_v<T, c10::BFloat16>;
}

// q's 16-dim groups as splits_pairs reads K: even dims, then odd ones (a last 8 as they are).
inline void split_q(float* q, int64_t d) {
  for (int64_t g = 0; g + 16 <= d; g += 16) {
    float even[8], odd[8];
    for (int i = 0; i < 8; ++i) {
      even[i] = q[g + 2 * i];
      odd[i] = q[g + 2 * i + 1];
    }
    std::copy(even, even + 8, q + g);
    std::copy(odd, odd + 8, q + g + 8);
  }
}

// The scores of one head's q (d floats, scaled) against 8 keys at column k_offset of `rows`.
template <typename T>
inline void score_tile(const float* q, const T* const* rows, int64_t k_offset, int64_t vectors,
                       float* s) {
  __m256 acc[kKeys];
#pragma GCC unroll 8
  for (int64_t j = 0; j < kKeys; ++j) acc[j] = _mm256_setzero_ps();
  int64_t v = 0;
  if constexpr (splits_pairs<T>()) {
    for (; v + 2 <= vectors; v += 2) {  // 16 dims: the even ones, then the odd ones
      const __m256 q_even = _mm256_loadu_ps(q + 8 * v), q_odd = _mm256_loadu_ps(q + 8 * v + 8);
#pragma GCC unroll 8
      for (int64_t j = 0; j < kKeys; ++j) {
        __m256 even, odd;
        vec_math::load_interleaved16(rows[j] + k_offset + 8 * v, even, odd);
        acc[j] = _mm256_fmadd_ps(q_odd, odd, _mm256_fmadd_ps(q_even, even, acc[j]));
      }
    }
  }
  for (; v < vectors; ++v) {  // 8 dims in order
    const __m256 qv = _mm256_loadu_ps(q + 8 * v);
#pragma GCC unroll 8
    for (int64_t j = 0; j < kKeys; ++j) {
      acc[j] = _mm256_fmadd_ps(qv, load8(rows[j] + k_offset + 8 * v), acc[j]);
    }
  }
  _mm256_storeu_ps(s, vec_math::reduce_add8(acc));
}

// s[0, n) scores -> softmax numerators in place (the padding to a multiple of 8 becomes 0);
// returns 1 / their sum.
inline float softmax_numerators(float* s, int64_t n, float softcap) {
  if (softcap > 0.f) {
    for (int64_t t = 0; t < n; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
  }
  const int64_t padded = (n + kKeys - 1) / kKeys * kKeys;
  std::fill(s + n, s + padded, -INFINITY);
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
  return 1.f / vec_math::sum8(total);
}

// out[0, 8 CV) = inv * sum over the n tokens, in order, of p[t] * V_t at column v_offset.
// (Split, acc[2 m] sums the even dims of the m-th 16 and acc[2 m + 1] the odd ones: each dim
// is still one chain over the tokens in order.)
template <int CV, typename T>
inline void weighted_v(float* out, const T* const* rows, int64_t v_offset, const float* p,
                       int64_t n, float inv) {
  constexpr int kPairs = splits_pairs<T>() ? CV / 2 : 0;  // vectors read as split pairs
  __m256 acc[CV];
#pragma GCC unroll 8
  for (int i = 0; i < CV; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const __m256 w = _mm256_set1_ps(p[t]);
    const T* v = rows[t] + v_offset;
    if constexpr (kPairs > 0) {
#pragma GCC unroll 4
      for (int m = 0; m < kPairs; ++m) {
        __m256 even, odd;
        vec_math::load_interleaved16(v + 16 * m, even, odd);
        acc[2 * m] = _mm256_fmadd_ps(w, even, acc[2 * m]);
        acc[2 * m + 1] = _mm256_fmadd_ps(w, odd, acc[2 * m + 1]);
      }
    }
#pragma GCC unroll 8
    for (int i = 2 * kPairs; i < CV; ++i) acc[i] = _mm256_fmadd_ps(w, load8(v + 8 * i), acc[i]);
  }
  for (int m = 0; m < kPairs; ++m) {  // back in order: dims 16 m .. 16 m + 7, then the next 8
    const __m256 lo = _mm256_unpacklo_ps(acc[2 * m], acc[2 * m + 1]);
    const __m256 hi = _mm256_unpackhi_ps(acc[2 * m], acc[2 * m + 1]);
    acc[2 * m] = _mm256_permute2f128_ps(lo, hi, 0x20);
    acc[2 * m + 1] = _mm256_permute2f128_ps(lo, hi, 0x31);
  }
  const __m256 scale = _mm256_set1_ps(inv);
#pragma GCC unroll 8
  for (int i = 0; i < CV; ++i) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], scale));
}

// One head's output from its weights p (n of them, summing to 1 / inv), V of KV head kv_head.
template <typename T>
void head_output(T* out, const T* const* rows, const Layout& l, int64_t kv_head, const float* p,
                 int64_t n, float inv) {
  const int64_t d = l.head_dim, vectors = d / 8;
  alignas(32) float result[512];
  for (int64_t c = 0; c < vectors; c += kChunkVectors) {
    const int64_t column = l.v_offset + kv_head * d + 8 * c;
    switch (std::min(kChunkVectors, vectors - c)) {
#define SPLITSERVE_CHUNK(CV)                                            \
  case CV:                                                              \
    weighted_v<CV>(result + 8 * c, rows, column, p, n, inv);            \
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

// Whether whole-row items over a cache of T fetch ahead (see the top of this file).
template <typename T>
constexpr bool fetches_ahead() {
  return sizeof(T) == 2;
}

// Heads [h0, h1) of a row (q_in, out: (h1 - h0) x d) over the tokens [first, context), a
// tile of keys over all of them; head h reads KV head h / group. With `fetch`, the rows of the
// tile two on are fetched meanwhile, and the last tiles fetch the first ones of `upcoming`
// (the row the thread attends next; none: no table).
template <typename T>
void attend_heads(const T* q_in, T* out, const T* cache, const int64_t* table, int64_t first,
                  int64_t context, int64_t h0, int64_t h1, int64_t group, const Layout& l,
                  float scale, float softcap, Scratch<T>& s, bool fetch = false,
                  const paged_kv::Context& upcoming = {}) {
  const int64_t d = l.head_dim, heads = h1 - h0;
  const int64_t n = context - first, padded = (n + kKeys - 1) / kKeys * kKeys;
  gather_tokens(s, cache, table, l, first, context, upcoming);
  const int64_t lines = (l.token_stride * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  s.q.resize(heads * d);
  s.scores.resize(heads * padded);
  for (int64_t i = 0; i < heads * d; ++i) s.q[i] = static_cast<float>(q_in[i]) * scale;
  if constexpr (splits_pairs<T>()) {
    for (int64_t h = 0; h < heads; ++h) split_q(s.q.data() + h * d, d);
  }
  for (int64_t i = 0; i < n; i += kKeys) {
    const T* const* tile = s.tokens.data() + i;
    for (int64_t h = 0; h < heads; ++h) {
      if (fetch) fetch_share(tile + kAhead * kKeys, lines, h, heads);
      score_tile(s.q.data() + h * d, tile, (h0 + h) / group * d, d / 8,
                 s.scores.data() + h * padded + i);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    float* p = s.scores.data() + h * padded;
    const float inv = softmax_numerators(p, n, softcap);
    head_output(out + h * d, s.tokens.data(), l, (h0 + h) / group, p, n, inv);
  }
}

}  // namespace attention_avx2
#endif
