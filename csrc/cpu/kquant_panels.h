// The panels of repack_kquant_amx (panels_repack.cpp) and the three ways
// linear_kquant_panels.cpp multiplies by them: panel P holds columns 16 P .. 16 P + 15; per group
// g of G codes (32, or 16 for Q6_K), low: G / 8 chunks of 64 bytes, chunk r's byte 4 c + e
// holding column c's code 4 r + e of the group (low nibble) and 4 (r + G / 8) + e (high
// nibble): nibble-split, the chunks are the rows of a tdpbssd B tile (G / 4 rows of 16
// columns' quads). A 5-6 bit code's bits above the nibble: G * (bits - 4) / 32 chunks, chunk
// h's byte 4 c + e holding in fields of bits - 4 from the bottom those of rows h, h + chunks,
// ... Factors: [panel][group or super-block][16].
//
// The one rule: `tile`, `wide_tiles` and `vnni_rows` each make, per row and column, the same
// exact integer I of a super-block (linear_kquant_panels.cpp) and hand it to `finish`, the one
// float step; so they give the same bits, and a call may take any of them.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "amx_tiles.h"
#include "group_quant_int8.h"
#include "panel_codes.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

namespace group_quant::kquant_panels {

constexpr int64_t kTileRows = 16;
constexpr int64_t kChunkRows = 128;  // rows of xq that stay in L2 while the panels pass
constexpr int64_t kVnniRows = 4;  // calls of up to this many rows take vnni_rows

// 16 int8 factors of a panel (one a column) as bytes, and as int32 lanes
[[gnu::always_inline]] inline __m128i bytes16(const int8_t* at) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
}
[[gnu::always_inline]] inline __m512i lanes16(const int8_t* at) {
  return _mm512_cvtepi8_epi32(bytes16(at));
}

template <int BITS, int G>
struct Panels {
  static constexpr int kGroups = kSuper / G;  // groups of a super-block
  static constexpr int kBRows = G / 4;  // rows of a B tile: the group's quads

  const Layout& L;
  const int8_t* xq;  // [M padded to 32, K]
  const float* d;  // [M, K / 256]
  const int16_t* group_sum;  // [M, groups]

  // panel P's super-block xb as signed codes u - Z: [kGroups][kBRows][64]
  void unpack(int64_t P, int64_t xb, int8_t* b) const {
    const __m512i zero = _mm512_set1_epi8(static_cast<char>(L.zero));
    for (int g = 0; g < kGroups; ++g) {
      __m512i rows[kBRows];
      panel_codes<BITS, G>(L, P, xb * kSuper + g * G, rows);
      for (int r = 0; r < kBRows; ++r) {
        _mm512_storeu_si512(b + (g * kBRows + r) * 64, _mm512_sub_epi8(rows[r], zero));
      }
    }
  }

  // A few rows (MR from m0) of panel P's super-block xb by AVX512-VNNI, the columns in lanes:
  // per B row (a quad of k for 16 columns) one vpdpbusd with the row's xq quad broadcast, then
  // - Z * the group's xq sum: the same integers C_g and I as the tiles'
  template <int MR>
  void vnni_rows(int64_t P, int64_t xb, int64_t m0, float* acc) const {
    const int8_t* sc = groups_of(L.sub_scale, P, xb);
    __m512i sums[MR];
    for (int r = 0; r < MR; ++r) sums[r] = _mm512_setzero_si512();
    for (int g = 0; g < kGroups; ++g) {
      __m512i rows[kBRows];
      panel_codes<BITS, G>(L, P, xb * kSuper + g * G, rows);
      const __m512i s = lanes16(sc + g * 16);
      for (int r = 0; r < MR; ++r) {
        const int8_t* x = xq + (m0 + r) * L.K + xb * kSuper + g * G;
        __m512i c = _mm512_set1_epi32(-static_cast<int32_t>(L.zero) *
                                      group_sum[(m0 + r) * L.groups + xb * kGroups + g]);
        for (int q = 0; q < kBRows; ++q) {
          int32_t quad;
          std::memcpy(&quad, x + 4 * q, sizeof(quad));
          c = _mm512_dpbusd_epi32(c, rows[q], _mm512_set1_epi32(quad));
        }
        sums[r] = _mm512_add_epi32(sums[r], _mm512_mullo_epi32(c, s));
      }
    }
    alignas(64) int32_t out[kTileRows][16];
    for (int r = 0; r < MR; ++r) _mm512_store_si512(out[r], sums[r]);
    finish(P, xb, out, m0, MR, acc);
  }

  // Many rows: the unpacked codes b times their group scales, p = (u - Z) * sc, split as
  // p = 128 * hi + lo (lo in 0 .. 127, hi signed), two int8 planes [64 quads][64] each
  void products(int64_t P, int64_t xb, const int8_t* b, int8_t* lo, int8_t* hi) const {
    const int8_t* sc = groups_of(L.sub_scale, P, xb);
    alignas(64) static constexpr struct Quads {  // byte 4 c + e: column c's scale
      int8_t i[64];
      constexpr Quads() : i{} {
        for (int j = 0; j < 64; ++j) i[j] = static_cast<int8_t>(j / 4);
      }
    } kQuads;
    const __m512i quads = _mm512_load_si512(kQuads.i), low7 = _mm512_set1_epi16(0x7F);
    const __m512i low8 = _mm512_set1_epi16(0xFF);
    for (int g = 0; g < kGroups; ++g) {
      const __m512i s = _mm512_permutexvar_epi8(
          quads, _mm512_castsi128_si512(bytes16(sc + g * 16)));
      const __m512i s_even = _mm512_srai_epi16(_mm512_slli_epi16(s, 8), 8);
      const __m512i s_odd = _mm512_srai_epi16(s, 8);
      for (int r = g * kBRows; r < (g + 1) * kBRows; ++r) {
        const __m512i v = _mm512_loadu_si512(b + r * 64);
        const __m512i v_even = _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8);
        const __m512i even = _mm512_mullo_epi16(v_even, s_even);
        const __m512i odd = _mm512_mullo_epi16(_mm512_srai_epi16(v, 8), s_odd);
        const __m512i l = _mm512_or_si512(_mm512_and_si512(even, low7),
                                          _mm512_slli_epi16(_mm512_and_si512(odd, low7), 8));
        const __m512i h = _mm512_or_si512(_mm512_and_si512(_mm512_srai_epi16(even, 7), low8),
                                          _mm512_slli_epi16(_mm512_srai_epi16(odd, 7), 8));
        _mm512_storeu_si512(lo + r * 64, l);
        _mm512_storeu_si512(hi + r * 64, h);
      }
    }
  }

#ifdef SPLITSERVE_AMX
  // Rows m0 .. m0 + 31 (mr of them kept) of panel P's super-block xb from the product planes,
  // I = 128 * (xq . hi) + (xq . lo) over 4 k steps of 64 (the same integer as `tile`'s): two
  // row tiles at once, each k step's B tiles loaded once for both, four accumulators in flight
  void wide_tiles(int64_t P, int64_t xb, const int8_t* lo, const int8_t* hi, int64_t m0,
                  int64_t mr, float* acc) const {
    alignas(64) int32_t c[4][kTileRows][16];
    const int8_t* a = xq + m0 * L.K + xb * kSuper;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(6);
    _tile_zero(7);
    for (int step = 0; step < kSuper / 64; ++step) {
      _tile_loadd(2, a + step * 64, L.K);
      _tile_loadd(4, lo + step * 16 * 64, 64);
      _tile_dpbssd(0, 2, 4);
      _tile_loadd(3, a + kTileRows * L.K + step * 64, L.K);
      _tile_dpbssd(6, 3, 4);
      _tile_loadd(5, hi + step * 16 * 64, 64);
      _tile_dpbssd(1, 2, 5);
      _tile_dpbssd(7, 3, 5);
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(1, c[1], 64);
    _tile_stored(6, c[2], 64);
    _tile_stored(7, c[3], 64);
    for (int half = 0; half < 2; ++half) {
      alignas(64) int32_t sums[kTileRows][16];
      const int64_t rows = std::clamp<int64_t>(mr - half * kTileRows, 0, kTileRows);
      for (int64_t r = 0; r < rows; ++r) {
        const __m512i h = _mm512_slli_epi32(_mm512_load_si512(c[2 * half + 1][r]), 7);
        _mm512_store_si512(sums[r], _mm512_add_epi32(h, _mm512_load_si512(c[2 * half][r])));
      }
      finish(P, xb, sums, m0 + half * kTileRows, rows, acc + half * kTileRows * 16);
    }
  }
#endif

  // sums[r] += sc[g] * c[0][r] + sc[g + 1] * c[1][r] for the first mr rows (sc: the panel's
  // group scales of the super-block)
  static void scale_pair(const int32_t (&c)[2][kTileRows][16], const int8_t* sc, int g,
                         int64_t mr, int32_t (&sums)[kTileRows][16]) {
    const __m512i s0 = lanes16(sc + g * 16), s1 = lanes16(sc + (g + 1) * 16);
    for (int64_t r = 0; r < mr; ++r) {
      const __m512i t = _mm512_add_epi32(_mm512_mullo_epi32(_mm512_load_si512(c[0][r]), s0),
                                         _mm512_mullo_epi32(_mm512_load_si512(c[1][r]), s1));
      _mm512_store_si512(sums[r], _mm512_add_epi32(_mm512_load_si512(sums[r]), t));
    }
  }

  // a per-group factor (sub_scale, sub_min) of panel P's super-block xb: [kGroups][16]
  const int8_t* groups_of(const int8_t* factor, int64_t P, int64_t xb) const {
    return factor + (P * L.groups + xb * kGroups) * 16;
  }

#ifdef SPLITSERVE_AMX
  // rows m0 .. m0 + mr - 1 (mr <= 16) of panel P's super-block xb into acc [rows][16]
  void tile(int64_t P, int64_t xb, const int8_t* b, int64_t m0, int64_t mr, float* acc) const {
    alignas(64) int32_t c[2][kTileRows][16];
    alignas(64) int32_t sums[kTileRows][16] = {};
    const int8_t* a = xq + m0 * L.K + xb * kSuper;
    for (int g = 0; g < kGroups; g += 2) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_loadd(2, a + g * G, L.K);
      _tile_loadd(4, b + g * kBRows * 64, 64);
      _tile_dpbssd(0, 2, 4);
      _tile_loadd(3, a + (g + 1) * G, L.K);
      _tile_loadd(5, b + (g + 1) * kBRows * 64, 64);
      _tile_dpbssd(1, 3, 5);
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
      scale_pair(c, groups_of(L.sub_scale, P, xb), g, mr, sums);
    }
    finish(P, xb, sums, m0, mr, acc);
  }
#endif

  // acc of rows m0 .. m0 + mr - 1 += their super-block sums I times d * super_scale (and the
  // mins' term)
  void finish(int64_t P, int64_t xb, const int32_t (&sums)[kTileRows][16], int64_t m0,
              int64_t mr, float* acc) const {
    const int64_t f = P * L.supers + xb;
    const __m512 scale = _mm512_loadu_ps(L.super_scale + f * 16);
    __m512i pairs[kGroups / 2];
    if (L.super_min) min_pairs(P, xb, pairs);
    for (int64_t r = 0; r < mr; ++r) {
      const int64_t m = m0 + r;
      const __m512 dv = _mm512_set1_ps(d[m * L.supers + xb]);
      float* out = acc + r * 16;
      __m512 y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[r])),
                                 _mm512_mul_ps(dv, scale), _mm512_loadu_ps(out));
      if (L.super_min) {
        const __m512 min = _mm512_mul_ps(dv, _mm512_loadu_ps(L.super_min + f * 16));
        y = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins(pairs, xb, m)), min, y);
      }
      _mm512_storeu_ps(out, y);
    }
  }

  // per column of panel P, the int16 pairs (sub_min of group g, of group g + 1) of
  // super-block xb (no sub_min: 1)
  void min_pairs(int64_t P, int64_t xb, __m512i (&pairs)[kGroups / 2]) const {
    for (int g = 0; g < kGroups; g += 2) {
      if (!L.sub_min) {
        pairs[g / 2] = _mm512_set1_epi32(0x00010001);
        continue;
      }
      const int8_t* sm = groups_of(L.sub_min, P, xb);
      const __m512i low16 = _mm512_and_si512(lanes16(sm + g * 16), _mm512_set1_epi32(0xFFFF));
      pairs[g / 2] = _mm512_or_si512(low16, _mm512_slli_epi32(lanes16(sm + (g + 1) * 16), 16));
    }
  }

  // per column: the sum over super-block xb's groups of sub_min * row m's xq sums
  __m512i mins(const __m512i (&pairs)[kGroups / 2], int64_t xb, int64_t m) const {
    const int16_t* gs = group_sum + m * L.groups + xb * kGroups;
    __m512i sum = _mm512_setzero_si512();
    for (int g = 0; g < kGroups; g += 2) {
      int32_t both;
      std::memcpy(&both, gs + g, sizeof(both));
      sum = _mm512_dpwssd_epi32(sum, pairs[g / 2], _mm512_set1_epi32(both));
    }
    return sum;
  }

#ifdef SPLITSERVE_AMX
  // `tile`: tmm0-1 C, tmm2-3 A (`rows` each: fewer than 16 where the call has fewer rows, so
  // a decode step multiplies and stores no padding), tmm4-5 B; `wide_tiles`: every tile
  // 16 x 64
  static void configure(int64_t rows, bool wide) {
    if (wide) return amx::configure();
    const auto t = static_cast<uint8_t>(rows);
    constexpr uint8_t kB = kBRows, kT = kTileRows;
    amx::configure({t, t, t, t, kB, kB, kT, kT}, {64, 64, G, G, 64, 64, 64, 64});
  }
#endif
};

// rows m0 .. m0 + mr - 1 (mr <= 4) of panel P's super-block xb by AVX512-VNNI into acc [mr][16]
template <int BITS, int G>
void vnni_rows(const Panels<BITS, G>& k, int64_t mr, int64_t P, int64_t xb, int64_t m0,
               float* acc) {
  switch (mr) {
    case 1: return k.template vnni_rows<1>(P, xb, m0, acc);
    case 2: return k.template vnni_rows<2>(P, xb, m0, acc);
    case 3: return k.template vnni_rows<3>(P, xb, m0, acc);
    default: return k.template vnni_rows<4>(P, xb, m0, acc);
  }
}

}  // namespace group_quant::kquant_panels

#endif
