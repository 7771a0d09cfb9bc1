// Paged attention on CPU: one work item per (query row, head), scores in a thread-local
// buffer (over the row's sliding window, when the layer has one; soft-capped for Gemma 2),
// exact softmax in float32, V accumulated in float32. Items of one row and KV group
// are adjacent, so a thread reuses the group's K/V from its cache across the query heads.
// With AVX-512, fp32 and bf16 caches take attend_heads below instead (a row's heads by KV
// group, q.k over 16-token K tiles, a long prefill chunk's context widened to fp32 once for
// all of its rows, a context of over 512 tokens in parts the threads share); a bf16 cache on a
// CPU with AVX512-BF16 takes attention_bf16.h's dot products for its heads instead (the same
// work items and parts; a long chunk's keys transposed once instead, transposed_keys.h);
// fp16, or a build without AVX-512, takes attend_one, or in an AVX2 build attention_avx2.h
// (8-key tiles, a row's heads together when rows are many).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "attention_avx2.h"
#include "attention_bf16.h"
#include "ops.h"
#include "paged_layout.h"
#include "row_runs.h"
#include "vec_math.h"

namespace {

using paged_kv::Layout;

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
// group are computed together. A head's arithmetic is the same whatever the batch, the
// threads or where its K and V are read from: q.k over d as 16 lanes reduced by a fixed tree
// (that of _mm512_reduce_add_ps, 16 keys at a time), times the scale; exact softmax with
// vec_math::exp16, summed in 16 lanes then a fixed tree; V accumulated in fp32 over the tokens
// in order.
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
  std::vector<float> scores, q, k, parts, stats;
#ifdef __AVX512BF16__
  attention_bf16::Scratch bf16;
#endif
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

constexpr int64_t kWidenRows = 16;           // a chunk this long reads a widened copy
constexpr int64_t kWidenBytes = 64ll << 20;  // of at most this size

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

// Whether a cache of T with heads of d dims is read by attention_bf16.h's dot products.
template <typename T>
constexpr bool reads_bf16_pairs(int64_t d) {
#ifdef __AVX512BF16__
  return std::is_same_v<T, c10::BFloat16> && d <= 32 * attention_bf16::kMaxVectors;
#else
  return false;
#endif
}

// Work items: whole rows when there are enough of them for the threads (each row's K read
// in one pass, its parts one after another), else (row, part, KV head). The arithmetic of a
// head is the same either way, over the cache or a widened copy.
template <int G, typename T>
void attend_items(T* out, const T* q, const T* cache, const int64_t* tables, int64_t width,
                  const int64_t* table_of, const int64_t* context_of, int64_t rows,
                  int64_t heads, int64_t kv_heads, const Layout& layout, float scale,
                  int64_t window, float softcap) {
  const int64_t d = layout.head_dim;
  // A bf16 cache read by dot products (attention_bf16.h) needs no fp32 copy: every row reads
  // the cache itself, and fetches its context ahead unless many rows share it.
  const bool dot_products = reads_bf16_pairs<T>(d);
  // Runs of >= kWidenRows consecutive rows on one block table (a prefill chunk's rows) share
  // their context: each such run's is widened once, and its rows read the copy.
  std::vector<const WidenedKV*> widened_of(rows, nullptr);
  std::vector<WidenedKV> widened;
  widened.reserve(rows / kWidenRows + 1);  // never reallocated: widened_of points into it
  std::vector<char> shared_context(rows, 0);
#ifdef __AVX512BF16__
  // and with dot products, each such run's keys are transposed once for all its rows
  // (transposed_keys.h)
  std::vector<const transposed_keys::TransposedKeys*> transposed_of(rows, nullptr);
  std::vector<transposed_keys::TransposedKeys> transposed;
  transposed.reserve(rows / kWidenRows + 1);  // never reallocated: transposed_of points into it
#endif
  for (int64_t r = 0; r < rows;) {
    int64_t end = r + 1;
    while (end < rows && table_of[end] == table_of[r]) ++end;
    const int64_t tokens = *std::max_element(context_of + r, context_of + end);
    const bool fits = tokens * layout.token_stride * 4 <= kWidenBytes;  // a copy of it
    if (end - r >= kWidenRows) {
      std::fill(shared_context.begin() + r, shared_context.begin() + end, 1);
      if (fits && !dot_products) {
        widen(widened.emplace_back(), PagedKV<T>{cache, tables + table_of[r] * width, layout},
              tokens);
        std::fill(widened_of.begin() + r, widened_of.begin() + end, &widened.back());
      }
#ifdef __AVX512BF16__
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (fits && dot_products) {
          transposed_keys::transpose(transposed.emplace_back(),
                                     reinterpret_cast<const uint16_t*>(cache),
                                     tables + table_of[r] * width, layout, tokens);
          std::fill(transposed_of.begin() + r, transposed_of.begin() + end, &transposed.back());
        }
      }
#endif
    }
    r = end;
  }
  const auto span_of = [&](int64_t r) {
    const int64_t context = context_of[r];
    return Span{window > 0 ? std::max<int64_t>(0, context - window) : 0, context};
  };
  // KV heads [kv_begin, kv_end) of row r over `span` into out (O: T or a part's fp32)
  const auto attend = [&](int64_t r, const Span& span, int64_t kv_begin, int64_t kv_end,
                          auto* o, float* stats, Scratch& scratch,
                          const paged_kv::Context& upcoming = {}) {
    const int64_t head0 = r * heads + kv_begin * G;
#ifdef __AVX512BF16__
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (dot_products) {
        attention_bf16::attend_heads<G>(q + head0 * d, o, cache, tables + table_of[r] * width,
                                        layout, span.first, span.context, kv_begin, kv_end,
                                        scale, softcap, !shared_context[r], scratch.bf16,
                                        stats, upcoming, transposed_of[r]);
        return;
      }
    }
#endif
    if (widened_of[r] != nullptr) {
      attend_heads<G>(q + head0 * d, o, *widened_of[r], span.first, span.context, kv_begin,
                      kv_end, scale, softcap, scratch, stats);
    } else {
      attend_heads<G>(q + head0 * d, o, PagedKV<T>{cache, tables + table_of[r] * width, layout},
                      span.first, span.context, kv_begin, kv_end, scale, softcap, scratch,
                      stats);
    }
  };
  const auto context_of_part = [&](int64_t r, int64_t part) {
    const Span span = part_of(span_of(r), part);
    return paged_kv::Context{tables + table_of[r] * width, span.first, span.context};
  };
  if (rows >= 4 * at::get_num_threads()) {
    const int64_t threads = at::get_num_threads();
    const std::vector<int64_t> first_row = row_runs::runs_of_equal_work(
        rows, threads, [&](int64_t r) { return span_of(r).context - span_of(r).first; },
        [&](int64_t r) { return !shared_context[r]; });
    at::parallel_for(0, threads, 1, [&](int64_t thread_begin, int64_t thread_end) {
      const int64_t begin = first_row[thread_begin], end = first_row[thread_end];
      Scratch scratch;
      for (int64_t r = begin; r < end; ++r) {
        const Span span = span_of(r);
        const int64_t count = part_count(span);
        // what this thread attends after part i of row r
        const auto upcoming = [&](int64_t i) {
          if (i + 1 < count) return context_of_part(r, i + 1);
          return r + 1 < end ? context_of_part(r + 1, 0) : paged_kv::Context{};
        };
        if (count == 1) {
          attend(r, span, 0, kv_heads, out + r * heads * d, nullptr, scratch, upcoming(0));
          continue;
        }
        std::vector<float>&parts = scratch.parts, &stats = scratch.stats;
        parts.resize(count * heads * d);
        stats.resize(count * heads * 2);
        for (int64_t i = 0; i < count; ++i) {
          attend(r, part_of(span, i), 0, kv_heads, parts.data() + i * heads * d,
                 stats.data() + i * heads * 2, scratch, upcoming(i));
        }
        for (int64_t h = 0; h < heads; ++h) {
          merge_parts(out + (r * heads + h) * d, parts.data() + h * d, stats.data() + h * 2,
                      count, heads, d);
        }
      }
    });
    return;
  }
  // A few rows: every (row, part, KV head) an item, the parts' results in one buffer
  // ([row's first part + part][heads][d]), merged once all are done.
  std::vector<int64_t> first_part(rows + 1, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t count = part_count(span_of(r));
    first_part[r + 1] = first_part[r] + (count > 1 ? count : 0);
  }
  std::vector<float> parts(first_part[rows] * heads * d), stats(first_part[rows] * heads * 2);
  struct Item {
    int64_t row, part, kv_head;
  };
  std::vector<Item> items;
  // rows zigzag (first, last, second, ...): a chunk's rows see ever more context, and each
  // thread's contiguous share of items then holds as much of it as another's
  const auto zigzag = [rows](int64_t k) { return k % 2 == 0 ? k / 2 : rows - 1 - k / 2; };
  for (int64_t k = 0; k < rows; ++k) {
    const int64_t r = zigzag(k), count = part_count(span_of(r));
    for (int64_t i = 0; i < count; ++i) {
      for (int64_t kh = 0; kh < kv_heads; ++kh) items.push_back({r, i, kh});
    }
  }
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t item = begin; item < end; ++item) {
      const auto [r, i, kh] = items[item];
      const Span span = span_of(r);
      if (first_part[r + 1] == first_part[r]) {
        attend(r, span, kh, kh + 1, out + (r * heads + kh * G) * d, nullptr, scratch);
      } else {
        const int64_t at = (first_part[r] + i) * heads + kh * G;
        attend(r, part_of(span, i), kh, kh + 1, parts.data() + at * d, stats.data() + at * 2,
               scratch);
      }
    }
  });
  if (first_part[rows] == 0) return;  // no row in parts
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / heads, h = item % heads;
      const int64_t count = first_part[r + 1] - first_part[r];
      if (count > 0) {
        merge_parts(out + item * d, parts.data() + (first_part[r] * heads + h) * d,
                    stats.data() + (first_part[r] * heads + h) * 2, count, heads, d);
      }
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

#ifdef SPLITSERVE_AVX2

// The whole call through attention_avx2.h: whole rows as work items when there are at least
// two a thread (each fetching the start of the thread's next row; a run of rows a thread, as
// row_runs.h splits them), else (row, head) items so that a few rows still spread over the
// threads.
template <typename T>
void attend_avx2(T* out, const T* q, const T* cache, const int64_t* tables, int64_t width,
                 const int64_t* table_of, const int64_t* context_of, int64_t rows, int64_t heads,
                 const Layout& layout, float scale, int64_t window, float softcap) {
  const int64_t d = layout.head_dim, group = heads / (layout.v_offset / d);
  const bool whole_rows = rows >= 2 * at::get_num_threads();
  const bool fetch = whole_rows && attention_avx2::fetches_ahead<T>();
  const int64_t per_item = whole_rows ? heads : 1;
  // Only the first row of a run on one block table fetches ahead: the rest of a prefill
  // chunk's rows read the same context, in cache by then (fetching it again took a 256-token
  // prefill's attention from 90 to 126 ms on one thread).
  const auto leads = [&](int64_t r) { return r == 0 || table_of[r - 1] != table_of[r]; };
  const auto context = [&](int64_t r) {
    const int64_t first = window > 0 ? std::max<int64_t>(0, context_of[r] - window) : 0;
    return paged_kv::Context{tables + table_of[r] * width, first, context_of[r]};
  };
  // whole rows: a run of rows of equal work a thread; else (row, head) items, equal counts
  const int64_t threads = at::get_num_threads();
  const auto tokens = [&](int64_t r) { return context(r).context - context(r).first; };
  // a row alone on its block table (a decode's) reads a context of its own
  const auto own = [&](int64_t r) { return leads(r) && (r + 1 == rows || leads(r + 1)); };
  const std::vector<int64_t> first_row =
      whole_rows ? row_runs::runs_of_equal_work(rows, threads, tokens, own)
                 : std::vector<int64_t>{};
  at::parallel_for(0, whole_rows ? threads : rows * heads, 1, [&](int64_t task, int64_t task_end) {
    const int64_t begin = whole_rows ? first_row[task] : task;
    const int64_t end = whole_rows ? first_row[task_end] : task_end;
    attention_avx2::Scratch<T> scratch;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t head = item * per_item, r = head / heads, h0 = head % heads;
      const paged_kv::Context own = context(r);
      const bool ahead = fetch && leads(r);
      const paged_kv::Context upcoming =
          ahead && item + 1 < end && leads(r + 1) ? context(r + 1) : paged_kv::Context{};
      attention_avx2::attend_heads(q + head * d, out + head * d, cache, own.table, own.first,
                                   own.context, h0, h0 + per_item, group, layout, scale, softcap,
                                   scratch, ahead, upcoming);
    }
  });
}

#endif

}  // namespace

std::string attention_path(torch::ScalarType dtype, int64_t heads, int64_t kv_heads,
                           int64_t head_dim) {
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0, "head shape");
  const int64_t group = heads / kv_heads;
  const bool grouped = group <= 8 && head_dim <= 512;
#ifdef __AVX512F__
  if (grouped && dtype == at::kBFloat16 && reads_bf16_pairs<c10::BFloat16>(head_dim)) {
    return "bf16 dot products over the cache, its rows fetched ahead (AVX512-BF16)";
  }
  if (grouped && (dtype == at::kFloat || dtype == at::kBFloat16)) {
    return "fp32 multiply-adds over 16-token K tiles widened to fp32 (AVX-512)";
  }
  const char* why = grouped ? "no AVX-512 path for this dtype" : "more than 8 heads a KV head";
#elif defined(SPLITSERVE_AVX2)
  if (attention_avx2::takes(head_dim)) {
    return "one head at a time, 8-lane multiply-adds over 8-key tiles (AVX2)";
  }
  const char* why = "an AVX2 build, head_dim not a multiple of 8";
#else
  const char* why = "a build without AVX-512 or AVX2";
#endif
  return std::string("one head at a time, scalar loops (") + why + ")";
}

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
#ifdef SPLITSERVE_AVX2
        if constexpr (!std::is_same_v<scalar_t, double>) {  // fp32, bf16, fp16 caches
          if (attention_avx2::takes(d)) {
            attend_avx2(out_ptr, q_ptr, cache_ptr, tables, width, table_of, context_of, rows,
                        heads, layout, static_cast<float>(scale), window,
                        static_cast<float>(softcap));
            return;
          }
        }
#endif
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
