// linear_group_quant.cpp's entry points (kept apart from ops.h, which every kernel includes).
//
// linear_group_quant: y [M, N] fp32 = x [M, K] (fp32 or bf16) @ w.T for a group-quantized w
// (shared/models/gguf_quant.py's layout; an absent part is an empty tensor), dequantized in
// registers; batch-invariant. kernel: "auto" (AVX-512, else AVX2, where built), "avx2" or
// "generic" (any CPU), all the same bits; "int8" (activations quantized to int8 per block,
// integer dot products on AVX512-VNNI, else AVX2, where built: linear_group_quant_int8.cpp),
// "int8-avx2" or "int8-generic" (its scalar model), all the same bits, or "int8-amx" (AMX-INT8
// tiles over repack_kquant_amx's panels, k-quants, or repack_block_panels's, the one-group
// formats) or "int8-panels" (the same panels by AVX512-VNNI alone: int8-amx's bits).
// group_quant_paths(): the paths "auto" and
// "int8" take in this build: {avx512 | avx2 | generic, avx512_vnni | avx2 | generic}.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

std::vector<std::string> group_quant_paths();
torch::Tensor linear_group_quant(torch::Tensor x, torch::Tensor codes, torch::Tensor low,
                                 torch::Tensor high, torch::Tensor super_scale,
                                 torch::Tensor sub_scale, torch::Tensor super_min,
                                 torch::Tensor sub_min, int64_t bits, int64_t group,
                                 int64_t per_super, int64_t zero, int64_t out_features,
                                 const std::string& kernel);

// repack_kquant_amx: the same parts as linear_group_quant's "int8-amx" and "int8-panels"
// kernels read them (linear_kquant_panels.cpp: Q2_K-Q6_K; N a multiple of 16), the same sizes.
std::vector<torch::Tensor> repack_kquant_amx(torch::Tensor low, torch::Tensor high,
                                             torch::Tensor super_scale, torch::Tensor sub_scale,
                                             torch::Tensor super_min, torch::Tensor sub_min,
                                             int64_t bits, int64_t group, int64_t zero);
// repack_block_panels: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 as "int8-amx" and "int8-panels" read
// them (linear_block_panels.cpp): codes (8-bit) or low, high, then scale, -, min, -, the same
// sizes.
std::vector<torch::Tensor> repack_block_panels(torch::Tensor codes, torch::Tensor low,
                                               torch::Tensor high, torch::Tensor scale,
                                               torch::Tensor min, int64_t bits);
