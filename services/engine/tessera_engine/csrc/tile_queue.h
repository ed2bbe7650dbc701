// tessera's CPU kernels: a layer's work cut into tiles that the OpenMP team's threads take
// from shared runs (TileQueue, run_tiles), used by the matmuls and decode attention.
//
// at::parallel_for splits a range evenly over the team before it starts. On cores shared with
// the frontend, tokenizer and clients, one preempted thread then holds up the whole layer while
// the others spin at its end: a served step was measured at about the in-process step plus all
// the other processes' work, as if none of it overlapped. With tiles taken from runs, a thread
// that runs takes the tiles of one that does not.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace tessera {
namespace {

// Tiles [0, n) for `threads` threads: one contiguous run of tiles per thread, taken in order
// by its owner (a forward stream through the weight, which the hardware prefetchers follow:
// faster, measured, than the threads taking alternate tiles), then, when its run is done, the
// last tiles of another's run that its owner has not reached (a thread that is preempted, or
// slow, hands its remaining work over). Which thread computes a tile never changes its result.
class TileQueue {
 public:
  TileQueue(int64_t n, int64_t threads) : runs_(static_cast<size_t>(std::max<int64_t>(threads, 1))) {
    const int64_t k = static_cast<int64_t>(runs_.size());
    for (int64_t i = 0; i < k; ++i) runs_[i].v.store(pack(n * i / k, n * (i + 1) / k), std::memory_order_relaxed);
  }
  // The next tile for thread `me`, or -1 when none is left.
  int64_t take(int64_t me) {
    const int64_t k = static_cast<int64_t>(runs_.size());
    const int64_t own = take_from(runs_[me].v, true);
    if (own >= 0) return own;
    for (int64_t j = 1; j < k; ++j) {
      const int64_t stolen = take_from(runs_[(me + j) % k].v, false);
      if (stolen >= 0) return stolen;
    }
    return -1;
  }

 private:
  static uint64_t pack(int64_t lo, int64_t hi) { return static_cast<uint64_t>(lo) << 32 | static_cast<uint64_t>(hi); }
  // [lo, hi) of a run: its owner takes lo, others take hi - 1
  static int64_t take_from(std::atomic<uint64_t>& run, bool front) {
    uint64_t cur = run.load(std::memory_order_relaxed);
    while (true) {
      const int64_t lo = static_cast<int64_t>(cur >> 32), hi = static_cast<int64_t>(cur & 0xffffffffu);
      if (lo >= hi) return -1;
      const uint64_t next = front ? pack(lo + 1, hi) : pack(lo, hi - 1);
      if (run.compare_exchange_weak(cur, next, std::memory_order_relaxed)) return front ? lo : hi - 1;
    }
  }
  // a cache line each: an owner's takes do not pull its line from the other threads' caches
  struct alignas(64) Run {
    std::atomic<uint64_t> v;
  };
  std::vector<Run> runs_;
};

// work(me, queue) for each thread `me` of up to n of the team (the calling thread alone when
// that is one), each taking tiles of [0, n) from the shared queue until none is left.
template <typename Work>
void run_tiles(int64_t n, const Work& work) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  TileQueue queue(n, threads);
  if (threads <= 1) work(int64_t{0}, queue);
  else at::parallel_for(0, threads, 1, [&](int64_t b, int64_t) { work(b, queue); });
}

}  // namespace
}  // namespace tessera
