// The k-quants' int8-activation linear on a column-interleaved layout (Q4_K, Q6_K): panels of
// 16 output columns, so that one 512-bit register holds one thing of each of 16 columns.
//
// Layout (panels_repack.cpp, a permutation of the same bytes): panel P holds columns 16 P ..
// 16 P + w - 1 (w = 16 but in a last, narrower panel). Per 32-block b, low: 8 chunks q of 2 w
// bytes, byte 2 c + e holding column c's weight 4 q + e (low nibble) and 4 q + 2 + e (high);
// 6-bit codes' high 2 bits in 4 chunks h of 2 w bytes, byte 2 c + e holding, in 2-bit fields
// from the bottom, weights 4 h + e, 4 h + 2 + e, 4 (h + 4) + e, 4 (h + 4) + 2 + e. sub_scale,
// sub_min: [panel][group][w]; super_scale, super_min: [panel][super-block][w].
//
// Kernel: per panel and x-block of 256, the codes are unpacked once for every row of the call
// into int16 already times their group scale (sc * u fits int16), 32 lanes = (column, one of
// two consecutive weights); per row, vpdpwssd with that row's two int16 xq broadcast adds two
// weights' sc * u * xq into 16 int32 lanes, one per column. One row: unpacked in registers.
//
// The one subtle rule: the generic path (linear_group_quant_int8.cpp, dot_kquant) keeps, per
// output, 16 float lanes l, lane l taking weights 4 l .. 4 l + 3 of every pair of 32-blocks,
// and its zero's and mins' terms on the first lanes only. So here every output keeps those 16
// lanes too, as 16 registers (one per l, lane c: column c): the same exact int32 per lane and
// x-block, the same float fma per lane in the same order, the same tree over the lanes at the
// end. Which rows or columns share a call changes nothing: batch-invariant, the generic bits.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "group_quant.h"
#include "group_quant_int8.h"

namespace group_quant {
namespace {

constexpr int64_t kChunk = 16;  // rows whose float lanes stay in the cache together
constexpr int kTileRows = 8;  // rows per register tile
constexpr int64_t kXCodes = kSuper * kPanel;  // int16 codes of a panel's x-block

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

struct Packed {
  const uint8_t* low;
  const uint8_t* high;
  const float* super_scale;
  const int8_t* sub_scale;
  const float* super_min;
  const int8_t* sub_min;  // nullptr: 1
  int64_t K, N, group, zero, groups, supers;
};

// two int8 column vectors [w] as int16 pairs (a, b) per int32 lane; absent: (1, 1)
[[gnu::always_inline]] inline __m512i pairs(const int8_t* a, const int8_t* b, __mmask16 cols) {
  if (!a) return _mm512_set1_epi32(0x00010001);
  const __m512i lo = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(cols, a));
  const __m512i hi = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(cols, b));
  const __m512i low16 = _mm512_and_si512(lo, _mm512_set1_epi32(0xFFFF));
  return _mm512_or_si512(low16, _mm512_slli_epi32(hi, 16));
}

[[gnu::always_inline]] inline __m512i bcast_pair(const int16_t* at) {
  int32_t v;
  std::memcpy(&v, at, sizeof(v));
  return _mm512_set1_epi32(v);
}

// chunk q of 32-block `block` of panel p (w columns): weights 4 q + e (u0) and 4 q + 2 + e
// (u1) of each column c in int16 lane 2 c + e
template <int BITS>
[[gnu::always_inline]] inline void chunk(const Packed& W, int64_t p, int64_t w, int64_t block,
                                         int64_t q, __m512i& u0, __m512i& u1) {
  const __mmask32 bytes = static_cast<__mmask32>((1ull << (2 * w)) - 1);
  const uint8_t* low = W.low + p * kPanel * (W.K / 2) + block * 16 * w + 2 * w * q;
  const __m512i u = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(bytes, low));
  u0 = _mm512_and_si512(u, _mm512_set1_epi16(0x0F)), u1 = _mm512_srli_epi16(u, 4);
  if constexpr (BITS == 6) {
    const __m512i top = _mm512_set1_epi16(0x30);
    const uint8_t* high = W.high + p * kPanel * (W.K / 4) + block * 8 * w + 2 * w * (q % 4);
    const __m512i h = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(bytes, high));
    const __m512i h0 = q < 4 ? _mm512_slli_epi16(h, 4) : h;
    const __m512i h1 = q < 4 ? _mm512_slli_epi16(h, 2) : _mm512_srli_epi16(h, 2);
    u0 = _mm512_or_si512(u0, _mm512_and_si512(h0, top));
    u1 = _mm512_or_si512(u1, _mm512_and_si512(h1, top));
  }
}

// the group scale of chunk q of `block`, in both int16 lanes of each column
[[gnu::always_inline]] inline __m512i chunk_scale(const Packed& W, int64_t p, int64_t w,
                                                  int64_t block, int64_t q) {
  const int8_t* s = W.sub_scale + p * kPanel * W.groups + (block * 32 + 4 * q) / W.group * w;
  return pairs(s, s, static_cast<__mmask16>((1u << w) - 1));
}

// x-block xb of panel p as int16 sc * u: [8 blocks][16 t][32], t = 2 q (+ 1: weights + 2)
template <int BITS>
void unpack(const Packed& W, int64_t p, int64_t w, int64_t xb, int16_t* out) {
  for (int64_t b = 0; b < kSuper / 32; ++b) {
    const int64_t block = xb * (kSuper / 32) + b;
    __m512i scale = _mm512_setzero_si512(), u0, u1;
    for (int64_t q = 0; q < 8; ++q) {
      if (q % (W.group / 4) == 0) scale = chunk_scale(W, p, w, block, q);  // a new group
      chunk<BITS>(W, p, w, block, q, u0, u1);
      int16_t* t = out + (b * 16 + 2 * q) * 32;
      _mm512_storeu_si512(t, _mm512_mullo_epi16(u0, scale));
      _mm512_storeu_si512(t + 32, _mm512_mullo_epi16(u1, scale));
    }
  }
}

// rows r0 .. r0 + MR - 1 of the call at x-block xb of panel p: their factors, and the integer
// lane sums' float steps into acc ([row][l][16], row 0 the chunk's first), as dot_kquant's
template <int MR>
struct XBlock {
  const Packed& W;
  const int16_t* gs;  // row r0's group xq sums of the x-block
  const int8_t *sc, *mn;
  int64_t w;
  __mmask16 cols;
  __m512 f[MR], fm[MR];
  bool all_mins;  // the mins' fma on every lane (else lanes 0-3)

  XBlock(const Packed& W, const Rows& R, int64_t p, int64_t w, int64_t xb, int64_t r0)
      : W(W), w(w) {
    cols = static_cast<__mmask16>((1u << w) - 1);
    const int64_t per_x = kSuper / W.group, sup = p * kPanel * W.supers + xb * w;
    const __m512 ss = _mm512_maskz_loadu_ps(cols, W.super_scale + sup);
    const __m512 sm = W.super_min ? _mm512_maskz_loadu_ps(cols, W.super_min + sup) : ss;
    sc = W.sub_scale + p * kPanel * W.groups + xb * per_x * w;
    mn = W.sub_min ? W.sub_min + p * kPanel * W.groups + xb * per_x * w : nullptr;
    gs = R.group_sum.data() + r0 * W.groups + xb * per_x;
    // past lane 3 the mins' fma adds 0 * fm: v itself where fm is finite (v is never -0: the
    // lanes start at +0, and an fma onto +0 or a nonzero gives -0 only from -0 + -0)
    __mmask16 finite = cols;
    for (int r = 0; r < MR; ++r) {
      const __m512 d = _mm512_set1_ps(R.d[(r0 + r) * (W.K / kSuper) + xb]);
      f[r] = _mm512_mul_ps(d, ss), fm[r] = _mm512_mul_ps(d, sm);
      finite &= _mm512_cmp_ps_mask(_mm512_abs_ps(fm[r]), _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
    }
    all_mins = W.super_min && finite != cols;
  }

  // row r's lane l: I[l] -= Z * (sc[2l] * s[2l] + sc[2l + 1] * s[2l + 1]) for l < groups / 2
  [[gnu::always_inline]] void zero_term(int l, __m512i (&sum)[MR]) const {
    if (!W.zero || l >= kSuper / W.group / 2) return;
    const __m512i z = _mm512_mullo_epi16(pairs(sc + 2 * l * w, sc + (2 * l + 1) * w, cols),
                                         _mm512_set1_epi16(static_cast<int16_t>(-W.zero)));
    for (int r = 0; r < MR; ++r) {
      sum[r] = _mm512_dpwssd_epi32(sum[r], z, bcast_pair(gs + r * W.groups + 2 * l));
    }
  }

  // acc lane l += float(I) * f, then the mins' term (dot_kquant: for every lane, 0 past 3)
  [[gnu::always_inline]] void step(int l, const __m512i (&sum)[MR], float* acc) const {
    __m512i mp = _mm512_setzero_si512();
    if (W.super_min && l < 4) {
      mp = mn ? pairs(mn + 2 * l * w, mn + (2 * l + 1) * w, cols) : pairs(nullptr, nullptr, cols);
    }
    for (int r = 0; r < MR; ++r) {
      float* a = acc + (r * kLanes + l) * kPanel;
      __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]), f[r], _mm512_loadu_ps(a));
      if (W.super_min && (l < 4 || all_mins)) {
        const __m512i m = l < 4 ? _mm512_dpwssd_epi32(_mm512_setzero_si512(), mp,
                                                      bcast_pair(gs + r * W.groups + 2 * l))
                                : mp;
        v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m), fm[r], v);
      }
      _mm512_storeu_ps(a, v);
    }
  }
};

// rows r0 .. r0 + MR - 1, x-block xb, from the unpacked codes: per lane two chains per row
// (the even and the odd pairs of 32-blocks; their int32 sum is exact)
template <int MR>
void rows_xblock(const Packed& W, const Rows& R, const int16_t* xq16, const int16_t* codes,
                 int64_t p, int64_t w, int64_t xb, int64_t r0, float* acc) {
  const XBlock<MR> X(W, R, p, w, xb, r0);
  for (int l = 0; l < kLanes; ++l) {
    __m512i sum[MR], odd[MR];
    for (int r = 0; r < MR; ++r) sum[r] = odd[r] = _mm512_setzero_si512();
    X.zero_term(l, sum);
    const int64_t q = l % 8;
#pragma GCC unroll 4
    for (int64_t j = 0; j < kSuper / kPair; ++j) {  // the pairs of 32-blocks
      const int64_t b = 2 * j + l / 8;
      const __m512i c0 = _mm512_loadu_si512(codes + (b * 16 + 2 * q) * 32);
      const __m512i c1 = _mm512_loadu_si512(codes + (b * 16 + 2 * q + 1) * 32);
      const int16_t* x = xq16 + xb * kSuper + b * 32 + 4 * q;
      for (int r = 0; r < MR; ++r) {
        __m512i& s = j % 2 ? odd[r] : sum[r];
        s = _mm512_dpwssd_epi32(s, c0, bcast_pair(x + (r0 + r) * W.K));
        s = _mm512_dpwssd_epi32(s, c1, bcast_pair(x + (r0 + r) * W.K + 2));
      }
    }
    for (int r = 0; r < MR; ++r) sum[r] = _mm512_add_epi32(sum[r], odd[r]);
    X.step(l, sum, acc);
  }
}

// one row (decoding), x-block xb: the codes unpacked in registers straight into its 16 lane
// sums, no panel
template <int BITS>
void one_row(const Packed& W, const Rows& R, const int16_t* xq16, int64_t p, int64_t w,
             int64_t xb, int64_t m, float* acc) {
  const XBlock<1> X(W, R, p, w, xb, m);
  __m512i sum[kLanes][1];
  for (int l = 0; l < kLanes; ++l) {
    sum[l][0] = _mm512_setzero_si512();
    X.zero_term(l, sum[l]);
  }
  const int16_t* x = xq16 + m * W.K + xb * kSuper;
#pragma GCC unroll 8
  for (int b = 0; b < kSuper / 32; ++b) {
    const int64_t block = xb * (kSuper / 32) + b;
    __m512i scale = _mm512_setzero_si512(), u0, u1;
#pragma GCC unroll 8
    for (int q = 0; q < 8; ++q) {
      if (q % (W.group / 4) == 0) scale = chunk_scale(W, p, w, block, q);
      chunk<BITS>(W, p, w, block, q, u0, u1);
      __m512i& s = sum[b % 2 * 8 + q][0];
      s = _mm512_dpwssd_epi32(s, _mm512_mullo_epi16(u0, scale), bcast_pair(x + b * 32 + 4 * q));
      s = _mm512_dpwssd_epi32(s, _mm512_mullo_epi16(u1, scale), bcast_pair(x + b * 32 + 4 * q + 2));
    }
  }
  for (int l = 0; l < kLanes; ++l) X.step(l, sum[l], acc);
}

void finish(const float* acc, float* y, __mmask16 cols) {  // hsum16_generic, lane by lane
  __m512 s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = _mm512_loadu_ps(acc + i * kPanel), b = _mm512_loadu_ps(acc + (i + 8) * kPanel);
    s8[i] = _mm512_add_ps(a, b);
  }
  for (int i = 0; i < 4; ++i) s4[i] = _mm512_add_ps(s8[i], s8[i + 4]);
  for (int i = 0; i < 2; ++i) s2[i] = _mm512_add_ps(s4[i], s4[i + 2]);
  _mm512_mask_storeu_ps(y, cols, _mm512_add_ps(s2[0], s2[1]));
}

template <int BITS>
void run_panel(const Packed& W, const Rows& R, const int16_t* xq16, std::vector<int16_t>& codes,
               std::vector<float>& acc, float* y, int64_t p, int64_t M) {
  const int64_t w = std::min(kPanel, W.N - p * kPanel), xblocks = W.K / kSuper;
  const bool once = M > kChunk;  // more than one chunk of rows: the whole panel unpacked once
  for (int64_t xb = 0; once && xb < xblocks; ++xb) unpack<BITS>(W, p, w, xb, &codes[xb * kXCodes]);
  for (int64_t m0 = 0; m0 < M; m0 += kChunk) {
    const int64_t rows = std::min(kChunk, M - m0);
    std::fill(acc.begin(), acc.begin() + rows * kLanes * kPanel, 0.f);
    for (int64_t xb = 0; M == 1 && xb < xblocks; ++xb) {
      one_row<BITS>(W, R, xq16, p, w, xb, 0, acc.data());
    }
    for (int64_t xb = 0; M > 1 && xb < xblocks; ++xb) {
      const int16_t* c = once ? &codes[xb * kXCodes] : codes.data();
      if (!once) unpack<BITS>(W, p, w, xb, codes.data());
      for (int64_t r = 0; r < rows; r += kTileRows) {
        float* a = &acc[r * kLanes * kPanel];
        switch (std::min<int64_t>(kTileRows, rows - r)) {
          case 1: rows_xblock<1>(W, R, xq16, c, p, w, xb, m0 + r, a); break;
          case 2: rows_xblock<2>(W, R, xq16, c, p, w, xb, m0 + r, a); break;
          case 3: rows_xblock<3>(W, R, xq16, c, p, w, xb, m0 + r, a); break;
          case 4: rows_xblock<4>(W, R, xq16, c, p, w, xb, m0 + r, a); break;
          case 5: rows_xblock<5>(W, R, xq16, c, p, w, xb, m0 + r, a); break;
          case 6: rows_xblock<6>(W, R, xq16, c, p, w, xb, m0 + r, a); break;
          case 7: rows_xblock<7>(W, R, xq16, c, p, w, xb, m0 + r, a); break;
          default: rows_xblock<kTileRows>(W, R, xq16, c, p, w, xb, m0 + r, a);
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      finish(&acc[r * kLanes * kPanel], y + (m0 + r) * W.N + p * kPanel,
             static_cast<__mmask16>((1u << w) - 1));
    }
  }
}

template <int BITS>
void run_panels(const Packed& W, const Rows& R, float* y, int64_t M) {
  std::vector<int16_t> xq16(R.xq.begin(), R.xq.end());
  const int64_t panels = (W.N + kPanel - 1) / kPanel, threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(1, panels / (8 * threads));
  const int64_t tasks = std::min(threads, (panels + chunk - 1) / chunk);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
    std::vector<int16_t> codes(M > kChunk ? W.K / kSuper * kXCodes : kXCodes);
    std::vector<float> acc(kChunk * kLanes * kPanel);
    for (int64_t begin = next.fetch_add(chunk); begin < panels; begin = next.fetch_add(chunk)) {
      for (int64_t p = begin; p < std::min(begin + chunk, panels); ++p) {
        run_panel<BITS>(W, R, xq16.data(), codes, acc, y, p, M);
      }
    }
  });
}

#endif

template <typename T>
T* data(const torch::Tensor& t, int64_t numel, const char* name) {
  TORCH_CHECK(t.is_contiguous() && t.numel() == numel, name, " does not fit the layout");
  return t.data_ptr<T>();
}

}  // namespace
}  // namespace group_quant

torch::Tensor linear_kquant16(torch::Tensor x, torch::Tensor low, torch::Tensor high,
                              torch::Tensor super_scale, torch::Tensor sub_scale,
                              torch::Tensor super_min, torch::Tensor sub_min, int64_t bits,
                              int64_t group, int64_t zero, int64_t out_features) {
  using namespace group_quant;
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K % kSuper == 0 && (bits == 4 || bits == 6), "4 or 6 bit k-quants of 256");
  Layout L{};  // what Rows reads: the int8 path's quantization of x
  L.K = K, L.bits = bits, L.group = group, L.per_super = kSuper / group, L.zero = zero;
  L.groups = K / group, L.supers = K / kSuper;
  auto x32 = x.to(torch::kFloat).contiguous();
  auto y = torch::empty({M, N}, x32.options());
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const bool mins = super_min.numel() > 0;
  const Packed W{data<uint8_t>(low, N * K / 2, "low"),
                 bits == 6 ? data<uint8_t>(high, N * K / 4, "high") : nullptr,
                 data<float>(super_scale, N * L.supers, "super_scale"),
                 data<int8_t>(sub_scale, N * L.groups, "sub_scale"),
                 mins ? data<float>(super_min, N * L.supers, "super_min") : nullptr,
                 sub_min.numel() ? data<int8_t>(sub_min, N * L.groups, "sub_min") : nullptr,
                 K, N, group, zero, L.groups, L.supers};
  if (M == 0 || N == 0) return y;
  const Rows R(L, x32.data_ptr<float>(), M);
  if (bits == 6) {
    run_panels<6>(W, R, y.data_ptr<float>(), M);
  } else {
    run_panels<4>(W, R, y.data_ptr<float>(), M);
  }
  return y;
#else
  TORCH_CHECK(false, "linear_kquant16 needs an AVX512-VNNI build");
#endif
}
