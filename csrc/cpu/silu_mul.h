// SiLU(gate) * up over one row, shared by the element-wise op (fused_ops.cpp's silu_mul) and
// the gate_up matmul that applies it to its own output (linear.cpp's linear_silu_mul), so
// that both give the same bits.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>

#include "linear_tiles.h"
#include "vec_math.h"
#include "vec_math_avx2.h"

// One row: SiLU rounded to T, then the product with up, as torch. With AVX-512 (fp32, bf16)
// every element takes the 16-lane code (a masked last vector); with AVX2, fp32 rows take 8
// lanes at a time and their tail the scalar loop, which computes the same bits; else the
// scalar loop.
template <typename T>
void silu_mul_row(T* out, const T* gate, const T* up, int64_t n) {
#ifdef __AVX512F__
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    using namespace vec_math;
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = lanes_below(n - i);
      const __m512 g = load16(gate + i, m);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 act = round_to(out, _mm512_div_ps(g, _mm512_add_ps(one, e)));
      store16(out + i, _mm512_mul_ps(act, load16(up + i, m)), m);
    }
    return;
  }
#elif defined(SPLITSERVE_AVX2)
  if constexpr (std::is_same_v<T, float>) {  // the engine's activations: fp32
    using namespace vec_math;
    const __m256 one = _mm256_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
      const __m256 act = _mm256_div_ps(g, _mm256_add_ps(one, e));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(act, _mm256_loadu_ps(up + i)));
    }
    gate += i, up += i, out += i, n -= i;  // the tail: the scalar loop, the same operations
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    const T act = static_cast<T>(vec_math::silu(static_cast<float>(gate[i])));
    out[i] = static_cast<T>(static_cast<float>(act) * static_cast<float>(up[i]));
  }
}

// linear_tiles' epilogue for a gate_up matrix packed as pairs of panels (64 columns of gate,
// then the same 64 of up): once rows [m0, m1) of pair u are summed, out gets their
// silu(gate) * up, as silu_mul would give from the plain product; a bf16 out gets those fp32
// values rounded once (to nearest even, as torch's conversion), for a bf16 matmul next.
template <typename O>
struct SiluMulPanels {
  static constexpr int64_t kUnitVectors = 2 * linear_tiles::kPanelVectors;
  const float* y;  // [M, 2 * inter]: the product, panel pairs in order
  O* out;          // [M, inter]
  int64_t inter;

  void operator()(int64_t m0, int64_t m1, int64_t u) const {
    constexpr int64_t panel = linear_tiles::kPanel;
    for (int64_t m = m0; m < m1; ++m) {
      const float* gate = y + m * 2 * inter + u * 2 * panel;
      O* row = out + m * inter + u * panel;
      if constexpr (std::is_same_v<O, float>) {
        silu_mul_row(row, gate, gate + panel, panel);
      } else {
        float product[panel];
        silu_mul_row(product, gate, gate + panel, panel);
        for (int64_t j = 0; j < panel; ++j) row[j] = static_cast<O>(product[j]);
      }
    }
  }
};
