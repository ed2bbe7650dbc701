// tessera's CPU kernels: a kernel's work cut into tiles that the caller and the pool's helper
// threads take from shared runs (TileQueue, run_tiles, parallel_rows), used by every kernel
// loop that runs on more than one thread.
//
// On cores shared with the frontend, tokenizer and clients, every other process's work of a token
// preempts one of the engine's threads. at::parallel_for (an OpenMP team) splits a range before it
// starts and joins on its threads: a preempted thread holds up the whole layer while the others
// spin at its end, so a served step measured the in-process step plus all the other processes'
// work, as if none of it overlapped. Here tiles are taken from runs (a thread that runs takes the
// tiles of one that does not), and the pool joins on the tiles, not on its threads: the caller
// returns once every tile is done and no helper is inside, so a helper that is preempted before
// it starts costs nothing. Which thread computes a tile never changes its result.
//
// The kernels' loops all run here, none on OpenMP: two teams would each spin while the other
// computes (a 64-row step took twice as long with only the matmuls moved). torch's own ops still
// use its OpenMP team; the engine shortens that team's spin (GOMP_SPINCOUNT: tessera_engine's
// openmp_env) so its idle threads leave the cores to this pool's.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace tessera {

// Helper threads for run_tiles, one process-wide pool (an inline function's static: one across
// the kernels' files). A helper spins a while after each job (the next layer's comes within
// microseconds), then sleeps on a futex until the next.
class TilePool {
 public:
  static TilePool& get() {
    // never destroyed: its threads outlive static destruction. A forked child has the parent's list
    // of helpers but none of them: its jobs run on the calling thread alone.
    static TilePool* pool = new TilePool();
    return *pool;
  }

  // Bind helper k to cpus[k % size], as bind_threads binds the OpenMP team's thread k.
  void bind(const std::vector<int64_t>& cpus) {
    std::lock_guard<std::mutex> lock(busy_);
    cpus_ = cpus;
    for (size_t k = 0; k < handles_.size(); ++k) place(handles_[k], static_cast<int64_t>(k) + 1);
  }

  // f(me) on the calling thread (me = 0) and on helpers (me = 1 .. threads - 1, those that come
  // while the job is open); returns when f(0) has returned and no helper is inside f. f(0) alone
  // must finish the job (run_tiles: the caller takes every tile no helper took).
  template <typename F>
  void run(int64_t threads, const F& f) {
    std::unique_lock<std::mutex> lock(busy_, std::defer_lock);
    if (inside_ || !lock.try_lock()) {  // nested, or another thread's job running: this thread alone
      f(int64_t{0});
      return;
    }
    inside_ = true;
    grow(threads - 1);
    call_ = [](const void* ctx, int64_t me) { (*static_cast<const F*>(ctx))(me); };
    ctx_ = &f;
    participants_ = threads;
    slot_.store(1, std::memory_order_relaxed);
    const uint32_t g = gen_.load(std::memory_order_relaxed) + 1;
    gen_.store(g, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0)
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&gen_), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
    // a kernel's error is raised here, on the caller, once no helper is inside the job (whose
    // tiles and closure live on this thread's stack)
    std::exception_ptr error;
    try {
      f(int64_t{0});
    } catch (...) {
      error = std::current_exception();
    }
    closed_.store(g, std::memory_order_seq_cst);
    // only a helper inside a tile (or about to find none left) is waited for
    for (int64_t spins = 0; active_.load(std::memory_order_seq_cst) != 0; ++spins) {
      if (spins < 4096) _mm_pause();
      else sched_yield();
    }
    inside_ = false;
    std::exception_ptr helper_error = std::exchange(helper_error_, nullptr);
    if (error) std::rethrow_exception(error);
    if (helper_error) std::rethrow_exception(helper_error);
  }

 private:
  static constexpr auto kSpin = std::chrono::microseconds(200);

  void grow(int64_t n) {
    while (static_cast<int64_t>(handles_.size()) < n) {
      std::thread helper([this] { loop(); });
      place(helper.native_handle(), static_cast<int64_t>(handles_.size()) + 1);
      handles_.push_back(helper.native_handle());
      helper.detach();
    }
  }

  // helper k (1, 2, ...) on cpus_[k % size] when the team is bound (bind_threads), else on any
  // CPU the process may use (not only its creator's: the core thread may be bound to one)
  void place(pthread_t handle, int64_t k) {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (!cpus_.empty()) CPU_SET(static_cast<int>(cpus_[k % cpus_.size()]), &set);
    else if (sched_getaffinity(getpid(), sizeof(set), &set) != 0) return;
    pthread_setaffinity_np(handle, sizeof(set), &set);
  }

  void loop() {
    inside_ = true;  // a kernel a helper runs never starts a job of its own
    uint32_t seen = gen_.load(std::memory_order_acquire);
    for (;;) {
      uint32_t g;
      auto start = std::chrono::steady_clock::now();
      for (int64_t spins = 0; (g = gen_.load(std::memory_order_acquire)) == seen; ++spins) {
        _mm_pause();
        if ((spins & 63) == 63 && std::chrono::steady_clock::now() - start > kSpin) {
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          if (gen_.load(std::memory_order_seq_cst) == seen)
            syscall(SYS_futex, reinterpret_cast<uint32_t*>(&gen_), FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
          sleepers_.fetch_sub(1, std::memory_order_seq_cst);
          start = std::chrono::steady_clock::now();
        }
      }
      seen = g;
      // counted in before it checks the job is still open: the caller, once it has closed the
      // job, waits for every helper counted in, and a helper that counts in later sees it closed
      active_.fetch_add(1, std::memory_order_seq_cst);
      if (gen_.load(std::memory_order_seq_cst) == g && closed_.load(std::memory_order_seq_cst) != g) {
        const int64_t me = slot_.fetch_add(1, std::memory_order_relaxed);
        if (me < participants_) {
          try {
            call_(ctx_, me);
          } catch (...) {
            std::lock_guard<std::mutex> lock(error_mutex_);
            if (!helper_error_) helper_error_ = std::current_exception();
          }
        }
      }
      active_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  std::mutex busy_;
  std::vector<pthread_t> handles_;  // the helpers started
  std::mutex error_mutex_;
  std::exception_ptr helper_error_;  // a helper's first error in the job, raised by run
  std::vector<int64_t> cpus_;
  void (*call_)(const void*, int64_t) = nullptr;
  const void* ctx_ = nullptr;
  int64_t participants_ = 0;
  std::atomic<int64_t> slot_{0};
  static inline thread_local bool inside_ = false;
  alignas(64) std::atomic<uint32_t> gen_{0};     // the job's number, bumped to open one
  alignas(64) std::atomic<uint32_t> closed_{0};  // the last job closed
  alignas(64) std::atomic<int32_t> active_{0};   // helpers counted in
  alignas(64) std::atomic<int32_t> sleepers_{0};
};

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

// work(me, queue) for each thread `me` of up to n (the calling thread and the pool's helpers;
// the calling thread alone when that is one), each taking tiles of [0, n) from the shared queue
// until none is left.
template <typename Work>
void run_tiles(int64_t n, const Work& work) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  TileQueue queue(n, threads);
  if (threads <= 1) work(int64_t{0}, queue);
  else TilePool::get().run(threads, [&](int64_t me) { work(me, queue); });
}

// at::parallel_for's contract (f(b, e) on disjoint ranges covering [begin, end), each of at least
// grain unless the range is smaller) on the pool
template <typename F>
void parallel_rows(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t threads = at::get_num_threads();
  if (n <= grain || threads <= 1) { f(begin, end); return; }
  const int64_t chunks = std::min<int64_t>(threads, (n + grain - 1) / std::max<int64_t>(grain, 1));
  run_tiles(chunks, [&](int64_t me, TileQueue& q) {
    for (int64_t t = q.take(me); t >= 0; t = q.take(me)) f(begin + n * t / chunks, begin + n * (t + 1) / chunks);
  });
}

}  // namespace
}  // namespace tessera
