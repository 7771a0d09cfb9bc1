// Batch-invariant int8 linear (W8A8): weights int8 per output channel, activations quantized
// per row, int32 sums, on AMX-INT8 tiles where they run (linear_amx.h), else AVX512-VNNI dot
// products (here).
//
//   sx[m] = max_k |x[m, k]| / 127;  xq[m, k] = round(x[m, k] / sx[m]) + 128  (uint8)
//   acc[m, n] = sum over k quads of dot(xq quad, wq quad)                     (exact int32)
//   y[m, n] = (acc[m, n] - 128 * colsum[n]) * sx[m] * sw[n] (+ bias[n])      (fp32, rounded once)
// vpdpbusd and tdpbusd multiply unsigned by signed bytes, hence the +128 offset, taken back out
// through the weight's column sums. A row's quantization depends on that row alone and the
// integer sums are exact, so row m of y is bitwise the same whatever other rows share the
// call, and the same from the tiles as from the dot products.
//
// w is packed once at load into panels of 64 columns, [P, quads, 256] with quads = ceil(K / 4)
// rounded up to a whole AMX step (16; zeros past K): per k quad the 64 columns'
// (w[n, 4j], ..., w[n, 4j + 3]). A CPU without AVX512-VNNI never packs it
// (int8_dot_product_kernel() is false); the engine then uses torch's weight-only kernel.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "dot_kernel.h"
#include "linear_amx.h"
#include "linear_tiles.h"
#include "ops.h"

using linear_tiles::kLanes;
using linear_tiles::kPanel;
using linear_tiles::Step;

bool int8_dot_product_kernel() {
#ifdef __AVX512VNNI__
  return true;
#else
  return false;
#endif
}

namespace {

constexpr int64_t kQuad = 4;
constexpr int32_t kOffset = 128;  // int8 activation + 128 = the uint8 the dot products read

}  // namespace

#ifdef __AVX512VNNI__

namespace {

struct Int8Quads {
  using X = uint8_t;
  using W = int8_t;
  using Acc = int32_t;
  static constexpr int64_t kPack = kQuad;

  template <int MR, int NV>
  static void tile(const X* x, const W* w, int32_t* y, const Step& s, int64_t last) {
    const __mmask16 tail = static_cast<__mmask16>((1u << last) - 1u);
    __m512i acc[MR][NV];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        const __mmask16 mask = v == NV - 1 ? tail : 0xFFFF;
        acc[r][v] = s.first ? _mm512_setzero_si512()
                            : _mm512_maskz_loadu_epi32(mask, y + r * s.ldy + v * kLanes);
      }
    }
    for (int64_t k = 0; k < s.kc; ++k) {
      linear_tiles::fetch_step(s, k);
      const W* wk = w + k * kPanel * kPack;
      __m512i wv[NV];
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512(wk + v * kLanes * kPack);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        int32_t quad;  // x[r, 4k .. 4k + 3] as one 32-bit lane
        std::memcpy(&quad, x + r * s.ldx + k * kPack, sizeof(quad));
        const __m512i xr = _mm512_set1_epi32(quad);
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbusd_epi32(acc[r][v], xr, wv[v]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) {
        _mm512_mask_storeu_epi32(y + r * s.ldy + v * kLanes, v == NV - 1 ? tail : 0xFFFF,
                                 acc[r][v]);
      }
    }
  }
};

}  // namespace

#endif

namespace {

// xq [M, quads * 4] uint8 and sx [M] from x [M, K] (fp32), one row at a time.
void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t width, uint8_t* xq,
                   float* sx) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      const float* row = x + m * ldx;
      float top = 0.f;
      for (int64_t k = 0; k < K; ++k) top = std::max(top, std::fabs(row[k]));
      const float scale = top > 0.f ? top / 127.f : 1.f;
      const float inv = 1.f / scale;
      uint8_t* out = xq + m * width;
      for (int64_t k = 0; k < K; ++k) {
        const float q = std::nearbyint(row[k] * inv);
        out[k] = static_cast<uint8_t>(static_cast<int32_t>(std::clamp(q, -127.f, 127.f)) + kOffset);
      }
      std::memset(out + K, kOffset, width - K);  // padded k: x = 0 (w is 0 there too)
      sx[m] = scale;
    }
  });
}

}  // namespace

std::vector<torch::Tensor> pack_int8_quads(torch::Tensor q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar, "q: [N, K] int8");
  const int64_t N = q.size(0), K = q.size(1), quads = packed_groups(K, kQuad);
  const int64_t panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, quads * 4}, q.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(q);
  auto packed = padded.view({panels, kPanel, quads, 4})
                    .permute({0, 2, 1, 3})
                    .contiguous()
                    .view({panels, quads, kPanel * 4});  // [P, quads, 64 x 4]
  auto colsums = q.to(torch::kInt).sum(1, false, torch::kInt);  // [N]: sum_k w[n, k]
  return {packed, colsums};
}

torch::Tensor linear_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                          torch::Tensor colsums, int64_t out_features,
                          c10::optional<torch::Tensor> bias, const std::string& kernel) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3, "x: [M, K]; packed: [P, quads, 256]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, quads = packed.size(1);
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == torch::kChar &&
                  quads == packed_groups(K, kQuad) &&
                  packed.size(0) == (N + kPanel - 1) / kPanel && packed.size(2) == kPanel * 4,
              "packed must come from pack_int8_quads of an [", N, ", ", K, "] matrix");
  TORCH_CHECK(scales.numel() == N && scales.scalar_type() == torch::kFloat &&
                  colsums.numel() == N && colsums.scalar_type() == torch::kInt,
              "scales: [N] float32; colsums: [N] int32");
  const DotKernel path = pick_dot_kernel(kernel, int8_dot_product_kernel(), "AVX512-VNNI");
  auto y = torch::empty({M, N}, x.options().dtype(torch::kFloat));
  auto x32 = x.to(torch::kFloat).contiguous();
  // the tiles read whole tiles of 16 rows: those past M hold x = 0 (quantize_rows fills the M)
  const int64_t rows =
      path == DotKernel::kDotProducts ? M : (M + amx::kRows - 1) / amx::kRows * amx::kRows;
  auto xq = torch::empty({rows, quads * 4}, x.options().dtype(torch::kByte));
  xq.narrow(0, M, rows - M).fill_(kOffset);
  auto sx = torch::empty({M}, x.options().dtype(torch::kFloat));
  auto acc = torch::empty({M, N}, x.options().dtype(torch::kInt));
  if (M > 0 && N > 0 && K > 0) {
    quantize_rows(x32.data_ptr<float>(), K, M, K, quads * 4, xq.data_ptr<uint8_t>(),
                  sx.data_ptr<float>());
    const uint8_t* xs = xq.data_ptr<uint8_t>();
    const int8_t* w = packed.data_ptr<int8_t>();
    int32_t* a = acc.data_ptr<int32_t>();
    switch (path) {
      case DotKernel::kEmulatedTiles:
        linear_amx::run<amx::EmulatedTiles<amx::Int8>>(xs, quads * 4, w, a, M, N, quads);
        break;
      case DotKernel::kTiles:
#ifdef SPLITSERVE_AMX
        linear_amx::run<amx::HardwareTiles<amx::Int8>>(xs, quads * 4, w, a, M, N, quads);
#endif
        break;
      case DotKernel::kDotProducts:
#ifdef __AVX512VNNI__
        linear_tiles::run<Int8Quads>(xs, quads * 4, w, a, M, N, quads);
#endif
        break;
    }
    const int32_t* cs = colsums.data_ptr<int32_t>();
    const float* sw = scales.data_ptr<float>();
    const float* sxp = sx.data_ptr<float>();
    float* out = y.data_ptr<float>();
    at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        for (int64_t n = 0; n < N; ++n) {
          const int32_t dot = a[m * N + n] - kOffset * cs[n];
          out[m * N + n] = static_cast<float>(dot) * sxp[m] * sw[n];
        }
      }
    });
  } else {
    y.zero_();
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bias: [N]");
    y.add_(bias->to(torch::kFloat));
  }
  return y.to(x.scalar_type());
}
