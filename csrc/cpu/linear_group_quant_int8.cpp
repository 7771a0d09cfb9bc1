// Group-quantized linear with int8 activations and integer dot products (the "int8" kernel of
// linear_group_quant): decoding over the fp32 path is bound by dequantizing, so here the
// weights' integer codes meet int8 activations in integer multiply-adds, as llama.cpp's
// Q4_K x Q8_K does.
//
// Row m of x is quantized per x-block (32 weights where per_super is 1, else the super-block
// of group * per_super weights, cut to 256 as llama.cpp's Q8_K): d = max |x| / 127,
// xq = round(x * (1 / d)), in [-127, 127]. Codes u are unsigned (q; 8-bit: the int8 code +
// 128) and Z the layout's zero (8-bit: zero + 128). Per output column n and pair p of
// 32-blocks (64 weights, in k order), 16 int32 lanes of 4 consecutive weights each:
//   per_super 1:   v[l] = sum of u * xq over the lane's 4 weights - Z * sum of their xq (exact)
//                  acc[l] = fma(float(v[l]), d(block) * scale(block), acc[l])
//                  tail = fma(d(block) * min(block), float(the block's xq sum), tail)
//   no group scales (AWQ, GPTQ; per_super > 1):
//                  I[l] = sum over the x-block's pairs of v[l]                     (exact)
//                  acc[l] = fma(float(I[l]), d * super_scale, acc[l])
//                  tail = fma(d * super_min, float(sum over its groups of sub_min * xq sum), tail)
//   k-quants (Q2_K to Q6_K; `kquant`): x-blocks of 256, G = 8 or 16 groups, sc the group
//   scales, s the groups' xq sums:
//                  I[l] = sum over the pairs of sc(l's group) * (sum of u * xq over its 4)
//                  I[j] -= Z * (sc[2j] * s[2j] + sc[2j + 1] * s[2j + 1])   for j < G / 2
//                  acc[l] = fma(float(I[l]), d * super_scale, acc[l])
//                  mins: acc[l] = fma(float(mn[l]), d * super_min, acc[l]) for every lane,
//                  mn[j] = sub_min[2j] * s[2j] + sub_min[2j + 1] * s[2j + 1] for j < G / 2, else 0
//   y[m, n] = hsum16(acc) + tail
// Every step depends on row m alone, in one order: batch-invariant, and the AVX512-VNNI path
// and the generic one (scalar code doing the same integer and float operations lane by lane)
// give the same bits. |v| <= 2 * 4 * 255 * 127 and |sub_scale| <= 128: I, over the 4 pairs of
// an x-block at most, fits int32 many times over; a k-quant's u * xq pairs fit int16 (u < 64),
// as the vector path's vpmaddubsw needs. This file: the rows' quantization, the generic path,
// the dispatch; linear_group_quant_int8_vnni.cpp: the AVX512-VNNI path, which runs these same
// steps for a tile of rows times columns at once.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "group_quant_avx2.h"
#include "group_quant_int8.h"

namespace group_quant {

namespace {

// The rows' quantization, vectorized where AVX-512 (else AVX2) is built in: each step is the
// scalar one lane by lane (a max, one product, the current rounding mode's round half to even,
// exact integer sums), so both give the same codes.

// max |x| of n floats (n: a multiple of 16)
float abs_max(const float* x, int64_t n) {
#ifdef __AVX512F__
  __m512 lanes = _mm512_setzero_ps();
  for (int64_t k = 0; k < n; k += kLanes) {
    lanes = _mm512_max_ps(lanes, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  }
  return _mm512_reduce_max_ps(lanes);
#elif defined(GROUP_QUANT_AVX2)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 lanes = _mm256_setzero_ps();
  for (int64_t k = 0; k < n; k += 8) {
    lanes = _mm256_max_ps(lanes, _mm256_and_ps(_mm256_loadu_ps(x + k), magnitude));
  }
  float m[8];
  _mm256_storeu_ps(m, lanes);
  return *std::max_element(m, m + 8);
#else
  float lanes[kLanes] = {};
  for (int64_t k = 0; k < n; k += kLanes) {
    for (int l = 0; l < kLanes; ++l) lanes[l] = std::max(lanes[l], std::fabs(x[k + l]));
  }
  return *std::max_element(lanes, lanes + kLanes);
#endif
}

// out = round(x * inverse) for n floats (n: a multiple of 16)
void round_block(const float* x, int64_t n, float inverse, int8_t* out) {
#ifdef __AVX512F__
  const __m512 v = _mm512_set1_ps(inverse);
  for (int64_t k = 0; k < n; k += kLanes) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + k), v));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtepi32_epi8(q));
  }
#elif defined(GROUP_QUANT_AVX2)
  const __m256 v = _mm256_set1_ps(inverse);
  for (int64_t k = 0; k < n; k += 8) {  // |q| <= 127: the saturating packs are exact
    const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), v));
    const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + k), _mm_packs_epi16(q16, q16));
  }
#else
  for (int64_t k = 0; k < n; ++k) out[k] = static_cast<int8_t>(std::nearbyint(x[k] * inverse));
#endif
}

// sums[l] = the sum of xq[4 l .. 4 l + 3] for l < K / 4
void quad_sums(const int8_t* xq, int64_t K, int32_t* sums) {
  int64_t k = 0;
#ifdef __AVX512BW__
  const __m512i ones8 = _mm512_set1_epi8(1), ones16 = _mm512_set1_epi16(1);
  for (; k + 64 <= K; k += 64) {
    const __m512i pairs = _mm512_maddubs_epi16(ones8, _mm512_loadu_si512(xq + k));
    _mm512_storeu_si512(sums + k / 4, _mm512_madd_epi16(pairs, ones16));
  }
#elif defined(GROUP_QUANT_AVX2)
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (; k + 32 <= K; k += 32) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + k));
    const __m256i pairs = _mm256_maddubs_epi16(ones8, bytes);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + k / 4), _mm256_madd_epi16(pairs, ones16));
  }
#endif
  for (; k < K; k += 4) sums[k / 4] = xq[k] + xq[k + 1] + xq[k + 2] + xq[k + 3];
}

}  // namespace

Rows::Rows(const Layout& L, const float* x, int64_t M)
    : K(L.K),
      span(L.per_super == 1 ? 32 : std::min<int64_t>(L.group * L.per_super, kSuper)),
      groups(L.groups),
      xq(M * L.K),
      lane_base(M * L.K / 4),
      d(M * (L.K / span)),
      group_sum(M * L.groups) {
  const int32_t z = static_cast<int32_t>(L.zero + (L.bits == 8 ? 128 : 0));
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) quantize(x + m * K, m, z, L.group);
  });
}

void Rows::quantize(const float* xr, int64_t m, int32_t z, int64_t group) {
  int8_t* out = xq.data() + m * K;
  for (int64_t b = 0; b < K / span; ++b) {
    const float amax = abs_max(xr + b * span, span);
    const float scale = amax / 127.f, inverse = scale > 0.f ? 1.f / scale : 0.f;
    d[m * (K / span) + b] = scale;
    round_block(xr + b * span, span, inverse, out + b * span);
  }
  int32_t* quads = lane_base.data() + m * (K / 4);
  quad_sums(out, K, quads);
  for (int64_t g = 0; g < groups; ++g) {
    int32_t sum = 0;
    for (int64_t l = g * group / 4; l < (g + 1) * group / 4; ++l) sum += quads[l];
    group_sum[m * groups + g] = static_cast<int16_t>(sum);
  }
  for (int64_t l = 0; l < K / 4; ++l) quads[l] *= -z;
}

namespace {

// pair p of row n's codes as unsigned bytes, in k order (the generic path)
void codes_generic(const Layout& L, int64_t n, int64_t p, uint8_t* u) {
  for (int i = 0; i < kPair; ++i) {
    const int64_t b = 2 * p + i / 32, w = i % 32;  // weight w of block b
    if (L.bits == 8) {
      u[i] = static_cast<uint8_t>(L.codes[n * L.K + b * 32 + w] + 128);
      continue;
    }
    const uint8_t byte = L.low[n * (L.K / 2) + b * 16 + w % 16];
    int32_t q = w < 16 ? byte & 0x0F : byte >> 4;
    for (int64_t pl = 0; pl < L.planes; ++pl) {
      uint32_t word;
      std::memcpy(&word, L.high + (n * L.planes + pl) * (L.K / 8) + b * 4, sizeof(word));
      q |= static_cast<int32_t>((word >> w) & 1) << (4 + pl);
    }
    u[i] = static_cast<uint8_t>(q);
  }
}

// the k-quant path (kquant(L)): x-blocks of 256 weights, one per super-block
float dot_kquant(const Layout& L, const Rows& R, int64_t m, int64_t n) {
  const int64_t K = L.K, per_x = kSuper / L.group;  // groups per x-block
  const int8_t* xq = R.xq.data() + m * K;
  const float* d = R.d.data() + m * (K / kSuper);
  const int16_t* gs = R.group_sum.data() + m * L.groups;
  const int32_t z = static_cast<int32_t>(L.zero);
  float acc[kLanes] = {};
  for (int64_t xb = 0; xb < K / kSuper; ++xb) {
    const int8_t* sc = L.sub_scale + n * L.groups + xb * per_x;
    const int16_t* s = gs + xb * per_x;
    int32_t sums[kLanes] = {};
    for (int64_t j = 0; j < kSuper / kPair; ++j) {
      const int64_t p = xb * (kSuper / kPair) + j;
      uint8_t u[kPair];
      codes_generic(L, n, p, u);
      for (int l = 0; l < kLanes; ++l) {
        int32_t dot = 0;
        for (int i = 0; i < 4; ++i) dot += u[4 * l + i] * xq[p * kPair + 4 * l + i];
        const int64_t g = j * (kPair / L.group) + 4 * l / L.group;  // l's group in the x-block
        sums[l] += sc[g] * dot;
      }
    }
    for (int64_t j = 0; z && j < per_x / 2; ++j) {
      sums[j] -= z * (sc[2 * j] * s[2 * j] + sc[2 * j + 1] * s[2 * j + 1]);
    }
    const int64_t sup = n * L.supers + xb;
    const float f = d[xb] * L.super_scale[sup];
    for (int l = 0; l < kLanes; ++l) acc[l] = std::fma(static_cast<float>(sums[l]), f, acc[l]);
    if (!L.super_min) continue;
    int32_t mins[kLanes] = {};
    const int8_t* sm = L.sub_min + n * L.groups + xb * per_x;
    for (int64_t j = 0; j < per_x / 2; ++j) {
      mins[j] = sm[2 * j] * s[2 * j] + sm[2 * j + 1] * s[2 * j + 1];
    }
    const float fm = d[xb] * L.super_min[sup];
    for (int l = 0; l < kLanes; ++l) acc[l] = std::fma(static_cast<float>(mins[l]), fm, acc[l]);
  }
  return hsum16_generic(acc);
}

float dot_generic(const Layout& L, const Rows& R, int64_t m, int64_t n) {
  if (kquant(L)) return dot_kquant(L, R, m, n);
  const int64_t K = L.K, pairs_per_x = R.span / kPair, super_span = L.group * L.per_super;
  const int8_t* xq = R.xq.data() + m * K;
  const int32_t* base = R.lane_base.data() + m * (K / 4);
  const float* d = R.d.data() + m * (K / R.span);
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
        acc[l] = std::fma(static_cast<float>(v[l]), f[l / 8], acc[l]);
      }
      for (int64_t b = 2 * p; L.super_min && b < 2 * p + 2; ++b) {
        tail = block_tail(L, R, m, n, b, tail);
      }
      continue;
    }
    for (int l = 0; l < kLanes; ++l) sums[l] += v[l];
    if ((p + 1) % pairs_per_x) continue;
    const int64_t xb = p / pairs_per_x, s = xb * R.span / super_span;
    const float f = d[xb] * L.super_scale[n * L.supers + s];
    for (int l = 0; l < kLanes; ++l) {
      acc[l] = std::fma(static_cast<float>(sums[l]), f, acc[l]);
      sums[l] = 0;
    }
    if (L.super_min) tail = super_tail(L, R, m, n, xb, tail);
  }
  return hsum16_generic(acc) + tail;
}

}  // namespace

bool int8_fits(const Layout& L) {
  if (L.fp8) return false;  // FP8 values are no integer codes
  const int64_t span = L.group * L.per_super;
  const bool blocks = L.per_super == 1 ? L.group == 32 : span % kPair == 0;
  return L.K % kPair == 0 && blocks && (!L.sub_scale || L.per_super == 1 || kquant(L));
}

void run_int8(const Layout& L, const float* x, float* y, int64_t M, int64_t N, Int8Path path) {
  Rows R(L, x, M);
  if (path == Int8Path::kAmx || path == Int8Path::kPanels) {
    const bool tiles = path == Int8Path::kAmx;
    return kquant(L) ? run_kquant_panels(L, R, y, M, N, tiles)
                     : run_block_panels(L, R, y, M, N, tiles);
  }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  if (path == Int8Path::kVnni) return run_vnni(L, R, y, M, N);
#endif
#ifdef GROUP_QUANT_AVX2
  if (path == Int8Path::kAvx2) return run_int8_avx2(L, R, y, M, N);
#endif
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t m = 0; m < M; ++m) y[m * N + n] = dot_generic(L, R, m, n);
    }
  });
}

}  // namespace group_quant
