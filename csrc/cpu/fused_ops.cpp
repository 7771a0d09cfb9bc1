// The element-wise and per-row steps of a decoder layer between its matmuls, fused so that
// each is one pass over memory and one call: RMSNorm (with the residual add before it),
// SiLU(gate) * up, and RoPE of q and k together with the KV-cache write.
//
// Every op is per row (per token): a row's result depends only on that row, whatever the
// batch, the chunking or the thread count (threads split the rows). The rounding matches
// torch's and transformers' (e.g. RMSNorm rounds x * rsqrt to the activation dtype before
// the weight multiply; SiLU rounds before the product with up), so the fused path and the
// torch path differ only in the last bit of a sum of squares or an exp.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "ops.h"
#include "silu_mul.h"
#include "vec_math.h"

namespace {

constexpr int64_t kLanes = 16;

// Rows per task: enough work (~16K elements) that a thread is worth waking.
int64_t row_grain(int64_t n) { return std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(n, 1)); }

// 1 / sqrt(mean(x^2) + eps) over one row, in fp32: 16 running sums (lane l takes the
// elements i = l mod 16, in order), then a fixed pairwise tree.
template <typename T>
float inverse_rms(const T* x, int64_t n, float eps) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) {
      const float v = static_cast<float>(x[i + l]);
      acc[l] = std::fma(v, v, acc[l]);
    }
  }
  for (int64_t l = 0; i + l < n; ++l) {
    const float v = static_cast<float>(x[i + l]);
    acc[l] = std::fma(v, v, acc[l]);
  }
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
    for (int64_t l = 0; l < width; ++l) acc[l] += acc[l + width];
  }
  return 1.0f / std::sqrt(acc[0] / static_cast<float>(n) + eps);
}

// out: x's type T, or bf16 beside fp32 x (the T result rounded once more, as torch's .to).
template <typename T, typename O>
void norm_row(O* out, const T* x, const T* w, int64_t n, float eps) {
  const float r = inverse_rms(x, n, eps);
  for (int64_t i = 0; i < n; ++i) {
    const T normed = static_cast<T>(static_cast<float>(x[i]) * r);  // rounded, as HF
    const T y = static_cast<T>(static_cast<float>(normed) * static_cast<float>(w[i]));
    out[i] = static_cast<O>(static_cast<float>(y));
  }
}

// rows of x (row stride ld) normed into dst [rows, n]
template <typename T, typename O>
void norm_rows(O* dst, const T* src, int64_t ld, const T* w, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(dst + r * n, src + r * ld, w, n, eps);
  });
}

// residual rows h [rows, n] += delta rows (row stride ld), each then normed into dst
template <typename T, typename O>
void add_norm_rows(O* dst, T* h, const T* d, int64_t ld, const T* w, int64_t rows, int64_t n,
                   float eps) {
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* hr = h + r * n;
      const T* dr = d + r * ld;
      for (int64_t i = 0; i < n; ++i) {  // rounded once, as torch's add
        hr[i] = static_cast<T>(static_cast<float>(hr[i]) + static_cast<float>(dr[i]));
      }
      norm_row(dst + r * n, hr, w, n, eps);
    }
  });
}

void check_rows(const torch::Tensor& x, const torch::Tensor& weight, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": x must be [rows, n], rows contiguous");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              name, ": weight must be [n] in x's dtype");
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, bool bf16_out) {
  check_rows(x, weight, "rms_norm");
  TORCH_CHECK(!bf16_out || x.scalar_type() == torch::kFloat, "rms_norm: bf16_out takes float32 x");
  auto out = torch::empty(x.sizes(), x.options().dtype(bf16_out ? torch::kBFloat16 : x.scalar_type()));
  const int64_t rows = x.size(0), n = x.size(1), ld = x.stride(0);
  const float e = static_cast<float>(eps);
  if (bf16_out) {
    norm_rows(out.data_ptr<c10::BFloat16>(), x.data_ptr<float>(), ld, weight.data_ptr<float>(),
              rows, n, e);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    norm_rows(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), ld, weight.data_ptr<scalar_t>(),
              rows, n, e);
  });
  return out;
}

torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight,
                           double eps, bool bf16_out) {
  check_rows(residual, weight, "add_rms_norm");
  TORCH_CHECK(residual.is_contiguous() && delta.sizes() == residual.sizes() &&
                  delta.stride(1) == 1 && delta.scalar_type() == residual.scalar_type(),
              "add_rms_norm: residual contiguous [rows, n], delta [rows, n] in its dtype");
  TORCH_CHECK(!bf16_out || residual.scalar_type() == torch::kFloat,
              "add_rms_norm: bf16_out takes a float32 residual");
  auto out = torch::empty(residual.sizes(),
                          residual.options().dtype(bf16_out ? torch::kBFloat16 : residual.scalar_type()));
  const int64_t rows = residual.size(0), n = residual.size(1), ld = delta.stride(0);
  const float e = static_cast<float>(eps);
  if (bf16_out) {
    add_norm_rows(out.data_ptr<c10::BFloat16>(), residual.data_ptr<float>(), delta.data_ptr<float>(),
                  ld, weight.data_ptr<float>(), rows, n, e);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, residual.scalar_type(), "add_rms_norm", [&] {
        add_norm_rows(out.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                      delta.data_ptr<scalar_t>(), ld, weight.data_ptr<scalar_t>(), rows, n, e);
      });
  return out;
}

torch::Tensor silu_mul(torch::Tensor fused) {
  TORCH_CHECK(fused.dim() == 2 && fused.stride(1) == 1 && fused.size(1) % 2 == 0,
              "silu_mul: fused must be [rows, 2 * inter], rows contiguous");
  const int64_t rows = fused.size(0), inter = fused.size(1) / 2, ld = fused.stride(0);
  auto out = torch::empty({rows, inter}, fused.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, fused.scalar_type(), "silu_mul", [&] {
    const scalar_t* src = fused.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(inter), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = src + r * ld;
        const scalar_t* up = gate + inter;
        scalar_t* o = dst + r * inter;
        silu_mul_row(o, gate, up, inter);
      }
    });
  });
  return out;
}

// The leading 2 * half dims of one head v rotated, pair (2j, 2j + 1) times cos + i sin, into out
// (v itself, or another head's row of type O, each value rounded to T first, as in place).
template <typename T, typename O>
inline void rotate_head(const T* v, const float* rot, int64_t half, O* out) {
  for (int64_t j = 0; j < half; ++j) {
    const float a = static_cast<float>(v[2 * j]), b = static_cast<float>(v[2 * j + 1]);
    const float c = rot[2 * j], s = rot[2 * j + 1];
    out[2 * j] = static_cast<O>(static_cast<T>(std::fma(a, c, -(b * s))));
    out[2 * j + 1] = static_cast<O>(static_cast<T>(std::fma(a, s, b * c)));
  }
}

// Rows of qkv [T, heads + 2 * kv_heads, d]: q and k heads rotated, then k and v copied into
// their cache slots (converted to the cache's element type C). With q_out ([T, heads, d], C)
// the rotated q heads go there, converted as k is, and qkv's own stay as they were; else
// they are rotated in place.
template <typename T, typename C>
void rope_write_rows(T* x, C* kv_cache, C* q_out, const float* table, const int64_t* pos,
                     const int64_t* slots, int64_t tokens, int64_t heads, int64_t kv_heads,
                     int64_t d, int64_t half, int64_t row) {
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* rot = table + pos[t] * half * 2;
      T* token = x + t * (heads + 2 * kv_heads) * d;
      for (int64_t h = 0; h < heads + kv_heads; ++h) {  // q heads, then k heads
        T* v = token + h * d;
        if (q_out != nullptr && h < heads) {
          C* q = q_out + (t * heads + h) * d;
          rotate_head(v, rot, half, q);
          for (int64_t j = 2 * half; j < d; ++j) q[j] = static_cast<C>(v[j]);  // unrotated dims
        } else {
          rotate_head(v, rot, half, v);
        }
      }
      C* slot = kv_cache + slots[t] * row;  // [2, kv_heads, d]: rotated k, then v
      for (int64_t i = 0; i < 2 * kv_heads * d; ++i) slot[i] = static_cast<C>(token[heads * d + i]);
    }
  });
}

torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor rotations, torch::Tensor positions,
                            torch::Tensor cache, torch::Tensor slot_mapping, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.is_contiguous(), "rope_write_kv: qkv [T, heads, d] contiguous");
  TORCH_CHECK(rotations.dim() == 3 && rotations.size(2) == 2 && rotations.is_contiguous() &&
                  rotations.scalar_type() == torch::kFloat,
              "rope_write_kv: rotations [max_len, r / 2, 2] float32 (cos, sin)");
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous(), "rope_write_kv: cache 5-d, contiguous");
  const bool rounds = cache.scalar_type() != qkv.scalar_type();  // fp32 stream, 16-bit cache
  TORCH_CHECK(!rounds || (qkv.scalar_type() == torch::kFloat &&
                          (cache.scalar_type() == torch::kBFloat16 ||
                           cache.scalar_type() == torch::kHalf)),
              "rope_write_kv: the cache in qkv's dtype, or 16-bit beside float32 qkv");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && slot_mapping.scalar_type() == torch::kInt64,
              "rope_write_kv: positions and slot_mapping int64");
  const int64_t tokens = qkv.size(0), d = qkv.size(2), kv_heads = cache.size(3);
  const int64_t half = rotations.size(1), max_len = rotations.size(0);
  TORCH_CHECK(qkv.size(1) == heads + 2 * kv_heads && cache.size(4) == d && 2 * half <= d,
              "rope_write_kv: qkv must be [T, heads + 2 * kv_heads, d], the cache's d");
  TORCH_CHECK(positions.numel() == tokens && slot_mapping.numel() == tokens,
              "rope_write_kv: one position and one slot per token");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t row = 2 * kv_heads * d, num_slots = cache.numel() / row;
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_len, "position ", pos[t], " beyond the rope table");
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " out of range");
  }
  const float* table = rotations.data_ptr<float>();
  if (rounds) {  // the q heads rounded to the cache's dtype too, for attention
    auto q = torch::empty({tokens, heads, d}, cache.options());
    AT_DISPATCH_REDUCED_FLOATING_TYPES(cache.scalar_type(), "rope_write_kv", [&] {
      rope_write_rows(qkv.data_ptr<float>(), cache.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(),
                      table, pos, slots, tokens, heads, kv_heads, d, half, row);
    });
    return q;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_write_kv", [&] {
    rope_write_rows(qkv.data_ptr<scalar_t>(), cache.data_ptr<scalar_t>(),
                    static_cast<scalar_t*>(nullptr), table, pos, slots, tokens, heads, kv_heads,
                    d, half, row);
  });
  return torch::Tensor();
}
