// KV block pack/unpack for GPU transfers, with a plain C ABI (ctypes, or any C caller).
//
// A layer's cache is [num_blocks, block_size, 2, kv_heads, head_dim], contiguous, so one
// block of one layer is block_bytes contiguous bytes. The transfer buffer is
// [layers, blocks, block_bytes]: the wire layout of a KVChunk (shared/kvtransfer).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// layer_caches: device array of num_layers cache base pointers; block_ids: device array of
// num_blocks ids. Both calls are asynchronous on `stream`; they return a cudaError_t.
int splitserve_kv_pack(const void* const* layer_caches, int num_layers, const int64_t* block_ids,
                       int num_blocks, int64_t block_bytes, void* buffer, cudaStream_t stream);

int splitserve_kv_unpack(void* const* layer_caches, int num_layers, const int64_t* block_ids,
                         int num_blocks, int64_t block_bytes, const void* buffer,
                         cudaStream_t stream);

#ifdef __cplusplus
}
#endif
