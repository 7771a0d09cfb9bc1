// Where a token's K and V lie in one layer's paged KV cache ([num_blocks, block_size, 2,
// kv_heads, head_dim], contiguous; ops.h), in elements.
#pragma once

#include <cstdint>

namespace paged_kv {

struct Layout {
  int64_t block_size, block_stride, token_stride, v_offset, head_dim;
};

// The context tokens [first, context) of one row, through its block table (none: nullptr).
struct Context {
  const int64_t* table = nullptr;
  int64_t first = 0, context = 0;
};

}  // namespace paged_kv
