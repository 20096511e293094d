// Work items of unequal cost among torch's threads, split by cost instead of by count.
//
// at::parallel_for hands each thread an equal run of consecutive indices. That is right for equal items,
// but a cascade's groups cost their shared prompt's length (real prompts differ several-fold), so with a
// few groups per thread one thread can get far more keys than another. Here the runs stay consecutive (a
// kernel's next item is the one it prefetches, and rows next to each other share lines) but end where the
// running cost crosses each thread's equal share. Every item still runs once, whole, on one thread, with
// per-item results: where the runs end changes the time only, never a value.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace autobucket_parallel {

// Calls run(first, end) on runs of consecutive items that together cover [0, count) once, one run per
// thread. cost(i): item i's work in any one unit, asked only where more than one thread runs; on one
// thread (or inside a parallel region) a single run takes every item.
template <typename Cost, typename Run>
void parallel_for_balanced(int64_t count, const Cost& cost, const Run& run) {
  if (count <= 0) return;
  const int64_t threads = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), count);
  if (threads <= 1) {
    run(int64_t{0}, count);
    return;
  }
  std::vector<int64_t> before(static_cast<size_t>(count + 1), 0);  // before[i]: the cost of items [0, i)
  for (int64_t i = 0; i < count; ++i) before[i + 1] = before[i] + std::max<int64_t>(cost(i), 1);  // a free item still costs its call
  std::vector<int64_t> bounds(static_cast<size_t>(threads + 1), count);
  bounds[0] = 0;
  for (int64_t t = 1; t < threads; ++t) {  // each run ends at the item boundary nearest its share's end
    const double target = static_cast<double>(before[count]) * static_cast<double>(t) / static_cast<double>(threads);
    int64_t i = std::lower_bound(before.begin(), before.end(), target) - before.begin();
    if (i > 0 && target - static_cast<double>(before[i - 1]) < static_cast<double>(before[i]) - target) --i;
    bounds[t] = std::clamp(i, bounds[t - 1], count);
  }
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t end) {
    for (int64_t t = first; t < end; ++t)
      if (bounds[t] < bounds[t + 1]) run(bounds[t], bounds[t + 1]);
  });
}

}  // namespace autobucket_parallel
