// The AVX512-VNNI path's register helpers (linear_group_quant_int8_vnni.cpp): a pair of
// 32-blocks' codes unpacked into one register in k order, and the k-quant path's group
// factors and sums as int16 lanes. The one rule: each gives exactly the values the generic
// path reads one by one (linear_group_quant_int8.cpp: codes_generic, dot_kquant).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "group_quant_int8.h"

namespace group_quant {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

// pair p of row n's codes as unsigned bytes, in k order: for 4-6 bits one 32-byte load of the
// two blocks' nibbles, each 16 bytes twice (low nibbles, then high ones: one variable shift),
// and per bit plane its 64 bits as the mask of a masked add
template <int BITS>
[[gnu::always_inline]] inline __m512i codes64(const Layout& L, int64_t n, int64_t p) {
  if constexpr (BITS == 8) {
    const __m512i v = _mm512_loadu_si512(L.codes + n * L.K + p * kPair);
    return _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    const __m512i t = _mm512_castsi256_si512(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(L.low + n * (L.K / 2) + p * 32)));
    const __m512i twice = _mm512_shuffle_i64x2(t, t, _MM_SHUFFLE(1, 1, 0, 0));
    constexpr int64_t kBy4 = 0x0004000400040004;  // the high nibbles' 128-bit lanes: >> 4
    const __m512i shift = _mm512_set_epi64(kBy4, kBy4, 0, 0, kBy4, kBy4, 0, 0);
    __m512i q = _mm512_and_si512(_mm512_srlv_epi16(twice, shift), _mm512_set1_epi8(0x0F));
#pragma GCC unroll 2
    for (int pl = 0; pl < BITS - 4; ++pl) {
      uint64_t u;
      std::memcpy(&u, L.high + (n * L.planes + pl) * (L.K / 8) + p * 8, sizeof(u));
      const __m512i add = _mm512_set1_epi8(static_cast<char>(16 << pl));
      q = _mm512_mask_add_epi8(q, _cvtu64_mask64(u), q, add);
    }
    return q;
  }
}

// pair p of row n's codes asked into the cache (a row past the last one: prefetches do not fault)
template <int BITS>
[[gnu::always_inline]] inline void prefetch_codes(const Layout& L, int64_t n, int64_t p) {
  if constexpr (BITS == 8) {
    _mm_prefetch(reinterpret_cast<const char*>(L.codes + n * L.K + p * kPair), _MM_HINT_T0);
  } else {
    _mm_prefetch(reinterpret_cast<const char*>(L.low + n * (L.K / 2) + p * 32), _MM_HINT_T0);
    for (int pl = 0; pl < BITS - 4 && p % 8 == 0; ++pl) {  // a plane's 64 bytes: 8 pairs
      _mm_prefetch(reinterpret_cast<const char*>(L.high + (n * L.planes + pl) * (L.K / 8) + p * 8),
                   _MM_HINT_T0);
    }
  }
}

// The k-quant path's vpermw indices: pair j of an x-block takes, per int16 lane e (weights
// 2e, 2e + 1 of the pair), its group's scale from the x-block's 256 / G (G: the group size)
struct PairGroups {
  int16_t e[kSuper / kPair][32];
};

template <int G>
constexpr PairGroups pair_groups() {
  PairGroups t{};
  for (int j = 0; j < kSuper / kPair; ++j) {
    for (int e = 0; e < 32; ++e) t.e[j][e] = static_cast<int16_t>(j * (kPair / G) + 2 * e / G);
  }
  return t;
}

template <int G>
inline constexpr PairGroups kPairGroups = pair_groups<G>();

// an x-block's 256 / G int8 group factors (G: the group size) as the first int16 lanes, the
// rest zero
template <int G>
[[gnu::always_inline]] inline __m512i groups16(const int8_t* from) {
  if constexpr (G == 32) {
    return _mm512_zextsi128_si512(
        _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(from))));
  } else {
    return _mm512_zextsi256_si512(
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from))));
  }
}

// an x-block's 256 / G groups' xq sums (int16) as the first lanes, the rest zero
template <int G>
[[gnu::always_inline]] inline __m512i sums16(const int16_t* from) {
  if constexpr (G == 32) {
    return _mm512_zextsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from)));
  } else {
    return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(from)));
  }
}

#endif

}  // namespace group_quant
