// AMX-BF16 tile operations for linear_amx.h, and a scalar model of the same operations that
// runs on any CPU (the tests check the tile walk with it; the instructions themselves run
// only where the CPU has AMX).
//
// One tile set covers a 16-row x 64-column tile of y (one panel) and one k step of 16 pairs:
//   C0..C3 (tmm0-3): 16 rows x 16 fp32 columns each, the accumulators;
//   A (tmm4): 16 rows x 16 pairs of x, bf16 (64 bytes a row);
//   B (tmm5-7, reused in turn): 16 pairs x 16 columns of the panel in linear_bf16.cpp's pair
//   layout, per pair the columns' (w[n, 2j], w[n, 2j + 1]), 64 bytes a row, 256 apart.
// tdpbf16ps C, A, B computes, for every (m, n), in this order (Intel SDM):
//   for k in 0..15: C[m][n] += a[m][2k] * b[k][2n]; C[m][n] += a[m][2k + 1] * b[k][2n + 1]
// The products of two bf16 are exact in fp32, so each += rounds once. The hardware also
// flushes denormal inputs and results to zero; the model does not (the engine's activations
// and weights are normal numbers, and nothing here compares the two bitwise).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SPLITSERVE_AMX 1
#endif

namespace amx {

constexpr int64_t kRows = 16;     // rows of a tile of y
constexpr int64_t kPairs = 16;    // k pairs of one step
constexpr int64_t kColumns = 16;  // fp32 columns of one accumulator tile
constexpr int64_t kTiles = 4;     // accumulator tiles: a 64-column panel

using bf16 = c10::BFloat16;

// Whether the tile instructions may run: the build has AMX-BF16 (-march=native on such a CPU)
// and the Linux kernel granted this process the tile data state (arch_prctl, once).
bool granted();
// "on", "refused" (built with AMX, the kernel said no) or "absent" (not on this CPU), for the
// start-up log.
const char* status();

#ifdef SPLITSERVE_AMX

// Loads the tile configuration on the calling thread: palette 1, every tile 16 rows x 64
// bytes. Each thread that runs tile instructions configures its own tiles.
void configure();

// `iterations` x 4 independent tdpbf16ps (16 x 16 x 32 multiply-adds each) on registers
// alone: csrc/cpu/peak.cpp times it for the measured peak.
constexpr int64_t kLoopMultiplyAdds = 4 * kRows * kColumns * 2 * kPairs;
void dot_loop(int64_t iterations);

class HardwareTiles {
 public:
  HardwareTiles() { configure(); }
  ~HardwareTiles() { _tile_release(); }
  HardwareTiles(const HardwareTiles&) = delete;
  HardwareTiles& operator=(const HardwareTiles&) = delete;

  void zero() {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }

  // One k step: a at the tile's first row (row stride lda bytes), b at the step's first pair
  // of the panel (row stride ldb bytes).
  void step(const bf16* a, int64_t lda, const bf16* b, int64_t ldb) {
    _tile_loadd(4, a, lda);
    _tile_loadd(5, b, ldb);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, b + 2 * kColumns, ldb);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, b + 4 * kColumns, ldb);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, b + 6 * kColumns, ldb);
    _tile_dpbf16ps(3, 4, 5);
  }

  void store(float* y, int64_t ldy) {
    _tile_stored(0, y, ldy);
    _tile_stored(1, y + kColumns, ldy);
    _tile_stored(2, y + 2 * kColumns, ldy);
    _tile_stored(3, y + 3 * kColumns, ldy);
  }
};

#endif

// The same three operations in scalar code, with the accumulators in memory.
class EmulatedTiles {
 public:
  void zero() { std::memset(acc_, 0, sizeof(acc_)); }

  void step(const bf16* a, int64_t lda, const bf16* b, int64_t ldb) {
    for (int64_t t = 0; t < kTiles; ++t) {
      for (int64_t m = 0; m < kRows; ++m) {
        const bf16* row = at(a, m * lda);
        for (int64_t n = 0; n < kColumns; ++n) {
          float c = acc_[t][m][n];
          for (int64_t k = 0; k < kPairs; ++k) {
            const bf16* pair = at(b, k * ldb) + 2 * (t * kColumns + n);
            c += static_cast<float>(row[2 * k]) * static_cast<float>(pair[0]);
            c += static_cast<float>(row[2 * k + 1]) * static_cast<float>(pair[1]);
          }
          acc_[t][m][n] = c;
        }
      }
    }
  }

  void store(float* y, int64_t ldy) {
    for (int64_t m = 0; m < kRows; ++m) {
      float* row = reinterpret_cast<float*>(reinterpret_cast<char*>(y) + m * ldy);
      for (int64_t t = 0; t < kTiles; ++t) {
        std::memcpy(row + t * kColumns, acc_[t][m], sizeof(acc_[t][m]));
      }
    }
  }

 private:
  static const bf16* at(const bf16* base, int64_t bytes) {
    return reinterpret_cast<const bf16*>(reinterpret_cast<const char*>(base) + bytes);
  }

  float acc_[kTiles][kRows][kColumns];
};

}  // namespace amx
