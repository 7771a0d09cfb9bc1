// The one-group formats' int8-activation linear over panels (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: a
// float scale, and a min, per block of 32 weights): repack_block_panels's panels of 16
// columns, 4-5 bit codes as kquant_panels.h lays out a group of 32; 8-bit codes as the
// rows of a tdpbssd B tile (quad q of panel P: 64 bytes, column c's codes 4 q .. 4 q + 3 at
// byte 4 c); the factors [panel][block][16].
//
// Arithmetic, per row m (its int8 codes xq and per-block d, linear_group_quant_int8.cpp),
// column n and block b (u its codes, Z the zero, s the row's xq sum over the block):
//   C   = sum over the block of (u - Z) * xq                                   (exact int32)
//   t   = float(C) * scale;  with mins: t = fma(float(C), scale, float(s) * min)
//   acc = fma(t, d, acc)
// y[m, n] = acc after the last block, the blocks in k order. C is made two ways: by
// AVX512-VNNI on the panels, 4 rows at a time (u * xq, then - Z * s), or on AMX-INT8 tiles (the
// signed codes u - Z, two blocks a step). With tiles ("int8-amx") calls of up to 4 rows take
// the first way, more rows the second; without ("int8-panels", any AVX512-VNNI build) every call
// the first. Not the VNNI register tiles' bits (they keep 16 lanes of partial sums, the
// generic path's order). The one rule: both ways make the same exact C and take the same float
// steps after it, and a row's result depends on its own data alone: every row count, with or
// without tiles, gives a row the same bits (batch-invariant).

#include <algorithm>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "group_quant_int8.h"
#include "panel_codes.h"
#include "panel_tasks.h"

namespace group_quant {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

namespace {

constexpr int64_t kBlock = 32;
constexpr int kQuads = kBlock / 4;  // a block's quads: the rows of its B tile
constexpr int64_t kQuadBytes = kQuads * 64;  // a block of a panel
constexpr int64_t kTileRows = 16;
constexpr int64_t kChunkRows = 128;  // rows of xq that stay in L2 while the panels pass
constexpr int64_t kVnniRows = 4;  // calls of up to this many rows take vnni_rows

template <int BITS>
struct Blocks {
  const Layout& L;
  const int8_t* xq;  // [M padded to 16, K]
  const float* d;  // [K / 32, M padded to 16]: the rows' block scales, a block's together
  const float* sums;  // [K / 32, M padded to 16]: the blocks' xq sums
  int64_t blocks, rows;  // K / 32, M padded to 16

  // the codes' zero as vnni_rows reads them (8-bit: unsigned, the signed code + 128)
  int32_t unsigned_zero() const { return static_cast<int32_t>(L.zero) + (BITS == 8 ? 128 : 0); }

  // block b of panel P as unsigned codes, one register a quad row
  [[gnu::always_inline]] void codes(int64_t P, int64_t b, __m512i (&rows)[kQuads]) const {
    if constexpr (BITS == 8) {
      const int8_t* at = L.codes + P * kPanel * L.K + b * kQuadBytes;
      const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
      for (int q = 0; q < kQuads; ++q) {
        rows[q] = _mm512_xor_si512(_mm512_loadu_si512(at + q * 64), flip);
      }
    } else {
      panel_codes<BITS, kBlock>(L, P, b * kBlock, rows);
    }
  }

  // panel P's signed codes u - Z [blocks][kQuads][64], the B tiles (8-bit: the panel itself)
  const int8_t* signed_codes(int64_t P, std::vector<int8_t>& scratch) const {
    if constexpr (BITS == 8) {
      return L.codes + P * kPanel * L.K;
    } else {
      const __m512i zero = _mm512_set1_epi8(static_cast<char>(L.zero));
      for (int64_t b = 0; b < blocks; ++b) {
        __m512i rows[kQuads];
        codes(P, b, rows);
        for (int q = 0; q < kQuads; ++q) {
          _mm512_storeu_si512(&scratch[b * kQuadBytes + q * 64], _mm512_sub_epi8(rows[q], zero));
        }
      }
      return scratch.data();
    }
  }

  [[gnu::always_inline]] __m512 factor(const float* f, int64_t P, int64_t b) const {
    return f ? _mm512_loadu_ps(f + (P * blocks + b) * kPanel) : _mm512_setzero_ps();
  }

  // acc plus a row's block whose C is c (dm, sm: the row's d and xq sum of the block): the
  // float steps every way takes
  [[gnu::always_inline]] __m512 step(__m512 acc, __m512i c, const float* dm, const float* sm,
                                     __m512 scale, __m512 min) const {
    const __m512 cs = _mm512_cvtepi32_ps(c);
    const __m512 t = L.super_min
                         ? _mm512_fmadd_ps(cs, scale, _mm512_mul_ps(_mm512_set1_ps(*sm), min))
                         : _mm512_mul_ps(cs, scale);
    return _mm512_fmadd_ps(t, _mm512_set1_ps(*dm), acc);
  }

  // rows m0 .. m0 + MR - 1 of panel P into y by AVX512-VNNI: per quad row one vpdpbusd with
  // the row's xq quad broadcast, after - Z * s
  template <int MR>
  void vnni_rows(int64_t P, int64_t m0, float* y, int64_t N) const {
    __m512 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i u[kQuads];
      codes(P, b, u);
      const __m512 scale = factor(L.super_scale, P, b), min = factor(L.super_min, P, b);
      for (int r = 0; r < MR; ++r) {
        const int64_t at = b * rows + m0 + r;
        const int8_t* x = xq + (m0 + r) * L.K + b * kBlock;
        __m512i c = _mm512_set1_epi32(-unsigned_zero() * static_cast<int32_t>(sums[at]));
        for (int q = 0; q < kQuads; ++q) {
          int32_t quad;
          std::memcpy(&quad, x + 4 * q, sizeof(quad));
          c = _mm512_dpbusd_epi32(c, u[q], _mm512_set1_epi32(quad));
        }
        acc[r] = step(acc[r], c, d + at, sums + at, scale, min);
      }
    }
    for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + (m0 + r) * N + P * kPanel, acc[r]);
  }

#ifdef SPLITSERVE_AMX
  // rows m0 .. m0 + MR - 1 (MR: the tiles' rows, 8 or 16; the first mr kept, the rest padding)
  // of panel P into y on tiles, B its signed codes: per span of kSpan blocks their C tiles
  // (two blocks a step) to memory, then their float steps (the accumulators stay in registers)
  template <int MR>
  void tile_rows(int64_t P, const int8_t* B, int64_t m0, int64_t mr, float* y, int64_t N) const {
    constexpr int64_t kSpan = 8;
    __m512 acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
    alignas(64) int32_t c[kSpan][MR][16];
    const int8_t* a = xq + m0 * L.K;
    for (int64_t b0 = 0; b0 < blocks; b0 += kSpan) {
      const int64_t span = std::min(kSpan, blocks - b0);  // even: K is whole 64s
      for (int64_t j = 0; j < span; j += 2) {
        const int64_t b = b0 + j;
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(2, a + b * kBlock, L.K);
        _tile_loadd(4, B + b * kQuadBytes, 64);
        _tile_dpbssd(0, 2, 4);
        _tile_loadd(3, a + (b + 1) * kBlock, L.K);
        _tile_loadd(5, B + (b + 1) * kQuadBytes, 64);
        _tile_dpbssd(1, 3, 5);
        _tile_stored(0, c[j], 64);
        _tile_stored(1, c[j + 1], 64);
      }
      for (int64_t j = 0; j < span; ++j) {
        const __m512 scale = factor(L.super_scale, P, b0 + j), min = factor(L.super_min, P, b0 + j);
        const float* dm = d + (b0 + j) * rows + m0;
        const float* sm = sums + (b0 + j) * rows + m0;
#pragma GCC unroll 16
        for (int r = 0; r < MR; ++r) {
          acc[r] = step(acc[r], _mm512_load_si512(c[j][r]), dm + r, sm + r, scale, min);
        }
      }
    }
    for (int64_t r = 0; r < mr; ++r) _mm512_storeu_ps(y + (m0 + r) * N + P * kPanel, acc[r]);
  }
#endif
};

// One thread's share: whole panels into y for rows c0 .. c0 + rows - 1, by the way the call
// picks (both the same bits)
template <int BITS>
struct BlockRun {
  const Blocks<BITS>& k;
  int64_t tile;  // 0: vnni_rows, 4 rows at a time; else the tiles' rows (8 or 16)
  int64_t c0, rows;
  float* y;
  int64_t N;
  std::vector<int8_t> scratch;

  BlockRun(const Blocks<BITS>& k, int64_t M, bool tiles, int64_t c0, int64_t rows, float* y,
           int64_t N)
      : k(k), tile(!tiles || M <= kVnniRows ? 0 : M <= 8 ? 8 : kTileRows), c0(c0), rows(rows),
        y(y), N(N) {
#ifdef SPLITSERVE_AMX
    if (!tile) return;
    if (BITS < 8) scratch.resize(k.blocks * kQuadBytes);
    const auto t = static_cast<uint8_t>(tile);
    amx::configure({t, t, t, t, kQuads, kQuads, kTileRows, kTileRows},
                   {64, 64, kBlock, kBlock, 64, 64, 64, 64});
#endif
  }
  ~BlockRun() {
#ifdef SPLITSERVE_AMX
    if (tile) _tile_release();
#endif
  }

  void panel(int64_t P) {
    if (!tile) {
      for (int64_t m0 = c0; m0 < c0 + rows; m0 += kVnniRows) {
        switch (std::min(kVnniRows, c0 + rows - m0)) {
          case 1: k.template vnni_rows<1>(P, m0, y, N); break;
          case 2: k.template vnni_rows<2>(P, m0, y, N); break;
          case 3: k.template vnni_rows<3>(P, m0, y, N); break;
          default: k.template vnni_rows<4>(P, m0, y, N);
        }
      }
      return;
    }
#ifdef SPLITSERVE_AMX
    const int8_t* B = k.signed_codes(P, scratch);
    for (int64_t m0 = c0; m0 < c0 + rows; m0 += tile) {
      const int64_t mr = std::min(tile, c0 + rows - m0);
      if (tile == 8) {
        k.template tile_rows<8>(P, B, m0, mr, y, N);
      } else {
        k.template tile_rows<kTileRows>(P, B, m0, mr, y, N);
      }
    }
#endif
  }
};

template <int BITS>
void run_blocks(const Layout& L, Rows& R, float* y, int64_t M, int64_t N, bool tiles) {
  const int64_t blocks = L.K / kBlock, padded = (M + kTileRows - 1) / kTileRows * kTileRows;
  R.xq.resize(padded * L.K, 0);
  std::vector<float> d(blocks * padded, 0.f), sums(blocks * padded, 0.f);  // [block][row]
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      d[b * padded + m] = R.d[m * blocks + b];
      sums[b * padded + m] = R.group_sum[m * blocks + b];  // exact: |s| <= 32 * 127
    }
  }
  const Blocks<BITS> k{L, R.xq.data(), d.data(), sums.data(), blocks, padded};
  for_panels(M, N, kChunkRows, [&](int64_t c0, int64_t rows) {
    return BlockRun<BITS>(k, M, tiles, c0, rows, y, N);
  });
}

}  // namespace

void run_block_panels(const Layout& L, Rows& R, float* y, int64_t M, int64_t N, bool tiles) {
  TORCH_CHECK(!tiles || amx::granted(), "the AMX block kernel needs AMX tiles (", amx::status(),
              " here)");
  switch (L.bits) {
    case 4: return run_blocks<4>(L, R, y, M, N, tiles);
    case 5: return run_blocks<5>(L, R, y, M, N, tiles);
    default: return run_blocks<8>(L, R, y, M, N, tiles);
  }
}

#else

void run_block_panels(const Layout&, Rows&, float*, int64_t, int64_t, bool) {
  TORCH_CHECK(false, "the block panels need AVX512-VNNI, not in this build");
}

#endif

}  // namespace group_quant
