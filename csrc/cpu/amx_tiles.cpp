// Whether AMX tiles may run in this process, the per-thread tile configuration and the peak
// loop (amx_tiles.h). Without torch/extension.h, so the tests compile it for an AMX CPU in
// seconds on any host.
#include "amx_tiles.h"

#include <sys/syscall.h>
#include <unistd.h>

namespace amx {

namespace {

#ifdef SPLITSERVE_AMX
// Linux (5.16+) hands out the 8 KiB tile data state only to a process that asks for it;
// the first tile instruction of one that did not dies of SIGILL.
constexpr int kArchRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
constexpr int kTileData = 18;                   // XFEATURE_XTILEDATA

bool ask_for_tile_data() { return syscall(SYS_arch_prctl, kArchRequestPermission, kTileData) == 0; }

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};
#endif

}  // namespace

bool granted() {
#ifdef SPLITSERVE_AMX
  static const bool ok = ask_for_tile_data();  // once per process; it holds for every thread
  return ok;
#else
  return false;
#endif
}

const char* status() {
#ifdef SPLITSERVE_AMX
  return granted() ? "on" : "refused";
#else
  return "absent";
#endif
}

#ifdef SPLITSERVE_AMX
void configure(const uint8_t (&rows)[8], const uint16_t (&bytes)[8]) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = bytes[t];
    config.rows[t] = rows[t];
  }
  // GCC does not see ldtilecfg read the 64 bytes and drops the stores above (the first AMX
  // host, 2026-12-07: a general-protection fault on garbage rows): make them happen
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

void configure() {
  constexpr uint8_t kAll = kRows;
  configure({kAll, kAll, kAll, kAll, kAll, kAll, kAll, kAll}, {64, 64, 64, 64, 64, 64, 64, 64});
}

template <typename Kind>
void dot_loop(int64_t iterations) {
  TORCH_CHECK(granted(), "AMX tiles are refused here (the OS granted no tile data)");
  alignas(64) static const uint8_t zeros[kRows * 64] = {};
  configure();
  _tile_loadd(4, zeros, 64);  // A and B: their values do not matter
  _tile_loadd(5, zeros, 64);
  _tile_loadd(6, zeros, 64);
  _tile_loadd(7, zeros, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t n = 0; n < iterations; ++n) {
    SPLITSERVE_TILE_DOT(Kind, 0, 4, 5);
    SPLITSERVE_TILE_DOT(Kind, 1, 4, 6);
    SPLITSERVE_TILE_DOT(Kind, 2, 4, 7);
    SPLITSERVE_TILE_DOT(Kind, 3, 5, 6);
  }
  _tile_release();
}

template void dot_loop<Bf16>(int64_t);
template void dot_loop<Int8>(int64_t);
#endif

}  // namespace amx
