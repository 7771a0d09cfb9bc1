// The AVX2 paths of the group-quantized linear (CPUs with AVX2 and FMA but no AVX-512, and,
// chosen by name, any build that has AVX2, so the tests run them on AVX-512 hosts too): the
// 16 lanes of the other paths as two 8-lane registers, lo (lanes 0-7) and hi (8-15), and the
// helpers both paths share. The one rule: every lane gets the same operations in the same
// order as the generic path's lane, and hsum16 adds the halves in the same tree, so these
// paths give the generic path's bits.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#define GROUP_QUANT_AVX2 1
#endif

#ifdef GROUP_QUANT_AVX2
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "group_quant_layout.h"

namespace group_quant {

// The lanes' sum in hsum16_generic's tree: halves (lo + hi), quarters, pairs, the last two.
inline float hsum16(__m256 lo, __m256 hi) {
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// 8 FP8 E4M3 codes' values (the low 8 bytes) times 2^-8, as fp8x16_scaled makes them
// (group_quant_layout.h)
[[gnu::always_inline]] inline __m256 fp8x8_scaled(__m128i bytes) {
  const __m128i half = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7),
                                     _mm_set1_epi16(static_cast<int16_t>(0xBF80)));
  return _mm256_cvtph_ps(half);
}

// 32 bits (bit i: byte i) as a byte mask, 0xFF where the bit is set
[[gnu::always_inline]] inline __m256i bit_bytes(uint32_t bits) {
  // byte i takes byte i / 8 (in-lane: both 128-bit lanes hold all 4 bytes)
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
}

// block b (32 weights) of row n's 4-6 bit codes as unsigned bytes, in k order: its 16 bytes of
// nibbles, low ones (weights 0-15) then high ones (16-31), and each bit plane's 32 bits added
template <int BITS>
[[gnu::always_inline]] inline __m256i codes32(const Layout& L, int64_t n, int64_t b) {
  const __m128i t =
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(L.low + n * (L.K / 2) + b * 16));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  __m256i q =
      _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(t, 4), nibble), _mm_and_si128(t, nibble));
#pragma GCC unroll 2
  for (int pl = 0; pl < BITS - 4; ++pl) {
    uint32_t bits32;
    std::memcpy(&bits32, L.high + (n * L.planes + pl) * (L.K / 8) + b * 4, sizeof(bits32));
    const __m256i add = _mm256_set1_epi8(static_cast<char>(16 << pl));
    q = _mm256_add_epi8(q, _mm256_and_si256(bit_bytes(bits32), add));
  }
  return q;
}

// y [M, N] from x fp32 (linear_group_quant_avx2.cpp; linear_group_quant.cpp's arithmetic)
void run_avx2(const Layout& L, const float* x, float* y, int64_t M, int64_t N);

}  // namespace group_quant

#endif
