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
// an x-block at most, fits int32 many times over.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "group_quant_layout.h"

namespace group_quant {

namespace {

constexpr int kCols = 4;  // columns per block of a thread's share
constexpr int64_t kScratchRows = 4;  // more rows than this: unpack a column's codes once
constexpr int64_t kPair = 64;  // weights per pair of 32-blocks (one 512-bit register of codes)

// The int8 activations of every row, as the dots read them.
struct Rows {
  int64_t K, span, groups;  // span: weights per x-block
  std::vector<int8_t> xq;  // [M, K], per pair in lane order
  std::vector<int32_t> lane_base;  // [M, K / 4]: -Z * each lane's sum of xq
  std::vector<float> d;  // [M, K / span]
  std::vector<int32_t> group_sum;  // [M, K / group]: each group's sum of xq

  Rows(const Layout& L, const float* x, int64_t M)
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

  void quantize(const float* xr, int64_t m, int32_t z, int8_t* natural, int64_t group) {
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
};

// The factors both paths take, computed the same way: a 32-group's scale and min (per_super
// 1), and an x-block's sum of sub_min times its groups' xq sums.
inline float block_scale(const Layout& L, int64_t n, int64_t g) {
  const float scale = L.super_scale[n * L.supers + g];
  return L.sub_scale ? scale * static_cast<float>(L.sub_scale[n * L.groups + g]) : scale;
}

inline float block_min(const Layout& L, int64_t n, int64_t g) {
  const float min = L.super_min[n * L.supers + g];
  return L.sub_min ? min * static_cast<float>(L.sub_min[n * L.groups + g]) : min;
}

inline int32_t min_sum(const Layout& L, int64_t n, int64_t xb, int64_t span,
                       const int32_t* group_sum) {  // over x-block xb's groups
  int32_t sum = 0;
  for (int64_t g = xb * span / L.group; g < (xb + 1) * span / L.group; ++g) {
    sum += (L.sub_min ? L.sub_min[n * L.groups + g] : 1) * group_sum[g];
  }
  return sum;
}

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

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

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

template <int BITS>
float dot_vnni(const Layout& L, const Rows& R, int64_t m, int64_t n, const uint8_t* panel) {
  const int64_t K = L.K, pairs_per_x = R.span / kPair, super_span = L.group * L.per_super;
  const int8_t* xq = R.xq.data() + m * K;
  const int32_t* base = R.lane_base.data() + m * (K / 4);
  const float* d = R.d.data() + m * (K / R.span);
  const int32_t* group_sum = R.group_sum.data() + m * L.groups;
  __m512 acc = _mm512_setzero_ps();
  float tail = 0.f;
  auto pair = [&](int64_t p) {
    const __m512i q = panel ? _mm512_loadu_si512(panel + p * kPair) : codes64<BITS>(L, n, p);
    return _mm512_dpbusd_epi32(_mm512_loadu_si512(base + p * kLanes), q,
                               _mm512_loadu_si512(xq + p * kPair));
  };
  if (L.per_super == 1) {
    for (int64_t p = 0; p < K / kPair; ++p) {
      const __m512i v = pair(p);
      const float f0 = d[2 * p] * block_scale(L, n, 2 * p);
      const float f1 = d[2 * p + 1] * block_scale(L, n, 2 * p + 1);
      const __m512 f = _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(f0), _mm512_set1_ps(f1));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), f, acc);
      for (int64_t b = 2 * p; L.super_min && b < 2 * p + 2; ++b) {
        tail = std::fma(d[b] * block_min(L, n, b), static_cast<float>(group_sum[b]), tail);
      }
    }
    return hsum16(acc) + tail;
  }
  for (int64_t xb = 0; xb < K / R.span; ++xb) {
    __m512i sums = _mm512_setzero_si512();
    for (int64_t p = xb * pairs_per_x; p < (xb + 1) * pairs_per_x; ++p) {
      __m512i v = pair(p);
      if (L.sub_scale) v = _mm512_mullo_epi32(v, sub_scales(L, n, p));
      sums = _mm512_add_epi32(sums, v);
    }
    const int64_t s = xb * R.span / super_span;
    const float f = d[xb] * L.super_scale[n * L.supers + s];
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(f), acc);
    if (L.super_min) {
      const float sum = static_cast<float>(min_sum(L, n, xb, R.span, group_sum));
      tail = std::fma(d[xb] * L.super_min[n * L.supers + s], sum, tail);
    }
  }
  return hsum16(acc) + tail;
}

template <int BITS>
void run_vnni(const Layout& L, const Rows& R, float* y, int64_t M, int64_t N) {
  at::parallel_for(0, (N + kCols - 1) / kCols, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> scratch(M > kScratchRows ? L.K * kCols : 0);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n0 = block * kCols, nb = std::min<int64_t>(kCols, N - n0);
      if (M > kScratchRows) {
        for (int64_t j = 0; j < nb; ++j) {
          for (int64_t p = 0; p < L.K / kPair; ++p) {
            _mm512_storeu_si512(&scratch[j * L.K + p * kPair], codes64<BITS>(L, n0 + j, p));
          }
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t j = 0; j < nb; ++j) {
          const uint8_t* panel = scratch.empty() ? nullptr : &scratch[j * L.K];
          y[m * N + n0 + j] = dot_vnni<BITS>(L, R, m, n0 + j, panel);
        }
      }
    }
  });
}

#endif

}  // namespace

bool int8_fits(const Layout& L) {
  const int64_t span = L.group * L.per_super;
  const bool blocks = L.per_super == 1 ? L.group == 32 : span % kPair == 0;
  return L.K % kPair == 0 && blocks;
}

void run_int8(const Layout& L, const float* x, float* y, int64_t M, int64_t N, bool vnni) {
  const Rows R(L, x, M);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (vnni) {
    switch (L.bits) {
      case 4: return run_vnni<4>(L, R, y, M, N);
      case 5: return run_vnni<5>(L, R, y, M, N);
      case 6: return run_vnni<6>(L, R, y, M, N);
      default: return run_vnni<8>(L, R, y, M, N);
    }
  }
#endif
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < M; ++m) y[m * N + n] = dot_generic(L, R, m, n);
    }
  });
}

}  // namespace group_quant
