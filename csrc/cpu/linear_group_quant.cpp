// Batch-invariant linear over group-quantized weights as checkpoints ship them (GGUF Q4_0 ...
// Q6_K, unpacked at pull into shared/models/gguf_quant.py's layout), dequantized in registers.
//
//   w[n, k] = fma(q[n, k], scale[n, g], min[n, g] - zero * scale[n, g])   g = k / group
//   scale = super_scale[n, g / per_super] * sub_scale[n, g]        (sub_scale absent: 1)
//   min   = super_min[n, g / per_super] * sub_min[n, g]            (absent: 0, resp. 1)
//   acc[m, n][l] = fma chain over k = 16 c + l, c = 0, 1, ...      (16 lanes, in k order)
//   y[m, n] = the lanes summed by a fixed tree (hsum16)
// Every y[m, n] is that one sequence whatever M, the blocking, the threads or the path: the
// AVX-512 path (dequantizing 32 weights into two registers, or for many rows into a per-thread
// scratch panel first: the same values) and the generic one (scalar code doing the same
// operations lane by lane; any CPU, and the tests' model of the vector path) give the same
// bits. Columns are split across threads, in blocks of kCols. The fma gives the reference's
// value (q - zero) * scale + min: zero is 0, or 8, 16, 32 where min is 0, so min - zero * scale
// is exact, and the one rounding is of the exact (q - zero) * scale + min.
//
// Codes: bits 8: int8 [N, K]. Bits 4-6: low nibbles [N, K / 2], per 32 weights 16 bytes with
// weight j in byte j's low nibble and weight j + 16 in its high one, and bit planes
// [N, bits - 4, K / 8], per 16 weights a little-endian uint16 whose bit l is weight l's.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "group_quant.h"
#include "group_quant_avx2.h"
#include "group_quant_int8.h"

namespace {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kVnni = true;  // the "int8" kernel's path: AVX512-VNNI, else AVX2 or generic
#else
constexpr bool kVnni = false;
#endif

}  // namespace

std::vector<std::string> group_quant_paths() {
#ifdef __AVX512F__
  std::string fp32 = "avx512";
#elif defined(GROUP_QUANT_AVX2)
  std::string fp32 = "avx2";
#else
  std::string fp32 = "generic";
#endif
#if defined(GROUP_QUANT_AVX2)
  std::string int8 = "avx2";
#else
  std::string int8 = "generic";
#endif
  if (kVnni) int8 = "avx512_vnni";
  return {fp32, int8};
}

namespace {

using group_quant::hsum16_generic;
using group_quant::kLanes;
using group_quant::Layout;
#ifdef __AVX512F__
using group_quant::fp8x16_scaled;
using group_quant::kFp8Unscale;
using group_quant::hsum16;
#endif
constexpr int kCols = 4;  // columns per block (and per register tile)
constexpr int kRows = 6;  // rows per register tile
constexpr int64_t kScratchRows = 4;  // more rows than this: dequantize a panel once

void run_generic(const Layout& L, const float* x, float* y, int64_t M, int64_t N) {
  at::parallel_for(0, (N + kCols - 1) / kCols, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(L.K * kCols);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = block * kCols, nb = std::min<int64_t>(kCols, N - n0);
      for (int64_t j = 0; j < nb; ++j) {
        for (int64_t c = 0; c < L.K / kLanes; ++c) L.dequant16(n0 + j, c, &w[j * L.K + c * kLanes]);
      }
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t j = 0; j < nb; ++j) {
          float acc[kLanes] = {};
          for (int64_t c = 0; c < L.K / kLanes; ++c) {
            for (int l = 0; l < kLanes; ++l) {
              const int64_t k = c * kLanes + l;
              acc[l] = std::fma(w[j * L.K + k], x[m * L.K + k], acc[l]);
            }
          }
          y[m * N + n0 + j] = hsum16_generic(acc);
        }
      }
    }
  });
}

#ifdef __AVX512F__

// 32 weights of row n from weight 32 b on, in two vectors (the lanes of chunks 2 b, 2 b + 1):
// one load of their low nibbles, one of each plane's 32 bits; f: the row's factors
// (Layout::row_factors)
template <int BITS>
[[gnu::always_inline]] inline void dequant32(const Layout& L, const float* f, int64_t n,
                                             int64_t b, __m512& w0, __m512& w1) {
  __m512i q0, q1;
  if constexpr (BITS == 8) {
    const int8_t* codes = L.codes + n * L.K + b * 32;
    const __m128i c0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i c1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16));
    if (L.fp8) {  // groups of 32
      const __m512 scale = _mm512_set1_ps(f[b] * kFp8Unscale);
      const __m512 offset = _mm512_set1_ps(f[L.groups + b]);
      w0 = _mm512_fmadd_ps(fp8x16_scaled(c0), scale, offset);
      w1 = _mm512_fmadd_ps(fp8x16_scaled(c1), scale, offset);
      return;
    }
    q0 = _mm512_cvtepi8_epi32(c0);
    q1 = _mm512_cvtepi8_epi32(c1);
  } else {
    const __m512i bytes = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(L.low + n * (L.K / 2) + b * kLanes)));
    q0 = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F));
    q1 = _mm512_srli_epi32(bytes, 4);
#pragma GCC unroll 2
    for (int p = 0; p < BITS - 4; ++p) {
      uint32_t bits32;
      std::memcpy(&bits32, L.high + (n * L.planes + p) * (L.K / 8) + b * 4, sizeof(bits32));
      const __m512i add = _mm512_set1_epi32(16 << p);
      q0 = _mm512_mask_add_epi32(q0, static_cast<__mmask16>(bits32), q0, add);
      q1 = _mm512_mask_add_epi32(q1, static_cast<__mmask16>(bits32 >> 16), q1, add);
    }
  }
  int64_t g0, g1;
  L.block_groups(b, g0, g1);
  const float* offset = f + L.groups;
  w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), _mm512_set1_ps(f[g0]), _mm512_set1_ps(offset[g0]));
  w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), _mm512_set1_ps(f[g1]), _mm512_set1_ps(offset[g1]));
}

// rows m0 .. m0 + MR - 1 times columns n0 .. n0 + NB - 1; panel: NB dequantized rows of w
// ([NB, K]), or nullptr to dequantize in registers, 32 weights at a time, with the columns'
// factors f (Layout::row_factors, factor_floats() a column)
template <int BITS, int MR, int NB>
void tile(const Layout& L, const float* panel, const float* f, const float* x, float* y,
          int64_t m0, int64_t n0, int64_t N) {
  const int64_t K = L.K;
  __m512 acc[MR][NB];
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < K / 32; ++b) {
    if (panel) {  // one 16-weight half at a time: MR x NB sums + NB weights + x in registers
      for (int64_t h = 0; h < 2; ++h) {
        __m512 w[NB];
        for (int j = 0; j < NB; ++j) w[j] = _mm512_loadu_ps(panel + j * K + b * 32 + h * kLanes);
        for (int r = 0; r < MR; ++r) {
          const __m512 xh = _mm512_loadu_ps(x + (m0 + r) * K + b * 32 + h * kLanes);
          for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_fmadd_ps(w[j], xh, acc[r][j]);
        }
      }
      continue;
    }
    __m512 w0[NB], w1[NB];
    for (int j = 0; j < NB; ++j) {
      dequant32<BITS>(L, f + j * L.factor_floats(), n0 + j, b, w0[j], w1[j]);
    }
    for (int r = 0; r < MR; ++r) {
      const float* xr = x + (m0 + r) * K + b * 32;
      const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + kLanes);
      for (int j = 0; j < NB; ++j) {
        acc[r][j] = _mm512_fmadd_ps(w0[j], x0, acc[r][j]);
        acc[r][j] = _mm512_fmadd_ps(w1[j], x1, acc[r][j]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < NB; ++j) y[(m0 + r) * N + n0 + j] = hsum16(acc[r][j]);
  }
}

template <int BITS, int NB>
void rows_tile(int64_t mr, const Layout& L, const float* panel, const float* f, const float* x,
               float* y, int64_t m0, int64_t n0, int64_t N) {
  switch (mr) {
    case 1: return tile<BITS, 1, NB>(L, panel, f, x, y, m0, n0, N);
    case 2: return tile<BITS, 2, NB>(L, panel, f, x, y, m0, n0, N);
    case 3: return tile<BITS, 3, NB>(L, panel, f, x, y, m0, n0, N);
    case 4: return tile<BITS, 4, NB>(L, panel, f, x, y, m0, n0, N);
    case 5: return tile<BITS, 5, NB>(L, panel, f, x, y, m0, n0, N);
    default: return tile<BITS, kRows, NB>(L, panel, f, x, y, m0, n0, N);
  }
}

template <int BITS>
void run_avx512(const Layout& L, const float* x, float* y, int64_t M, int64_t N) {
  at::parallel_for(0, (N + kCols - 1) / kCols, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(M > kScratchRows ? L.K * kCols : 0);
    std::vector<float> factors(L.factor_floats() * kCols);
    const float* f = factors.data();
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = block * kCols, nb = std::min<int64_t>(kCols, N - n0);
      for (int64_t j = 0; j < nb; ++j) L.row_factors(n0 + j, &factors[j * L.factor_floats()]);
      const float* panel = nullptr;
      if (M > kScratchRows) {
        for (int64_t j = 0; j < nb; ++j) {
          for (int64_t b = 0; b < L.K / 32; ++b) {
            __m512 w0, w1;
            dequant32<BITS>(L, f + j * L.factor_floats(), n0 + j, b, w0, w1);
            _mm512_storeu_ps(&scratch[j * L.K + b * 32], w0);
            _mm512_storeu_ps(&scratch[j * L.K + b * 32 + kLanes], w1);
          }
        }
        panel = scratch.data();
      }
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int64_t mr = std::min<int64_t>(kRows, M - m0);
        switch (nb) {
          case 1: rows_tile<BITS, 1>(mr, L, panel, f, x, y, m0, n0, N); break;
          case 2: rows_tile<BITS, 2>(mr, L, panel, f, x, y, m0, n0, N); break;
          case 3: rows_tile<BITS, 3>(mr, L, panel, f, x, y, m0, n0, N); break;
          default: rows_tile<BITS, kCols>(mr, L, panel, f, x, y, m0, n0, N); break;
        }
      }
    }
  });
}

void run_avx512(const Layout& L, const float* x, float* y, int64_t M, int64_t N) {
  switch (L.bits) {
    case 4: return run_avx512<4>(L, x, y, M, N);
    case 5: return run_avx512<5>(L, x, y, M, N);
    case 6: return run_avx512<6>(L, x, y, M, N);
    default: return run_avx512<8>(L, x, y, M, N);
  }
}

#endif

template <typename T>
const T* optional_data(const torch::Tensor& t, torch::ScalarType type, int64_t numel,
                       const char* name) {
  if (t.numel() == 0) return nullptr;
  TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.numel() == numel, name,
              " does not fit the layout");
  return t.data_ptr<T>();
}

}  // namespace

torch::Tensor linear_group_quant(torch::Tensor x, torch::Tensor codes, torch::Tensor low,
                                 torch::Tensor high, torch::Tensor super_scale,
                                 torch::Tensor sub_scale, torch::Tensor super_min,
                                 torch::Tensor sub_min, int64_t bits, int64_t group,
                                 int64_t per_super, int64_t zero, int64_t out_features,
                                 const std::string& kernel) {
  TORCH_CHECK(x.dim() == 2, "x: [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K % 32 == 0 && (group == 16 || group == 32) && per_super >= 1,
              "K a multiple of 32, group 16 or 32");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "bits: 4, 5, 6 or 8");
  const int64_t groups = K / group, supers = groups / per_super;
  TORCH_CHECK(groups % per_super == 0 && (per_super & (per_super - 1)) == 0,
              "whole super-blocks of a power of 2 groups per row");
  Layout L{};
  L.K = K, L.bits = bits, L.group = group, L.per_super = per_super, L.zero = zero;
  L.planes = bits == 8 ? 0 : bits - 4, L.supers = supers, L.groups = groups;
  L.super_shift = __builtin_ctzll(static_cast<uint64_t>(per_super));
  if (bits == 8) {
    L.fp8 = codes.scalar_type() == torch::kFloat8_e4m3fn;  // else int8 codes
    const auto stored = L.fp8 ? codes.view(torch::kChar) : codes;
    L.codes = optional_data<int8_t>(stored, torch::kChar, N * K, "codes");
    TORCH_CHECK(L.codes, "8-bit weights need their codes");
    TORCH_CHECK(!L.fp8 || group == 32, "FP8 codes take groups of 32");
  } else {
    L.low = optional_data<uint8_t>(low, torch::kByte, N * K / 2, "low");
    TORCH_CHECK(L.low, "4-6 bit weights need their low nibbles");
    L.high = optional_data<uint8_t>(high, torch::kByte, N * L.planes * K / 8, "high");
    TORCH_CHECK(L.planes == 0 || L.high, "5-6 bit weights need their bit planes");
  }
  L.super_scale = optional_data<float>(super_scale, torch::kFloat, N * supers, "super_scale");
  TORCH_CHECK(L.super_scale, "super_scale is required");
  L.sub_scale = optional_data<int8_t>(sub_scale, torch::kChar, N * groups, "sub_scale");
  L.super_min = optional_data<float>(super_min, torch::kFloat, N * supers, "super_min");
  L.sub_min = optional_data<int8_t>(sub_min, torch::kChar, N * groups, "sub_min");
  const bool amx = kernel == "int8-amx", on_panels = kernel == "int8-panels";
  const bool int8 = kernel == "int8" || kernel == "int8-avx2" || kernel == "int8-generic" || amx ||
                    on_panels;
  TORCH_CHECK(int8 || kernel == "auto" || kernel == "avx2" || kernel == "generic",
              "kernel: auto, avx2, generic, int8, int8-avx2, int8-generic, int8-amx or "
              "int8-panels");
  const bool avx2 = kernel == "avx2" || kernel == "int8-avx2";
#ifndef GROUP_QUANT_AVX2
  TORCH_CHECK(!avx2, "kernel ", kernel, ": this build has no AVX2");
#endif
  TORCH_CHECK(!on_panels || kVnni, "kernel int8-panels: this build has no AVX512-VNNI");
  const bool panels = (group_quant::kquant(L) && group_quant::amx_shape(bits, group)) ||
                      group_quant::one_group(L);
  TORCH_CHECK(!(amx || on_panels) || (panels && N % 16 == 0), "kernel ", kernel,
              " takes Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K-Q6_K layouts of whole 16-column "
              "panels");
  TORCH_CHECK(!int8 || group_quant::int8_fits(L),
              "int8 activations need K in whole 64s and super-blocks of 64s or single groups "
              "(group scales within super-blocks: 4-6 bit k-quants of 256)");

  auto x32 = x.to(torch::kFloat).contiguous();
  auto y = torch::empty({M, N}, x32.options());
  if (M == 0 || N == 0) return y;
  if (int8) {
    using group_quant::Int8Path;
    const Int8Path path = amx                ? Int8Path::kAmx
                          : on_panels        ? Int8Path::kPanels
                          : avx2             ? Int8Path::kAvx2
                          : kernel != "int8" ? Int8Path::kGeneric
                          : kVnni            ? Int8Path::kVnni
                                             : Int8Path::kAvx2;  // the generic one without AVX2
    group_quant::run_int8(L, x32.data_ptr<float>(), y.data_ptr<float>(), M, N, path);
    return y;
  }
  const float* xs = x32.data_ptr<float>();
  float* ys = y.data_ptr<float>();
#ifdef __AVX512F__
  if (kernel == "auto") {
    run_avx512(L, xs, ys, M, N);
    return y;
  }
#endif
#ifdef GROUP_QUANT_AVX2
  if (kernel != "generic") {
    group_quant::run_avx2(L, xs, ys, M, N);
    return y;
  }
#endif
  run_generic(L, xs, ys, M, N);
  return y;
}
