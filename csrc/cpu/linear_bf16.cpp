// Batch-invariant bf16 linear: y = x @ w.T (+ bias), x and w bf16, fp32 sums, y rounded to
// bf16 once. Two kernels share one weight layout: AMX tiles where the CPU has them
// (linear_amx.h), else AVX512-BF16 dot products (here). A process takes one of them for
// every call, so a row's result never depends on the batch around it.
//
// The dot-product kernel: every output element is one chain over the k pairs in order:
//   acc = 0; for j: acc = dpbf16(acc, (x[m, 2j], x[m, 2j + 1]), (w[n, 2j], w[n, 2j + 1]))
// (vdpbf16ps: the two products are exact in fp32 and summed into acc, round to nearest even,
// denormals flushed). The blocking is linear_tiles.h's, so the chain does not depend on M,
// the tiling or the thread count: a row's result is bitwise the same in any batch.
//
// w is packed once at load into panels of 64 columns, [P, pairs, 128] with pairs = ceil(K / 2)
// rounded up to a whole AMX step (16; zeros past K): per k pair, the 64 columns'
// (w[n, 2j], w[n, 2j + 1]), so one 512-bit load feeds 16 columns' dot products and one tile
// row holds 16 columns' pairs. A CPU with neither AMX nor AVX512-BF16 never packs this layout
// (bf16_dot_product_kernel() is false): its bf16 weights take linear.cpp's FMA chain.
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstring>

#include "dot_kernel.h"
#include "linear_amx.h"
#include "linear_tiles.h"
#include "ops.h"
#include "silu_mul.h"

using linear_tiles::kLanes;
using linear_tiles::kPanel;
using linear_tiles::Step;

bool bf16_dot_product_kernel() {
#ifdef __AVX512BF16__
  return true;
#else
  return false;
#endif
}

std::string amx_tiles() { return amx::status(); }

#ifdef __AVX512BF16__

namespace {

struct Bf16Pairs {
  using X = c10::BFloat16;
  using W = c10::BFloat16;
  using Acc = float;
  static constexpr int64_t kPack = 2;

  template <int MR, int NV>
  static void tile(const X* x, const W* w, float* y, const Step& s, int64_t last) {
    const __mmask16 tail = static_cast<__mmask16>((1u << last) - 1u);
    __m512 acc[MR][NV];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const __mmask16 mask = v == NV - 1 ? tail : 0xFFFF;
        acc[r][v] =
            s.first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, y + r * s.ldy + v * kLanes);
      }
    }
    for (int64_t k = 0; k < s.kc; ++k) {
      linear_tiles::fetch_step(s, k);
      const W* wk = w + k * kPanel * kPack;
      __m512bh wv[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        wv[v] = (__m512bh)_mm512_loadu_si512(wk + v * kLanes * kPack);  // padded panel
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        int32_t pair;  // (x[r, 2k], x[r, 2k + 1]) as one 32-bit lane
        std::memcpy(&pair, x + r * s.ldx + k * kPack, sizeof(pair));
        const __m512bh xr = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xr, wv[v]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        _mm512_mask_storeu_ps(y + r * s.ldy + v * kLanes, v == NV - 1 ? tail : 0xFFFF, acc[r][v]);
      }
    }
  }
};

}  // namespace

#endif

torch::Tensor pack_bf16_pairs(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "w: [N, K] bfloat16");
  const int64_t N = w.size(0), K = w.size(1), pairs = packed_groups(K, 2);
  const int64_t panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, pairs * 2}, w.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  // [P, 64, pairs, 2] -> [P, pairs, 64, 2]
  return padded.view({panels, kPanel, pairs, 2})
      .permute({0, 2, 1, 3})
      .contiguous()
      .view({panels, pairs, kPanel * 2});
}

namespace {

// x as the kernels read it: bf16 (fp32 activations, the engine's residual stream beside bf16
// weights, rounded here element by element), unit column stride, zeros out to the packed
// pairs and, for the tiles, rows out to a whole tile; after checking that it fits packed.
torch::Tensor pairs_input(torch::Tensor x, const torch::Tensor& packed, int64_t N,
                          DotKernel kernel) {
  const int64_t M = x.size(0), K = x.size(1), pairs = packed.size(1);
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat,
              "x must be bfloat16 or float32 for bfloat16 weights");
  TORCH_CHECK(packed.is_contiguous() && pairs == packed_groups(K, 2) &&
                  packed.size(0) == (N + kPanel - 1) / kPanel,
              "packed must come from pack_linear_weight of an [", N, ", ", K, "] matrix");
  if (x.scalar_type() == torch::kFloat) x = x.to(torch::kBFloat16);
  const int64_t rows = kernel == DotKernel::kDotProducts
                           ? M
                           : (M + amx::kRows - 1) / amx::kRows * amx::kRows;
  if (K < pairs * 2 || rows > M || x.stride(1) != 1 || x.stride(0) < K) {
    x = torch::constant_pad_nd(x, {0, pairs * 2 - K, 0, rows - M}).contiguous();
  }
  return x;
}

// y [M, N] fp32 = x @ w.T over x's first M rows, then the epilogue.
template <typename Epilogue = linear_tiles::NoEpilogue>
void run_pairs(DotKernel kernel, const torch::Tensor& x, int64_t M, const torch::Tensor& packed,
               float* y, int64_t N, const Epilogue& epilogue = {}) {
  const auto* xs = x.data_ptr<c10::BFloat16>();
  const auto* w = packed.data_ptr<c10::BFloat16>();
  const int64_t pairs = packed.size(1);
  switch (kernel) {
    case DotKernel::kEmulatedTiles:
      linear_amx::run<amx::EmulatedTiles<amx::Bf16>>(xs, x.stride(0), w, y, M, N, pairs,
                                                      epilogue);
      return;
    case DotKernel::kTiles:
#ifdef SPLITSERVE_AMX
      linear_amx::run<amx::HardwareTiles<amx::Bf16>>(xs, x.stride(0), w, y, M, N, pairs,
                                                      epilogue);
#endif
      return;
    case DotKernel::kDotProducts:
#ifdef __AVX512BF16__
      linear_tiles::run<Bf16Pairs>(xs, x.stride(0), w, y, M, N, pairs, epilogue);
#endif
      return;
  }
}

}  // namespace

torch::Tensor linear_bf16_pairs(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                                c10::optional<torch::Tensor> bias, const std::string& kernel,
                                bool float_out) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3, "x: [M, K]; packed: [P, pairs, 128]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  // y comes back in x's dtype (unrounded for fp32), or in fp32 with float_out
  const auto out_dtype = float_out ? torch::kFloat : x.scalar_type();
  const DotKernel path = pick_dot_kernel(kernel, bf16_dot_product_kernel(), "AVX512-BF16");
  x = pairs_input(x, packed, N, path);
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  if (M > 0 && N > 0 && K > 0) {
    run_pairs(path, x, M, packed, y.data_ptr<float>(), N);
  } else {
    y.zero_();
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bias: [N]");
    y.add_(bias->to(torch::kFloat));  // one rounding per element, after the whole chain
  }
  return y.to(out_dtype);
}

torch::Tensor linear_silu_mul_bf16_pairs(torch::Tensor x, torch::Tensor packed, int64_t inter,
                                         const std::string& kernel, bool bf16_out) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3, "x: [M, K]; packed: [P, pairs, 128]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16,
              "linear_silu_mul: x must be float32 or bfloat16");
  TORCH_CHECK(inter > 0 && inter % kPanel == 0,
              "linear_silu_mul: inter must be a multiple of ", kPanel);
  const int64_t M = x.size(0), K = x.size(1);
  const DotKernel path = pick_dot_kernel(kernel, bf16_dot_product_kernel(), "AVX512-BF16");
  x = pairs_input(x, packed, 2 * inter, path);
  auto y = torch::empty({M, 2 * inter}, x.options().dtype(torch::kFloat));
  auto out = torch::empty({M, inter}, y.options().dtype(bf16_out ? torch::kBFloat16 : torch::kFloat));
  if (M > 0 && K > 0) {
    float* y_ptr = y.data_ptr<float>();
    if (bf16_out) {
      run_pairs(path, x, M, packed, y_ptr, 2 * inter,
                SiluMulPanels<c10::BFloat16>{y_ptr, out.data_ptr<c10::BFloat16>(), inter});
    } else {
      run_pairs(path, x, M, packed, y_ptr, 2 * inter,
                SiluMulPanels<float>{y_ptr, out.data_ptr<float>(), inter});
    }
  } else {
    out.zero_();  // silu(0) * 0
  }
  return out;
}
