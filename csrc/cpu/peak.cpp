// The arithmetic peak of one core, measured: a loop of independent multiply-adds that never
// touches memory, for the fp32 FMA (vfmadd231ps: 16 lanes, or 8 in an AVX2 build), bf16 pair
// dot product (vdpbf16ps), int8 quad dot product (vpdpbusd), the k-quants' int8 pair
// (vpmaddubsw then vpmaddwd: `int8_kquant`) and AMX bf16 and int8 tile
// products (tdpbf16ps, tdpbusd) the linear kernels are built on. `splitserve bench linear` states each kernel's
// speed as a fraction of it.
#include <immintrin.h>

#include <time.h>

#include "amx_tiles.h"
#include "ops.h"
#include "vec_math_avx2.h"

namespace {

constexpr int kChains = 12;  // independent accumulators: more than latency x throughput

double thread_seconds() {  // this thread's CPU time: other load on the machine does not count
  timespec now;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &now);
  return now.tv_sec + now.tv_nsec * 1e-9;
}

inline float lane_sum(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float sum = 0.f;
  for (float lane : lanes) sum += lane;
  return sum;
}

#ifdef __AVX512F__
inline float lane_sum(__m512 v) { return _mm512_reduce_add_ps(v); }
#endif

// Vec: the vector type the instruction works on (__m512, or __m256 on AVX2).
template <typename Vec, typename Step>
double giga_ops_per_second(int64_t iterations, double ops_per_instruction, Vec start_value,
                           Step step) {
  Vec acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = start_value;
  const double start = thread_seconds();
  for (int64_t n = 0; n < iterations; ++n) {
#pragma GCC unroll 12
    for (int i = 0; i < kChains; ++i) acc[i] = step(acc[i]);
  }
  const double took = thread_seconds() - start;
  float sink = 0.f;  // keeps the chains alive
  for (int i = 0; i < kChains; ++i) sink += lane_sum(acc[i]);
  volatile float keep = sink;
  (void)keep;
  return iterations * kChains * ops_per_instruction / took / 1e9;
}

#ifdef SPLITSERVE_AMX
template <typename Kind>
double amx_giga_ops_per_second(int64_t iterations) {
  const double start = thread_seconds();
  amx::dot_loop<Kind>(iterations);
  return iterations * 2.0 * amx::kLoopMultiplyAdds<Kind> / (thread_seconds() - start) / 1e9;
}
#endif

}  // namespace

double core_peak_gops(const std::string& numerics, int64_t iterations) {
#ifdef SPLITSERVE_AMX
  if (numerics == "amx_bf16") return amx_giga_ops_per_second<amx::Bf16>(iterations);
  if (numerics == "amx_int8") return amx_giga_ops_per_second<amx::Int8>(iterations);
#endif
#ifdef __AVX512F__
  const __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f), c0 = _mm512_set1_ps(1e-3f);
  if (numerics == "fp32") {
    return giga_ops_per_second(iterations, 32, c0,
                               [&](__m512 c) { return _mm512_fmadd_ps(a, b, c); });
  }
#ifdef __AVX512BF16__
  if (numerics == "bf16") {
    const __m512bh x = _mm512_cvtne2ps_pbh(a, b);
    return giga_ops_per_second(iterations, 64, c0,
                               [&](__m512 c) { return _mm512_dpbf16_ps(c, x, x); });
  }
#endif
#ifdef __AVX512VNNI__
  if (numerics == "int8") {
    const __m512i u = _mm512_set1_epi8(3), s = _mm512_set1_epi8(-2);
    return giga_ops_per_second(iterations, 128, c0, [&](__m512 c) {
      return _mm512_castsi512_ps(_mm512_dpbusd_epi32(_mm512_castps_si512(c), u, s));
    });
  }
  if (numerics == "int8_kquant") {  // the k-quant tile's step: codes x xq in int16 pairs,
    // then by the groups' scales into int32 (linear_group_quant_int8_vnni.cpp); the chain's
    // own value feeds the next step's codes, so nothing leaves the loop
    const __m512i s = _mm512_set1_epi8(-2), scales = _mm512_set1_epi16(3);
    return giga_ops_per_second(iterations, 128, c0, [&](__m512 c) {
      const __m512i codes = _mm512_castps_si512(c);
      const __m512i pairs = _mm512_madd_epi16(_mm512_maddubs_epi16(codes, s), scales);
      return _mm512_castsi512_ps(_mm512_add_epi32(codes, pairs));
    });
  }
#endif
#elif defined(SPLITSERVE_AVX2)
  if (numerics == "fp32") {  // the instruction linear.cpp's AVX2 tiles are built on
    const __m256 a = _mm256_set1_ps(1.0001f), b = _mm256_set1_ps(0.9999f);
    return giga_ops_per_second(iterations, 16, _mm256_set1_ps(1e-3f),
                               [&](__m256 c) { return _mm256_fmadd_ps(a, b, c); });
  }
#endif
  TORCH_CHECK(false, "no ", numerics, " multiply-add instruction in this build");
}
