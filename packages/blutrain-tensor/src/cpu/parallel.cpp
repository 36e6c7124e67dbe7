// cpu/parallel.cpp: the thread budget and the pool (see parallel.h for the policy).
//
// Locking rule: `busy_` (an atomic flag, taken with compare-exchange) is held by the one thread
// that owns the current region, from posting it to seeing every worker done; workers never take
// it. `mu_` guards only the sleep / wake-up handshakes (the condition variables) and the
// worker list; nothing runs user code while holding it.
#include "parallel.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <chrono>
#include <cmath>
#include <condition_variable>
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
constexpr int64_t kSpinUs = 50;         // microseconds
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

// One region: contiguous ranges handed out dynamically, or OpenBLAS's jobs (one per thread).
struct Region {
  // ranges
  void (*fn)(void*, int64_t, int64_t) = nullptr;
  void* ctx = nullptr;
  int64_t n = 0, chunk = 1;
  std::atomic<int64_t> next{0};
  // BLAS jobs
  void (*dojob)(int, void*, int) = nullptr;
  char* jobs = nullptr;
  size_t job_size = 0;
  int arg = 0, njobs = 0;
  // the first exception
  std::mutex err_mu;
  std::exception_ptr err;

  void run(int pid) noexcept {
    try {
      if (dojob) {
        if (pid < njobs) dojob(pid, jobs + static_cast<size_t>(pid) * job_size, arg);
        return;
      }
      for (;;) {
        const int64_t b = next.fetch_add(chunk, std::memory_order_relaxed);
        if (b >= n) return;
        fn(ctx, b, std::min(n, b + chunk));
      }
    } catch (...) {
      std::lock_guard<std::mutex> lk(err_mu);
      if (!err) err = std::current_exception();
    }
  }
};

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

  // Runs r on `threads` threads (the caller is thread 0); false when the pool is taken (a
  // nested or concurrent region, Note [nested and concurrent regions]): the caller runs alone.
  bool run(Region& r, int threads) {
    if (t_in_region) return false;
    bool expected = false;
    if (!busy_.compare_exchange_strong(expected, true, std::memory_order_acquire)) return false;
    t_in_region = true;
    start_workers(threads - 1);
    const int w = static_cast<int>(workers_->size());
    region_ = &r;
    pending_.store(w, std::memory_order_seq_cst);
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lk(mu_);
      wake_cv_.notify_all();
    }
    r.run(0);
    if (!spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock<std::mutex> lk(mu_);
      owner_sleeping_.store(true, std::memory_order_seq_cst);
      done_cv_.wait(lk, [&] { return pending_.load(std::memory_order_seq_cst) == 0; });
      owner_sleeping_.store(false, std::memory_order_relaxed);
    }
    region_ = nullptr;
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
    busy_.store(false);
    stop_ = false;
    t_in_region = false;
  }

 private:
  Pool() { pthread_atfork(nullptr, nullptr, [] { Pool::get().after_fork_in_child(); }); }

  void acquire_exclusive() {
    for (;;) {
      bool expected = false;
      if (busy_.compare_exchange_weak(expected, true, std::memory_order_acquire)) return;
      std::this_thread::yield();
    }
  }

  // Workers are kept up to the budget minus one (the caller); a region with fewer threads
  // leaves the rest idle for it. Called with busy_ held.
  void start_workers(int want) {
    want = std::max(want, std::max(0, size() - 1));
    if (static_cast<int>(workers_->size()) >= want) return;
    std::lock_guard<std::mutex> lk(mu_);
    const uint64_t e = epoch_.load();
    for (int i = static_cast<int>(workers_->size()); i < want; ++i) {
      workers_->emplace_back([this, i, e] { worker_main(i, e); });
    }
  }

  void stop_workers() {  // with busy_ held
    if (workers_->empty()) return;
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      pending_.store(static_cast<int>(workers_->size()));
      epoch_.fetch_add(1, std::memory_order_seq_cst);
      wake_cv_.notify_all();
    }
    for (auto& t : *workers_) t.join();
    workers_->clear();
    stop_ = false;
  }

  void worker_main(int index, uint64_t seen) {
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
      if (stop_) return;
      // Every worker acknowledges every region (pending_ counts them all), so none can miss
      // one or see a later region's fields while an earlier one is in flight.
      region_->run(index + 1);
      if (pending_.fetch_sub(1, std::memory_order_seq_cst) == 1 &&
          owner_sleeping_.load(std::memory_order_seq_cst)) {
        std::lock_guard<std::mutex> lk(mu_);
        done_cv_.notify_one();
      }
    }
  }

  std::atomic<int> budget_{0};  // 0: not decided yet (size() reads the environment)
  std::atomic<bool> busy_{false};
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> pending_{0};
  std::atomic<int> sleeping_{0};
  std::atomic<bool> owner_sleeping_{false};
  Region* region_ = nullptr;
  bool stop_ = false;
  std::mutex mu_;
  std::condition_variable wake_cv_, done_cv_;
  std::vector<std::thread>* workers_ = new std::vector<std::thread>();
};

void rethrow(Region& r) {
  if (r.err) std::rethrow_exception(r.err);
}

// The BLAS's threading: our pool through its callback, unless BLUTRAIN_BLAS_THREADS=openblas.
void configure_blas(int n) {
  const auto* api = static_cast<const bt_linalg_api*>(linalg_hooks().api);
  if (!api) return;
  api->set_option("num_threads", n);
  static const bool own_pool = [] {
    const char* e = std::getenv("BLUTRAIN_BLAS_THREADS");
    return e && std::strcmp(e, "openblas") == 0;
  }();
  if (!own_pool && api->struct_size >= offsetof(bt_linalg_api, set_cpu_threads_callback) +
                                            sizeof(api->set_cpu_threads_callback)) {
    api->set_cpu_threads_callback(&bt_cpu_run_blas_jobs);
  }
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

bool in_parallel_region() { return t_in_region; }

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
    if (Pool::get().run(r, threads)) {
      rethrow(r);
      return;
    }
  }
  fn(ctx, 0, n);
}

extern "C" void bt_cpu_run_blas_jobs(int, void (*dojob)(int, void*, int), int n, size_t job_size,
                                     void* jobs, int arg) noexcept {
  if (n <= 0) return;
  Region r;
  r.dojob = dojob;
  r.jobs = static_cast<char*>(jobs);
  r.job_size = job_size;
  r.arg = arg;
  r.njobs = n;
  if (n == 1) {
    r.run(0);
  } else if (n > num_threads() || !Pool::get().run(r, n)) {
    // The jobs wait on each other, so each needs a thread of its own now (Note [nested and
    // concurrent regions]).
    std::vector<std::thread> extra;
    for (int i = 1; i < n; ++i) extra.emplace_back([&r, i] { r.run(i); });
    r.run(0);
    for (auto& t : extra) t.join();
  }
  // OpenBLAS's jobs raise nothing, and nothing may unwind into its C frames.
}

}  // namespace bt::cpu
