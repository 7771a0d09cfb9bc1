// What both int8-activation paths of linear_group_quant read: the rows of x quantized to int8
// (Rows, made in linear_group_quant_int8.cpp, which describes the arithmetic) and the
// per-block factors, computed the same way by both (the one rule: a factor is the same
// product in the same order on every path, so the paths give the same bits). The AVX512-VNNI
// path is linear_group_quant_int8_vnni.cpp's run_vnni.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "group_quant_layout.h"

namespace group_quant {

constexpr int64_t kPair = 64;  // weights per pair of 32-blocks (one 512-bit register of codes)
constexpr int64_t kSuper = 256;  // a k-quant's super-block (the x-block of its path)
constexpr int64_t kPanel = 16;  // columns per panel of the repacked layouts (panels_repack.cpp)

// The int8 activations of every row, as the dots read them.
struct Rows {
  int64_t K, span, groups;  // span: weights per x-block
  std::vector<int8_t> xq;  // [M, K], in k order
  std::vector<int32_t> lane_base;  // [M, K / 4]: -Z * the sum of each 4 xq
  std::vector<float> d;  // [M, K / span]
  std::vector<int16_t> group_sum;  // [M, K / group]: each group's sum of xq (|sum| <= 32 * 127)

  Rows(const Layout& L, const float* x, int64_t M);
  void quantize(const float* xr, int64_t m, int32_t z, int64_t group);
};

// Whether a layout with group scales takes the k-quant path (Q2_K to Q6_K): 4-6 bit codes
// (u * xq pairs fit int16), super-blocks of 256, mins with a factor per group.
inline bool kquant(const Layout& L) {
  return L.sub_scale && L.bits < 8 && L.group * L.per_super == kSuper &&
         (!L.super_min || L.sub_min);
}

// a 32-group's scale and min (per_super 1), and an x-block's sum of sub_min times its groups'
// xq sums (exact in int32: the order of its terms does not matter)
inline float block_scale(const Layout& L, int64_t n, int64_t g) {
  const float scale = L.super_scale[n * L.supers + g];
  return L.sub_scale ? scale * static_cast<float>(L.sub_scale[n * L.groups + g]) : scale;
}

inline float block_min(const Layout& L, int64_t n, int64_t g) {
  const float min = L.super_min[n * L.supers + g];
  return L.sub_min ? min * static_cast<float>(L.sub_min[n * L.groups + g]) : min;
}

inline int32_t min_sum(const Layout& L, int64_t n, int64_t xb, int64_t span,
                       const int16_t* group_sum) {  // over x-block xb's groups
  int32_t sum = 0;
  for (int64_t g = xb * span / L.group; g < (xb + 1) * span / L.group; ++g) {
    sum += (L.sub_min ? L.sub_min[n * L.groups + g] : 1) * group_sum[g];
  }
  return sum;
}

// The tail's steps of row m, column n, the same on every path: per_super 1, block b adds
// (d * min) * its xq sum; per_super > 1, x-block xb adds (d * super_min) * min_sum
inline float block_tail(const Layout& L, const Rows& R, int64_t m, int64_t n, int64_t b,
                        float tail) {
  const float sum = static_cast<float>(R.group_sum[m * L.groups + b]);
  return std::fma(R.d[m * (L.K / R.span) + b] * block_min(L, n, b), sum, tail);
}

inline float super_tail(const Layout& L, const Rows& R, int64_t m, int64_t n, int64_t xb,
                        float tail) {
  const int64_t s = xb * R.span / (L.group * L.per_super);
  const float sum =
      static_cast<float>(min_sum(L, n, xb, R.span, R.group_sum.data() + m * L.groups));
  return std::fma(R.d[m * (L.K / R.span) + xb] * L.super_min[n * L.supers + s], sum, tail);
}

// A register tile's tails (rows m0 .., columns n0 ..): per_super 1, pair p's two blocks;
// per_super > 1, x-block xb
template <int MR, int NB>
inline void pair_tails(const Layout& L, const Rows& R, int64_t m0, int64_t n0, int64_t p,
                       float (&tail)[MR][NB]) {
  for (int64_t blk = 2 * p; L.super_min && blk < 2 * p + 2; ++blk) {
    for (int r = 0; r < MR; ++r) {
      for (int j = 0; j < NB; ++j) tail[r][j] = block_tail(L, R, m0 + r, n0 + j, blk, tail[r][j]);
    }
  }
}

template <int MR, int NB>
inline void super_tails(const Layout& L, const Rows& R, int64_t m0, int64_t n0, int64_t xb,
                        float (&tail)[MR][NB]) {
  for (int j = 0; L.super_min && j < NB; ++j) {
    for (int r = 0; r < MR; ++r) tail[r][j] = super_tail(L, R, m0 + r, n0 + j, xb, tail[r][j]);
  }
}

// y [M, N] from the quantized rows, in register tiles (built with AVX512-VNNI only), and the
// same on AVX2 (linear_group_quant_int8_avx2.cpp; built with AVX2 and FMA only)
void run_vnni(const Layout& L, const Rows& R, float* y, int64_t M, int64_t N);
void run_int8_avx2(const Layout& L, const Rows& R, float* y, int64_t M, int64_t N);

// The k-quant shapes linear_kquant_panels.cpp takes: 4-6 bit codes in groups of 32, or 4 or 6
// bits in groups of 16 (a B tile's high bits fill whole 64-byte chunks).
constexpr bool amx_shape(int64_t bits, int64_t group) {
  return (group == 32 && bits >= 4 && bits <= 6) || (group == 16 && (bits == 4 || bits == 6));
}

// The one-group shapes linear_block_panels.cpp takes (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): a factor
// per block of 32, 4, 5 or 8 bits a code (8-bit: signed codes, zero 0, as its tiles read them).
inline bool one_group(const Layout& L) {
  return L.per_super == 1 && L.group == 32 && !L.sub_scale && !L.sub_min && !L.fp8 &&
         (L.bits == 4 || L.bits == 5 || (L.bits == 8 && L.zero == 0));
}

// y [M, N] from the quantized rows (N a multiple of 16; both pad R's rows to whole tiles) over
// the panels of repack_kquant_amx (the k-quants) or of repack_block_panels (one_group), on AMX
// tiles or, tiles false, by AVX512-VNNI alone (the same bits)
void run_kquant_panels(const Layout& L, Rows& R, float* y, int64_t M, int64_t N, bool tiles);
void run_block_panels(const Layout& L, Rows& R, float* y, int64_t M, int64_t N, bool tiles);

}  // namespace group_quant
