// Batch-invariant linear on CPU: y = x @ w.T (+ bias); fp32, bf16 or fp16 in, fp32 math.
//
// Every output element is one chain of fused multiply-adds over k = 0..K-1 in order:
//   acc = 0; for k: acc = fma(x[m, k], w[n, k], acc); y[m, n] = acc (+ bias[n])
// The chain does not depend on M, on how rows, columns and k are blocked, on vector tails or
// on the thread count (threads split the columns), so row m of the result is bitwise the same
// whatever other rows share the call. The AVX-512 path and the portable one run the same
// chain (an FMA is exactly rounded), so they agree bitwise too; so does the AVX2 path, which
// splits a tile into passes that fit its 16 registers.
//
// w is packed once at load (pack_linear_weight) into panels of 64 columns, [P, K, 64]: one
// k step of a tile reads contiguous columns, a thread's panels are one contiguous stream,
// and no horizontal reduction is needed; the blocking is linear_tiles.h's. (An AVX2 build
// interleaves a bf16 panel's columns in pairs of eight; see fma_pass.)
//
// bf16 weights on a CPU with AVX512-BF16 take linear_bf16.cpp's kernels instead (AMX tiles or
// dot products, packed [P, pairs, 128]); `linear` tells the layouts apart by their last axis.
//
// linear_silu_mul is the gated MLP's gate_up matmul with silu(gate) * up applied as each
// thread finishes a pair of panels (the weights interleave 64 rows of gate with the same 64
// of up, PackedGateUp), while the product is still in cache: the same bits as linear, then
// silu_mul.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "linear_tiles.h"
#include "ops.h"
#include "silu_mul.h"
#include "vec_math_avx2.h"

namespace {

using linear_tiles::kLanes;
using linear_tiles::kPanel;
using linear_tiles::Step;

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
void fma_tile(const float* x, const W* w, float* y, const Step& s, int64_t last) {
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
    linear_tiles::fetch_step(s, k);
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

#elif defined(SPLITSERVE_AVX2)

// AVX2 has 16 vector registers, not AVX-512's 32: a tile's rows x 64 columns do not fit, so
// a tile runs as passes over groups of its 16-column vectors, each pass keeping at most 12
// accumulators (rows x 2 halves of 8 x vectors) in registers; every element's chain is the
// same as above, only the order in which elements are computed changes.
//
// bf16 panels hold each 16 columns interleaved (c0 c8 c1 c9 ... c7 c15; pack_linear_weight),
// so a shift and a mask widen them in-lane, where load8's zero-extension crosses lanes; and a
// pass fetches the panel rows kAheadSteps on into L2 as it goes, a steady stream in place of
// linear_tiles.h's fetch of the next block (then a burst at the start of each row tile). The
// two, on the 2-core AMD EPYC AVX2 host (2026-12-03, SmolLM2-135M's bf16 matrices, 30 layers
// + LM head from memory, 8 rounds alternated in one process, medians; two threads):
// interleaved 64 rows 139.4 -> 128.4 ms, 16 rows 51.7 -> 48.9; then the stream, against the
// burst: 1 row 11.3 -> 10.8, 4 rows 19.1 -> 16.4, 16 rows 36.4 -> 33.0, 64 rows 108.5 -> 106.5
// (16 steps on: 10.3, 17.3, 34.5, 105.6; the burst as well: no better). Neither changes a bit:
// the same FMA chain per element.
constexpr int kAccumulators = 12;
constexpr int64_t kAheadSteps = 32;

// The weight vectors of k step wk for a pass's H halves: bf16 interleaved in pairs of halves.
template <typename W, int H>
[[gnu::always_inline]] inline void load_weights(const W* wk, __m256* wv) {
  if constexpr (std::is_same_v<W, c10::BFloat16>) {
    static_assert(H % 2 == 0, "a pass takes whole 16-column vectors");
#pragma GCC unroll 4
    for (int v = 0; v < H / 2; ++v) {
      vec_math::load_interleaved16(wk + 16 * v, wv[2 * v], wv[2 * v + 1]);
    }
  } else {
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) wv[h] = vec_math::load8(wk + 8 * h);
  }
}

using vec_math::first_lanes;

// One k block of rows x[0..MR) against NV vectors (2 NV halves) of a panel; `cols` of them
// are real (the rest are the panel's padding and are not stored).
template <typename W, int MR, int NV>
void fma_pass(const float* x, const W* w, float* y, const Step& s, int64_t cols) {
  constexpr int H = 2 * NV;
  const int64_t kc = s.kc, ldx = s.ldx, ldy = s.ldy;
  const bool whole = cols >= 8 * H;  // masked moves are slow on some CPUs: only for a tail
  __m256i mask[H];
  __m256 acc[MR][H];
#pragma GCC unroll 8
  for (int h = 0; h < H; ++h) mask[h] = first_lanes(cols - 8 * h);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) {
      float* yr = y + r * ldy + 8 * h;
      acc[r][h] = s.first ? _mm256_setzero_ps()
                  : whole ? _mm256_loadu_ps(yr)
                          : _mm256_maskload_ps(yr, mask[h]);
    }
  }
  // the lines this pass reads of a panel row (prefetches never fault: past the end is fine)
  constexpr int64_t lines = (8 * H * static_cast<int64_t>(sizeof(W)) + 63) / 64;
  for (int64_t k = 0; k < kc; ++k) {
    const W* wk = w + k * kPanel;
    const char* ahead = reinterpret_cast<const char*>(wk + kAheadSteps * kPanel);
#pragma GCC unroll 4
    for (int64_t i = 0; i < lines; ++i) _mm_prefetch(ahead + 64 * i, _MM_HINT_T1);
    __m256 wv[H];
    load_weights<W, H>(wk, wv);  // padded panel
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 8
      for (int h = 0; h < H; ++h) acc[r][h] = _mm256_fmadd_ps(xr, wv[h], acc[r][h]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 8
    for (int h = 0; h < H; ++h) {
      float* yr = y + r * ldy + 8 * h;
      if (whole) {
        _mm256_storeu_ps(yr, acc[r][h]);
      } else {
        _mm256_maskstore_ps(yr, mask[h], acc[r][h]);
      }
    }
  }
}

template <typename W, int MR, int NV>
void fma_tile(const float* x, const W* w, float* y, const Step& s, int64_t last) {
  constexpr int group = std::max(1, std::min(NV, kAccumulators / (2 * MR)));
  constexpr int full = NV / group * group;
  const int64_t cols = (NV - 1) * kLanes + last;
  for (int v = 0; v < full; v += group) {
    fma_pass<W, MR, group>(x, w + v * kLanes, y + v * kLanes, s, cols - v * kLanes);
  }
  if constexpr (full < NV) {
    fma_pass<W, MR, NV - full>(x, w + full * kLanes, y + full * kLanes, s, cols - full * kLanes);
  }
}

#else  // portable: the same chain per element, vectorized across columns by the compiler

inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(c10::Half v) { return static_cast<float>(v); }

template <typename W, int MR, int NV>
void fma_tile(const float* x, const W* w, float* y, const Step& s, int64_t last) {
  constexpr int64_t kCols = NV * kLanes;
  const int64_t cols = (NV - 1) * kLanes + last;
  float acc[MR][kCols];
  for (int r = 0; r < MR; ++r) {
    for (int64_t j = 0; j < kCols; ++j) acc[r][j] = s.first || j >= cols ? 0.f : y[r * s.ldy + j];
  }
  for (int64_t k = 0; k < s.kc; ++k) {
    linear_tiles::fetch_step(s, k);
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

// The fp32 FMA chain as a linear_tiles kernel: one k per step, x widened to fp32 once.
template <typename Weight>
struct Fma {
  using X = float;
  using W = Weight;
  using Acc = float;
  static constexpr int64_t kPack = 1;
#ifdef SPLITSERVE_AVX2
  static constexpr bool kFetchesAhead = true;  // fma_pass streams its panel rows
#endif
  template <int MR, int NV>
  static void tile(const float* x, const W* w, float* y, const Step& s, int64_t last) {
    fma_tile<W, MR, NV>(x, w, y, s, last);
  }
};

// y [M, N] = x32 @ w.T over an FMA-packed w of any float dtype, then the epilogue.
template <typename Epilogue = linear_tiles::NoEpilogue>
void run(const torch::Tensor& x32, const torch::Tensor& packed, float* y, int64_t M, int64_t N,
         const Epilogue& epilogue = {}) {
  const int64_t K = x32.size(1), ldx = x32.stride(0);
  const float* x = x32.data_ptr<float>();
  switch (packed.scalar_type()) {
    case torch::kFloat:
      linear_tiles::run<Fma<float>>(x, ldx, packed.data_ptr<float>(), y, M, N, K, epilogue);
      break;
    case torch::kBFloat16:
      linear_tiles::run<Fma<c10::BFloat16>>(x, ldx, packed.data_ptr<c10::BFloat16>(), y, M, N, K,
                                            epilogue);
      break;
    case torch::kHalf:
      linear_tiles::run<Fma<c10::Half>>(x, ldx, packed.data_ptr<c10::Half>(), y, M, N, K,
                                        epilogue);
      break;
    default:
      TORCH_CHECK(false, "packed: float32, bfloat16 or float16");
  }
}

// x as the FMA kernel reads it: fp32, unit column stride, after checking it fits packed.
torch::Tensor fma_input(const torch::Tensor& x, const torch::Tensor& packed, int64_t N) {
  const int64_t K = x.size(1);
  TORCH_CHECK(packed.is_contiguous() && packed.size(1) == K && packed.size(2) == kPanel &&
                  packed.size(0) == (N + kPanel - 1) / kPanel,
              "packed must come from pack_linear_weight of an [", N, ", ", K, "] matrix");
  // x in fp32 (the engine's activations whatever the weights) or in the weights' dtype
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == packed.scalar_type(),
              "x must be float32 or the weights' dtype");
  auto x32 = x.to(torch::kFloat);
  if (x32.stride(1) != 1 || x32.stride(0) < K) x32 = x32.contiguous();
  return x32;
}

}  // namespace

torch::Tensor pack_linear_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "w: [N, K]");
  TORCH_CHECK(w.scalar_type() == torch::kFloat || w.scalar_type() == torch::kBFloat16 ||
                  w.scalar_type() == torch::kHalf,
              "linear supports float32, bfloat16 and float16 weights");
  if (w.scalar_type() == torch::kBFloat16 && bf16_dot_product_kernel()) return pack_bf16_pairs(w);
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t panels = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({panels * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
#ifdef SPLITSERVE_AVX2
  if (w.scalar_type() == torch::kBFloat16) {  // each 16 columns as c0 c8 c1 c9 ... c7 c15
    const auto order = torch::arange(16).view({2, 8}).t().reshape({16});
    padded = padded.view({panels * kPanel / 16, 16, K}).index_select(1, order);
  }
#endif
  return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();  // [P, K, 64]
}

torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                     c10::optional<torch::Tensor> bias, bool float_out) {
  if (packed.dim() == 3 && packed.size(2) == 2 * kPanel) {
    return linear_bf16_pairs(x, packed, out_features, bias, "auto", float_out);
  }
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3, "x: [M, K]; packed: [P, K, 64]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  const auto x32 = fma_input(x, packed, N);
  auto y = torch::empty({M, N}, x32.options());
  if (M > 0 && N > 0 && K > 0) {
    run(x32, packed, y.data_ptr<float>(), M, N);
  } else {
    y.zero_();
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "bias: [N]");
    y.add_(bias->to(torch::kFloat));  // one rounding per element, after the whole chain
  }
  return float_out ? y : y.to(x.scalar_type());
}

torch::Tensor linear_silu_mul(torch::Tensor x, torch::Tensor packed, int64_t inter,
                              bool bf16_out) {
  if (packed.dim() == 3 && packed.size(2) == 2 * kPanel) {
    return linear_silu_mul_bf16_pairs(x, packed, inter, "auto", bf16_out);
  }
  TORCH_CHECK(!bf16_out, "linear_silu_mul: bf16_out with pair-packed bf16 weights only");
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3, "x: [M, K]; packed: [P, K, 64]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat, "linear_silu_mul: x must be float32");
  TORCH_CHECK(inter > 0 && inter % kPanel == 0,
              "linear_silu_mul: inter must be a multiple of ", kPanel);
  const int64_t M = x.size(0), N = 2 * inter;
  const auto x32 = fma_input(x, packed, N);
  auto y = torch::empty({M, N}, x32.options());
  auto out = torch::empty({M, inter}, x32.options());
  if (M > 0 && x.size(1) > 0) {
    float* y_ptr = y.data_ptr<float>();
    run(x32, packed, y_ptr, M, N, SiluMulPanels<float>{y_ptr, out.data_ptr<float>(), inter});
  } else {
    out.zero_();  // silu(0) * 0
  }
  return out;
}
