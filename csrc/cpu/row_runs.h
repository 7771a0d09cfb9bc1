// How paged attention (paged_attention.cpp) hands a step's rows to the threads when there are
// many: a run of rows each, of about equal work.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace row_runs {

// Many rows go to the threads as runs of about equal work, not equal counts: a step that mixes
// decodes (first) with a prompt's chunk otherwise left most decodes on one thread. Work is
// counted in context tokens: those of a row reading a context of its own from memory (a
// decode's) count kOwnContextWork times those of a chunk row, whose context its neighbours
// share in cache; each row costs kRowWork more. Tried on the 2-core AVX512-BF16 host
// (2026-12-04, 64 x 128 -> 128 offline, the AVX-512 path): own-context weights 1 / 2 / 3 and
// row costs 8 / 32 / 64; 2 and 32 were best or tied at every mix of decodes and chunk rows.
constexpr int64_t kOwnContextWork = 2;
constexpr int64_t kRowWork = 32;

// first[t], t in [0, threads]: thread t takes rows [first[t], first[t + 1]). tokens(r): row r's
// context tokens; own(r): whether no other row shares its context.
template <typename Tokens, typename Own>
std::vector<int64_t> runs_of_equal_work(int64_t rows, int64_t threads, const Tokens& tokens,
                                        const Own& own) {
  std::vector<int64_t> work(rows + 1, 0);  // strictly growing: a row costs kRowWork at least
  for (int64_t r = 0; r < rows; ++r) {
    work[r + 1] = work[r] + tokens(r) * (own(r) ? kOwnContextWork : 1) + kRowWork;
  }
  std::vector<int64_t> first(threads + 1);
  for (int64_t t = 0; t <= threads; ++t) {
    first[t] = std::lower_bound(work.begin(), work.end(), work[rows] * t / threads) - work.begin();
  }
  return first;
}

}  // namespace row_runs
