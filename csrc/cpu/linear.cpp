// Batch-invariant linear on CPU: y = x @ w.T (+ bias); fp32, bf16 or fp16 in, fp32 math.
//
// Every output element is one chain of fused multiply-adds over k = 0..K-1 in order:
//   acc = 0; for k: acc = fma(x[m, k], w[n, k], acc); y[m, n] = acc (+ bias[n])
// The chain does not depend on M, on how rows, columns and k are blocked, on vector tails or
// on the thread count (threads split the columns), so row m of the result is bitwise the same
// whatever other rows share the call. The AVX-512 path and the portable one run the same
// chain (an FMA is exactly rounded), so they agree bitwise too.
//
// w is packed once at load (pack_linear_weight) into panels of 64 columns, [P, K, 64]: one
// k step of a tile reads contiguous columns, a thread's panels are one contiguous stream,
// and no horizontal reduction is needed. A tile is up to 6 rows x 4 vectors of 16 columns
// with its accumulators in registers; k runs in blocks whose slice of the panel stays in L1
// while every row tile passes over it (partial sums wait in y, in fp32, between blocks).
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "ops.h"

namespace {

constexpr int64_t kLanes = 16;                  // columns per vector
constexpr int64_t kPanel = 64;                  // columns per panel of packed w
constexpr int64_t kPanelVectors = kPanel / kLanes;
constexpr int kMaxRows = 6;                     // rows per tile: 6 x 4 accumulators
constexpr int64_t kBlockK = 96;                 // k per block: 96 x 64 fp32 = 24 KiB of w
constexpr int64_t kRowBlockBytes = 512 * 1024;  // x rows kept in L2 across the panels

struct Step {
  int64_t kc, ldx, ldy;  // k of this block; row strides of x and y
  bool first;            // the block starts at k = 0: accumulators start from zero
};

#ifdef __AVX512F__

inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }

inline __m512 load16(const c10::BFloat16* p, __mmask16 mask) {
  // bf16 is the upper half of an fp32: widen to 32 bits and shift into place.
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m512 load16(const c10::Half* p, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

// One k block of a tile: rows x[0..MR) against NV vectors of one panel (row stride kPanel);
// the last vector holds `last` columns. Partial sums come from and go back to y.
template <typename W, int MR, int NV>
void tile(const float* x, const W* w, float* y, const Step& s, int64_t last) {
  const __mmask16 tail = static_cast<__mmask16>((1u << last) - 1u);
  const int64_t kc = s.kc, ldx = s.ldx, ldy = s.ldy;
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      const __mmask16 mask = v == NV - 1 ? tail : 0xFFFF;
      acc[r][v] = s.first ? _mm512_setzero_ps() : load16(y + r * ldy + v * kLanes, mask);
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    const W* wk = w + k * kPanel;
    __m512 wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) wv[v] = load16(wk + v * kLanes, 0xFFFF);  // padded panel
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(xr, wv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      _mm512_mask_storeu_ps(y + r * ldy + v * kLanes, v == NV - 1 ? tail : 0xFFFF, acc[r][v]);
    }
  }
}

#else  // portable: the same chain per element, vectorized across columns by the compiler

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(c10::Half v) { return static_cast<float>(v); }

template <typename W, int MR, int NV>
void tile(const float* x, const W* w, float* y, const Step& s, int64_t last) {
  constexpr int64_t kCols = NV * kLanes;
  const int64_t cols = (NV - 1) * kLanes + last;
  float acc[MR][kCols];
  for (int r = 0; r < MR; ++r) {
    for (int64_t j = 0; j < kCols; ++j) acc[r][j] = s.first || j >= cols ? 0.f : y[r * s.ldy + j];
  }
  for (int64_t k = 0; k < s.kc; ++k) {
    const W* wk = w + k * kPanel;
    for (int r = 0; r < MR; ++r) {
      const float xr = x[r * s.ldx + k];
#pragma omp simd
      for (int64_t j = 0; j < kCols; ++j) acc[r][j] = std::fma(xr, to_float(wk[j]), acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int64_t j = 0; j < cols; ++j) y[r * s.ldy + j] = acc[r][j];
  }
}

#endif

template <typename W>
using TileFn = void (*)(const float*, const W*, float*, const Step&, int64_t);

template <typename W, int MR>
constexpr TileFn<W> kRowTiles[kPanelVectors] = {&tile<W, MR, 1>, &tile<W, MR, 2>,
                                                &tile<W, MR, 3>, &tile<W, MR, 4>};

template <typename W>
constexpr const TileFn<W>* kTiles[kMaxRows] = {kRowTiles<W, 1>, kRowTiles<W, 2>,
                                               kRowTiles<W, 3>, kRowTiles<W, 4>,
                                               kRowTiles<W, 5>, kRowTiles<W, 6>};

// y[M, N] (fp32, row stride N) = x[M, K] (fp32, row stride ldx) @ w.T, w packed [P, K, 64].
template <typename W>
void run(const float* x, int64_t ldx, const W* w, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t vectors = (N + kLanes - 1) / kLanes;
  const int64_t row_block =
      std::max<int64_t>(kMaxRows, kRowBlockBytes / (K * 4) / kMaxRows * kMaxRows);
  // Enough multiply-adds per task (~256K) that a thread is worth waking.
  const int64_t grain = std::max<int64_t>(1, (1 << 18) / (std::min(M, row_block) * K * kLanes));
  // Threads split the vectors (16 columns), so a thread may start or end inside a panel.
  at::parallel_for(0, vectors, grain, [&](int64_t v0, int64_t v1) {
    for (int64_t m0 = 0; m0 < M; m0 += row_block) {
      const int64_t m1 = std::min(M, m0 + row_block);
      for (int64_t v = v0; v < v1;) {
        const int64_t nv = std::min(v1, (v / kPanelVectors + 1) * kPanelVectors) - v;
        const int64_t n0 = v * kLanes;
        const int64_t last = std::min(N - n0 - (nv - 1) * kLanes, kLanes);
        const W* panel = w + (v / kPanelVectors) * K * kPanel + (v % kPanelVectors) * kLanes;
        for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
          const Step s{std::min(kBlockK, K - k0), ldx, N, k0 == 0};
          for (int64_t m = m0; m < m1; m += kMaxRows) {
            const int64_t mr = std::min<int64_t>(kMaxRows, m1 - m);
            kTiles<W>[mr - 1][nv - 1](x + m * ldx + k0, panel + k0 * kPanel, y + m * N + n0, s,
                                      last);
          }
        }
        v += nv;
      }
    }
  });
}

}  // namespace

torch::Tensor pack_linear_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "w: [N, K]");
  TORCH_CHECK(w.scalar_type() == torch::kFloat || w.scalar_type() == torch::kBFloat16 ||
                  w.scalar_type() == torch::kHalf,
              "linear supports float32, bfloat16 and float16 weights");
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();  // [P, K, 64]
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                     c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3, "x: [M, K]; packed: [P, K, 64]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(packed.is_contiguous() && packed.size(1) == K && packed.size(2) == kPanel &&
                  packed.size(0) == (N + kPanel - 1) / kPanel,
              "packed must come from pack_linear_weight of an [", N, ", ", K, "] matrix");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "x and w dtypes differ");
  auto x32 = x.to(torch::kFloat);
  if (x32.stride(1) != 1 || x32.stride(0) < K) x32 = x32.contiguous();
  auto y = torch::empty({M, N}, x32.options());
  if (M > 0 && N > 0 && K > 0) {
    const float* x_ptr = x32.data_ptr<float>();
    float* y_ptr = y.data_ptr<float>();
    switch (packed.scalar_type()) {
      case torch::kFloat:
        run(x_ptr, x32.stride(0), packed.data_ptr<float>(), y_ptr, M, N, K);
        break;
      case torch::kBFloat16:
        run(x_ptr, x32.stride(0), packed.data_ptr<c10::BFloat16>(), y_ptr, M, N, K);
        break;
      case torch::kHalf:
        run(x_ptr, x32.stride(0), packed.data_ptr<c10::Half>(), y_ptr, M, N, K);
        break;
      default:
        TORCH_CHECK(false, "packed: float32, bfloat16 or float16");
    }
  } else {
    y.zero_();
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bias: [N]");
    y.add_(bias->to(torch::kFloat));  // one rounding per element, after the whole chain
  }
  return y.to(x.scalar_type());
}
