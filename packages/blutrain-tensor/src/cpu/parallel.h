// cpu/parallel.h: the process's CPU thread budget and the one pool that spends it.
//
// Policy. Every parallel CPU loop of blutrain (the op kernels here, and blutrain-linalg's GEMMs:
// blocks of their output through bt_cpu_parallel_items, or with BLUTRAIN_BLAS_THREADS=jobs
// OpenBLAS's jobs through bt_cpu_run_blas_jobs) runs on one pool of num_threads() - 1 workers
// plus the calling thread, so the process never has more runnable threads than its budget, and
// a GEMM gets the whole budget while the op loops are idle (and the reverse). The budget defaults
// to OMP_NUM_THREADS when set, else available_cpus(): the CPUs of the process's affinity mask,
// capped by its cgroup CPU quota (not the host's count). A worker spins about kSpinUs after its
// last item (the next op usually follows within a few microseconds) and then sleeps on a
// condition variable, so an idle pool costs no core; a caller waiting at the join for a worker's
// item spins as long, then sleeps.
//
// Results never depend on the thread count: every caller computes each output element (row,
// chunk, GEMM block) the same way whichever thread runs it (a contract of the kernels, not of
// the pool; OpenBLAS's own threaded GEMM under BLUTRAIN_BLAS_THREADS=jobs is the exception).
//
// Note [claiming, not assigning]
// A region is a list of items (parallel_ranges: `count` contiguous chunks whose boundaries
// depend only on n, grain and the budget; OpenBLAS: its jobs). No item belongs to a thread: the
// caller and every worker that wakes claim the next one from one atomic word (region number,
// next item, items) until none is left, and the caller's join waits only for items that were
// claimed, never for a worker that has not woken. On a loaded machine (more runnable threads
// than cores) a worker the scheduler has not run yet takes nothing, and the caller runs every
// chunk itself: a region is never slower than on one thread by more than the posting (a few
// microseconds), where waiting for every worker to check in cost a scheduler timeslice (ms)
// per region. Results stay bitwise the same whoever runs a chunk: chunk boundaries never depend
// on which thread ran what, kernels write per-chunk (never per-thread) partials and combine them
// in chunk order, and no kernel is told its thread's number. Limits: a worker descheduled in
// the middle of an item still delays the join by that item; OpenBLAS's jobs (and the compiled
// kernels' OpenMP teams, blutrain-compiler's kmp_pool.c) wait on each other and so need all
// their threads running at once: one item per thread, and a descheduled one still stalls them.
//
// Note [nested and concurrent regions]
// One region runs at a time. A parallel_for started inside a region (a kernel calling a helper
// that is itself parallel), or from a second Python thread while another region runs, runs
// serially on its caller; OpenBLAS's jobs, which wait on each other and so must run at the same
// time, get temporary threads in that case (correct, only slower).
//
// Note [fork]
// A child forked while the pool exists has none of its threads: the child drops them (leaked,
// never joined) and starts fresh workers at its first parallel region.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace bt::cpu {

// CPUs this process may run on: the affinity mask, capped by the cgroup (v1 or v2) CPU quota
// rounded up; at least 1.
int available_cpus();
// The CPU limit of the tightest cgroup quota over this process's cgroup and its parents (v1 or
// v2), rounded up; 0 when none. Arguments: /proc/self/cgroup and /sys/fs/cgroup (tests pass
// a fake tree).
int cgroup_cpus(const std::string& self_cgroup, const std::string& root);
// The budget: threads that run a parallel region (the caller included).
int num_threads();
// Sets the budget (n >= 1; the caller checks) and OpenBLAS's thread count with it.
void set_num_threads(int n);
// Whether the calling thread is inside a parallel region (a nested one would run serially).
bool in_parallel_region();

// Test hooks. pool_hold_workers(true): workers woken for a region of ranges wait before claiming
// (as if the scheduler had not run them); regions still finish, on their callers. pool_stats():
// {regions run on the pool, items run by their callers, items run by workers, joins where the
// caller slept waiting for an item a worker had claimed}, counted since the process started.
void pool_hold_workers(bool hold);
std::vector<uint64_t> pool_stats();

// Calls fn(ctx, begin, end) over contiguous ranges covering [0, n) exactly once, on up to
// num_threads() threads; ranges are at least `grain` long. Exceptions thrown by fn reach the
// caller (the first one; the other ranges still run).
void parallel_ranges(int64_t n, int64_t grain, void (*fn)(void*, int64_t, int64_t), void* ctx);

// OpenBLAS's threads callback (openblas_threads_callback): runs dojob(i, jobs + i * job_size,
// arg) for i in [0, n) on n threads at once and returns when all are done.
extern "C" void bt_cpu_run_blas_jobs(int sync, void (*dojob)(int, void*, int), int n,
                                     size_t job_size, void* jobs, int arg) noexcept;
// blutrain-linalg's parallel loop (bt_linalg_parallel_fn): parallel_ranges with grain 1. Its
// GEMMs run blocks of their output on it, each block by single-threaded OpenBLAS.
extern "C" void bt_cpu_parallel_items(int64_t n, void (*fn)(void*, int64_t, int64_t),
                                      void* ctx) noexcept;
// Gives blutrain-linalg's GEMMs the budget, as BLUTRAIN_BLAS_THREADS says: "jobs" (the
// default: OpenBLAS's threaded GEMM, its jobs run by bt_cpu_run_blas_jobs; the bits of
// OpenBLAS's own threads at the same count), "blocks" (blocks of each GEMM's output claimed by
// the pool's threads, OpenBLAS on one thread; results independent of the budget) or "openblas"
// (OpenBLAS's own threads). At module init; ValueError for another value.
void attach_blas();
// Switches the GEMMs' threading at run time (a mode above; no GEMM may be running): benchmarks
// and tests. blas_threads() is the current one ("" before attach_blas).
void set_blas_threads(const std::string& mode);
std::string blas_threads();

template <typename F>
void parallel_ranges(int64_t n, int64_t grain, F&& f) {
  using Fn = std::remove_reference_t<F>;
  parallel_ranges(
      n, grain, [](void* c, int64_t b, int64_t e) { (*static_cast<Fn*>(c))(b, e); },
      const_cast<void*>(static_cast<const void*>(&f)));
}

}  // namespace bt::cpu
