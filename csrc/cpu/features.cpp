// The instruction sets the kernels were compiled with. The build targets the host it runs on
// (-march=native), so these are what this CPU runs; the engine logs them at start.
#include "ops.h"

std::vector<std::string> cpu_features() {
  std::vector<std::string> names;
#ifdef __AVX2__
  names.emplace_back("avx2");
#endif
#ifdef __AVX512F__
  names.emplace_back("avx512f");
#endif
#ifdef __AVX512BF16__
  names.emplace_back("avx512_bf16");
#endif
#ifdef __AVX512VNNI__
  names.emplace_back("avx512_vnni");
#endif
#ifdef __AMX_BF16__
  names.emplace_back("amx_bf16");
#endif
#ifdef __AMX_INT8__
  names.emplace_back("amx_int8");
#endif
  return names;
}
