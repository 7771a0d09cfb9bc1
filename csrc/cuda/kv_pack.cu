// One CUDA block per (block, layer) pair copies block_bytes, 16 bytes per thread-step when
// every address is 16-byte aligned (the usual case), byte by byte otherwise.
#include "kv_pack.h"

namespace {

constexpr int kThreads = 256;

template <bool kPack>
__global__ void copy_blocks(void* const* layer_caches, const int64_t* block_ids,
                            int num_blocks, int64_t block_bytes, char* buffer, bool vector) {
  const int b = blockIdx.x, layer = blockIdx.y;
  char* cache_block = static_cast<char*>(layer_caches[layer]) + block_ids[b] * block_bytes;
  char* packed = buffer + (static_cast<int64_t>(layer) * num_blocks + b) * block_bytes;
  char* dst = kPack ? packed : cache_block;
  const char* src = kPack ? cache_block : packed;
  if (vector) {
    const int64_t n = block_bytes / 16;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    }
  } else {
    for (int64_t i = threadIdx.x; i < block_bytes; i += blockDim.x) dst[i] = src[i];
  }
}

// Aligned when every cache base, the buffer and the block size are multiples of 16 bytes;
// the caller's pointer array lives on the device, so base alignment is the caller's promise
// checked on the buffer and the size (torch allocations are 256-byte aligned).
bool aligned(const void* buffer, int64_t block_bytes) {
  return reinterpret_cast<uintptr_t>(buffer) % 16 == 0 && block_bytes % 16 == 0;
}

template <bool kPack>
int launch(void* const* layer_caches, int num_layers, const int64_t* block_ids, int num_blocks,
           int64_t block_bytes, void* buffer, cudaStream_t stream) {
  if (num_layers <= 0 || num_blocks <= 0 || num_layers > 65535) {
    return num_layers == 0 || num_blocks == 0 ? cudaSuccess : cudaErrorInvalidValue;
  }
  const dim3 grid(num_blocks, num_layers);
  copy_blocks<kPack><<<grid, kThreads, 0, stream>>>(layer_caches, block_ids, num_blocks,
                                                    block_bytes, static_cast<char*>(buffer),
                                                    aligned(buffer, block_bytes));
  return cudaGetLastError();
}

}  // namespace

extern "C" int splitserve_kv_pack(const void* const* layer_caches, int num_layers,
                                  const int64_t* block_ids, int num_blocks, int64_t block_bytes,
                                  void* buffer, cudaStream_t stream) {
  return launch<true>(const_cast<void* const*>(layer_caches), num_layers, block_ids, num_blocks,
                      block_bytes, buffer, stream);
}

extern "C" int splitserve_kv_unpack(void* const* layer_caches, int num_layers,
                                    const int64_t* block_ids, int num_blocks,
                                    int64_t block_bytes, const void* buffer,
                                    cudaStream_t stream) {
  return launch<false>(layer_caches, num_layers, block_ids, num_blocks, block_bytes,
                       const_cast<void*>(buffer), stream);
}
