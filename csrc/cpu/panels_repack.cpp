// The panel repacks of 16 columns (group_quant.h): a matrix from the stored layout
// (linear_group_quant.cpp) for linear_kquant_panels.cpp (repack_kquant_amx, laid out in
// kquant_panels.h) and for linear_block_panels.cpp (repack_block_panels, laid out there), N
// a multiple of 16. Each puts the factors in [panel][group or super-block][16 columns]. The
// one rule: a permutation, every code and factor kept as it is (the same bytes: resident
// weights do not grow).
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "group_quant.h"
#include "group_quant_int8.h"

using group_quant::kPanel;
using group_quant::kSuper;
using group_quant::Layout;

namespace {

// The stored layout of low/high as a Layout (codes only), checked.
Layout stored(const torch::Tensor& low, const torch::Tensor& high, int64_t bits, int64_t group,
              int64_t zero, int64_t span = kSuper) {
  const int64_t N = low.size(0), K = low.size(1) * 2;
  TORCH_CHECK(K % span == 0 && (group == 16 || group == 32), "whole blocks of ", span);
  TORCH_CHECK(low.is_contiguous() && low.scalar_type() == torch::kByte, "low: uint8");
  Layout L{};
  L.K = K, L.bits = bits, L.group = group, L.zero = zero, L.planes = bits - 4;
  TORCH_CHECK(bits == 4 || (high.is_contiguous() && high.scalar_type() == torch::kByte &&
                            high.numel() == N * K / 8 * L.planes),
              "high: ", L.planes, " bit planes");
  L.low = low.data_ptr<uint8_t>();
  L.high = bits > 4 ? high.data_ptr<uint8_t>() : nullptr;
  return L;
}

// The outputs: low, high, then the factors laid out per panel, filled for row n by `factors`.
std::vector<torch::Tensor> outputs(const torch::Tensor& low, const torch::Tensor& high,
                                   const std::vector<torch::Tensor>& factors) {
  std::vector<torch::Tensor> out{torch::empty_like(low), torch::empty_like(high)};
  for (const torch::Tensor& t : factors) out.push_back(torch::empty_like(t));
  return out;
}

// row n's factors (super_scale, sub_scale, super_min, sub_min; absent ones empty) into
// [panel][group or super-block][16]
void permute_factors(const std::vector<torch::Tensor>& from, std::vector<torch::Tensor>& out,
                     int64_t n, int64_t groups, int64_t supers) {
  const int64_t p = n / kPanel, c = n % kPanel;
  for (int64_t t = 0; t < 4; ++t) {
    if (from[t].numel() == 0) continue;
    const int64_t per_row = t % 2 ? groups : supers, size = from[t].element_size();
    const auto* src = static_cast<const uint8_t*>(from[t].data_ptr()) + n * per_row * size;
    auto* dst = static_cast<uint8_t*>(out[2 + t].data_ptr()) + p * kPanel * per_row * size;
    for (int64_t g = 0; g < per_row; ++g) {
      std::memcpy(dst + (g * kPanel + c) * size, src + g * size, size);
    }
  }
}

// row n's group g of G codes into its panel's chunks (kquant_panels.h: low nibbles in
// chunks of 64 bytes, the bits above them in fields of bits - 4)
void panel_group(const Layout& L, int64_t n, int64_t g, uint8_t* ol, uint8_t* oh) {
  const int64_t K = L.K, G = L.group, fw = L.bits - 4, rows = G / 4;
  const int64_t p = n / kPanel, c = n % kPanel;
  uint8_t* lo = ol + p * 8 * K + g * 8 * G;  // 16 columns x G codes / 2
  for (int64_t r = 0; r < rows / 2; ++r) {  // chunk r: rows r (low) and r + rows / 2
    for (int64_t e = 0; e < 4; ++e) {
      const int64_t k = g * G + 4 * r + e;
      lo[r * 64 + c * 4 + e] =
          static_cast<uint8_t>(L.code(n, k) % 16 | L.code(n, k + G / 2) % 16 << 4);
    }
  }
  const int64_t chunks = G * fw / 32, fields = fw ? 8 / fw : 0;
  uint8_t* hi = oh ? oh + p * 2 * fw * K + g * 2 * fw * G : nullptr;
  for (int64_t h = 0; hi && h < chunks; ++h) {  // field f: row h + f * chunks
    for (int64_t e = 0; e < 4; ++e) {
      uint32_t v = 0;
      for (int64_t f = 0; f < fields; ++f) {
        v |= (L.code(n, g * G + 4 * (h + f * chunks) + e) >> 4) << (f * fw);
      }
      hi[h * 64 + c * 4 + e] = static_cast<uint8_t>(v);
    }
  }
}

}  // namespace

std::vector<torch::Tensor> repack_kquant_amx(torch::Tensor low, torch::Tensor high,
                                             torch::Tensor super_scale, torch::Tensor sub_scale,
                                             torch::Tensor super_min, torch::Tensor sub_min,
                                             int64_t bits, int64_t group, int64_t zero) {
  TORCH_CHECK(group_quant::amx_shape(bits, group), "the AMX panels: 4-6 bit codes in groups of 32, "
              "or 4 or 6 in groups of 16");
  const Layout L = stored(low, high, bits, group, zero);
  const int64_t N = low.size(0), K = L.K;
  TORCH_CHECK(N % kPanel == 0, "the AMX panels: output features a multiple of 16");
  const std::vector<torch::Tensor> factors{super_scale, sub_scale, super_min, sub_min};
  std::vector<torch::Tensor> out = outputs(low, high, factors);
  uint8_t* ol = out[0].data_ptr<uint8_t>();
  uint8_t* oh = bits > 4 ? out[1].data_ptr<uint8_t>() : nullptr;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t g = 0; g < K / group; ++g) panel_group(L, n, g, ol, oh);
      permute_factors(factors, out, n, K / group, K / kSuper);
    }
  });
  return out;
}

std::vector<torch::Tensor> repack_block_panels(torch::Tensor codes, torch::Tensor low,
                                               torch::Tensor high, torch::Tensor scale,
                                               torch::Tensor min, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "the block panels: 4, 5 or 8 bit codes");
  const bool bytes = bits == 8;
  TORCH_CHECK(!bytes || (codes.dim() == 2 && codes.is_contiguous() &&
                         codes.scalar_type() == torch::kChar),
              "codes: int8 [N, K]");
  const int64_t N = bytes ? codes.size(0) : low.size(0);
  const int64_t K = bytes ? codes.size(1) : 2 * low.size(1);
  TORCH_CHECK(N % kPanel == 0 && K % 64 == 0,
              "the block panels: output features a multiple of 16, K of 64");
  const std::vector<torch::Tensor> factors{scale, torch::empty(0), min, torch::empty(0)};
  std::vector<torch::Tensor> out = outputs(bytes ? codes : low, high, factors);
  const Layout L = bytes ? Layout{} : stored(low, high, bits, 32, 0, 64);
  const int8_t* from = bytes ? codes.data_ptr<int8_t>() : nullptr;
  auto* to = static_cast<uint8_t*>(out[0].data_ptr());
  auto* oh = bits == 5 ? out[1].data_ptr<uint8_t>() : nullptr;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t p = n / kPanel, c = n % kPanel;
      for (int64_t k = 0; bytes && k < K; ++k) {  // quad k / 4's byte 4 c + k % 4
        to[p * kPanel * K + k / 4 * 64 + c * 4 + k % 4] = static_cast<uint8_t>(from[n * K + k]);
      }
      for (int64_t b = 0; !bytes && b < K / 32; ++b) panel_group(L, n, b, to, oh);
      permute_factors(factors, out, n, K / 32, K / 32);
    }
  });
  return out;
}
