// Paged attention over a bf16 KV cache with AVX512-BF16 dot products (vdpbf16ps), for the
// heads of one query row: what attention_fp32.h's attend_heads computes in fp32, without
// widening K or V to fp32 and with the row's context fetched ahead. For each query head:
//
//   scores  per key, acc = dpbf16(acc, q[32 v .. 32 v + 32), k[32 v .. 32 v + 32)) over the
//           32-wide vectors v of the head in order, its 16 lanes by reduce_add16's tree, times
//           the scale (then the soft cap);
//   softmax exact, in fp32, as attend_heads (top, e^(s - top) with weights under 2^-64 as 0,
//           their sum in 16 lanes then a fixed tree, times 1 / sum), each weight then rounded
//           to bf16 once;
//   p.V     per output lane one chain over the token pairs in order:
//           acc = dpbf16(acc, (p[t], p[t + 1]), (V[t][c], V[t + 1][c])), t = first, first + 2, ...
//
// (vdpbf16ps: both products exact in fp32, each sum rounded to nearest even, denormals
// flushed.) Tiles and pairs count from the span's first token, and a missing token is a zero
// row with weight 0: a head's bits depend on its own context alone, never on the batch, the
// threads or where a chunk's rows begin. Rounding the weights to bf16 is what flash attention
// does on GPUs and torch's CPU flash kernel does for bf16; the error is of the order of the
// output's own rounding to bf16.
//
// Memory: a decode step reads every row's context from memory, and how it is read decides
// the time. The scores go 16 tokens (a tile) at a time over every KV head, and meanwhile the
// whole rows (K and V) of the tile two on are prefetched into L2, so the p.V pass, one KV head
// at a time over the context, reads from L2 (a part of a split context, at most 512 tokens,
// fits there). A thread's last two tiles of a row fetch the first two of its next row.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paged_layout.h"
#include "transposed_keys.h"
#include "vec_math.h"

namespace attention_bf16 {

constexpr int64_t kMaxVectors = 4;  // head_dim <= 128: up to four 32-wide bf16 vectors
// Tokens per tile, the 16 sums reduce_add16 takes: the transposed keys' tiles, which must match.
using transposed_keys::kKeys;
// The tile prefetched: two on, into L2 (prefetcht1), its lines in address order and shared out
// over the tile's score calls (one per query head), so that no call waits behind a burst of
// prefetches. On the 2-core AMD EPYC host with AVX-512 (64 rows x 192 tokens x 30 layers, one
// thread, a one-pass variant of this kernel) no prefetch took 54-66 ms; the whole next tile
// at once into L1 54-68, into L2 45; the tile two on in shares into L1 57-64, into L2 36-38
// (three on 40, four on 42, prefetchnta 54). On a later host of the class with full-width
// AVX-512 (2026-12-02, `bench attention`'s step, bf16, one thread, 3 rounds alternated): a KV
// head's share at once before its score calls 27.3-29.8 ms, spread over its calls 23.1-23.9,
// the whole tile spread in address order over all the tile's calls 21.4-26.5 (16 rows x 1024
// tokens: 34.8-37.9, 28.0-29.0, 24.6-32.4); on two threads, 4 rounds, 16.4-17.6 -> 14.0-15.6
// (16 x 1024: 19.8-21.8 -> 16.5-18.4). Fetching the next row's first two tiles during a row's
// last two (same host, 2 threads, 4 rounds alternated): 64 x 192 14.8-19.8 -> 11.6-13.8 ms,
// 16 x 192 4.7-5.5 -> 3.0-6.2, 16 x 1024 unchanged (17.4-18.9 against 17.9-19.1).
constexpr int64_t kAhead = 2;

// Share `call` of `calls` of a tile's lines (16 token rows of `lines` lines each, row by row),
// fetched into L2 one line a next(), which score_tile calls beside each key's products: spread
// over the tile's work, never sent in a burst. Before (2026-12-05), each share went out at once,
// its line's row and offset divided out per line, and that division was 70% of the kernel's
// samples where the context sat in L3. On the 2-core AMD EPYC host with AVX512-BF16 (`bench
// attention`'s step, bf16, 2 threads, the builds alternated in separate processes, 7 rounds),
// 64 rows x 192 tokens in L3 7.4-11.2 ms -> 5.2-8.7 (faster in every round), and from memory
// unchanged within the host's noise (64 x 192 10.7-15.0 against 11.2-12.7, 16 x 1024 13.8-19.9
// against 14.4-20.4). The same shares without the division but still sent at once ran at
// 19.7-20.5 ms from memory: the division had been spacing them out.
class LineFetch {
 public:
  LineFetch() = default;  // fetches nothing
  LineFetch(const uint16_t* const* rows, int64_t lines, int64_t call, int64_t calls)
      : rows_(rows), lines_(lines) {
    const int64_t all = kKeys * lines, begin = all * call / calls;
    left_ = all * (call + 1) / calls - begin;
    row_ = begin / lines;
    line_ = begin % lines;
  }

  [[gnu::always_inline]] void next() {
    if (left_ <= 0) return;
    _mm_prefetch(reinterpret_cast<const char*>(rows_[row_]) + line_ * 64, _MM_HINT_T1);
    --left_;
    if (++line_ == lines_) {
      line_ = 0;
      ++row_;
    }
  }

 private:
  const uint16_t* const* rows_ = nullptr;
  int64_t lines_ = 1, row_ = 0, line_ = 0, left_ = 0;
};

// A thread's buffers, reused across its work items.
struct Scratch {
  std::vector<const uint16_t*> tokens;  // [n rounded up to 16, + kAhead tiles]: token rows
  std::vector<float> scores;            // [heads][padded]
  std::vector<uint16_t> weights;        // [heads][padded]: the softmax weights in bf16
  std::vector<uint16_t> zero;           // one token's row of zeros, for padding
  std::vector<uint32_t> q_pairs;        // [heads][pairs_per_head]: q's dim pairs, zero past d
};

inline __mmask32 words_below(int64_t n) {  // n > 0: a vector that holds part of the head
  return n >= 32 ? ~static_cast<__mmask32>(0) : static_cast<__mmask32>((1u << n) - 1u);
}

// 32 bf16 of a head's vector v (zero past d)
inline __m512bh load32(const uint16_t* p, int64_t v, int64_t d) {
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(words_below(d - v * 32), p + v * 32));
}

// p.V leaves lane 4 L + i of a pair vector's accumulator holding dim 8 L + i (lo) or
// 8 L + 4 + i (hi) of its 32 dims: this puts them back in order, 16 dims a vector.
inline void unpermute(__m512 lo, __m512 hi, __m512& first, __m512& second) {
  const __m512i a = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i b = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  first = _mm512_permutex2var_ps(lo, a, hi);
  second = _mm512_permutex2var_ps(lo, b, hi);
}

// A tile's 16 scores soft-capped in place (none: softcap 0).
inline void cap(float* scores, float softcap) {
  if (softcap > 0.f) {
    for (int64_t j = 0; j < kKeys; ++j) scores[j] = softcap * std::tanh(scores[j] / softcap);
  }
}

// The 16 scores of one tile's keys for query head q (scale and soft cap applied), a line of
// `fetch` fetched beside each key's product.
[[gnu::always_inline]] inline void score_tile(const uint16_t* q, const uint16_t* const* tile,
                                              int64_t k_at, int64_t d, int64_t vectors,
                                              float scale, float softcap, float* out,
                                              LineFetch& fetch) {
  __m512 acc[kKeys];
#pragma GCC unroll 16
  for (int64_t j = 0; j < kKeys; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t v = 0; v < vectors; ++v) {  // the 16 keys' chains interleaved
    const __m512bh qv = load32(q, v, d);
#pragma GCC unroll 16
    for (int64_t j = 0; j < kKeys; ++j) {
      fetch.next();
      acc[j] = _mm512_dpbf16_ps(acc[j], qv, load32(tile[j] + k_at, v, d));
    }
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(vec_math::reduce_add16(acc), _mm512_set1_ps(scale)));
  cap(out, softcap);
}

// The weights of one head from its scores [padded] (0 past n, e left in their place), in
// bf16; gives (top, sum).
inline void softmax(float* scores, uint16_t* weights, int64_t n, int64_t padded,
                    float& top_score, float& sum) {
  vec_math::softmax_numerators(scores, n, top_score, sum);
  const __m512 inv = _mm512_set1_ps(1.f / sum);
  for (int64_t i = 0; i < padded; i += 16) {
    const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(scores + i), inv);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights + i),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(p)));
  }
}

// out[g][c .. c + 32 C) for the G query heads of one KV head: one chain per lane over the token
// pairs (weights: G rows `padded` apart, pair i at 2 i). Inlined, with C and G compile-time
// counts, so the accumulators stay in registers.
template <int G, int C, typename O>
[[gnu::always_inline]] inline void accumulate_v(O* out, const uint16_t* const* tokens,
                                                const uint16_t* weights, int64_t pairs,
                                                int64_t padded, int64_t v_at, int64_t c,
                                                int64_t d) {
  __m512 acc[G][C][2];
  for (int g = 0; g < G; ++g) {
    for (int v = 0; v < C; ++v) acc[g][v][0] = acc[g][v][1] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < pairs; ++i) {
    const uint16_t* x_row = tokens[2 * i] + v_at;
    const uint16_t* y_row = tokens[2 * i + 1] + v_at;
    __m512bh lo[C], hi[C];
    for (int v = 0; v < C; ++v) {
      const __m512i x = reinterpret_cast<__m512i>(load32(x_row, (c >> 5) + v, d));
      const __m512i y = reinterpret_cast<__m512i>(load32(y_row, (c >> 5) + v, d));
      lo[v] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(x, y));
      hi[v] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(x, y));
    }
    for (int g = 0; g < G; ++g) {
      int32_t pair;
      std::memcpy(&pair, weights + g * padded + 2 * i, sizeof(pair));
      const __m512bh w = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      for (int v = 0; v < C; ++v) {
        acc[g][v][0] = _mm512_dpbf16_ps(acc[g][v][0], lo[v], w);
        acc[g][v][1] = _mm512_dpbf16_ps(acc[g][v][1], hi[v], w);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int v = 0; v < C; ++v) {
      __m512 first, second;
      unpermute(acc[g][v][0], acc[g][v][1], first, second);
      const int64_t at = c + v * 32;  // a head of d <= at + 16 dims leaves `second` unstored
      vec_math::store16(out + g * d + at, first, vec_math::lanes_below(d - at));
      vec_math::store16(out + g * d + at + 16, second,
                        vec_math::lanes_below(std::max<int64_t>(d - at - 16, 0)));
    }
  }
}

// rows[i]: the cache row (K and V of every head) of token first + i, for i < context - first.
inline void token_rows(const uint16_t* base, const int64_t* table, const paged_kv::Layout& l,
                       int64_t first, int64_t context, const uint16_t** rows) {
  for (int64_t t = first; t < context;) {  // one run of tokens inside one block
    const int64_t offset = t % l.block_size, run = std::min(l.block_size - offset, context - t);
    const uint16_t* row = base + table[t / l.block_size] * l.block_stride + offset * l.token_stride;
    for (int64_t j = 0; j < run; ++j) rows[t - first + j] = row + j * l.token_stride;
    t += run;
  }
}

// The scores of KV heads [kv_begin, kv_end) of one query row (their G heads each) over the
// context tokens [first, context), read through s.tokens (the context's token rows, then zero
// rows for the tile's end and two tiles more): s.scores[h][i] for token first + i. Fetching
// ahead, the rows of those two tiles past the end become the upcoming context's first ones.
template <int G>
void score_rows(const uint16_t* q, const uint16_t* base, const paged_kv::Layout& l,
                int64_t first, int64_t context, int64_t kv_begin, int64_t kv_end, float scale,
                float softcap, bool prefetch, const paged_kv::Context& upcoming, Scratch& s) {
  const int64_t d = l.head_dim, n = context - first, vectors = (d + 31) / 32;
  const int64_t padded = (n + kKeys - 1) / kKeys * kKeys, groups = kv_end - kv_begin;
  if (prefetch && upcoming.table != nullptr) {
    token_rows(base, upcoming.table, l, upcoming.first,
               std::min(upcoming.context, upcoming.first + kAhead * kKeys),
               s.tokens.data() + padded);
  }
  const int64_t lines = l.token_stride * 2 / 64;  // of a token's row, K and V of every head
  const int64_t calls = groups * G;                // score calls a tile: one per query head
  for (int64_t i0 = 0; i0 < n; i0 += kKeys) {
    const uint16_t* const* tile = s.tokens.data() + i0;
    for (int64_t kh = kv_begin; kh < kv_end; ++kh) {
      const int64_t h0 = (kh - kv_begin) * G;  // the group's first head, within q and scores
      for (int g = 0; g < G; ++g) {
        auto fetch = prefetch ? LineFetch(tile + kAhead * kKeys, lines, h0 + g, calls)
                              : LineFetch();
        score_tile(q + (h0 + g) * d, tile, kh * d, d, vectors, scale, softcap,
                   s.scores.data() + (h0 + g) * padded + i0, fetch);
      }
    }
  }
}

// The same scores read from a prefill chunk's transposed keys (first: a multiple of 16; d: the
// head's dims, q's pairs past them zeros).
template <int G>
void score_transposed(const uint16_t* q, const transposed_keys::TransposedKeys& keys, int64_t d,
                      int64_t first, int64_t padded, int64_t kv_begin, int64_t kv_end,
                      float scale, float softcap, Scratch& s) {
  const int64_t per_head = keys.pairs_per_head, heads = (kv_end - kv_begin) * G;
  s.q_pairs.assign(heads * per_head, 0);
  for (int64_t h = 0; h < heads; ++h) {
    std::memcpy(s.q_pairs.data() + h * per_head, q + h * d, d * sizeof(uint16_t));
  }
  transposed_keys::score_heads(keys, G, s.q_pairs.data(), kv_begin, kv_end, first / kKeys,
                               padded / kKeys, scale, s.scores.data(), padded);
  for (int64_t i = 0; softcap > 0.f && i < heads * padded; i += kKeys) {
    cap(s.scores.data() + i, softcap);
  }
}

// KV heads [kv_begin, kv_end) of one query row over the context tokens [first, context), each
// with its G = heads / kv_heads query heads (q_in: those heads, [heads][d]; out likewise, O =
// bf16, or fp32 for a part of a split context, whose top score and sum of weights per head
// go to stats [h][2]). prefetch: whether the context is fetched ahead (not when many rows
// share it, as a prefill chunk's do: it is in cache then); upcoming: the context the thread
// attends next, whose first two tiles are then fetched during this one's last two; transposed:
// the keys of a prefill chunk's context, transposed for all its rows (transposed_keys.h), which
// the scores read instead of the cache where the row's span starts on a tile (the same bits).
template <int G, typename O>
void attend_heads(const c10::BFloat16* q_in, O* out, const c10::BFloat16* cache,
                  const int64_t* table, const paged_kv::Layout& l, int64_t first,
                  int64_t context, int64_t kv_begin, int64_t kv_end, float scale, float softcap,
                  bool prefetch, Scratch& s, float* stats = nullptr,
                  const paged_kv::Context& upcoming = {},
                  const transposed_keys::TransposedKeys* transposed = nullptr) {
  const int64_t d = l.head_dim, n = context - first;
  const int64_t padded = (n + kKeys - 1) / kKeys * kKeys, groups = kv_end - kv_begin;
  const auto* q = reinterpret_cast<const uint16_t*>(q_in);
  const transposed_keys::TransposedKeys* keys = first % kKeys == 0 ? transposed : nullptr;
  // the context's token rows, then zero rows for the tile's end and two tiles more
  const auto* base = reinterpret_cast<const uint16_t*>(cache);
  if (static_cast<int64_t>(s.zero.size()) != l.token_stride) s.zero.assign(l.token_stride, 0);
  s.tokens.resize(padded + kAhead * kKeys);
  token_rows(base, table, l, first, context, s.tokens.data());
  std::fill(s.tokens.begin() + n, s.tokens.end(), s.zero.data());
  s.scores.resize(groups * G * padded);
  s.weights.resize(groups * G * padded);
  // head h's score of token first + i: scores[h * padded + i]
  if (keys != nullptr) {
    score_transposed<G>(q, *keys, d, first, padded, kv_begin, kv_end, scale, softcap, s);
  } else {
    score_rows<G>(q, base, l, first, context, kv_begin, kv_end, scale, softcap, prefetch,
                  upcoming, s);
  }
  for (int64_t h = 0; h < groups * G; ++h) {
    float top, sum;
    softmax(s.scores.data() + h * padded, s.weights.data() + h * padded, n, padded, top, sum);
    if (stats != nullptr) {
      stats[h * 2] = top;
      stats[h * 2 + 1] = sum;
    }
  }
  const int64_t pairs = (n + 1) / 2;
  for (int64_t kh = kv_begin; kh < kv_end; ++kh) {
    const int64_t h0 = (kh - kv_begin) * G, v_at = l.v_offset + kh * d;
    const uint16_t* w = s.weights.data() + h0 * padded;
    O* o = out + h0 * d;
    if constexpr (G <= 4) {  // 64 dims a pass: G * 4 accumulators
      for (int64_t c = 0; c < d; c += 64) {
        if (d - c > 32) {
          accumulate_v<G, 2>(o, s.tokens.data(), w, pairs, padded, v_at, c, d);
        } else {
          accumulate_v<G, 1>(o, s.tokens.data(), w, pairs, padded, v_at, c, d);
        }
      }
    } else {  // 32 dims a pass: G * 2 accumulators
      for (int64_t c = 0; c < d; c += 32) {
        accumulate_v<G, 1>(o, s.tokens.data(), w, pairs, padded, v_at, c, d);
      }
    }
  }
}

}  // namespace attention_bf16

#endif
