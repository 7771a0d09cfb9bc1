// AMX tile operations for linear_amx.h, bf16 and int8, and a scalar model of the same
// operations that runs on any CPU (the tests check the tile walk with it; the instructions
// themselves run only where the CPU has AMX).
//
// Both kinds work on groups of 4 bytes along k: a bf16 pair or an int8 quad. One tile set
// covers 16 x 64 or 32 x 32 of y (a block: `kTall` = 1 or 2 row tiles) over one k step of 16
// groups:
//   C0..C3 (tmm0-3): 16 rows x 16 columns each (fp32 or int32), the accumulators; C_t holds
//   row tile t / (4 / kTall) and column tile t % (4 / kTall) of the block;
//   A: 16 rows x 16 groups of x (64 bytes a row), one per row tile (tmm4, and tmm5 for 2 x 2);
//   B: 16 groups x 16 columns of the panel in the kernels' group layout, per group the
//   columns' 2 or 4 consecutive k values, 64 bytes a row, 256 apart (1 x 4: tmm5-7, reused in
//   turn; 2 x 2: tmm6-7).
// Why 2 x 2 where it can: one tile product takes 16 cycles, in which L2 delivers 48-64 bytes a
// cycle, 0.75-1 tile (Intel's optimization manual, the AMX chapter; github.com/usstq/mm_amx).
// The panel's tiles come from L2 (a bf16 panel is 72 KiB at K = 576, 192 at K = 1536), and so
// do x's, since every row tile passes over a panel before the next panel starts: 1 x 4 reads
// 1.25 tiles a product from L2, 2 x 2 one at most (0.5 for a panel's second half where x's 32
// rows, 36 KiB at K = 576, are still in L1). Not yet measured on an AMX CPU.
// tdpbf16ps computes, for every (m, n), in this order (Intel SDM):
//   for k in 0..15: C[m][n] += a[m][2k] * b[k][2n]; C[m][n] += a[m][2k + 1] * b[k][2n + 1]
// Row m of C depends on row m of A alone, so a row's sums are the same in either block shape.
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
constexpr int64_t kTiles = 4;     // accumulator tiles: a block of 16 x 64 or 32 x 32

// `bytes` past `base` (the tiles' strides are in bytes).
template <typename T>
T* at(T* base, int64_t bytes) {
  using Byte = std::conditional_t<std::is_const_v<T>, const char, char>;
  return reinterpret_cast<T*>(reinterpret_cast<Byte*>(base) + bytes);
}

// Accumulator t of a block of kTall row tiles: its first row in y (ldy bytes a row).
template <int64_t kTall, typename Acc>
Acc* tile_at(Acc* y, int64_t t, int64_t ldy) {
  constexpr int64_t wide = kTiles / kTall;  // column tiles of the block
  return at(y, t / wide * kRows * ldy) + t % wide * kColumns;
}

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
// The same with each of the 8 tiles' rows and bytes a row given (linear_kquant_panels.cpp).
void configure(const uint8_t (&rows)[8], const uint16_t (&bytes)[8]);

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

  // One k step of a block: a at its first row (row stride lda bytes), b at the step's first
  // group of its first column tile (row stride ldb bytes). The weights' tiles load with the
  // hint that L1 need not keep them (tileloaddt1, as vLLM's AMX micro-GEMM loads its B): the
  // next row tiles read them from L2 anyway, and L1 keeps x's tiles for the panel's next half.
  template <int64_t kTall>
  void step(const X* a, int64_t lda, const W* b, int64_t ldb) {
    constexpr int64_t next = kColumns * Kind::kPack;  // the next 16 columns' groups
    if constexpr (kTall == 1) {
      _tile_loadd(4, a, lda);
      _tile_stream_loadd(5, b, ldb);
      SPLITSERVE_TILE_DOT(Kind, 0, 4, 5);
      _tile_stream_loadd(6, b + next, ldb);
      SPLITSERVE_TILE_DOT(Kind, 1, 4, 6);
      _tile_stream_loadd(7, b + 2 * next, ldb);
      SPLITSERVE_TILE_DOT(Kind, 2, 4, 7);
      _tile_stream_loadd(5, b + 3 * next, ldb);
      SPLITSERVE_TILE_DOT(Kind, 3, 4, 5);
    } else {
      static_assert(kTall == 2);
      _tile_loadd(4, a, lda);
      _tile_stream_loadd(6, b, ldb);
      SPLITSERVE_TILE_DOT(Kind, 0, 4, 6);
      _tile_stream_loadd(7, b + next, ldb);
      SPLITSERVE_TILE_DOT(Kind, 1, 4, 7);
      _tile_loadd(5, at(a, kRows * lda), lda);
      SPLITSERVE_TILE_DOT(Kind, 2, 5, 6);
      SPLITSERVE_TILE_DOT(Kind, 3, 5, 7);
    }
  }

  template <int64_t kTall>
  void store(Acc* y, int64_t ldy) {
    _tile_stored(0, tile_at<kTall>(y, 0, ldy), ldy);
    _tile_stored(1, tile_at<kTall>(y, 1, ldy), ldy);
    _tile_stored(2, tile_at<kTall>(y, 2, ldy), ldy);
    _tile_stored(3, tile_at<kTall>(y, 3, ldy), ldy);
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

  template <int64_t kTall>
  void step(const X* a, int64_t lda, const W* b, int64_t ldb) {
    constexpr int64_t pack = Kind::kPack, wide = kTiles / kTall;
    for (int64_t t = 0; t < kTiles; ++t) {
      const X* rows = at(a, t / wide * kRows * lda);
      const W* columns = b + t % wide * kColumns * pack;
      for (int64_t m = 0; m < kRows; ++m) {
        const X* row = at(rows, m * lda);
        for (int64_t n = 0; n < kColumns; ++n) {
          Acc c = acc_[t][m][n];
          for (int64_t k = 0; k < kGroups; ++k) {
            const W* group = at(columns, k * ldb) + pack * n;
            for (int64_t e = 0; e < pack; ++e) {
              c += static_cast<Acc>(row[pack * k + e]) * static_cast<Acc>(group[e]);
            }
          }
          acc_[t][m][n] = c;
        }
      }
    }
  }

  template <int64_t kTall>
  void store(Acc* y, int64_t ldy) {
    for (int64_t t = 0; t < kTiles; ++t) {
      Acc* tile = tile_at<kTall>(y, t, ldy);
      for (int64_t m = 0; m < kRows; ++m) {
        std::memcpy(at(tile, m * ldy), acc_[t][m], sizeof(acc_[t][m]));
      }
    }
  }

 private:
  Acc acc_[kTiles][kRows][kColumns];
};

}  // namespace amx
