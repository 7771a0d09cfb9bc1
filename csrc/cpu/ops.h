// CPU kernels (paged attention, KV write, batch-invariant linear), exported to Python by
// bindings.cpp.
//
// KV cache of one layer: [num_blocks, block_size, 2, kv_heads, head_dim], contiguous;
// index 0 of the third axis holds K, index 1 holds V.
#pragma once

#include <torch/extension.h>

// Writes the new tokens' KV into their slots. kv: [T, 2, kv_heads, d];
// slot_mapping: [T] int64, slot = block_id * block_size + offset.
void write_kv(torch::Tensor cache, torch::Tensor kv, torch::Tensor slot_mapping);

// Attention of each query row over a prefix of its sequence's paged context.
// q, out: [T, heads, d]; block_tables: [S, max_blocks] int64; row_table: [T] int64, the
// table row of each query row; row_context: [T] int64, how many leading context tokens the
// row sees (its own position + 1). A decode row sees its whole context; a prefill row at
// position p sees p + 1 tokens, which makes the same call a causal varlen prefill.
// window > 0: a row sees only the last `window` of those tokens (sliding-window layers);
// softcap > 0: scores become softcap * tanh(score / softcap) before the softmax.
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor cache,
                     torch::Tensor block_tables, torch::Tensor row_table,
                     torch::Tensor row_context, double scale, int64_t window, double softcap);

// Which of paged_attention's paths a cache of `dtype` with these heads takes, in words (for
// the start-up log: no silent fallback).
std::string attention_path(torch::ScalarType dtype, int64_t heads, int64_t kv_heads,
                           int64_t head_dim);

// Batch-invariant linear (linear.cpp). pack_linear_weight lays an [N, K] float32 or
// bfloat16 matrix out once as the kernel reads it: [ceil(N / 64), K, 64], zero-padded.
// linear: y [M, N] = x [M, K] @ w.T (+ bias [N]) in x's dtype (w's dtype), or in fp32 with
// float_out (a bf16 x into the fp32 residual stream: no widening pass before, no rounding
// after), each y[m, n] one k-ordered chain of fused multiply-adds in fp32 whatever M, the
// blocking or the threads.
// bf16 weights on a CPU with AVX512-BF16 are packed [ceil(N / 64), ceil(K / 2), 128] for the
// dot-product kernel of linear_bf16.cpp instead; `linear` takes either layout.
torch::Tensor pack_linear_weight(torch::Tensor w);
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                     c10::optional<torch::Tensor> bias, bool float_out = false);
// linear_silu_mul: silu(gate) * up [M, inter] of x [M, K] (fp32) and a gate_up matrix packed
// as pairs of panels (64 rows of gate, then the same 64 of up; inter a multiple of 64): the
// bits of silu_mul over the plain product, taken from each part of it while it is in cache.
// With pair-packed bf16 weights x may be bf16, and bf16_out gives those bits rounded to bf16
// (as .to(torch.bfloat16) would) for the bf16 matmul next.
torch::Tensor linear_silu_mul(torch::Tensor x, torch::Tensor packed, int64_t inter,
                              bool bf16_out = false);

// linear_bf16.cpp: whether this build has the AVX512-BF16 kernel, the pair packing
// [ceil(N / 64), pairs, 128] (pairs: ceil(K / 2) rounded up to 16) and the linear over it.
// kernel: "auto" (AMX tiles where they run, else AVX512-BF16 dot products), or "dot",
// "tiles", "emulated_tiles" (a scalar model of the tiles, on any CPU) by name.
bool bf16_dot_product_kernel();
torch::Tensor pack_bf16_pairs(torch::Tensor w);
torch::Tensor linear_bf16_pairs(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                                c10::optional<torch::Tensor> bias, const std::string& kernel,
                                bool float_out = false);
torch::Tensor linear_silu_mul_bf16_pairs(torch::Tensor x, torch::Tensor packed, int64_t inter,
                                         const std::string& kernel, bool bf16_out = false);
// Whether it and linear_int8 run on AMX tiles: "on", "refused" (the OS did not grant tile
// data) or "absent" (amx_tiles.h).
std::string amx_tiles();

// linear_int8.cpp: W8A8 with AMX-INT8 or AVX512-VNNI. pack_int8_quads(q [N, K] int8) ->
// (packed [ceil(N / 64), quads, 256], colsums [N] int32; quads: ceil(K / 4) rounded up to 16);
// linear_int8 quantizes x per row and returns (x_q @ q.T) * sx * scales (+ bias) in x's
// dtype; kernel as linear_bf16_pairs' (the same bits from each: the sums are exact).
bool int8_dot_product_kernel();
std::vector<torch::Tensor> pack_int8_quads(torch::Tensor q);
torch::Tensor linear_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          torch::Tensor colsums, int64_t out_features,
                          c10::optional<torch::Tensor> bias, const std::string& kernel);

// features.cpp: the instruction sets this build's kernels use (compiled for this host).
std::vector<std::string> cpu_features();

// One core's measured multiply-add peak, giga-ops/s (2 per multiply-add): fp32, bf16, int8.
double core_peak_gops(const std::string& numerics, int64_t iterations);

// fused_ops.cpp: per-row steps between the matmuls (any float dtype, fp32 math, rounded to the
// dtype where torch rounds). rms_norm: x [rows, n] (rows contiguous) -> x * rsqrt(mean(x^2) +
// eps) * weight. add_rms_norm: residual += delta in place, returns rms_norm(residual). With
// bf16_out (float32 x or residual) the norm comes back rounded to bf16, as .to(torch.bfloat16)
// would round it, for a bf16 matmul next.
// silu_mul: fused [rows, 2 * inter] (gate, up) -> silu(gate) * up [rows, inter].
// rope_write_kv: qkv [T, heads + 2 * kv_heads, d]: rotates the leading 2 * r/2 dims of the q
// and k heads in place by rotations [max_len, r/2, 2] (cos, sin) at each token's position,
// then writes the token's k and v into cache slot slot_mapping[t]. Where the cache is 16-bit
// beside float32 qkv, the rotated q heads come back in the cache's dtype ([T, heads, d], as
// .to() rounds them) and qkv's q heads are left unrotated; else q rotates in place (None back).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, bool bf16_out = false);
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight,
                           double eps, bool bf16_out = false);
torch::Tensor silu_mul(torch::Tensor fused);
torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor rotations, torch::Tensor positions,
                            torch::Tensor cache, torch::Tensor slot_mapping, int64_t heads);

// argmax.cpp: argmax_rows(logits [rows, n] fp32) -> [rows] int64, each row's first maximum
// (a NaN counts as the maximum), as torch.argmax.
torch::Tensor argmax_rows(torch::Tensor logits);
