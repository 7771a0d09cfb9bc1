// repack_kquant16 (group_quant.h): a Q4_K / Q6_K matrix from the stored layout
// (linear_group_quant.cpp) into the panels of 16 columns linear_kquant16.cpp reads (its top
// comment lays them out). The one rule: a permutation, every code and factor kept as it is
// (the same bytes: resident weights do not grow).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "group_quant.h"
#include "group_quant_int8.h"

namespace {

using group_quant::kPanel;
using group_quant::kSuper;
using group_quant::Layout;

uint32_t code(const Layout& L, int64_t n, int64_t k) {  // the stored layout's code u
  const uint8_t byte = L.low[n * (L.K / 2) + k / 32 * 16 + k % 16];
  uint32_t u = k % 32 < 16 ? byte & 0x0F : byte >> 4;
  for (int64_t pl = 0; pl < L.planes; ++pl) {
    u |= ((L.high[(n * L.planes + pl) * (L.K / 8) + k / 8] >> (k % 8)) & 1u) << (4 + pl);
  }
  return u;
}

}  // namespace

std::vector<torch::Tensor> repack_kquant16(torch::Tensor low, torch::Tensor high,
                                           torch::Tensor super_scale, torch::Tensor sub_scale,
                                           torch::Tensor super_min, torch::Tensor sub_min,
                                           int64_t bits, int64_t group, int64_t zero) {
  TORCH_CHECK(bits == 4 || bits == 6, "the interleaved layout: 4 or 6 bit k-quants");
  const int64_t N = low.size(0), K = low.size(1) * 2, groups = K / group, supers = K / kSuper;
  TORCH_CHECK(K % kSuper == 0 && (group == 16 || group == 32), "super-blocks of 256");
  Layout L{};
  L.K = K, L.bits = bits, L.group = group, L.zero = zero, L.planes = bits - 4;
  TORCH_CHECK(low.is_contiguous() && low.scalar_type() == torch::kByte, "low: uint8");
  TORCH_CHECK(bits == 4 || (high.is_contiguous() && high.numel() == N * K / 4), "high: 2 planes");
  L.low = low.data_ptr<uint8_t>();
  L.high = bits == 6 ? high.data_ptr<uint8_t>() : nullptr;
  auto out_low = torch::empty_like(low), out_high = torch::empty_like(high);
  uint8_t* ol = out_low.data_ptr<uint8_t>();
  uint8_t* oh = bits == 6 ? out_high.data_ptr<uint8_t>() : nullptr;
  std::vector<torch::Tensor> out{out_low, out_high};
  for (const torch::Tensor& t : {super_scale, sub_scale, super_min, sub_min}) {
    out.push_back(torch::empty_like(t));
  }
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t p = n / kPanel, c = n % kPanel, w = std::min(kPanel, N - p * kPanel);
      for (int64_t b = 0; b < K / 32; ++b) {
        uint8_t* lo = ol + p * kPanel * (K / 2) + b * 16 * w + 2 * c;
        for (int64_t i = 0; i < 16; ++i) {  // chunk q = i / 2, weight e = i % 2
          const int64_t k = b * 32 + 4 * (i / 2) + i % 2;
          lo[(i / 2) * 2 * w + i % 2] = static_cast<uint8_t>(code(L, n, k) % 16 |
                                                             code(L, n, k + 2) % 16 << 4);
        }
        for (int64_t i = 0; oh && i < 8; ++i) {  // high chunk h = i / 2, weight e = i % 2
          const int64_t k = b * 32 + 4 * (i / 2) + i % 2;
          uint32_t v = 0;
          for (int f = 0; f < 4; ++f) v |= (code(L, n, k + f % 2 * 2 + f / 2 * 16) >> 4) << 2 * f;
          oh[p * kPanel * (K / 4) + b * 8 * w + (i / 2) * 2 * w + 2 * c + i % 2] =
              static_cast<uint8_t>(v);
        }
      }
      for (int64_t t = 0; t < 4; ++t) {  // the factors: [panel][group or super-block][w]
        const torch::Tensor& from = t % 2 ? (t == 1 ? sub_scale : sub_min)
                                          : (t == 0 ? super_scale : super_min);
        if (from.numel() == 0) continue;
        const int64_t per_row = t % 2 ? groups : supers, size = from.element_size();
        const auto* src = static_cast<const uint8_t*>(from.data_ptr()) + n * per_row * size;
        auto* dst = static_cast<uint8_t*>(out[2 + t].data_ptr()) + p * kPanel * per_row * size;
        for (int64_t g = 0; g < per_row; ++g) {
          std::memcpy(dst + (g * w + c) * size, src + g * size, size);
        }
      }
    }
  });
  return out;
}
