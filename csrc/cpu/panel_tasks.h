// How the panel kernels (linear_kquant_panels.cpp, linear_block_panels.cpp) share a call among
// threads: the rows in chunks whose int8 activations stay in L2, and per chunk the panels of
// 16 columns taken in small runs as threads come free (a thread descheduled on a busy machine
// holds up no share of the others'). The one rule: which thread takes a panel changes no bit.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "group_quant_int8.h"

namespace group_quant {

// make(c0, rows): a task's run for rows c0 .. c0 + rows - 1 (its tiles' configuration, its
// scratch), whose panel(P) writes panel P of y
template <typename Make>
void for_panels(int64_t M, int64_t N, int64_t chunk_rows, Make make) {
  const int64_t panels = N / kPanel, threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(1, panels / (8 * threads));
  const int64_t tasks = std::min(threads, (panels + chunk - 1) / chunk);
  for (int64_t c0 = 0; c0 < M; c0 += chunk_rows) {
    std::atomic<int64_t> next{0};
    at::parallel_for(0, tasks, 1, [&](int64_t, int64_t) {
      auto run = make(c0, std::min(chunk_rows, M - c0));
      for (int64_t begin = next.fetch_add(chunk); begin < panels; begin = next.fetch_add(chunk)) {
        for (int64_t P = begin; P < std::min(begin + chunk, panels); ++P) run.panel(P);
      }
    });
  }
}

}  // namespace group_quant
