// Paged attention on CPU: one work item per (query row, head), scores in a thread-local
// buffer (over the row's sliding window, when the layer has one; soft-capped for Gemma 2),
// exact softmax in float32, V accumulated in float32. Items of one row and KV group
// are adjacent, so a thread reuses the group's K/V from its cache across the query heads.
// With AVX-512, fp32 and bf16 caches take attention_fp32.h instead (a row's heads by KV
// group, q.k over 16-token K tiles, a long prefill chunk's context widened to fp32 once for
// all of its rows), a context of over 512 tokens in parts the threads share and a merge
// (split_context.h); a bf16 cache on a CPU with AVX512-BF16 takes attention_bf16.h's dot
// products for its heads instead (the same work items and parts; a long chunk's keys
// transposed once instead, transposed_keys.h);
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
#include "attention_fp32.h"
#include "ops.h"
#include "paged_layout.h"
#include "row_runs.h"
#include "split_context.h"
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

// The AVX-512 kernels' code, and a thread's buffers, reused across its work items.
using attention_fp32::PagedKV;
using attention_fp32::WidenedKV;
using split_context::part_count;
using split_context::part_of;
using split_context::Span;

struct Scratch {
  attention_fp32::Scratch fp32;
  std::vector<float> parts, stats;  // a row's split context: each part's output and stats
#ifdef __AVX512BF16__
  attention_bf16::Scratch bf16;
#endif
};

constexpr int64_t kWidenRows = 16;           // a chunk this long reads a widened copy
constexpr int64_t kWidenBytes = 64ll << 20;  // of at most this size

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
        attention_fp32::widen(widened.emplace_back(),
                              PagedKV<T>{cache, tables + table_of[r] * width, layout}, tokens);
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
      attention_fp32::attend_heads<G>(q + head0 * d, o, *widened_of[r], span.first, span.context,
                                      kv_begin, kv_end, scale, softcap, scratch.fp32, stats);
    } else {
      attention_fp32::attend_heads<G>(
          q + head0 * d, o, PagedKV<T>{cache, tables + table_of[r] * width, layout}, span.first,
          span.context, kv_begin, kv_end, scale, softcap, scratch.fp32, stats);
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
          split_context::merge_parts(out + (r * heads + h) * d, parts.data() + h * d,
                                     stats.data() + h * 2, count, heads, d);
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
        split_context::merge_parts(out + item * d,
                                   parts.data() + (first_part[r] * heads + h) * d,
                                   stats.data() + (first_part[r] * heads + h) * 2, count, heads,
                                   d);
      }
    }
  });
}

#endif

// The whole call through the AVX-512 kernels, for the types and group sizes it takes; false (nothing
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
