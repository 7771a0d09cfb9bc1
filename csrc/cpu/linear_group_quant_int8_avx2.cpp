// The AVX2 path of the int8-activation linear (linear_group_quant_int8.cpp describes the
// arithmetic): a pair of 32-blocks as two 8-lane registers, lo (block 2p, lanes 0-7) and hi
// (block 2p + 1, lanes 8-15), each int32 lane the sum of 4 weights' products. Without
// vpdpbusd the sums are vpmaddubsw then vpmaddwd by ones (4-6 bit codes: u * xq pairs fit
// int16); 8-bit codes (u up to 255 would saturate vpmaddubsw) multiply as signed codes c by
// vpmaddubsw(|c|, sign(xq, c)), and u * xq = c * xq + 128 * xq adds 128 times the lane's xq
// sum. The k-quants' group scales are broadcast per 16 or 32 weights (a register holds one
// block). The one rule: the same integer sums and the same float operations per lane, in the
// same order, as the generic path's dot_generic (an fma by 0 included where the AVX512-VNNI
// path has one), so the same bits.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "group_quant_avx2.h"
#include "group_quant_int8.h"

#ifdef GROUP_QUANT_AVX2

namespace group_quant {

namespace {

constexpr int kCols = 4;  // columns per block of a thread's share
constexpr int kRows = 2;  // rows per tile

[[gnu::always_inline]] inline __m256i load32(const void* p) {  // 32 bytes, unaligned
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

[[gnu::always_inline]] inline __m256i quads(__m256i pairs) {  // int16 pairs -> int32 quads
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// the int32 lanes' sums of 4 products u * xq, from the block's codes as loaded (BITS < 8:
// unsigned codes; 8: the int8 codes) and its xq
template <int BITS>
[[gnu::always_inline]] inline __m256i dot4(__m256i q, __m256i x) {
  if constexpr (BITS == 8) {
    const __m256i cx = quads(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q)));
    const __m256i xs = quads(_mm256_maddubs_epi16(_mm256_set1_epi8(1), x));
    return _mm256_add_epi32(cx, _mm256_slli_epi32(xs, 7));
  } else {
    return quads(_mm256_maddubs_epi16(q, x));
  }
}

// an x-block's G-groups' int8 factors (or int16 sums) as the first int16 lanes, the rest 0
template <int G>
[[gnu::always_inline]] inline __m256i groups16(const int8_t* from) {
  if constexpr (G == 32) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(from));
    return _mm256_zextsi128_si256(_mm_cvtepi8_epi16(bytes));
  } else {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from)));
  }
}

template <int G>
[[gnu::always_inline]] inline __m256i sums16(const int16_t* from) {
  if constexpr (G == 32) {
    return _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(from)));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from));
  }
}

template <int BITS, int MR, int NB>
struct Tile {
  const Layout& L;
  const Rows& R;
  const uint8_t* panel;  // the block's unpacked codes [kCols, K] from column p0, or nullptr
  int64_t p0, m0, n0;

  // block blk of column j's codes, in k order
  [[gnu::always_inline]] __m256i codes(int j, int64_t blk) const {
    if constexpr (BITS == 8) {
      return load32(L.codes + (n0 + j) * L.K + blk * 32);
    } else {
      if (!panel) return codes32<BITS>(L, n0 + j, blk);
      return load32(panel + (n0 + j - p0) * L.K + blk * 32);
    }
  }
  [[gnu::always_inline]] __m256i x(int r, int64_t blk) const {
    return load32(R.xq.data() + (m0 + r) * L.K + blk * 32);
  }
  [[gnu::always_inline]] __m256i base(int r, int64_t blk) const {
    return load32(R.lane_base.data() + (m0 + r) * (L.K / 4) + blk * 8);
  }
  [[gnu::always_inline]] const float* d(int r) const {
    return R.d.data() + (m0 + r) * (L.K / R.span);
  }
  [[gnu::always_inline]] const int16_t* group_sum(int r) const {
    return R.group_sum.data() + (m0 + r) * L.groups;
  }

  // per_super 1: per block, acc += v * (d * scale); tail += (d * min) * xq sum
  void single_groups(float* y, int64_t N) const {
    __m256 acc[MR][NB][2];
    float tail[MR][NB] = {};
    zero(acc);
    for (int64_t p = 0; p < L.K / kPair; ++p) {
      for (int j = 0; j < NB; ++j) {
        for (int h = 0; h < 2; ++h) {
          const int64_t blk = 2 * p + h;
          const __m256i q = codes(j, blk);
          const float scale = block_scale(L, n0 + j, blk);
          for (int r = 0; r < MR; ++r) {
            const __m256i v = _mm256_add_epi32(base(r, blk), dot4<BITS>(q, x(r, blk)));
            const __m256 f = _mm256_mul_ps(_mm256_set1_ps(d(r)[blk]), _mm256_set1_ps(scale));
            acc[r][j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), f, acc[r][j][h]);
          }
        }
      }
      pair_tails(L, R, m0, n0, p, tail);
    }
    store(acc, tail, y, N);
  }

  // per_super > 1, no group scales: per x-block, I = sum of v over its pairs, then
  // acc += I * (d * super_scale); tail += (d * super_min) * (sum of sub_min * group xq sums)
  void super_blocks(float* y, int64_t N) const {
    const int64_t blocks_per_x = R.span / 32, super_span = L.group * L.per_super;
    __m256 acc[MR][NB][2];
    float tail[MR][NB] = {};
    zero(acc);
    for (int64_t xb = 0; xb < L.K / R.span; ++xb) {
      __m256i sums[MR][NB][2];
      for (int r = 0; r < MR; ++r) {
        for (int j = 0; j < NB; ++j) sums[r][j][0] = sums[r][j][1] = _mm256_setzero_si256();
      }
      for (int64_t blk = xb * blocks_per_x; blk < (xb + 1) * blocks_per_x; ++blk) {
        for (int j = 0; j < NB; ++j) {
          const __m256i q = codes(j, blk);
          for (int r = 0; r < MR; ++r) {
            const __m256i v = _mm256_add_epi32(base(r, blk), dot4<BITS>(q, x(r, blk)));
            sums[r][j][blk % 2] = _mm256_add_epi32(sums[r][j][blk % 2], v);
          }
        }
      }
      const int64_t s = xb * R.span / super_span;
      for (int j = 0; j < NB; ++j) {
        const float scale = L.super_scale[(n0 + j) * L.supers + s];
        for (int r = 0; r < MR; ++r) {
          const __m256 f = _mm256_set1_ps(d(r)[xb] * scale);
          for (int h = 0; h < 2; ++h) {
            acc[r][j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][j][h]), f, acc[r][j][h]);
          }
        }
      }
      super_tails(L, R, m0, n0, xb, tail);
    }
    store(acc, tail, y, N);
  }

  // k-quants: per block, vpmaddubsw and vpmaddwd by its groups' scales (one per register, or
  // per half for groups of 16), summed over the x-block; then the zero's and mins' terms
  template <int G>
  void kquants(float* y, int64_t N) const {
    constexpr int per_x = kSuper / G;
    __m256 acc[MR][NB][2];
    zero(acc);
    for (int64_t xb = 0; xb < L.K / kSuper; ++xb) {
      __m256i sums[MR][NB][2];
      for (int r = 0; r < MR; ++r) {
        for (int j = 0; j < NB; ++j) sums[r][j][0] = sums[r][j][1] = _mm256_setzero_si256();
      }
      for (int64_t i = 0; i < kSuper / 32; ++i) {  // block i of the x-block
        const int64_t blk = xb * (kSuper / 32) + i;
        for (int j = 0; j < NB; ++j) {
          const int8_t* sc = L.sub_scale + (n0 + j) * L.groups + xb * per_x;
          const __m256i s = G == 32 ? _mm256_set1_epi16(sc[i])
                                    : _mm256_set_m128i(_mm_set1_epi16(sc[2 * i + 1]),
                                                       _mm_set1_epi16(sc[2 * i]));
          const __m256i q = codes(j, blk);
          for (int r = 0; r < MR; ++r) {
            const __m256i t = _mm256_maddubs_epi16(q, x(r, blk));
            sums[r][j][i % 2] = _mm256_add_epi32(sums[r][j][i % 2], _mm256_madd_epi16(t, s));
          }
        }
      }
      for (int r = 0; L.zero && r < MR; ++r) {
        const __m256i gs = sums16<G>(group_sum(r) + xb * per_x);
        for (int j = 0; j < NB; ++j) {  // lanes j < per_x / 2: groups 2j and 2j + 1
          const __m256i sc = groups16<G>(L.sub_scale + (n0 + j) * L.groups + xb * per_x);
          const __m256i zt = _mm256_mullo_epi32(_mm256_madd_epi16(sc, gs),
                                                _mm256_set1_epi32(-static_cast<int32_t>(L.zero)));
          sums[r][j][0] = _mm256_add_epi32(sums[r][j][0], zt);
        }
      }
      for (int j = 0; j < NB; ++j) {
        const int64_t sup = (n0 + j) * L.supers + xb;
        for (int r = 0; r < MR; ++r) {
          const __m256 f = _mm256_set1_ps(d(r)[xb] * L.super_scale[sup]);
          for (int h = 0; h < 2; ++h) {
            acc[r][j][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][j][h]), f, acc[r][j][h]);
          }
        }
      }
      if (!L.super_min) continue;
      for (int j = 0; j < NB; ++j) {
        const int64_t sup = (n0 + j) * L.supers + xb;
        const __m256i sm = groups16<G>(L.sub_min + (n0 + j) * L.groups + xb * per_x);
        for (int r = 0; r < MR; ++r) {
          const __m256i gs = sums16<G>(group_sum(r) + xb * per_x);
          const __m256 mins = _mm256_cvtepi32_ps(_mm256_madd_epi16(sm, gs));
          const __m256 f = _mm256_set1_ps(d(r)[xb] * L.super_min[sup]);
          acc[r][j][0] = _mm256_fmadd_ps(mins, f, acc[r][j][0]);
          acc[r][j][1] = _mm256_fmadd_ps(_mm256_setzero_ps(), f, acc[r][j][1]);  // lanes 8-15: 0
        }
      }
    }
    store(acc, nullptr, y, N);  // no tail: one added 0 would turn a -0 sum into +0
  }

  static void zero(__m256 (&acc)[MR][NB][2]) {
    for (int r = 0; r < MR; ++r) {
      for (int j = 0; j < NB; ++j) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_ps();
    }
  }

  // y = hsum16(acc) (+ tail, unless nullptr)
  void store(const __m256 (&acc)[MR][NB][2], const float (*tail)[NB], float* y, int64_t N) const {
    for (int r = 0; r < MR; ++r) {
      for (int j = 0; j < NB; ++j) {
        const float sum = hsum16(acc[r][j][0], acc[r][j][1]);
        y[(m0 + r) * N + n0 + j] = tail ? sum + tail[r][j] : sum;
      }
    }
  }

  void run(float* y, int64_t N) const {
    if (L.per_super == 1) return single_groups(y, N);
    if constexpr (BITS < 8) {
      if (kquant(L)) return L.group == 16 ? kquants<16>(y, N) : kquants<32>(y, N);
    }
    super_blocks(y, N);
  }
};

// rows in pairs times the block's columns in pairs (single ones at the edges)
template <int BITS>
void run_block(const Layout& L, const Rows& R, const uint8_t* panel, float* y, int64_t M,
               int64_t n0, int64_t nb, int64_t N) {
  for (int64_t j = 0; j < nb; j += 2) {
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      const bool rows2 = M - m0 >= 2, cols2 = nb - j >= 2;
      const int64_t n = n0 + j;
      if (rows2 && cols2) Tile<BITS, 2, 2>{L, R, panel, n0, m0, n}.run(y, N);
      else if (rows2) Tile<BITS, 2, 1>{L, R, panel, n0, m0, n}.run(y, N);
      else if (cols2) Tile<BITS, 1, 2>{L, R, panel, n0, m0, n}.run(y, N);
      else Tile<BITS, 1, 1>{L, R, panel, n0, m0, n}.run(y, N);
    }
  }
}

template <int BITS>
void run(const Layout& L, const Rows& R, float* y, int64_t M, int64_t N) {
  at::parallel_for(0, (N + kCols - 1) / kCols, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> scratch(BITS < 8 && M > kRows ? L.K * kCols : 0);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = block * kCols, nb = std::min<int64_t>(kCols, N - n0);
      if constexpr (BITS < 8) {  // more than one tile of rows: unpack the columns' codes once
        for (int64_t j = 0; !scratch.empty() && j < nb; ++j) {
          for (int64_t b = 0; b < L.K / 32; ++b) {
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(&scratch[j * L.K + b * 32]),
                                codes32<BITS>(L, n0 + j, b));
          }
        }
      }
      run_block<BITS>(L, R, scratch.empty() ? nullptr : scratch.data(), y, M, n0, nb, N);
    }
  });
}

}  // namespace

void run_int8_avx2(const Layout& L, const Rows& R, float* y, int64_t M, int64_t N) {
  switch (L.bits) {
    case 4: return run<4>(L, R, y, M, N);
    case 5: return run<5>(L, R, y, M, N);
    case 6: return run<6>(L, R, y, M, N);
    default: return run<8>(L, R, y, M, N);
  }
}

}  // namespace group_quant

#endif
