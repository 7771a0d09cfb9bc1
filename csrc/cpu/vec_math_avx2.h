// vec_math's vector helpers for a build with AVX2 and FMA but no AVX-512 (8 fp32 lanes): loads
// that widen bf16 and fp16 to fp32, lane masks, exp and horizontal sums. The AVX2 linear tiles
// (linear.cpp) and attention (attention_avx2.h) are built on them.
#pragma once

// An AVX2 build: the code guarded by this takes the place of the portable loops (an AVX-512
// build has its own paths).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define SPLITSERVE_AVX2 1
#endif

#ifdef SPLITSERVE_AVX2
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "vec_math.h"

namespace vec_math {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {
  // bf16 is the upper half of an fp32: widen to 32 bits and shift into place.
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

// 16 bf16 stored interleaved, a0 b0 a1 b1 ... a7 b7, as two fp32 vectors a and b: each 32-bit
// word holds a (low half) and b (high half), so a shift and a mask widen them, in-lane (where
// load8's zero-extension crosses 128-bit lanes, 2 of the 3 operations of a widened load).
inline void load_interleaved16(const c10::BFloat16* p, __m256& a, __m256& b) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  a = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  b = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The first n lanes of 8 (none for n <= 0) as a maskload/maskstore mask.
inline __m256i first_lanes(int64_t n) {
  const int lanes = static_cast<int>(std::clamp<int64_t>(n, 0, 8));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// vec_math::exp, 8 lanes at a time, the same operations in the same order.
inline __m256 exp8(__m256 x) {
  const __m256 normal = _mm256_cmp_ps(x, _mm256_set1_ps(kExpLow), _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLow)),
                    _mm256_set1_ps(88.3762626647949f));
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), normal);
}

// Eight horizontal sums at once: lane j of the result is the sum of a[j]'s lanes, always in
// the same tree (pairs, then pairs of pairs, within each 128-bit half, then the two halves).
inline __m256 reduce_add8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per half: a[0..3]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                       _mm256_permute2f128_ps(u0, u1, 0x31));
}

// The lanes of one vector summed in a fixed tree (halves, then pairs, then the last two).
inline float sum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

inline float max8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

}  // namespace vec_math
#endif
