// A prefill chunk's keys transposed once for all of its rows (a chunk of 16 rows or more,
// paged_attention.cpp's kWidenRows), and a tile's scores read from them: the same bits as
// attention_bf16.h's score_tile, which reads the keys from the cache, so a row's result never
// depends on which path it took (a chunk's rows take this one, decodes and short runs of rows
// the other).
//
// score_tile computes, for each key j of a tile, 16 lane partials (lane i: the dpbf16 chain
// over the head's dim pairs i, 16 + i, 32 + i, ... in order) and adds them in reduce_add16's
// fixed tree (i with i + 8, then i + 4, i + 2, i + 1): two to three shuffles and adds for every
// two dot products. Here lane j of a vector is key j: lane partial i is the same chain,
// dpbf16(acc, broadcast q's pair p, the 16 keys' pair p) over p = i, 16 + i, ..., and the same
// tree adds the 16 partials' vectors, one add a key. Tiles count from token 0, so a row whose
// span starts at a multiple of 16 (not inside a sliding window) reads them; a row's keys past
// its own context are scored too and then masked, as score_tile's zero rows are.
//
// On the 2-core AMD EPYC host (Zen 4, AVX512-BF16), a prefill chunk's attention over 30 layers
// (9 heads over 3, d 64), alternated with score_tile's path in one process, medians of 8: one
// thread, 256 rows x 256 tokens 25.9 -> 20.4 ms, 256 rows after 768 cached tokens 174.5 ->
// 139.3, 128 x 128 6.85 -> 6.05; two threads, 256 x 256 13.2 -> 10.6. A KV group's 3 heads at
// once against one at a time and two: 22.1 against 23.0 and 22.1 ms (256 x 256, one thread,
// an earlier build); each broadcast of q feeding 2 or 4 tiles: 27.5 and 34.3 (the partials
// spill).
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "paged_layout.h"

namespace transposed_keys {

constexpr int64_t kKeys = 16;  // keys a tile: a vector's 16 lanes

struct TransposedKeys {
  // [tile][kv head][p][16]: dims (2 p, 2 p + 1) of each key of the tile, p < pairs_per_head;
  // zero past the head's dims and past the context
  std::vector<uint32_t> keys;
  int64_t kv_heads = 0, vectors = 0, pairs_per_head = 0;  // pairs_per_head = 16 x vectors

  const uint32_t* key_tile(int64_t tile, int64_t kv_head) const {
    return keys.data() + (tile * kv_heads + kv_head) * pairs_per_head * kKeys;
  }
};

// The keys of tokens [0, tokens) of one block table's context, in parallel over tiles.
inline void transpose(TransposedKeys& out, const uint16_t* cache, const int64_t* table,
                      const paged_kv::Layout& l, int64_t tokens) {
  const int64_t d = l.head_dim, kv_heads = l.v_offset / d, tiles = (tokens + kKeys - 1) / kKeys;
  out.kv_heads = kv_heads;
  out.vectors = (d + 31) / 32;
  out.pairs_per_head = out.vectors * 16;
  out.keys.assign(tiles * kv_heads * out.pairs_per_head * kKeys, 0);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin * kKeys; t < std::min(tokens, end * kKeys); ++t) {
      const uint16_t* row = cache + table[t / l.block_size] * l.block_stride +
                            (t % l.block_size) * l.token_stride;
      for (int64_t kh = 0; kh < kv_heads; ++kh) {
        uint32_t* key = out.keys.data() + (t / kKeys * kv_heads + kh) * out.pairs_per_head * kKeys +
                        t % kKeys;
        for (int64_t p = 0; p < d / 2; ++p) std::memcpy(key + p * kKeys, row + kh * d + 2 * p, 4);
      }
    }
  });
}

// The accumulators of H query heads, one vector of 16 keys each.
template <int H>
struct Lanes {
  __m512 v[H];
};

template <int H>
[[gnu::always_inline]] inline Lanes<H> operator+(const Lanes<H>& a, const Lanes<H>& b) {
  Lanes<H> s;
#pragma GCC unroll 4
  for (int h = 0; h < H; ++h) s.v[h] = _mm512_add_ps(a.v[h], b.v[h]);
  return s;
}

// Lane partial i of H heads' scores over one tile's keys (V: the head's 32-dim vectors; q:
// the heads' pairs, 16 V apart, so that every broadcast's address is q's plus a constant).
template <int H, int V>
[[gnu::always_inline]] inline Lanes<H> partial(int i, const uint32_t* q, const uint32_t* tile) {
  Lanes<H> acc;
#pragma GCC unroll 4
  for (int h = 0; h < H; ++h) acc.v[h] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v) {
    const int p = 16 * v + i;
    const __m512bh keys = reinterpret_cast<__m512bh>(_mm512_loadu_si512(tile + p * kKeys));
#pragma GCC unroll 4
    for (int h = 0; h < H; ++h) {
      const __m512bh qp = reinterpret_cast<__m512bh>(_mm512_set1_epi32(q[h * 16 * V + p]));
      acc.v[h] = _mm512_dpbf16_ps(acc.v[h], qp, keys);
    }
  }
  return acc;
}

// h_i = partial i + partial i + 8, then q_i = h_i + h_i + 4: reduce_add16's first two levels.
template <int H, int V>
[[gnu::always_inline]] inline Lanes<H> quarter(int i, const uint32_t* q, const uint32_t* tile) {
  return (partial<H, V>(i, q, tile) + partial<H, V>(i + 8, q, tile)) +
         (partial<H, V>(i + 4, q, tile) + partial<H, V>(i + 12, q, tile));
}

// out[h * out_stride + j] = scale * (score of the tile's key j for head h), for H heads: the
// quarters added as reduce_add16's last two levels, (q_0 + q_2) + (q_1 + q_3). (H up to 4:
// more spills the partials out of the registers.)
template <int H, int V>
[[gnu::always_inline]] inline void score_tile(const uint32_t* q, const uint32_t* tile,
                                              float scale, float* out, int64_t out_stride) {
  const Lanes<H> sums = (quarter<H, V>(0, q, tile) + quarter<H, V>(2, q, tile)) +
                        (quarter<H, V>(1, q, tile) + quarter<H, V>(3, q, tile));
#pragma GCC unroll 4
  for (int h = 0; h < H; ++h) {
    _mm512_storeu_ps(out + h * out_stride, _mm512_mul_ps(sums.v[h], _mm512_set1_ps(scale)));
  }
}

// score_heads for V vectors a head.
template <int V>
void score_tiles(const TransposedKeys& context, int64_t G, const uint32_t* q, int64_t kv_begin,
                 int64_t kv_end, int64_t first_tile, int64_t count, float scale, float* out,
                 int64_t out_stride) {
  for (int64_t kh = kv_begin; kh < kv_end; ++kh) {
    for (int64_t g = 0; g < G; g += 4) {
      const int64_t h = (kh - kv_begin) * G + g;  // the first of these heads, in q and out
      const uint32_t* qh = q + h * 16 * V;
      for (int64_t t = 0; t < count; ++t) {
        const uint32_t* tile = context.key_tile(first_tile + t, kh);
        float* o = out + h * out_stride + t * kKeys;
        switch (std::min<int64_t>(4, G - g)) {
          case 4: score_tile<4, V>(qh, tile, scale, o, out_stride); break;
          case 3: score_tile<3, V>(qh, tile, scale, o, out_stride); break;
          case 2: score_tile<2, V>(qh, tile, scale, o, out_stride); break;
          default: score_tile<1, V>(qh, tile, scale, o, out_stride);
        }
      }
    }
  }
}

// The scores of KV heads [kv_begin, kv_end) of one query row, G query heads each (q: their
// pairs, pairs_per_head apart, in head order, zero past the head's dims), over `count` tiles
// from `first_tile`: head h's score of tile t's key j at out[h * out_stride + 16 t + j].
inline void score_heads(const TransposedKeys& context, int64_t G, const uint32_t* q,
                        int64_t kv_begin, int64_t kv_end, int64_t first_tile, int64_t count,
                        float scale, float* out, int64_t out_stride) {
  switch (context.vectors) {
#define SPLITSERVE_VECTORS(V)                                                                 \
  case V:                                                                                     \
    score_tiles<V>(context, G, q, kv_begin, kv_end, first_tile, count, scale, out, out_stride); \
    break;
    SPLITSERVE_VECTORS(1)
    SPLITSERVE_VECTORS(2)
    SPLITSERVE_VECTORS(3)
    SPLITSERVE_VECTORS(4)
#undef SPLITSERVE_VECTORS
  }
}

}  // namespace transposed_keys

#endif
