// A group of codes of the 16-column panels (kquant_panels.h lays them out; the k-quants'
// repack_kquant_amx and the one-group formats' repack_block_panels write them) as registers:
// the rows of a tdpbssd B tile, or of 16 lanes of vpdpbusd. The one rule: the unsigned codes
// u, exactly the stored layout's (Layout::code).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "group_quant_layout.h"

#ifdef __AVX512BW__

namespace group_quant {

// the group of G codes from k0 of panel P (BITS a code): its codes u (unsigned) as the G / 4
// rows of a B tile
template <int BITS, int G>
[[gnu::always_inline]] inline void panel_codes(const Layout& L, int64_t P, int64_t k0,
                                               __m512i (&rows)[G / 4]) {
  constexpr int kFw = BITS - 4, kRows = G / 4, kHighChunks = G * kFw / 32;
  const uint8_t* low = L.low + P * 8 * L.K + k0 * 8;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int r = 0; r < kRows / 2; ++r) {
    const __m512i v = _mm512_loadu_si512(low + r * 64);
    rows[r] = _mm512_and_si512(v, nibble);
    rows[r + kRows / 2] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
  }
  if constexpr (kFw > 0) {
    const uint8_t* high = L.high + P * 2 * kFw * L.K + k0 * 2 * kFw;
    const __m512i field = _mm512_set1_epi8(static_cast<char>(((1 << kFw) - 1) << 4));
    for (int h = 0; h < kHighChunks; ++h) {
      const __m512i w = _mm512_loadu_si512(high + h * 64);
      for (int f = 0; f < 8 / kFw; ++f) {  // field f to bits 4.. of row h + f * chunks
        const int s = f * kFw - 4;
        const __m512i t = s >= 0 ? _mm512_srli_epi16(w, s) : _mm512_slli_epi16(w, -s);
        __m512i& row = rows[h + f * kHighChunks];
        row = _mm512_or_si512(row, _mm512_and_si512(t, field));
      }
    }
  }
}

}  // namespace group_quant

#endif
