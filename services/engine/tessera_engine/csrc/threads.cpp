// tessera's CPU kernels: the OpenMP team's threads bound to CPUs.
#include "cpu_kernels.h"
#include "tile_queue.h"

#include <ATen/Parallel.h>

#include <sched.h>

namespace tessera {

// Binds the threads of the calling thread's team one to a CPU each: thread i of the team to
// cpus[i % cpus.size()], and the kernels' pool helper i (tile_queue.h) to the same CPU. Returns
// the CPU each team thread got (-1 where the call failed).
std::vector<int64_t> bind_threads(const std::vector<int64_t>& cpus) {
  const int64_t n = at::get_num_threads();
  std::vector<int64_t> got(n, -1);
  if (cpus.empty()) return got;
  // one index per thread: with a grain of 1 and n indices, thread i runs index i
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t cpu = cpus[i % cpus.size()];
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(static_cast<int>(cpu), &set);
      if (sched_setaffinity(0, sizeof(set), &set) == 0) got[at::get_thread_num()] = cpu;
    }
  });
  TilePool::get().bind(cpus);
  return got;
}

}  // namespace tessera
