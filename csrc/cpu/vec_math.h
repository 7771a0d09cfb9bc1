// Element-wise float math the fused kernels share, written so that GCC vectorizes the loops
// that call it (-O3) and so that an element's result never depends on whether it ran in a
// vector body or a scalar tail: every multiply-add is an explicit std::fma (nothing is left
// for -ffp-contract to fuse one way here and another there), the rest is exact IEEE
// arithmetic. So a row's result is a pure function of that row.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace vec_math {

// e^x within 2 ulp (Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for
// e^r, then 2^n put into the exponent). Below -87.3 it is 0 (no denormals, which are slow
// to compute with); above 88.3 it saturates at ~2e38 instead of inf, which leaves softmax
// and SiLU unchanged.
constexpr float kExpLow = -87.33654f;

inline float exp(float x) {
  const bool underflows = x < kExpLow;
  x = std::fmin(std::fmax(x, kExpLow), 88.3762626647949f);
  const float n = std::floor(std::fma(x, 1.44269504088896341f, 0.5f));
  float r = std::fma(n, -0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r + 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n, n in [-126, 127]
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return underflows ? 0.0f : p * scale;
}

// x * sigmoid(x) = x / (1 + e^-x)
inline float silu(float x) { return x / (1.0f + exp(-x)); }

}  // namespace vec_math

#ifdef __AVX512F__
#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace vec_math {

// exp above, 16 lanes at a time, the same operations in the same order.
inline __m512 exp16(__m512 x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpLow), _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLow)),
                    _mm512_set1_ps(88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(normal, p, _mm512_castsi512_ps(bits));
}

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  // bf16 is the upper half of an fp32: widen to 32 bits and shift into place.
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }

inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m) {
  // round to nearest even, as c10::BFloat16(float) (NaN aside: none reach here)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

inline __mmask16 lanes_below(int64_t n) {  // n >= 0
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

// The numerators of an exact softmax over s[0, n), in place: e^(s - top), where weights below
// 2^-64 (a score 44 under the top) count as 0, so no denormal products follow; the lanes past
// n up to the next 16 become 0. Gives the top score and the sum (16 lanes, then a fixed tree).
inline void softmax_numerators(float* s, int64_t n, float& top_score, float& sum) {
  __m512 highest = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < n; i += 16) {
    highest = _mm512_max_ps(
        highest, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes_below(n - i), s + i));
  }
  top_score = _mm512_reduce_max_ps(highest);
  const __m512 top = _mm512_set1_ps(top_score);
  __m512 total = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes_below(n - i);
    __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), top));
    e = _mm512_maskz_mov_ps(m & _mm512_cmp_ps_mask(e, _mm512_set1_ps(0x1p-64f), _CMP_GE_OQ), e);
    _mm512_storeu_ps(s + i, e);
    total = _mm512_add_ps(total, e);
  }
  sum = _mm512_reduce_add_ps(total);
}

// Sixteen horizontal sums at once: lane j of the result is _mm512_reduce_add_ps(a[j]), bit for
// bit. The same pairs are added in the same tree (lane i with i + 8, then i + 4, then i + 2, then
// i + 1), the vectors interleaved so that each level is one shuffle pair and an add for several
// of them; the last permute puts vector j's sum in lane j.
inline __m512 reduce_add16(const __m512* a) {
  __m512 halves[8], quarters[4], pairs[2];
  for (int k = 0; k < 8; ++k) {  // lanes 0-7: a[2k]'s i + (i + 8); lanes 8-15: a[2k + 1]'s
    const __m512 x = a[2 * k], y = a[2 * k + 1];
    halves[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int k = 0; k < 4; ++k) {  // 128-bit lane m: a[4k + m]'s i + (i + 4)
    const __m512 x = halves[2 * k], y = halves[2 * k + 1];
    quarters[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  for (int k = 0; k < 2; ++k) {  // 128-bit lane m: a[8k + m]'s i + (i + 2), then a[8k + 4 + m]'s
    const __m512 x = quarters[2 * k], y = quarters[2 * k + 1];
    pairs[k] = _mm512_add_ps(_mm512_shuffle_ps(x, y, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(x, y, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // lane 4m + i: a[4i + m]'s 0 + 1
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, sums);
}

// A round trip through T (the rounding torch does between two ops).
inline __m512 round_to(const float*, __m512 v) { return v; }
inline __m512 round_to(const c10::BFloat16*, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(-65536)));
}

}  // namespace vec_math
#endif
