// Group-quantized linear with int8 activations and integer dot products (the "int8" kernel of
// linear_group_quant): decoding over the fp32 path is bound by dequantizing, so here the
// weights' integer codes meet int8 activations in vpdpbusd, as llama.cpp's Q4_K x Q8_K does.
//
// Row m of x is quantized per x-block (32 weights where per_super is 1, else the super-block
// of group * per_super weights, cut to 256 as llama.cpp's Q8_K): d = max |x| / 127,
// xq = round(x * (1 / d)), in [-127, 127]. Codes u are
// unsigned (q; 8-bit: the int8 code + 128) and Z the layout's zero (8-bit: zero + 128). Per
// output column n and pair p of 32-blocks (64 weights), in 16 int32 lanes of 4 weights each:
//   v[l] = sum of u * xq over the lane's 4 weights - Z * sum of their xq      (exact)
// the lanes in the order the nibbles unpack (block 2p's first 16 weights, block 2p + 1's first
// 16, block 2p's last 16, block 2p + 1's last 16; xq is stored in that order). Then
//   per_super > 1: I[l] = sum over the x-block's pairs of v[l] * sub_scale(l)  (exact)
//                  acc[l] = fma(float(I[l]), d * super_scale, acc[l])
//                  tail = fma(d * super_min, float(sum over its groups of sub_min * xq sum), tail)
//   per_super 1:   acc[l] = fma(float(v[l]), d(block) * scale(block), acc[l])
//                  tail = fma(d(block) * min(block), float(the block's xq sum), tail)
//   y[m, n] = hsum16(acc) + tail
// Every step depends on row m alone, in one order: batch-invariant, and the AVX512-VNNI path
// and the generic one (scalar code doing the same integer and float operations lane by lane)
// give the same bits. |v| <= 2 * 4 * 255 * 127 and |sub_scale| <= 128: I, over the 4 pairs of
// an x-block at most, fits int32 many times over. This file: the rows' quantization, the
// generic path, the dispatch; linear_group_quant_int8_vnni.cpp: the AVX512-VNNI path, which
// runs these same steps for a tile of rows times columns at once.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "group_quant_int8.h"

namespace group_quant {

Rows::Rows(const Layout& L, const float* x, int64_t M)
    : K(L.K),
      span(L.per_super == 1 ? 32 : std::min<int64_t>(L.group * L.per_super, 256)),
      groups(L.groups),
      xq(M * L.K),
      lane_base(M * L.K / 4),
      d(M * (L.K / span)),
      group_sum(M * L.groups) {
  const int32_t z = static_cast<int32_t>(L.zero + (L.bits == 8 ? 128 : 0));
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    std::vector<int8_t> natural(K);
    for (int64_t m = begin; m < end; ++m) quantize(x + m * K, m, z, natural.data(), L.group);
  });
}

void Rows::quantize(const float* xr, int64_t m, int32_t z, int8_t* natural, int64_t group) {
  for (int64_t b = 0; b < K / span; ++b) {
    float amax = 0.f;
    for (int64_t k = b * span; k < (b + 1) * span; ++k) amax = std::max(amax, std::fabs(xr[k]));
    const float scale = amax / 127.f, inverse = scale > 0.f ? 1.f / scale : 0.f;
    d[m * (K / span) + b] = scale;
    for (int64_t k = b * span; k < (b + 1) * span; ++k) {
      natural[k] = static_cast<int8_t>(std::nearbyint(xr[k] * inverse));
    }
  }
  int8_t* out = xq.data() + m * K;
  for (int64_t p = 0; p < K / kPair; ++p) {
    for (int c = 0; c < 4; ++c) {  // lane quarter c: block 2p + (c & 1), half c >> 1
      const int8_t* from = natural + p * kPair + 32 * (c & 1) + 16 * (c >> 1);
      std::memcpy(out + p * kPair + 16 * c, from, 16);
    }
  }
  for (int64_t l = 0; l < K / 4; ++l) {
    int32_t sum = 0;
    for (int i = 0; i < 4; ++i) sum += out[4 * l + i];
    lane_base[m * (K / 4) + l] = -z * sum;
  }
  for (int64_t g = 0; g < groups; ++g) {
    int32_t sum = 0;
    for (int64_t k = g * group; k < (g + 1) * group; ++k) sum += natural[k];
    group_sum[m * groups + g] = sum;
  }
}

namespace {

// lane l's sub-scale in pair p: group 32: block 2p + (quarter & 1); group 16: that block's
// half quarter >> 1
inline int32_t lane_sub_scale(const Layout& L, int64_t n, int64_t p, int l) {
  const int q = l / 4;
  const int64_t g = L.group == 32 ? 2 * p + (q & 1) : 4 * p + 2 * (q & 1) + (q >> 1);
  return L.sub_scale[n * L.groups + g];
}

// pair p of row n's codes as unsigned bytes, in lane order (the generic path)
void codes_generic(const Layout& L, int64_t n, int64_t p, uint8_t* u) {
  for (int c = 0; c < 4; ++c) {
    const int64_t b = 2 * p + (c & 1);
    for (int i = 0; i < 16; ++i) {
      const int64_t w = (c >> 1) * 16 + i;  // weight w of block b
      if (L.bits == 8) {
        u[16 * c + i] = static_cast<uint8_t>(L.codes[n * L.K + b * 32 + w] + 128);
        continue;
      }
      const uint8_t byte = L.low[n * (L.K / 2) + b * 16 + i];
      int32_t q = w < 16 ? byte & 0x0F : byte >> 4;
      for (int64_t pl = 0; pl < L.planes; ++pl) {
        uint32_t word;
        std::memcpy(&word, L.high + (n * L.planes + pl) * (L.K / 8) + b * 4, sizeof(word));
        q |= static_cast<int32_t>((word >> w) & 1) << (4 + pl);
      }
      u[16 * c + i] = static_cast<uint8_t>(q);
    }
  }
}

float dot_generic(const Layout& L, const Rows& R, int64_t m, int64_t n) {
  const int64_t K = L.K, pairs_per_x = R.span / kPair, super_span = L.group * L.per_super;
  const int8_t* xq = R.xq.data() + m * K;
  const int32_t* base = R.lane_base.data() + m * (K / 4);
  const float* d = R.d.data() + m * (K / R.span);
  const int32_t* group_sum = R.group_sum.data() + m * L.groups;
  float acc[kLanes] = {}, tail = 0.f;
  int32_t sums[kLanes] = {};
  for (int64_t p = 0; p < K / kPair; ++p) {
    uint8_t u[kPair];
    codes_generic(L, n, p, u);
    int32_t v[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      v[l] = base[p * kLanes + l];
      for (int i = 0; i < 4; ++i) v[l] += u[4 * l + i] * xq[p * kPair + 4 * l + i];
    }
    if (L.per_super == 1) {
      const float f[2] = {d[2 * p] * block_scale(L, n, 2 * p),
                          d[2 * p + 1] * block_scale(L, n, 2 * p + 1)};
      for (int l = 0; l < kLanes; ++l) {
        acc[l] = std::fma(static_cast<float>(v[l]), f[(l / 4) & 1], acc[l]);
      }
      for (int64_t b = 2 * p; L.super_min && b < 2 * p + 2; ++b) {
        tail = std::fma(d[b] * block_min(L, n, b), static_cast<float>(group_sum[b]), tail);
      }
      continue;
    }
    for (int l = 0; l < kLanes; ++l) sums[l] += L.sub_scale ? v[l] * lane_sub_scale(L, n, p, l) : v[l];
    if ((p + 1) % pairs_per_x) continue;
    const int64_t xb = p / pairs_per_x, s = xb * R.span / super_span;
    const float f = d[xb] * L.super_scale[n * L.supers + s];
    for (int l = 0; l < kLanes; ++l) {
      acc[l] = std::fma(static_cast<float>(sums[l]), f, acc[l]);
      sums[l] = 0;
    }
    if (L.super_min) {
      const float sum = static_cast<float>(min_sum(L, n, xb, R.span, group_sum));
      tail = std::fma(d[xb] * L.super_min[n * L.supers + s], sum, tail);
    }
  }
  return hsum16_generic(acc) + tail;
}

}  // namespace

bool int8_fits(const Layout& L) {
  const int64_t span = L.group * L.per_super;
  const bool blocks = L.per_super == 1 ? L.group == 32 : span % kPair == 0;
  return L.K % kPair == 0 && blocks;
}

void run_int8(const Layout& L, const float* x, float* y, int64_t M, int64_t N, bool vnni) {
  const Rows R(L, x, M);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (vnni) return run_vnni(L, R, y, M, N);
#endif
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < M; ++m) y[m * N + n] = dot_generic(L, R, m, n);
    }
  });
}

}  // namespace group_quant
