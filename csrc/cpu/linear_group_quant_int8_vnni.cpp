// The AVX512-VNNI path of the int8-activation linear (linear_group_quant_int8.cpp describes the
// arithmetic): a register tile of up to kRows rows times kCols columns. Per pair of 32-blocks
// each column's codes are unpacked (or read from a per-thread panel, unpacked once when the
// rows take more than one tile) and each row's int8 activations loaded once, and every
// (row, column) takes its vpdpbusd from them; the factors of a pair are made once per column
// (scales) and per row (d) and meet lane by lane, the same float product as the generic path.
//
// The one rule: the tile shares loads, never arithmetic. Each y[m, n] is the same sequence of
// integer sums (exact, in any order) and float operations (in one order) as the generic
// path's dot_generic, whatever rows and columns share its tile: batch-invariant, and the same
// bits as the generic path.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "group_quant_int8.h"

namespace group_quant {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

namespace {

constexpr int kCols = 4;  // columns per block of a thread's share (and per tile)
constexpr int kRows = 4;  // rows per tile
constexpr __mmask16 kOdd = 0xF0F0;  // the lanes of block 2p + 1 (quarters 1 and 3)

// pair p of row n's codes as unsigned bytes, in lane order: for 4-6 bits one 32-byte load of
// the two blocks' nibbles (low nibbles then high ones are exactly the lane order) and one
// 64-bit read per bit plane (its middle 16-bit words swapped into lane order)
template <int BITS>
[[gnu::always_inline]] inline __m512i codes64(const Layout& L, int64_t n, int64_t p) {
  if constexpr (BITS == 8) {
    __m512i v = _mm512_loadu_si512(L.codes + n * L.K + p * kPair);
    v = _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
    return _mm512_shuffle_i64x2(v, v, _MM_SHUFFLE(3, 1, 2, 0));
  } else {
    const __m256i t =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(L.low + n * (L.K / 2) + p * 32));
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_and_si256(t, nibble);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(t, 4), nibble);
    __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
#pragma GCC unroll 2
    for (int pl = 0; pl < BITS - 4; ++pl) {
      uint64_t u;
      std::memcpy(&u, L.high + (n * L.planes + pl) * (L.K / 8) + p * 8, sizeof(u));
      const uint64_t lanes = (u & 0xFFFF00000000FFFFull) | ((u >> 16) & 0xFFFF0000ull) |
                             ((u << 16) & 0x0000FFFF00000000ull);
      q = _mm512_mask_add_epi8(q, lanes, q, _mm512_set1_epi8(static_cast<char>(16 << pl)));
    }
    return q;
  }
}

// lane l's sub-scale in pair p as int32 lanes (group 32: block 2p + (quarter & 1); group 16:
// that block's half quarter >> 1)
inline __m512i sub_scales(const Layout& L, int64_t n, int64_t p) {
  const int8_t* sc = L.sub_scale + n * L.groups;
  int32_t four = 0;
  __m512i index;
  if (L.group == 32) {
    std::memcpy(&four, sc + 2 * p, 2);
    index = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
  } else {
    std::memcpy(&four, sc + 4 * p, 4);
    index = _mm512_set_epi32(3, 3, 3, 3, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0, 0);
  }
  const __m512i wide = _mm512_cvtepi8_epi32(_mm_cvtsi32_si128(four));
  return _mm512_permutexvar_epi32(index, wide);
}

// Rows m0 .. m0 + MR - 1 times columns n0 .. n0 + NB - 1; panel: those columns' codes [NB, K]
// in lane order, or nullptr to unpack them in registers. The accumulators are locals of
// each loop (kept in registers: nothing the loads read can alias them).
template <int BITS, int MR, int NB>
struct Tile {
  const Layout& L;
  const Rows& R;
  const uint8_t* panel;
  int64_t m0, n0;

  __m512i codes(int j, int64_t p) const {
    return panel ? _mm512_loadu_si512(panel + j * L.K + p * kPair) : codes64<BITS>(L, n0 + j, p);
  }
  const int8_t* xq(int r) const { return R.xq.data() + (m0 + r) * L.K; }
  const int32_t* base(int r) const { return R.lane_base.data() + (m0 + r) * (L.K / 4); }
  const float* d(int r) const { return R.d.data() + (m0 + r) * (L.K / R.span); }
  const int32_t* group_sum(int r) const { return R.group_sum.data() + (m0 + r) * L.groups; }

  // per_super 1: per pair, per block, acc += v * (d * scale); tail += (d * min) * xq sum
  void single_groups(float* y, int64_t N) const {
    __m512 acc[MR][NB];
    float tail[MR][NB];
    zero(acc, tail);
    for (int64_t p = 0; p < L.K / kPair; ++p) {
      __m512i q[NB];
      __m512 scale[NB];
      for (int j = 0; j < NB; ++j) {
        q[j] = codes(j, p);
        scale[j] = _mm512_mask_blend_ps(kOdd, _mm512_set1_ps(block_scale(L, n0 + j, 2 * p)),
                                        _mm512_set1_ps(block_scale(L, n0 + j, 2 * p + 1)));
      }
      for (int r = 0; r < MR; ++r) {
        const __m512i x = _mm512_loadu_si512(xq(r) + p * kPair);
        const __m512i b = _mm512_loadu_si512(base(r) + p * kLanes);
        const float* dr = d(r);
        const __m512 dv =
            _mm512_mask_blend_ps(kOdd, _mm512_set1_ps(dr[2 * p]), _mm512_set1_ps(dr[2 * p + 1]));
        for (int j = 0; j < NB; ++j) {
          const __m512i v = _mm512_dpbusd_epi32(b, q[j], x);
          acc[r][j] =
              _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(dv, scale[j]), acc[r][j]);
        }
      }
      for (int64_t blk = 2 * p; L.super_min && blk < 2 * p + 2; ++blk) {
        for (int r = 0; r < MR; ++r) {
          const float sum = static_cast<float>(group_sum(r)[blk]);
          for (int j = 0; j < NB; ++j) {
            tail[r][j] = std::fma(d(r)[blk] * block_min(L, n0 + j, blk), sum, tail[r][j]);
          }
        }
      }
    }
    store(acc, tail, y, N);
  }

  // per_super > 1: per x-block, I = sum of v * sub_scale over its pairs (int32), then
  // acc += I * (d * super_scale); tail += (d * super_min) * (sum of sub_min * group xq sums)
  void super_blocks(float* y, int64_t N) const {
    const int64_t pairs_per_x = R.span / kPair, super_span = L.group * L.per_super;
    __m512 acc[MR][NB];
    float tail[MR][NB];
    zero(acc, tail);
    for (int64_t xb = 0; xb < L.K / R.span; ++xb) {
      __m512i sums[MR][NB];
      for (int r = 0; r < MR; ++r) {
        for (int j = 0; j < NB; ++j) sums[r][j] = _mm512_setzero_si512();
      }
      for (int64_t p = xb * pairs_per_x; p < (xb + 1) * pairs_per_x; ++p) {
        for (int j = 0; j < NB; ++j) {
          const __m512i q = codes(j, p);
          const __m512i sc = L.sub_scale ? sub_scales(L, n0 + j, p) : _mm512_set1_epi32(1);
          for (int r = 0; r < MR; ++r) {
            __m512i v = _mm512_dpbusd_epi32(_mm512_loadu_si512(base(r) + p * kLanes), q,
                                            _mm512_loadu_si512(xq(r) + p * kPair));
            if (L.sub_scale) v = _mm512_mullo_epi32(v, sc);
            sums[r][j] = _mm512_add_epi32(sums[r][j], v);
          }
        }
      }
      const int64_t s = xb * R.span / super_span;
      for (int j = 0; j < NB; ++j) {
        const float scale = L.super_scale[(n0 + j) * L.supers + s];
        for (int r = 0; r < MR; ++r) {
          const __m512 f = _mm512_set1_ps(d(r)[xb] * scale);
          acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][j]), f, acc[r][j]);
        }
      }
      if (!L.super_min) continue;
      for (int j = 0; j < NB; ++j) {
        const float min = L.super_min[(n0 + j) * L.supers + s];
        for (int r = 0; r < MR; ++r) {
          const float sum = static_cast<float>(min_sum(L, n0 + j, xb, R.span, group_sum(r)));
          tail[r][j] = std::fma(d(r)[xb] * min, sum, tail[r][j]);
        }
      }
    }
    store(acc, tail, y, N);
  }

  static void zero(__m512 (&acc)[MR][NB], float (&tail)[MR][NB]) {
    for (int r = 0; r < MR; ++r) {
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps(), tail[r][j] = 0.f;
    }
  }

  void store(const __m512 (&acc)[MR][NB], const float (&tail)[MR][NB], float* y,
             int64_t N) const {
    for (int r = 0; r < MR; ++r) {
      for (int j = 0; j < NB; ++j) y[(m0 + r) * N + n0 + j] = hsum16(acc[r][j]) + tail[r][j];
    }
  }

  void run(float* y, int64_t N) const {
    if (L.per_super == 1) return single_groups(y, N);
    super_blocks(y, N);
  }
};

template <int BITS, int NB>
void rows_tile(int64_t mr, const Layout& L, const Rows& R, const uint8_t* panel, float* y,
               int64_t m0, int64_t n0, int64_t N) {
  switch (mr) {
    case 1: return Tile<BITS, 1, NB>{L, R, panel, m0, n0}.run(y, N);
    case 2: return Tile<BITS, 2, NB>{L, R, panel, m0, n0}.run(y, N);
    case 3: return Tile<BITS, 3, NB>{L, R, panel, m0, n0}.run(y, N);
    default: return Tile<BITS, kRows, NB>{L, R, panel, m0, n0}.run(y, N);
  }
}

template <int BITS>
void run_tiles(const Layout& L, const Rows& R, float* y, int64_t M, int64_t N) {
  at::parallel_for(0, (N + kCols - 1) / kCols, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> scratch(M > kRows ? L.K * kCols : 0);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = block * kCols, nb = std::min<int64_t>(kCols, N - n0);
      if (!scratch.empty()) {  // more than one tile of rows: unpack the columns' codes once
        for (int64_t j = 0; j < nb; ++j) {
          for (int64_t p = 0; p < L.K / kPair; ++p) {
            _mm512_storeu_si512(&scratch[j * L.K + p * kPair], codes64<BITS>(L, n0 + j, p));
          }
        }
      }
      const uint8_t* panel = scratch.empty() ? nullptr : scratch.data();
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int64_t mr = std::min<int64_t>(kRows, M - m0);
        if (nb == kCols && M > 1) {
          rows_tile<BITS, kCols>(mr, L, R, panel, y, m0, n0, N);
          continue;
        }
        // one row (decoding: measured faster), or the last block's few columns: one at a time
        for (int64_t j = 0; j < nb; ++j) {
          const uint8_t* column = panel ? panel + j * L.K : nullptr;
          rows_tile<BITS, 1>(mr, L, R, column, y, m0, n0 + j, N);
        }
      }
    }
  });
}

}  // namespace

void run_vnni(const Layout& L, const Rows& R, float* y, int64_t M, int64_t N) {
  switch (L.bits) {
    case 4: return run_tiles<4>(L, R, y, M, N);
    case 5: return run_tiles<5>(L, R, y, M, N);
    case 6: return run_tiles<6>(L, R, y, M, N);
    default: return run_tiles<8>(L, R, y, M, N);
  }
}

#else

void run_vnni(const Layout&, const Rows&, float*, int64_t, int64_t) {}  // never called here

#endif

}  // namespace group_quant
