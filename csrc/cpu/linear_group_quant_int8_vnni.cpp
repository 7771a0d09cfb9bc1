// The AVX512-VNNI path of the int8-activation linear (linear_group_quant_int8.cpp describes the
// arithmetic): a register tile of up to kRows rows times kCols columns. Per pair of 32-blocks
// each column's codes are unpacked (or read from a per-thread panel, unpacked once when the
// rows take more than one tile) and each row's int8 activations loaded once, and every
// (row, column) takes its vpdpbusd (k-quants: vpmaddubsw and vpmaddwd by the group scales)
// from them; the factors of a pair are made once per column (scales) and per row (d) and meet
// lane by lane, the same float product as the generic path.
//
// The one rule: the tile shares loads, never arithmetic. Each y[m, n] is the same sequence of
// integer sums (exact, in any order) and float operations (in one order) as the generic
// path's dot_generic, whatever rows and columns share its tile: batch-invariant, and the same
// bits as the generic path.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "group_quant_int8_vnni.h"

namespace group_quant {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

namespace {

constexpr int kCols = 4;  // columns per block of a thread's share (and per tile)
constexpr int kRows = 4;  // rows per tile
constexpr __mmask16 kOdd = 0xFF00;  // the lanes of block 2p + 1
constexpr int64_t kAhead = 4;  // codes read in registers: those of column n + kAhead prefetched

// Rows m0 .. m0 + MR - 1 times columns n0 .. n0 + NB - 1; panel: those columns' codes [NB, K]
// in k order, or nullptr to unpack them in registers. The accumulators are locals of
// each loop (kept in registers: nothing the loads read can alias them); the accessors are
// inlined by force (a call per pair, as GCC chose for these large bodies, halved the speed).
template <int BITS, int MR, int NB>
struct Tile {
  const Layout& L;
  const Rows& R;
  const uint8_t* panel;
  int64_t m0, n0;

  [[gnu::always_inline]] __m512i codes(int j, int64_t p) const {
    if (panel) return _mm512_loadu_si512(panel + j * L.K + p * kPair);
    prefetch_codes<BITS>(L, n0 + j + kAhead, p);
    return codes64<BITS>(L, n0 + j, p);
  }
  [[gnu::always_inline]] const int8_t* xq(int r) const { return R.xq.data() + (m0 + r) * L.K; }
  [[gnu::always_inline]] const int32_t* base(int r) const {
    return R.lane_base.data() + (m0 + r) * (L.K / 4);
  }
  [[gnu::always_inline]] const float* d(int r) const {
    return R.d.data() + (m0 + r) * (L.K / R.span);
  }
  [[gnu::always_inline]] const int16_t* group_sum(int r) const {
    return R.group_sum.data() + (m0 + r) * L.groups;
  }

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
      pair_tails(L, R, m0, n0, p, tail);
    }
    store(acc, tail, y, N);
  }

  // per_super > 1, no group scales: per x-block, I = sum of v over its pairs (int32), then
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
          for (int r = 0; r < MR; ++r) {
            const __m512i v = _mm512_dpbusd_epi32(_mm512_loadu_si512(base(r) + p * kLanes), q,
                                                  _mm512_loadu_si512(xq(r) + p * kPair));
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
      super_tails(L, R, m0, n0, xb, tail);
    }
    store(acc, tail, y, N);
  }

  // k-quants: per pair, vpmaddubsw (u * xq pairs, int16) and vpmaddwd by the lanes' group
  // scales (int32 lanes of 4 weights), summed over the x-block; then the zero's and the mins'
  // terms from the groups' xq sums (linear_group_quant_int8.cpp: dot_kquant)
  template <int G>
  void kquants(float* y, int64_t N) const {
    constexpr int per_x = kSuper / G;
    const int8_t* scales = L.sub_scale;
    __m512 acc[MR][NB];
    for (int r = 0; r < MR; ++r) {
      for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
    }
    __m512i perm[kSuper / kPair];
    for (int j = 0; j < kSuper / kPair; ++j) perm[j] = _mm512_loadu_si512(kPairGroups<G>.e[j]);
    for (int64_t xb = 0; xb < L.K / kSuper; ++xb) {
      __m512i sc[NB], sums[MR][NB];
      for (int j = 0; j < NB; ++j) {
        sc[j] = groups16<G>(scales + (n0 + j) * L.groups + xb * per_x);
        for (int r = 0; r < MR; ++r) sums[r][j] = _mm512_setzero_si512();
      }
      for (int jp = 0; jp < kSuper / kPair; ++jp) {
        const int64_t p = xb * (kSuper / kPair) + jp;
        for (int j = 0; j < NB; ++j) {
          const __m512i q = codes(j, p), s = _mm512_permutexvar_epi16(perm[jp], sc[j]);
          for (int r = 0; r < MR; ++r) {
            const __m512i t = _mm512_maddubs_epi16(q, _mm512_loadu_si512(xq(r) + p * kPair));
            sums[r][j] = _mm512_add_epi32(sums[r][j], _mm512_madd_epi16(t, s));
          }
        }
      }
      for (int r = 0; L.zero && r < MR; ++r) {
        const __m512i gs = sums16<G>(group_sum(r) + xb * per_x);
        for (int j = 0; j < NB; ++j) {  // past the groups / 2 lanes sc is 0
          const __m512i zt = _mm512_mullo_epi32(_mm512_madd_epi16(sc[j], gs),
                                                _mm512_set1_epi32(-static_cast<int32_t>(L.zero)));
          sums[r][j] = _mm512_add_epi32(sums[r][j], zt);
        }
      }
      for (int j = 0; j < NB; ++j) {
        const int64_t sup = (n0 + j) * L.supers + xb;
        for (int r = 0; r < MR; ++r) {
          const __m512 f = _mm512_set1_ps(d(r)[xb] * L.super_scale[sup]);
          acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r][j]), f, acc[r][j]);
        }
      }
      if (!L.super_min) continue;
      for (int j = 0; j < NB; ++j) {  // the zero's pattern: lane i, groups 2i and 2i + 1
        const int64_t sup = (n0 + j) * L.supers + xb;
        const __m512i sm = groups16<G>(L.sub_min + (n0 + j) * L.groups + xb * per_x);
        for (int r = 0; r < MR; ++r) {
          const __m512i gs = sums16<G>(group_sum(r) + xb * per_x);
          const __m512 mins = _mm512_cvtepi32_ps(_mm512_madd_epi16(sm, gs));
          const __m512 f = _mm512_set1_ps(d(r)[xb] * L.super_min[sup]);
          acc[r][j] = _mm512_fmadd_ps(mins, f, acc[r][j]);
        }
      }
    }
    for (int r = 0; r < MR; ++r) {
      for (int j = 0; j < NB; ++j) y[(m0 + r) * N + n0 + j] = hsum16(acc[r][j]);
    }
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
    if constexpr (BITS < 8) {
      if (kquant(L)) return L.group == 16 ? kquants<16>(y, N) : kquants<32>(y, N);
    }
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

// Column block `block` (kCols columns) for every row; scratch: a panel [kCols, K] of the
// columns' codes where the rows take more than one tile, else empty
template <int BITS>
void run_block(const Layout& L, const Rows& R, std::vector<uint8_t>& scratch, float* y,
               int64_t block, int64_t M, int64_t N) {
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

template <int BITS>
void run_tiles(const Layout& L, const Rows& R, float* y, int64_t M, int64_t N) {
  // Column blocks in chunks the threads take as they come free: a thread descheduled on a
  // busy machine holds up no share of the others' (which thread takes a block changes no bit)
  const int64_t blocks = (N + kCols - 1) / kCols, threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(1, blocks / (8 * threads));
  const int64_t tasks = std::min(threads, (blocks + chunk - 1) / chunk);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    std::vector<uint8_t> scratch(M > kRows ? L.K * kCols : 0);
    for (int64_t begin = next.fetch_add(chunk); begin < blocks; begin = next.fetch_add(chunk)) {
      for (int64_t block = begin; block < std::min(begin + chunk, blocks); ++block) {
        run_block<BITS>(L, R, scratch, y, block, M, N);
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
