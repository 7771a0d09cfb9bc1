// The k-quants' int8-activation linear over the panels of repack_kquant_amx (Q2_K to Q6_K;
// kquant_panels.h lays them out): on AMX-INT8 tiles ("int8-amx"), or by AVX512-VNNI alone
// ("int8-panels", any AVX512-VNNI build).
//
// Arithmetic, per row m, column n and super-block of 256 (the rows' int8 codes xq and scale d
// as the other int8 paths quantize them, linear_group_quant_int8.cpp):
//   C_g = sum over group g of (u - Z) * xq                      (exact int32)
//   I   = sum over g of sub_scale[n, g] * C_g                   (exact: |I| < 2^29)
//   mn  = sum over g of sub_min[n, g] * (xq sum of group g)     (exact; with mins only)
//   acc = fma(float(I), d * super_scale, acc); acc = fma(float(mn), d * super_min, acc)
// y[m, n] = acc after the last super-block. I is made three ways, by the call's row count:
// up to 4 rows by AVX512-VNNI on the panels (the tiles' latency costs more than their
// arithmetic saves), up to 16 on tiles a group at a time (C_g stored, times its scale), more
// from planes of scale-times-code products split in two int8 halves (p = 128 hi + lo, made
// once per panel for all the rows: one tile store per super-block, two row tiles at once).
// Without tiles every row count takes the first way, 4 rows at a time.
// Not the VNNI path's bits (that one keeps 16 lanes of partial sums). The one rule: every way
// gives the same exact I and the same float steps after it, and a row's result depends on its
// own data alone (rows past M are zeros, their sums dropped): every row count, one row
// included, gives a row the same bits, so the kernel is batch-invariant.

#include <algorithm>
#include <cstring>
#include <vector>

#include "kquant_panels.h"
#include "panel_tasks.h"

namespace group_quant {

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

namespace {

using kquant_panels::kChunkRows;
using kquant_panels::kTileRows;
using kquant_panels::kVnniRows;
using kquant_panels::Panels;

// One thread's share of a chunk of rows: whole panels into y, by the path the call's row
// count picks (every path the same sums, so the same bits).
template <int BITS, int G>
struct PanelRun {
  const Panels<BITS, G>& k;
  float* y;
  int64_t M, N, c0, rows;
  bool few, wide;  // few: VNNI alone, 4 rows at a time
  std::vector<int8_t> b, lo, hi;
  std::vector<float> acc;

  PanelRun(const Panels<BITS, G>& k, float* y, int64_t M, int64_t N, int64_t c0, int64_t rows,
           bool tiles)
      : k(k), y(y), M(M), N(N), c0(c0), rows(rows), few(!tiles || M <= kVnniRows),
        wide(M > kTileRows) {
    acc.resize(rows * kPanel);
#ifdef SPLITSERVE_AMX
    if (few) return;
    b.resize(kSuper * kPanel);
    if (wide) lo.resize(kSuper * kPanel), hi.resize(kSuper * kPanel);
    k.configure(std::min(M, kTileRows), wide);
#endif
  }
  ~PanelRun() {
#ifdef SPLITSERVE_AMX
    if (!few) _tile_release();
#endif
  }

  // panel P into y
  void panel(int64_t P) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t xb = 0; xb < k.L.K / kSuper; ++xb) {
      if (few) {
        for (int64_t m0 = 0; m0 < rows; m0 += kVnniRows) {
          const int64_t mr = std::min(kVnniRows, rows - m0);
          vnni_rows(k, mr, P, xb, c0 + m0, acc.data() + m0 * kPanel);
        }
        continue;
      }
#ifdef SPLITSERVE_AMX
      k.unpack(P, xb, b.data());
      if (wide) k.products(P, xb, b.data(), lo.data(), hi.data());
      row_tiles(P, xb);
#endif
    }
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(y + (c0 + r) * N + P * kPanel, acc.data() + r * kPanel, kPanel * sizeof(float));
    }
  }

#ifdef SPLITSERVE_AMX
  void row_tiles(int64_t P, int64_t xb) {
    const int64_t step = wide ? 2 * kTileRows : kTileRows;  // wide: two row tiles a call
    for (int64_t m0 = 0; m0 < rows; m0 += step) {
      const int64_t mr = std::min(step, rows - m0);
      float* out = acc.data() + m0 * kPanel;
      if (wide) {
        k.wide_tiles(P, xb, lo.data(), hi.data(), c0 + m0, mr, out);
      } else {
        k.tile(P, xb, b.data(), c0 + m0, mr, out);
      }
    }
  }
#endif
};

template <int BITS, int G>
void run_panels(const Layout& L, const Rows& R, float* y, int64_t M, int64_t N, bool tiles) {
  const Panels<BITS, G> k{L, R.xq.data(), R.d.data(), R.group_sum.data()};
  for_panels(M, N, kChunkRows, [&](int64_t c0, int64_t rows) {
    return PanelRun<BITS, G>(k, y, M, N, c0, rows, tiles);
  });
}

}  // namespace

void run_kquant_panels(const Layout& L, Rows& R, float* y, int64_t M, int64_t N, bool tiles) {
  TORCH_CHECK(!tiles || amx::granted(), "the AMX k-quant kernel needs AMX tiles (",
              amx::status(), " here)");
  constexpr int64_t kPad = 2 * kTileRows;  // whole A tiles, two at a time
  R.xq.resize((M + kPad - 1) / kPad * kPad * L.K, 0);
  if (L.group == 16) {
    return L.bits == 6 ? run_panels<6, 16>(L, R, y, M, N, tiles)
                       : run_panels<4, 16>(L, R, y, M, N, tiles);
  }
  switch (L.bits) {
    case 4: return run_panels<4, 32>(L, R, y, M, N, tiles);
    case 5: return run_panels<5, 32>(L, R, y, M, N, tiles);
    default: return run_panels<6, 32>(L, R, y, M, N, tiles);
  }
}

#else

void run_kquant_panels(const Layout&, Rows&, float*, int64_t, int64_t, bool) {
  TORCH_CHECK(false, "the k-quant panels need AVX512-VNNI, not in this build");
}

#endif

}  // namespace group_quant
