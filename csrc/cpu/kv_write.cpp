// KV-cache write: one contiguous copy of 2 * kv_heads * d elements per new token.
#include <ATen/Parallel.h>

#include <cstring>

#include "ops.h"

void write_kv(torch::Tensor cache, torch::Tensor kv, torch::Tensor slot_mapping) {
  TORCH_CHECK(cache.is_contiguous() && kv.is_contiguous(), "cache and kv must be contiguous");
  TORCH_CHECK(cache.scalar_type() == kv.scalar_type(), "cache and kv dtypes differ");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64, "slot_mapping must be int64");
  const int64_t tokens = kv.size(0);
  TORCH_CHECK(slot_mapping.numel() == tokens, "one slot per new token");
  const int64_t row = kv.numel() / std::max<int64_t>(tokens, 1);  // 2 * kv_heads * d
  TORCH_CHECK(cache.numel() % row == 0 && cache.size(2) * cache.size(3) * cache.size(4) == row,
              "kv and cache disagree on [2, kv_heads, d]");
  const int64_t num_slots = cache.numel() / row;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " out of range");
  }
  const int64_t bytes = row * kv.element_size();
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* src = static_cast<const char*>(kv.data_ptr());
  at::parallel_for(0, tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(dst + slots[t] * bytes, src + t * bytes, bytes);
    }
  });
}
