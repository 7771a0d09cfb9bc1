// The AVX2 path of the group-quantized linear with fp32 activations (linear_group_quant.cpp
// describes the arithmetic): 32 weights dequantized into four 8-lane registers (the 16 lanes
// of chunks 2b and 2b + 1, lo and hi halves), each lane's fma chain in k order, the halves
// summed in hsum16's tree, so the same bits as the generic and AVX-512 paths. AVX2 has 16
// registers: tiles of up to 2 rows x 2 columns (one row: 4 columns), and for more rows than
// kScratchRows a per-thread panel of the block's columns dequantized once.
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "group_quant_avx2.h"

#ifdef GROUP_QUANT_AVX2

namespace group_quant {

namespace {

constexpr int kCols = 4;  // columns per block of a thread's share
constexpr int64_t kScratchRows = 2;  // more rows than this: dequantize a panel once

// weights 32 b .. 32 b + 31 of row n as fp32: w[0], w[1] the lo and hi lanes of chunk 2 b,
// w[2], w[3] those of chunk 2 b + 1; f: the row's factors (Layout::row_factors)
template <int BITS>
[[gnu::always_inline]] inline void dequant32(const Layout& L, const float* f, int64_t n,
                                             int64_t b, __m256 (&w)[4]) {
  __m256i q[4];
  if constexpr (BITS == 8) {
    const int8_t* codes = L.codes + n * L.K + b * 32;
    __m128i c[4];
    for (int i = 0; i < 4; ++i) {
      c[i] = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * i));
    }
    if (L.fp8) {  // groups of 32
      const __m256 scale = _mm256_set1_ps(f[b] * kFp8Unscale);
      const __m256 offset = _mm256_set1_ps(f[L.groups + b]);
      for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(fp8x8_scaled(c[i]), scale, offset);
      return;
    }
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtepi8_epi32(c[i]);
  } else {
    const __m256i u = codes32<BITS>(L, n, b);
    const __m128i lo = _mm256_castsi256_si128(u), hi = _mm256_extracti128_si256(u, 1);
    q[0] = _mm256_cvtepu8_epi32(lo), q[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
    q[2] = _mm256_cvtepu8_epi32(hi), q[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
  }
  int64_t g[2];
  L.block_groups(b, g[0], g[1]);
  for (int i = 0; i < 4; ++i) {
    const int64_t gi = g[i / 2];
    w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[i]), _mm256_set1_ps(f[gi]),
                           _mm256_set1_ps(f[L.groups + gi]));
  }
}

// rows m0 .. m0 + MR - 1 times columns n0 .. n0 + NB - 1; panel: the block's dequantized rows
// ([kCols, K], column n0 - p0 first), or nullptr to dequantize in registers with the block's
// factors f (Layout::row_factors, factor_floats() a column, column p0 first)
template <int BITS, int MR, int NB>
void tile(const Layout& L, const float* panel, const float* f, int64_t p0, const float* x,
          float* y, int64_t m0, int64_t n0, int64_t N) {
  const int64_t K = L.K;
  __m256 acc[MR][NB][2];
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < NB; ++j) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < K / 32; ++b) {
    for (int j = 0; j < NB; ++j) {
      __m256 w[4];
      if (panel) {
        const float* p = panel + (n0 + j - p0) * K + b * 32;
        for (int i = 0; i < 4; ++i) w[i] = _mm256_loadu_ps(p + 8 * i);
      } else {
        dequant32<BITS>(L, f + (n0 + j - p0) * L.factor_floats(), n0 + j, b, w);
      }
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + (m0 + r) * K + b * 32;
        acc[r][j][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr), acc[r][j][0]);
        acc[r][j][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), acc[r][j][1]);
        acc[r][j][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), acc[r][j][0]);
        acc[r][j][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), acc[r][j][1]);
      }
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < NB; ++j) y[(m0 + r) * N + n0 + j] = hsum16(acc[r][j][0], acc[r][j][1]);
  }
}

// one row times the block's nb columns, or rows in pairs times columns in pairs
template <int BITS>
void run_block(const Layout& L, const float* panel, const float* f, const float* x, float* y,
               int64_t M, int64_t n0, int64_t nb, int64_t N) {
  if (M == 1) {
    switch (nb) {
      case 1: return tile<BITS, 1, 1>(L, panel, f, n0, x, y, 0, n0, N);
      case 2: return tile<BITS, 1, 2>(L, panel, f, n0, x, y, 0, n0, N);
      case 3: return tile<BITS, 1, 3>(L, panel, f, n0, x, y, 0, n0, N);
      default: return tile<BITS, 1, kCols>(L, panel, f, n0, x, y, 0, n0, N);
    }
  }
  for (int64_t j = 0; j < nb; j += 2) {
    for (int64_t m0 = 0; m0 < M; m0 += 2) {
      const bool rows2 = M - m0 >= 2, cols2 = nb - j >= 2;
      if (rows2 && cols2) tile<BITS, 2, 2>(L, panel, f, n0, x, y, m0, n0 + j, N);
      else if (rows2) tile<BITS, 2, 1>(L, panel, f, n0, x, y, m0, n0 + j, N);
      else if (cols2) tile<BITS, 1, 2>(L, panel, f, n0, x, y, m0, n0 + j, N);
      else tile<BITS, 1, 1>(L, panel, f, n0, x, y, m0, n0 + j, N);
    }
  }
}

template <int BITS>
void run(const Layout& L, const float* x, float* y, int64_t M, int64_t N) {
  at::parallel_for(0, (N + kCols - 1) / kCols, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(M > kScratchRows ? L.K * kCols : 0);
    std::vector<float> factors(L.factor_floats() * kCols);
    const float* f = factors.data();
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = block * kCols, nb = std::min<int64_t>(kCols, N - n0);
      for (int64_t j = 0; j < nb; ++j) L.row_factors(n0 + j, &factors[j * L.factor_floats()]);
      const float* panel = nullptr;
      if (!scratch.empty()) {
        for (int64_t j = 0; j < nb; ++j) {
          for (int64_t b = 0; b < L.K / 32; ++b) {
            __m256 w[4];
            dequant32<BITS>(L, f + j * L.factor_floats(), n0 + j, b, w);
            for (int i = 0; i < 4; ++i) _mm256_storeu_ps(&scratch[j * L.K + b * 32 + 8 * i], w[i]);
          }
        }
        panel = scratch.data();
      }
      run_block<BITS>(L, panel, f, x, y, M, n0, nb, N);
    }
  });
}

}  // namespace

void run_avx2(const Layout& L, const float* x, float* y, int64_t M, int64_t N) {
  switch (L.bits) {
    case 4: return run<4>(L, x, y, M, N);
    case 5: return run<5>(L, x, y, M, N);
    case 6: return run<6>(L, x, y, M, N);
    default: return run<8>(L, x, y, M, N);
  }
}

}  // namespace group_quant

#endif
