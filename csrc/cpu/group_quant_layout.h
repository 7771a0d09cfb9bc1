// The group-quantized layout as the kernels read it (linear_group_quant.cpp: fp32
// activations; linear_group_quant_int8.cpp: int8 activations), and the lane sums both take.
// shared/models/gguf_quant.py describes the layout; linear_group_quant.cpp the arithmetic.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace group_quant {

constexpr int64_t kLanes = 16;

// An FP8 E4M3 (fn) code's value, exactly: sign, 4 exponent bits (bias 7), 3 mantissa bits;
// exponent 0: subnormal (m / 8 * 2^-6). NaN codes (0x7F, 0xFF) are refused at load.
inline float fp8_e4m3(uint8_t b) {
  const int e = (b >> 3) & 0xF, m = b & 7;
  const float v = e ? std::ldexp(1.f + m / 8.f, e - 7) : std::ldexp(m / 8.f, -6);
  return b & 0x80 ? -v : v;
}

#ifdef __AVX512F__
// 16 FP8 E4M3 codes' values times 2^-8, exactly: each code's bits moved into an fp16's (sign to
// bit 15, exponent and mantissa up by 7), whose bias is 8 more; a subnormal code lands on an
// fp16 subnormal, which the conversion to fp32 takes exactly whatever MXCSR's DAZ says
[[gnu::always_inline]] inline __m512 fp8x16_scaled(__m128i bytes) {
  const __m256i half = _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(bytes), 7),
                                        _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
  return _mm512_cvtph_ps(half);
}
#endif

// What fp8x16_scaled's values are multiplied by: a scale times this is exact (a power of 2)
constexpr float kFp8Unscale = 0x1p8f;

struct Layout {
  const int8_t* codes;  // 8-bit: int8 codes, or FP8 E4M3 ones (fp8)
  const uint8_t* low;
  const uint8_t* high;
  const float* super_scale;
  const int8_t* sub_scale;  // nullptr: 1
  const float* super_min;   // nullptr: 0
  const int8_t* sub_min;    // nullptr: 1
  int64_t K, bits, group, per_super, zero, planes, supers, groups;
  bool fp8;  // codes are FP8 E4M3 values (w = value * scale), not integers
  int super_shift;  // log2(per_super): no division per group (per_super is a power of 2)

  // scale and offset (min - zero * scale) of row n's group g
  [[gnu::always_inline]] void factors(int64_t n, int64_t g, float& scale, float& offset) const {
    const int64_t s = n * supers + (g >> super_shift);
    scale = super_scale[s];
    if (sub_scale) scale *= static_cast<float>(sub_scale[n * groups + g]);
    float min = 0.f;
    if (super_min) {
      min = super_min[s];
      if (sub_min) min *= static_cast<float>(sub_min[n * groups + g]);
    }
    offset = min - static_cast<float>(zero) * scale;  // exact (see the top)
  }

  // Row n's factors of every group g, as factors() gives them (the same operations, so the
  // same bits): f[g] its scale, f[groups + g] its offset (factor_floats() floats); the
  // vector paths work them out ahead of the loop that dequantizes the row, in passes the
  // compiler vectorizes, not as scalar work per 32 weights beside the vector work
  int64_t factor_floats() const { return 2 * groups; }  // row_factors' floats a row
  void row_factors(int64_t n, float* f) const {
    const int64_t G = groups, shift = super_shift;
    float* scale = f;
    float* offset = f + G;  // the min first
    const float* ss = super_scale + n * supers;
    const float* sm = super_min ? super_min + n * supers : nullptr;
    for (int64_t g = 0; g < G; ++g) {
      scale[g] = ss[g >> shift];
      offset[g] = sm ? sm[g >> shift] : 0.f;
    }
    if (sub_scale) {
      const int8_t* sub = sub_scale + n * G;
      for (int64_t g = 0; g < G; ++g) scale[g] *= static_cast<float>(sub[g]);
    }
    if (sm && sub_min) {
      const int8_t* sub = sub_min + n * G;
      for (int64_t g = 0; g < G; ++g) offset[g] *= static_cast<float>(sub[g]);
    }
    const float z = static_cast<float>(zero);
    for (int64_t g = 0; g < G; ++g) offset[g] = offset[g] - z * scale[g];  // exact (factors)
  }

  // block b's (32 weights) groups in row_factors' arrays: weights 0-15 take g0, 16-31 g1
  // (group 16: groups 2 b and 2 b + 1; group 32: both group b)
  [[gnu::always_inline]] void block_groups(int64_t b, int64_t& g0, int64_t& g1) const {
    g0 = group == 32 ? b : 2 * b;
    g1 = group == 32 ? b : 2 * b + 1;
  }

  uint16_t plane_bits(int64_t n, int64_t p, int64_t c) const {
    uint16_t bits16;
    std::memcpy(&bits16, high + (n * planes + p) * (K / 8) + c * 2, sizeof(bits16));
    return bits16;
  }

  // row n's code at k of a 4-6 bit layout (the panel repacks read the stored layout by it)
  uint32_t code(int64_t n, int64_t k) const {
    const uint8_t byte = low[n * (K / 2) + k / 32 * 16 + k % 16];
    uint32_t u = k % 32 < 16 ? byte & 0x0F : byte >> 4;
    for (int64_t pl = 0; pl < planes; ++pl) {
      u |= ((high[(n * planes + pl) * (K / 8) + k / 8] >> (k % 8)) & 1u) << (4 + pl);
    }
    return u;
  }

  // weights 16 c .. 16 c + 15 of row n, scalar (the generic path)
  void dequant16(int64_t n, int64_t c, float* w) const {
    float scale, min;
    factors(n, c * kLanes / group, scale, min);  // the generic path's, not the fast one
    float q[kLanes];
    if (bits == 8) {
      const int8_t* from = codes + n * K + c * kLanes;
      for (int l = 0; l < kLanes; ++l) {
        q[l] = fp8 ? fp8_e4m3(static_cast<uint8_t>(from[l])) : static_cast<float>(from[l]);
      }
    } else {
      int32_t u[kLanes];
      const uint8_t* bytes = low + n * (K / 2) + (c / 2) * kLanes;
      for (int l = 0; l < kLanes; ++l) u[l] = c % 2 ? bytes[l] >> 4 : bytes[l] & 0x0F;
      for (int64_t p = 0; p < planes; ++p) {
        const uint16_t b = plane_bits(n, p, c);
        for (int l = 0; l < kLanes; ++l) u[l] |= ((b >> l) & 1) << (4 + p);
      }
      for (int l = 0; l < kLanes; ++l) q[l] = static_cast<float>(u[l]);
    }
    for (int l = 0; l < kLanes; ++l) w[l] = std::fma(q[l], scale, min);
  }
};

// The lanes' sum, in the tree hsum16 (AVX-512) takes: halves, quarters, pairs, the last two.
inline float hsum16_generic(const float* a) {
  float s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; ++i) s8[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  for (int i = 0; i < 2; ++i) s2[i] = s4[i] + s4[i + 2];
  return s2[0] + s2[1];
}

#ifdef __AVX512F__
inline float hsum16(__m512 a) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#endif

// linear_group_quant_int8.cpp: whether a layout takes the int8-activation path (K in whole
// pairs of 32-blocks, and super-blocks of whole pairs or single 32-groups), and that path:
// y [M, N] from x [M, K] fp32 by one of its paths: the generic model, AVX512-VNNI or AVX2
// (where built, else the generic one), AMX tiles over the panels (k-quants, one-group formats),
// or AVX512-VNNI alone over the same panels (int8-amx's bits)
enum class Int8Path { kGeneric, kVnni, kAvx2, kAmx, kPanels };
bool int8_fits(const Layout& L);
void run_int8(const Layout& L, const float* x, float* y, int64_t M, int64_t N, Int8Path path);

}  // namespace group_quant
