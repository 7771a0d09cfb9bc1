// AMX tile operations for linear_amx.h, bf16 and int8, and a scalar model of the same
// operations that runs on any CPU (the tests check the tile walk with it; the instructions
// themselves run only where the CPU has AMX).
//
// Both kinds work on groups of 4 bytes along k: a bf16 pair or an int8 quad. One tile set
// covers a 16-row x 64-column tile of y (one panel) and one k step of 16 groups:
//   C0..C3 (tmm0-3): 16 rows x 16 columns each (fp32 or int32), the accumulators;
//   A (tmm4): 16 rows x 16 groups of x (64 bytes a row);
//   B (tmm5-7, reused in turn): 16 groups x 16 columns of the panel in the kernels' group
//   layout, per group the columns' 2 or 4 consecutive k values, 64 bytes a row, 256 apart.
// tdpbf16ps computes, for every (m, n), in this order (Intel SDM):
//   for k in 0..15: C[m][n] += a[m][2k] * b[k][2n]; C[m][n] += a[m][2k + 1] * b[k][2n + 1]
// The products of two bf16 are exact in fp32, so each += rounds once. The hardware also
// flushes denormal inputs and results to zero; the model does not (the engine's activations
// and weights are normal numbers, and nothing here compares the two bitwise). tdpbusd sums
// uint8 x int8 products into int32, exactly: its result is the same in any order, the
// AVX512-VNNI kernel's bits.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
#define SPLITSERVE_AMX 1
#endif

namespace amx {

constexpr int64_t kRows = 16;     // rows of a tile of y
constexpr int64_t kGroups = 16;   // k groups (pairs, quads) of one step
constexpr int64_t kColumns = 16;  // columns of one accumulator tile
constexpr int64_t kTiles = 4;     // accumulator tiles: a 64-column panel

using bf16 = c10::BFloat16;

// The two kinds: x's, w's and the sums' types, and k values per 4-byte group.
struct Bf16 {  // bf16 pairs, fp32 sums
  using X = bf16;
  using W = bf16;
  using Acc = float;
  static constexpr int64_t kPack = 2;
};

struct Int8 {  // int8 quads, int32 sums
  using X = uint8_t;  // int8 activations + 128 (the kernel takes the offset back out)
  using W = int8_t;
  using Acc = int32_t;
  static constexpr int64_t kPack = 4;
};

// Whether the tile instructions may run: the build has AMX-BF16 and AMX-INT8 (-march=native
// on such a CPU) and the Linux kernel granted this process the tile data state (arch_prctl,
// once).
bool granted();
// "on", "refused" (built with AMX, the kernel said no) or "absent" (not on this CPU), for the
// start-up log.
const char* status();

#ifdef SPLITSERVE_AMX

// Loads the tile configuration on the calling thread: palette 1, every tile 16 rows x 64
// bytes. Each thread that runs tile instructions configures its own tiles.
void configure();

// `iterations` x 4 independent tile products of the kind (tdpbf16ps: 16 x 16 x 32
// multiply-adds each; tdpbusd: 16 x 16 x 64) on registers alone: csrc/cpu/peak.cpp times it
// for the measured peak.
template <typename Kind>
constexpr int64_t kLoopMultiplyAdds = 4 * kRows * kColumns * Kind::kPack * kGroups;
template <typename Kind>
void dot_loop(int64_t iterations);

// C += A . B for the kind (the tile numbers must be literals: the intrinsics paste them);
// amx_tiles.cpp's peak loop uses it too.
#define SPLITSERVE_TILE_DOT(Kind, c, a, b)                             \
  do {                                                                 \
    if constexpr (std::is_same_v<Kind, ::amx::Int8>) {            \
      _tile_dpbusd(c, a, b);                                           \
    } else {                                                           \
      _tile_dpbf16ps(c, a, b);                                         \
    }                                                                  \
  } while (0)

template <typename Kind>
class HardwareTiles {
 public:
  using X = typename Kind::X;
  using W = typename Kind::W;
  using Acc = typename Kind::Acc;

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

  // One k step: a at the tile's first row (row stride lda bytes), b at the step's first group
  // of the panel (row stride ldb bytes).
  void step(const X* a, int64_t lda, const W* b, int64_t ldb) {
    constexpr int64_t next = kColumns * Kind::kPack;  // the next 16 columns' groups
    _tile_loadd(4, a, lda);
    _tile_loadd(5, b, ldb);
    SPLITSERVE_TILE_DOT(Kind, 0, 4, 5);
    _tile_loadd(6, b + next, ldb);
    SPLITSERVE_TILE_DOT(Kind, 1, 4, 6);
    _tile_loadd(7, b + 2 * next, ldb);
    SPLITSERVE_TILE_DOT(Kind, 2, 4, 7);
    _tile_loadd(5, b + 3 * next, ldb);
    SPLITSERVE_TILE_DOT(Kind, 3, 4, 5);
  }

  void store(Acc* y, int64_t ldy) {
    _tile_stored(0, y, ldy);
    _tile_stored(1, y + kColumns, ldy);
    _tile_stored(2, y + 2 * kColumns, ldy);
    _tile_stored(3, y + 3 * kColumns, ldy);
  }
};

#endif

// The same three operations in scalar code, with the accumulators in memory.
template <typename Kind>
class EmulatedTiles {
 public:
  using X = typename Kind::X;
  using W = typename Kind::W;
  using Acc = typename Kind::Acc;

  void zero() { std::memset(acc_, 0, sizeof(acc_)); }

  void step(const X* a, int64_t lda, const W* b, int64_t ldb) {
    constexpr int64_t pack = Kind::kPack;
    for (int64_t t = 0; t < kTiles; ++t) {
      for (int64_t m = 0; m < kRows; ++m) {
        const X* row = at(a, m * lda);
        for (int64_t n = 0; n < kColumns; ++n) {
          Acc c = acc_[t][m][n];
          for (int64_t k = 0; k < kGroups; ++k) {
            const W* group = at(b, k * ldb) + pack * (t * kColumns + n);
            for (int64_t e = 0; e < pack; ++e) {
              c += static_cast<Acc>(row[pack * k + e]) * static_cast<Acc>(group[e]);
            }
          }
          acc_[t][m][n] = c;
        }
      }
    }
  }

  void store(Acc* y, int64_t ldy) {
    for (int64_t m = 0; m < kRows; ++m) {
      Acc* row = reinterpret_cast<Acc*>(reinterpret_cast<char*>(y) + m * ldy);
      for (int64_t t = 0; t < kTiles; ++t) {
        std::memcpy(row + t * kColumns, acc_[t][m], sizeof(acc_[t][m]));
      }
    }
  }

 private:
  template <typename T>
  static const T* at(const T* base, int64_t bytes) {
    return reinterpret_cast<const T*>(reinterpret_cast<const char*>(base) + bytes);
  }

  Acc acc_[kTiles][kRows][kColumns];
};

}  // namespace amx
