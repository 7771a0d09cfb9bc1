// The LoRA adapters' products of one fused matrix for a whole step, every row by its own
// adapter, in one call (lora_products.cpp; shared/engine/lora/stacked.py lays the tensors out).
#pragma once

#include <torch/extension.h>

// y [T, N] (fp32 or bf16, unit column stride) += expand(shrink(x [T, K])) for each row t
// whose slot s = slots[t] (int32) is >= 0; rows of slot -1 (the base model) are left alone.
//   a [S, M, P, K, 16]: module m's A (rank <= 16 P) as P panels of 16 ranks, k-major;
//   b [S, C, 16 P, 16]: the output columns as C panels of 16, rank-major; module m's columns
//     [bounds[m], bounds[m + 1]) begin a panel of their own;
//   ranks [S, M] int32: module m's rank in slot s (0: the adapter leaves the module alone);
//   bounds [M + 1] int64;
//   interleave: 0, y's columns as bounds say; else y holds the modules (of equal width) in
//     turns of `interleave` columns (a multiple of 16): module m's column n is y's column
//     n / interleave * interleave * M + m * interleave + n % interleave (a gate_up packed
//     for SiLU·up, model/linear_weights.py's PackedGateUp: 64 of gate's, 64 of up's, ...).
// a and b are float32 or bfloat16 (the same), x float32 or bfloat16.
void lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor slots, torch::Tensor a,
              torch::Tensor b, torch::Tensor ranks, torch::Tensor bounds, int64_t interleave);
