// Paged attention with AVX-512 fp32 multiply-adds, for the heads of one query row: the path of
// fp32 caches, and of bf16 caches that attention_bf16.h does not take (no AVX512-BF16, or heads
// of over 128 dims), their K widened to fp32 tile by tile. paged_attention.cpp chooses the path
// and hands out the work items; a prefill chunk's rows read a copy of their context widened
// once for all of them (`widen`).
#pragma once

#ifdef __AVX512F__
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "paged_layout.h"
#include "vec_math.h"

namespace attention_fp32 {

using paged_kv::Layout;

// The G = heads / kv_heads query heads of a KV group are computed together. A head's
// arithmetic is the same whatever the batch, the threads or where its K and V are read from:
// q.k over d as 16 lanes reduced by a fixed tree (that of _mm512_reduce_add_ps, 16 keys at a
// time), times the scale; exact softmax with vec_math::exp16, summed in 16 lanes then a fixed
// tree; V accumulated in fp32 over the tokens in order.
constexpr int64_t kChunk = 64;   // head dims per pass over V: 4 vectors in registers
constexpr int64_t kTile = 16;    // keys per K tile: the 16 q.k sums reduce_add16 takes
constexpr int64_t kFront = 16;   // room for the scores of a tile's tokens before `first`

// A K tile: 16 tokens of one KV head in fp32, vector-major: [vectors][16 tokens][16 lanes], so
// the 16 keys' v-th vectors sit at fixed offsets (no per-key pointers). Lanes past d are 0.
constexpr int64_t tile_floats(int64_t vectors) { return vectors * kTile * 16; }

// The paged cache: K tiles widened from a block's run of tokens into a thread's buffer.
template <typename C>
struct PagedKV {
  const C* cache;
  const int64_t* table;
  Layout l;

  // use(kh, t0, lanes, tile) for every tile of KV heads [kv_begin, kv_end) over [first, context)
  template <typename Use>
  void k_tiles(int64_t first, int64_t context, int64_t kv_begin, int64_t kv_end, float* buffer,
               Use&& use) const {
    using vec_math::lanes_below;
    const int64_t d = l.head_dim, vectors = (d + 15) / 16;
    for (int64_t t = first; t < context;) {  // one run of tokens inside one block
      const int64_t offset = t % l.block_size, run = std::min(l.block_size - offset, context - t);
      const C* row = cache + table[t / l.block_size] * l.block_stride + offset * l.token_stride;
      for (int64_t j0 = 0; j0 < run; j0 += kTile) {
        const int64_t m = std::min(kTile, run - j0);
        for (int64_t kh = kv_begin; kh < kv_end; ++kh) {
          const C* k = row + j0 * l.token_stride + kh * d;
          for (int64_t v = 0; v < vectors; ++v) {
            for (int64_t j = 0; j < kTile; ++j) {
              const __m512 x = j < m ? vec_math::load16(k + j * l.token_stride + v * 16,
                                                        lanes_below(d - v * 16))
                                     : _mm512_setzero_ps();
              _mm512_storeu_ps(buffer + (v * kTile + j) * 16, x);
            }
          }
          use(kh, t + j0, lanes_below(m), static_cast<const float*>(buffer));
        }
      }
      t += run;
    }
  }

  const C* v_cache() const { return cache + l.v_offset; }
};

// A prefill chunk's context widened to fp32 once for all of its rows: K as tiles of the
// tokens [16 i, 16 i + 16) ([tile][kv head][tile_floats]), V token-major ([token][kv head][d]).
struct WidenedKV {
  std::vector<float> k, v;
  Layout l{};  // of v: one block of all the tokens
  int64_t kv_heads = 0, vectors = 0;
  const int64_t* table = &kZero;
  static constexpr int64_t kZero = 0;

  template <typename Use>
  void k_tiles(int64_t first, int64_t context, int64_t kv_begin, int64_t kv_end, float*,
               Use&& use) const {
    // a tile's tokens before `first` are scored too: into attend_heads' kFront, never read
    for (int64_t t0 = first / kTile * kTile; t0 < context; t0 += kTile) {
      const __mmask16 lanes = vec_math::lanes_below(context - t0);
      for (int64_t kh = kv_begin; kh < kv_end; ++kh) {
        use(kh, t0, lanes, k.data() + (t0 / kTile * kv_heads + kh) * tile_floats(vectors));
      }
    }
  }

  const float* v_cache() const { return v.data(); }
};

// A thread's buffers, reused across its work items.
struct Scratch {
  std::vector<float> scores, q, k;
};

// The scores of one K tile's 16 keys for the G query heads of its KV head (q: G rows of
// `vectors` * 16 floats): s[g * padded + j] = scale * q_g . k_j for the lanes in `lanes`.
template <int G>
[[gnu::always_inline]] inline void score_tile(const float* q, const float* tile, int64_t vectors,
                                              float scale, float softcap, __mmask16 lanes,
                                              float* s, int64_t padded) {
  for (int g = 0; g < G; ++g) {
    __m512 acc[kTile];
    for (int64_t j = 0; j < kTile; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t v = 0; v < vectors; ++v) {
      const __m512 qv = _mm512_loadu_ps(q + (g * vectors + v) * 16);
      const float* keys = tile + v * kTile * 16;
      for (int64_t j = 0; j < kTile; ++j) {
        acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys + j * 16), acc[j]);
      }
    }
    float* out = s + g * padded;
    _mm512_mask_storeu_ps(
        out, lanes, _mm512_mul_ps(vec_math::reduce_add16(acc), _mm512_set1_ps(scale)));
    if (softcap > 0.f) {
      for (int64_t j = 0; j < kTile; ++j) {
        if (lanes >> j & 1) out[j] = softcap * std::tanh(out[j] / softcap);
      }
    }
  }
}

// out[g][c, c + 16 V) = sum over the tokens, in order, of weight * V[kv_head][c, c + 16 V), for
// the G query heads of one KV head (their weights G rows `padded` apart from `p`, token t at
// p[t - first]). The accumulators stay in registers because V is a compile-time count of
// vectors and the function is inlined: as a call, GCC kept them on the stack, 1.6x slower.
template <int G, int V, typename T, typename KV>
[[gnu::always_inline]] inline void accumulate_v(T* out, const KV& kv, const float* p,
                                                int64_t padded, int64_t first, int64_t context,
                                                int64_t kv_head, int64_t c) {
  using vec_math::lanes_below;
  const Layout& l = kv.l;
  const int64_t d = l.head_dim;
  __m512 acc[G][V];
  for (int g = 0; g < G; ++g) {
    for (int v = 0; v < V; ++v) acc[g][v] = _mm512_setzero_ps();
  }
  const auto* values = kv.v_cache();
  for (int64_t t = first; t < context;) {
    const int64_t offset = t % l.block_size, run = std::min(l.block_size - offset, context - t);
    const auto* v_row = values + kv.table[t / l.block_size] * l.block_stride +
                        offset * l.token_stride + kv_head * d + c;
    const float* p_run = p + t - first;
    for (int64_t j = 0; j < run; ++j, v_row += l.token_stride) {
      __m512 vv[V];
      for (int v = 0; v < V; ++v) {
        vv[v] = vec_math::load16(v_row + v * 16, lanes_below(d - c - v * 16));
      }
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(p_run[g * padded + j]);
        for (int v = 0; v < V; ++v) acc[g][v] = _mm512_fmadd_ps(w, vv[v], acc[g][v]);
      }
    }
    t += run;
  }
  for (int g = 0; g < G; ++g) {
    for (int v = 0; v < V; ++v) {
      vec_math::store16(out + g * d + v * 16, acc[g][v], lanes_below(d - c - v * 16));
    }
  }
}

// KV heads [kv_begin, kv_end) of one query row, each with its G = heads / kv_heads query
// heads, over the context tokens [first, context): the q.k of a tile's 16 keys for each query
// head, then softmax and V per KV head. T is the type of q, O that of out (T, or fp32 for a
// part of a split context, whose top score and sum of weights per head go to stats [h][2]);
// KV the source of K and V (the paged cache or a widened copy: the same values, so the same
// bits).
template <int G, typename T, typename O, typename KV>
void attend_heads(const T* q_in, O* out, const KV& kv, int64_t first, int64_t context,
                  int64_t kv_begin, int64_t kv_end, float scale, float softcap, Scratch& scratch,
                  float* stats = nullptr) {
  using vec_math::lanes_below;
  using vec_math::load16;
  const Layout& l = kv.l;
  const int64_t d = l.head_dim, n = context - first, vectors = (d + 15) / 16;
  const int64_t padded = (n + 15) / 16 * 16 + kFront, groups = kv_end - kv_begin;
  std::vector<float>&scores = scratch.scores, &q = scratch.q;
  scores.resize(groups * G * padded);
  q.resize(groups * G * vectors * 16);
  scratch.k.resize(tile_floats(vectors));
  for (int64_t h = 0; h < groups * G; ++h) {  // the query heads, widened once
    for (int64_t v = 0; v < vectors; ++v) {
      _mm512_storeu_ps(q.data() + (h * vectors + v) * 16,
                       load16(q_in + h * d + v * 16, lanes_below(d - v * 16)));
    }
  }
  // head h's score of token t: scores[h * padded + kFront + t - first]
  kv.k_tiles(first, context, kv_begin, kv_end, scratch.k.data(),
             [&](int64_t kh, int64_t t0, __mmask16 lanes, const float* tile) {
               const int64_t h = (kh - kv_begin) * G;
               score_tile<G>(q.data() + h * vectors * 16, tile, vectors, scale, softcap, lanes,
                             scores.data() + h * padded + kFront + t0 - first, padded);
             });
  for (int64_t h = 0; h < groups * G; ++h) {
    float* s = scores.data() + h * padded + kFront;
    float top_score, sum;
    vec_math::softmax_numerators(s, n, top_score, sum);
    const float inv = 1.f / sum;
    if (stats != nullptr) {
      stats[h * 2] = top_score;
      stats[h * 2 + 1] = sum;
    }
    for (int64_t i = 0; i < n; i += 16) {  // fold 1 / total into the weights
      _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(inv)));
    }
  }
  for (int64_t kh = 0; kh < groups; ++kh) {
    const float* p_of = scores.data() + kh * G * padded + kFront;
    for (int64_t c = 0; c < d; c += kChunk) {  // 64 dims of the group's heads per pass
      O* o = out + kh * G * d + c;
      switch (std::min<int64_t>(4, (d - c + 15) / 16)) {
        case 4: accumulate_v<G, 4>(o, kv, p_of, padded, first, context, kv_begin + kh, c); break;
        case 3: accumulate_v<G, 3>(o, kv, p_of, padded, first, context, kv_begin + kh, c); break;
        case 2: accumulate_v<G, 2>(o, kv, p_of, padded, first, context, kv_begin + kh, c); break;
        default: accumulate_v<G, 1>(o, kv, p_of, padded, first, context, kv_begin + kh, c);
      }
    }
  }
}

// The first `tokens` tokens of a block table's context widened to fp32, in parallel over tiles.
template <typename C>
void widen(WidenedKV& w, const PagedKV<C>& paged, int64_t tokens) {
  using vec_math::lanes_below;
  const Layout& l = paged.l;
  const int64_t d = l.head_dim, kv_heads = l.v_offset / d, vectors = (d + 15) / 16;
  const int64_t tiles = (tokens + kTile - 1) / kTile;
  w.kv_heads = kv_heads;
  w.vectors = vectors;
  w.l = Layout{tokens, 0, kv_heads * d, 0, d};
  w.k.assign(tiles * kv_heads * tile_floats(vectors), 0.f);
  w.v.resize(tokens * kv_heads * d);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      for (int64_t t = tile * kTile; t < std::min(tokens, (tile + 1) * kTile); ++t) {
        const C* src = paged.cache + paged.table[t / l.block_size] * l.block_stride +
                       (t % l.block_size) * l.token_stride;
        for (int64_t kh = 0; kh < kv_heads; ++kh) {
          float* k = w.k.data() + (tile * kv_heads + kh) * tile_floats(vectors) + (t % kTile) * 16;
          for (int64_t v = 0; v < vectors; ++v) {
            const __mmask16 lanes = lanes_below(d - v * 16);
            _mm512_storeu_ps(k + v * kTile * 16, vec_math::load16(src + kh * d + v * 16, lanes));
            vec_math::store16(w.v.data() + (t * kv_heads + kh) * d + v * 16,
                              vec_math::load16(src + l.v_offset + kh * d + v * 16, lanes), lanes);
          }
        }
      }
    }
  });
}

}  // namespace attention_fp32

#endif
