// cpu/parallel.cpp: the thread budget and the pool (see parallel.h for the policy).
//
// Locking rule: `busy_` (an atomic flag, taken with compare-exchange) is held by the one thread
// that owns the current region, from posting it to seeing every item done; workers never take
// it. Items are claimed with a compare-exchange on `claim_` (Note [claiming, not assigning]).
// `mu_` guards only the sleep / wake-up handshakes (the condition variables) and the worker
// list; nothing runs user code while holding it.
#include "parallel.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define BT_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define BT_CPU_RELAX() asm volatile("yield" ::: "memory")
#else
#define BT_CPU_RELAX() ((void)0)
#endif

#include "../primitives.h"
#include "blutrain/linalg.h"

namespace bt::cpu {

namespace {

// How long an idle worker (or a region's owner waiting for its workers) spins before sleeping:
// long enough to span the host work between two ops, short against any op worth threading.
constexpr int64_t kSpinUs = 50;          // microseconds
constexpr int64_t kRangesPerThread = 4;  // dynamic chunks: a descheduled thread delays little

// ---- the budget's default ----------------------------------------------------------------------

int affinity_cpus() {
  for (int ncpu = 1024; ncpu <= (1 << 16); ncpu *= 4) {
    cpu_set_t* set = CPU_ALLOC(ncpu);
    if (!set) break;
    const size_t sz = CPU_ALLOC_SIZE(ncpu);
    CPU_ZERO_S(sz, set);
    if (sched_getaffinity(0, sz, set) == 0) {
      const int n = CPU_COUNT_S(sz, set);
      CPU_FREE(set);
      return std::max(1, n);
    }
    CPU_FREE(set);
    if (errno != EINVAL) break;  // EINVAL: the kernel's mask is larger, try a bigger set
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

bool read_text(const std::string& path, std::string& out) {
  std::ifstream f(path);
  if (!f) return false;
  std::stringstream ss;
  ss << f.rdbuf();
  out = ss.str();
  return true;
}

// CPUs allowed by a quota (us per period us), rounded up; 0 when there is no limit.
int quota_cpus(double quota, double period) {
  if (!(quota > 0) || !(period > 0)) return 0;
  return std::max(1, static_cast<int>(std::ceil(quota / period - 1e-9)));
}

}  // namespace

// The tightest CPU quota on the path from this process's cgroup up to the root (a parent's
// limit binds its children too); 0 when none. cgroup v2: cpu.max "quota period" or "max
// period"; v1: cpu.cfs_quota_us (-1: none) and cpu.cfs_period_us. `self_cgroup` is
// /proc/self/cgroup and `root` /sys/fs/cgroup but for tests.
int cgroup_cpus(const std::string& self_cgroup, const std::string& root) {
  std::string self;
  if (!read_text(self_cgroup, self)) return 0;
  int best = 0;
  auto take = [&](int n) {
    if (n > 0 && (best == 0 || n < best)) best = n;
  };
  std::istringstream lines(self);
  std::string line;
  while (std::getline(lines, line)) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    std::string path = line.substr(b + 1);
    const bool v2 = controllers.empty();
    bool v1_cpu = false;
    std::istringstream cs(controllers);
    for (std::string c; std::getline(cs, c, ',');) v1_cpu = v1_cpu || c == "cpu";
    if (!v2 && !v1_cpu) continue;
    // Inside a container the path may be the host's while the mount shows the container's
    // own cgroup at the root: walk up from the path, and the root is always looked at.
    std::vector<std::string> mounts;
    if (v2) {
      mounts = {root};
    } else {
      mounts = {root + "/cpu", root + "/cpu,cpuacct", root + "/cpuacct,cpu"};
    }
    for (const std::string& m : mounts) {
      std::string p = path;
      for (;;) {
        const std::string dir = m + (p == "/" ? "" : p);
        std::string text;
        if (v2) {
          if (read_text(dir + "/cpu.max", text)) {
            std::istringstream t(text);
            std::string q;
            double period = 0;
            t >> q >> period;
            if (q != "max") take(quota_cpus(std::atof(q.c_str()), period));
          }
        } else {
          std::string per;
          if (read_text(dir + "/cpu.cfs_quota_us", text) &&
              read_text(dir + "/cpu.cfs_period_us", per)) {
            take(quota_cpus(std::atof(text.c_str()), std::atof(per.c_str())));
          }
        }
        if (p.empty() || p == "/") break;
        const size_t slash = p.find_last_of('/');
        p = slash == 0 || slash == std::string::npos ? "/" : p.substr(0, slash);
      }
    }
  }
  return best;
}

namespace {

int env_threads() {
  const char* e = std::getenv("OMP_NUM_THREADS");  // "4" or a nested list "4,2": the first
  if (!e || !*e) return 0;
  char* end = nullptr;
  const long v = std::strtol(e, &end, 10);
  return v >= 1 && v <= 4096 && (end == e + std::strlen(e) || *end == ',') ? static_cast<int>(v)
                                                                           : 0;
}

// ---- the pool ---------------------------------------------------------------------------------

thread_local bool t_in_region = false;  // this thread runs (or owns) a region

// Spins (then yields) until pred() holds or kSpinUs pass; whether it holds.
template <typename P>
bool spin_until(P&& pred) {
  if (pred()) return true;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 1;; ++i) {
    BT_CPU_RELAX();
    if (pred()) return true;
    if ((i & 63) == 0 &&
        std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(kSpinUs)) {
      return pred();
    }
  }
}

// One region: `count` items claimed one at a time from the pool's claim word (Note [claiming,
// not assigning], parallel.h): contiguous ranges of `chunk` elements, or OpenBLAS's jobs.
struct Region {
  // ranges: item i is [i * chunk, min(n, (i + 1) * chunk))
  void (*fn)(void*, int64_t, int64_t) = nullptr;
  void* ctx = nullptr;
  int64_t n = 0, chunk = 1;
  // BLAS jobs: item i is job i
  void (*dojob)(int, void*, int) = nullptr;
  char* jobs = nullptr;
  size_t job_size = 0;
  int arg = 0;
  int count = 0;  // items
  // the first exception
  std::mutex err_mu;
  std::exception_ptr err;

  void run_item(int i) noexcept {
    try {
      if (dojob) {
        dojob(i, jobs + static_cast<size_t>(i) * job_size, arg);
      } else {
        const int64_t b = static_cast<int64_t>(i) * chunk;
        fn(ctx, b, std::min(n, b + chunk));
      }
    } catch (...) {
      std::lock_guard<std::mutex> lk(err_mu);
      if (!err) err = std::current_exception();
    }
  }
};

// The claim word: [region sequence number : 31 | one item per thread : 1 | next item : 16 |
// items : 16]. One CAS both checks that the region is still the one a thread saw (the sequence
// number: a worker that read the word of a region that then ended claims nothing from the next
// one by mistake) and takes an item.
constexpr int64_t kMaxItems = 0xFFFF;  // items a region may have (16 bits of the word)
constexpr uint64_t pack(uint64_t seq, bool one, uint64_t count) {
  return (seq & 0x7FFFFFFFu) << 33 | uint64_t{one} << 32 | count;
}
constexpr bool word_one(uint64_t w) { return (w >> 32 & 1) != 0; }
constexpr int word_next(uint64_t w) { return static_cast<int>(w >> 16 & 0xFFFF); }
constexpr int word_count(uint64_t w) { return static_cast<int>(w & 0xFFFF); }

class Pool {
 public:
  static Pool& get() {
    static Pool* p = new Pool();  // never destroyed: workers may outlive static destructors
    return *p;
  }

  int size() {
    int b = budget_.load(std::memory_order_relaxed);
    if (b > 0) return b;
    const int e = env_threads();
    b = e > 0 ? e : available_cpus();
    int expected = 0;
    budget_.compare_exchange_strong(expected, b);
    return budget_.load();
  }

  void resize(int n) {
    acquire_exclusive();
    stop_workers();
    budget_.store(n);
    busy_.store(false, std::memory_order_release);
  }

  // Runs r's items on up to `threads` threads, the caller claiming too; false when the pool is
  // taken (a nested or concurrent region, Note [nested and concurrent regions]): the caller then
  // runs alone. One item per thread for BLAS jobs (they wait on each other).
  bool run(Region& r, int threads) {
    if (t_in_region) return false;
    bool expected = false;
    if (!busy_.compare_exchange_strong(expected, true, std::memory_order_acquire)) return false;
    t_in_region = true;
    start_workers(threads - 1);
    region_.store(&r, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    seq_ = seq_ + 1;
    claim_.store(pack(seq_, r.dojob != nullptr, r.count), std::memory_order_release);
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      wake_cv_.notify_all();
    }
    stats_regions_.fetch_add(1, std::memory_order_relaxed);
    claim_and_run(false);
    // The join: every item is claimed by now (or is being run by a worker that claimed it);
    // wait for those only, never for a worker that has not woken.
    const int count = r.count;
    if (!spin_until([&] { return done_.load(std::memory_order_acquire) == count; })) {
      std::unique_lock<std::mutex> lk(mu_);
      owner_sleeping_.store(true, std::memory_order_seq_cst);
      done_cv_.wait(lk, [&] { return done_.load(std::memory_order_seq_cst) == count; });
      owner_sleeping_.store(false, std::memory_order_relaxed);
      stats_waits_.fetch_add(1, std::memory_order_relaxed);
    }
    region_.store(nullptr, std::memory_order_relaxed);
    t_in_region = false;
    busy_.store(false, std::memory_order_release);
    return true;
  }

  void after_fork_in_child() {
    // Note [fork]: the workers do not exist here; leak their handles (never joined), and
    // rebuild the synchronisation objects, which another thread may have held at the fork.
    workers_ = new std::vector<std::thread>();
    new (&mu_) std::mutex();
    new (&wake_cv_) std::condition_variable();
    new (&done_cv_) std::condition_variable();
    sleeping_.store(0);
    owner_sleeping_.store(false);
    claim_.store(0);
    busy_.store(false);
    stop_.store(false);
    t_in_region = false;
  }

  // Test hook: while held, workers that wake for a region wait before claiming (a worker the
  // scheduler has not run); regions must still finish, on their callers.
  void hold_workers(bool h) { hold_.store(h, std::memory_order_seq_cst); }
  std::vector<uint64_t> stats() const {
    return {stats_regions_.load(), stats_caller_.load(), stats_worker_.load(), stats_waits_.load()};
  }

 private:
  Pool() {
    pthread_atfork(nullptr, nullptr, [] { Pool::get().after_fork_in_child(); });
  }

  void acquire_exclusive() {
    for (;;) {
      bool expected = false;
      if (busy_.compare_exchange_weak(expected, true, std::memory_order_acquire)) return;
      std::this_thread::yield();
    }
  }

  // Claims items of the current region and runs them until none is left (one at most for BLAS
  // jobs, which wait on each other); returns how many it ran (counted in the stats as it goes).
  // Item i of region s can only be claimed while s is the posted region, and s cannot end
  // before its claimed items are done, so the region (its fields, on its owner's stack)
  // outlives every item run here.
  uint64_t claim_and_run(bool worker) {
    uint64_t ran = 0;
    uint64_t w = claim_.load(std::memory_order_acquire);
    for (;;) {
      const int i = word_next(w);
      if (i >= word_count(w)) return ran;
      // the test hook: a worker still looping here may see the next region's word; held, it
      // goes back to wait (worker_main) instead of claiming from it
      if (worker && !word_one(w) && hold_.load(std::memory_order_relaxed)) return ran;
      if (!claim_.compare_exchange_weak(w, w + (uint64_t{1} << 16), std::memory_order_acquire,
                                        std::memory_order_acquire)) {
        continue;  // w reloaded: another thread took item i, or a new region was posted
      }
      Region* r = region_.load(std::memory_order_relaxed);
      r->run_item(i);
      ++ran;
      // counted before the item is marked done, so a caller past the join sees every count
      (worker ? stats_worker_ : stats_caller_).fetch_add(1, std::memory_order_relaxed);
      // the last item done ends the region: r is not touched after this
      if (done_.fetch_add(1, std::memory_order_seq_cst) + 1 == word_count(w) &&
          owner_sleeping_.load(std::memory_order_seq_cst)) {
        std::lock_guard<std::mutex> lk(mu_);
        done_cv_.notify_one();
      }
      if (word_one(w)) return ran;
      w = claim_.load(std::memory_order_acquire);
    }
  }

  // Workers are kept up to the budget minus one (the caller); a region with fewer items than
  // threads leaves the rest with nothing to claim. Called with busy_ held.
  void start_workers(int want) {
    want = std::max(want, std::max(0, size() - 1));
    if (static_cast<int>(workers_->size()) >= want) return;
    std::lock_guard<std::mutex> lk(mu_);
    const uint64_t e = epoch_.load();
    for (int i = static_cast<int>(workers_->size()); i < want; ++i) {
      workers_->emplace_back([this, e] { worker_main(e); });
    }
  }

  void stop_workers() {  // with busy_ held
    if (workers_->empty()) return;
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_.store(true);
      epoch_.fetch_add(1, std::memory_order_seq_cst);
      wake_cv_.notify_all();
    }
    for (auto& t : *workers_) t.join();
    workers_->clear();
    stop_.store(false);
  }

  void worker_main(uint64_t seen) {
    t_in_region = true;  // anything a worker runs is inside a region
    for (;;) {
      auto posted = [&] { return epoch_.load(std::memory_order_seq_cst) != seen; };
      if (!spin_until(posted)) {
        std::unique_lock<std::mutex> lk(mu_);
        sleeping_.fetch_add(1, std::memory_order_seq_cst);
        wake_cv_.wait(lk, posted);
        sleeping_.fetch_sub(1, std::memory_order_relaxed);
      }
      seen = epoch_.load(std::memory_order_acquire);
      if (stop_.load()) return;
      while (hold_.load(std::memory_order_relaxed) && !stop_.load() &&
             !word_one(claim_.load(std::memory_order_relaxed))) {  // (BLAS jobs need everyone)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      // Whatever is left of the newest region (nothing when its items ran out before this
      // worker woke: it then just waits for the next one).
      claim_and_run(true);
    }
  }

  std::atomic<int> budget_{0};  // 0: not decided yet (size() reads the environment)
  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> epoch_{0};  // bumped per region posted (wakes the workers)
  std::atomic<uint64_t> claim_{0};  // the claim word (pack())
  std::atomic<int> done_{0};        // items of the current region finished
  std::atomic<Region*> region_{nullptr};
  uint64_t seq_ = 0;  // regions posted (owner only, with busy_ held)
  std::atomic<int> sleeping_{0};
  std::atomic<bool> owner_sleeping_{false};
  std::atomic<bool> stop_{false};
  std::atomic<bool> hold_{false};
  std::atomic<uint64_t> stats_regions_{0}, stats_caller_{0}, stats_worker_{0}, stats_waits_{0};
  std::mutex mu_;
  std::condition_variable wake_cv_, done_cv_;
  std::vector<std::thread>* workers_ = new std::vector<std::thread>();
};

void rethrow(Region& r) {
  if (r.err) std::rethrow_exception(r.err);
}

// How GEMMs spend the budget (parallel.h): BLUTRAIN_BLAS_THREADS, or set_blas_threads.
// kDefaultBlasThreads stays "jobs" until blocks are measured on a quiet machine (Note [GEMM
// blocks] in blutrain-linalg: they change the 2-thread bits of some GEMMs, to the 1-thread ones).
constexpr const char* kDefaultBlasThreads = "jobs";
std::mutex g_blas_mu;  // guards g_blas_mode and the reconfiguration
std::string g_blas_mode;

std::string checked_blas_mode(const std::string& v) {
  if (v == "blocks" || v == "jobs" || v == "openblas") return v;
  throw ValueError("[blutrain.tensor] BLUTRAIN_BLAS_THREADS is '" + v +
                   "'; expected blocks, jobs (the default) or openblas");
}

// The BLAS's threading (Note [GEMM blocks] in blutrain-linalg's src/cpu/gemm_cpu.cpp): blocks of
// each GEMM on our pool (OpenBLAS single-threaded), OpenBLAS's jobs on our pool through its
// threads callback, or OpenBLAS's own threads. With g_blas_mu held.
void configure_blas_locked(int n) {
  const auto* api = static_cast<const bt_linalg_api*>(linalg_hooks().api);
  if (!api) return;
  if (g_blas_mode.empty()) {
    const char* e = std::getenv("BLUTRAIN_BLAS_THREADS");
    g_blas_mode = checked_blas_mode(e && *e ? e : kDefaultBlasThreads);
  }
  auto has = [&](size_t end) { return api->struct_size >= end; };
  if (has(offsetof(bt_linalg_api, set_cpu_parallel_for) + sizeof(api->set_cpu_parallel_for))) {
    api->set_cpu_parallel_for(g_blas_mode == "blocks" ? &bt_cpu_parallel_items : nullptr);
  }
  api->set_option("num_threads", n);
  if (has(offsetof(bt_linalg_api, set_cpu_threads_callback) +
          sizeof(api->set_cpu_threads_callback))) {
    api->set_cpu_threads_callback(g_blas_mode == "openblas" ? nullptr : &bt_cpu_run_blas_jobs);
  }
}

void configure_blas(int n) {
  std::lock_guard<std::mutex> lk(g_blas_mu);
  configure_blas_locked(n);
}

}  // namespace

int available_cpus() {
  static const int n = [] {
    const int a = affinity_cpus(), q = cgroup_cpus("/proc/self/cgroup", "/sys/fs/cgroup");
    return q > 0 ? std::min(a, q) : a;
  }();
  return n;
}

int num_threads() { return Pool::get().size(); }

void set_num_threads(int n) {
  Pool::get().resize(std::max(1, n));
  configure_blas(std::max(1, n));
}

void attach_blas() { configure_blas(num_threads()); }

void set_blas_threads(const std::string& mode) {
  std::lock_guard<std::mutex> lk(g_blas_mu);
  g_blas_mode = checked_blas_mode(mode);
  configure_blas_locked(num_threads());
}

std::string blas_threads() {
  std::lock_guard<std::mutex> lk(g_blas_mu);
  return g_blas_mode;
}

bool in_parallel_region() { return t_in_region; }

void pool_hold_workers(bool hold) { Pool::get().hold_workers(hold); }
std::vector<uint64_t> pool_stats() { return Pool::get().stats(); }

void parallel_ranges(int64_t n, int64_t grain, void (*fn)(void*, int64_t, int64_t), void* ctx) {
  if (n <= 0) return;
  grain = std::max<int64_t>(grain, 1);
  const int64_t most = (n + grain - 1) / grain;
  const int threads = static_cast<int>(std::min<int64_t>(num_threads(), most));
  if (threads > 1 && !t_in_region) {
    Region r;
    r.fn = fn;
    r.ctx = ctx;
    r.n = n;
    r.chunk = std::max(grain, (n + threads * kRangesPerThread - 1) / (threads * kRangesPerThread));
    r.chunk = std::max(r.chunk, (n + kMaxItems - 1) / kMaxItems);  // never binds: threads <= 4096
    r.count = static_cast<int>((n + r.chunk - 1) / r.chunk);
    if (Pool::get().run(r, threads)) {
      rethrow(r);
      return;
    }
  }
  fn(ctx, 0, n);
}

extern "C" void bt_cpu_parallel_items(int64_t n, void (*fn)(void*, int64_t, int64_t),
                                      void* ctx) noexcept {
  parallel_ranges(n, 1, fn, ctx);  // fn never throws (the linalg ABI's contract)
}

extern "C" void bt_cpu_run_blas_jobs(int, void (*dojob)(int, void*, int), int n, size_t job_size,
                                     void* jobs, int arg) noexcept {
  if (n <= 0) return;
  Region r;
  r.dojob = dojob;
  r.jobs = static_cast<char*>(jobs);
  r.job_size = job_size;
  r.arg = arg;
  r.count = n;
  if (n == 1) {
    r.run_item(0);
  } else if (n > num_threads() || !Pool::get().run(r, n)) {
    // The jobs wait on each other, so each needs a thread of its own now (Note [nested and
    // concurrent regions]).
    std::vector<std::thread> extra;
    for (int i = 1; i < n; ++i) extra.emplace_back([&r, i] { r.run_item(i); });
    r.run_item(0);
    for (auto& t : extra) t.join();
  }
  // OpenBLAS's jobs raise nothing, and nothing may unwind into its C frames.
}

}  // namespace bt::cpu
