// Which kernel a dot-product linear (linear_bf16.cpp, linear_int8.cpp) runs, by name:
// "auto" (AMX tiles where they run, else the AVX-512 dot products) or, for the tests, "dot",
// "tiles" or "emulated_tiles" (the scalar model of the tiles, on any CPU). A process's "auto"
// is the same for every call, which keeps rows batch-invariant.
#pragma once

#include <c10/util/Exception.h>

#include <string>

#include "amx_tiles.h"

enum class DotKernel { kDotProducts, kTiles, kEmulatedTiles };

// dot_built: whether this build has the dot-product kernel (dot_name: its instruction set).
inline DotKernel pick_dot_kernel(const std::string& kernel, bool dot_built,
                                 const char* dot_name) {
  if (kernel == "auto") return amx::granted() ? DotKernel::kTiles : DotKernel::kDotProducts;
  if (kernel == "dot") {
    TORCH_CHECK(dot_built, "this build has no ", dot_name, " kernel");
    return DotKernel::kDotProducts;
  }
  if (kernel == "tiles") {
    TORCH_CHECK(amx::granted(), "AMX tiles are ", amx::status(), " here");
    return DotKernel::kTiles;
  }
  TORCH_CHECK(kernel == "emulated_tiles", "kernel: auto, dot, tiles or emulated_tiles");
  return DotKernel::kEmulatedTiles;
}

// k groups (of `pack` values, 4 bytes) of the kernels' packed layout: ceil(K / pack), rounded
// up to whole tile steps (zeros past K), so the tiles and the dot products share it.
inline int64_t packed_groups(int64_t K, int64_t pack) {
  const int64_t groups = (K + pack - 1) / pack;
  return (groups + amx::kGroups - 1) / amx::kGroups * amx::kGroups;
}
