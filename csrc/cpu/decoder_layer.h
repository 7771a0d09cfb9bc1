// One decoder layer of the Llama family in one call (shared/engine/model/native_layer.py):
// the same kernels in the same order as the Python layer of llama.py and decoder.py, so the
// same bits, without the Python between them. For layers whose matrices are all packed as
// bf16 pairs with SiLU·up fused into gate_up, no q/k norms, no biases, a bf16 KV cache and
// paged_attention's kernel.
//
// h [T, hidden] fp32 (updated in place; the `keep` rows of it on the last layer), y the
// previous layer's MLP output [T, hidden] fp32 (none on the first). Returns (h, this layer's
// MLP output). Only bindings.cpp includes this file.
#pragma once

#include "ops.h"

inline std::vector<torch::Tensor> decoder_layer(
    torch::Tensor h, c10::optional<torch::Tensor> y, torch::Tensor input_norm,
    torch::Tensor post_norm, double eps, torch::Tensor qkv_w, torch::Tensor o_w,
    torch::Tensor gate_up_w, int64_t inter, torch::Tensor down_w, torch::Tensor rotations,
    torch::Tensor positions, torch::Tensor cache, torch::Tensor slot_mapping,
    torch::Tensor block_tables, torch::Tensor row_table, torch::Tensor row_context,
    int64_t heads, int64_t kv_heads, double scale, int64_t window, double softcap,
    c10::optional<torch::Tensor> keep) {
  TORCH_CHECK(h.dim() == 2 && h.scalar_type() == torch::kFloat,
              "decoder_layer: h must be the fp32 residual stream [T, hidden]");
  const int64_t t = h.size(0), hidden = h.size(1), d = cache.size(-1);
  // pre-norm attention (the previous layer's MLP output joins the residual first)
  torch::Tensor x = y.has_value() ? add_rms_norm(h, *y, input_norm, eps, true)
                                  : rms_norm(h, input_norm, eps, true);
  auto qkv = linear(x, qkv_w, (heads + 2 * kv_heads) * d, c10::nullopt, true)
                 .view({t, heads + 2 * kv_heads, d});
  torch::Tensor q = rope_write_kv(qkv, rotations, positions, cache, slot_mapping, heads);
  TORCH_CHECK(q.defined(), "decoder_layer: wants a 16-bit cache beside the fp32 stream");
  q = q.contiguous();
  auto attn = torch::empty_like(q);  // [T, heads, d]
  paged_attention(attn, q, cache, block_tables, row_table, row_context, scale, window, softcap);
  auto rows = attn.reshape({t, heads * d});
  if (keep.has_value()) {  // the last layer: only the rows whose logits are wanted go on
    rows = rows.index_select(0, *keep);
    h = h.index_select(0, *keep);
  }
  auto o = linear(rows, o_w, hidden, c10::nullopt, true);
  // pre-norm MLP: down(silu(gate) * up)
  x = add_rms_norm(h, o, post_norm, eps, true);
  auto y_next = linear(linear_silu_mul(x, gate_up_w, inter, true), down_w, hidden, c10::nullopt,
                       true);
  return {h, y_next};
}
