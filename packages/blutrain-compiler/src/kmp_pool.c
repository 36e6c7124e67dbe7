/* kmp_pool.c: the OpenMP runtime entry points that LLVM's OpenMPIRBuilder emits for the
 * compiled CPU kernels' parallel loops, served by blutrain.tensor's CPU thread pool.
 *
 * Policy: the CPU pipeline lowers each fused kernel's outermost parallel loops through upstream
 * passes (affine-parallelize -> scf.parallel -> convert-scf-to-openmp), and LLVM translates
 * omp.parallel / omp.wsloop into calls of LLVM's OpenMP runtime ABI (libomp's __kmpc_*). A
 * second runtime (libomp, libgomp) would be a second pool: its own thread count beside
 * bt.set_num_threads, and idle threads spinning on the cores eager's pool is using. So a fork
 * runs its team on blutrain.tensor's pool (cpu/parallel.h) through the entry point that pool
 * gives OpenBLAS (bt_cpu_run_blas_jobs: n jobs on n threads at once, which a team with barriers
 * needs): one pool, one budget (bt.set_num_threads / OMP_NUM_THREADS / the CPU quota), never
 * more runnable threads than it. The pool's entry points arrive through btc_omp_attach (from
 * backend_cpu.py, which reads them from blutrain.tensor); unattached, every fork runs on its
 * caller alone.
 *
 * Only what the translation of a statically scheduled worksharing loop calls is here: fork, the
 * thread number, static init / fini, barrier. Scheduling is libomp's kmp_sch_static: thread t
 * of n takes the t-th of n contiguous, near-equal blocks of the iteration space, so each element
 * is computed by exactly one thread with the same arithmetic as the serial loop (results are
 * bitwise those of the serial code, whatever the budget).
 *
 * A fork inside a team, or while the calling thread is inside one of the pool's regions, runs
 * on a team of one (the pool runs one region at a time).
 *
 * Loaded with RTLD_GLOBAL by backend_cpu.py before any compiled code, so both the JIT and the
 * cached kernel libraries resolve these names here.
 */
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define BTC_RELAX() _mm_pause()
#else
#define BTC_RELAX() ((void)0)
#endif

#define BTC_EXPORT __attribute__((visibility("default")))
#define BTC_MAX_ARGS 32 /* captured values an outlined region may take (MLIR passes a few) */
#define BTC_SPINS 4000  /* barrier polls before yielding the core (~10 us of pauses) */

typedef struct ident ident_t; /* libomp's source-location record: unused here */
typedef void (*kmpc_micro)(int32_t* gtid, int32_t* btid, ...);

enum { kSchedStaticChunked = 33, kSchedStatic = 34 };

/* blutrain.tensor's pool (cpu/parallel.h) */
typedef void (*run_jobs_fn)(int sync, void (*dojob)(int, void*, int), int n, size_t job_size,
                            void* jobs, int arg);
static run_jobs_fn g_run_jobs;
static int (*g_num_threads)(void);
static _Bool (*g_in_region)(void);

/* A fork's team: what every member runs, and its barrier (sense-reversing). */
typedef struct team {
  kmpc_micro fn;
  int argc;
  void** args;
  int n;
  atomic_int arrived;
  atomic_int sense;
} team_t;

static __thread team_t* t_team; /* the team this thread runs in, if any */
static __thread int32_t t_tid;  /* its number in that team */

#define BTC_THREAD() (t_team ? t_tid : 0)
#define BTC_THREADS() (t_team ? t_team->n : 1)

BTC_EXPORT void btc_omp_attach(void* run_jobs, void* num_threads, void* in_region) {
  g_run_jobs = (run_jobs_fn)run_jobs;
  g_num_threads = (int (*)(void))num_threads;
  g_in_region = (_Bool (*)(void))in_region;
}

BTC_EXPORT int32_t __kmpc_global_thread_num(ident_t* loc) {
  (void)loc;
  return BTC_THREAD();
}

/* Calls fn(&tid, &tid, args[0..argc)) on this thread: a switch on argc (C cannot forward a
 * va_list into a variadic call). */
static void call_micro(kmpc_micro fn, int32_t tid, int argc, void** a) {
  int32_t g = tid, b = tid;
  switch (argc) {
#define A1 a[0]
#define A2 A1, a[1]
#define A3 A2, a[2]
#define A4 A3, a[3]
#define A5 A4, a[4]
#define A6 A5, a[5]
#define A7 A6, a[6]
#define A8 A7, a[7]
    case 0:
      fn(&g, &b);
      break;
    case 1:
      fn(&g, &b, A1);
      break;
    case 2:
      fn(&g, &b, A2);
      break;
    case 3:
      fn(&g, &b, A3);
      break;
    case 4:
      fn(&g, &b, A4);
      break;
    case 5:
      fn(&g, &b, A5);
      break;
    case 6:
      fn(&g, &b, A6);
      break;
    case 7:
      fn(&g, &b, A7);
      break;
    case 8:
      fn(&g, &b, A8);
      break;
    default: {
      /* more than 8 captured values: up to 32, the rest passed as trailing pointers (extra
       * variadic arguments are ignored by the callee) */
      fn(&g, &b, A8, a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15], a[16], a[17], a[18],
         a[19], a[20], a[21], a[22], a[23], a[24], a[25], a[26], a[27], a[28], a[29], a[30], a[31]);
    }
  }
}

/* One team member: thread number i of the team (the pool's job i). */
static void run_member(int i, void* ctx, int arg) {
  (void)arg;
  team_t* tm = (team_t*)ctx;
  team_t* outer = t_team;
  const int32_t outer_tid = t_tid;
  t_team = tm;
  t_tid = i;
  call_micro(tm->fn, i, tm->argc, tm->args);
  t_team = outer;
  t_tid = outer_tid;
}

BTC_EXPORT void __kmpc_fork_call(ident_t* loc, int32_t argc, kmpc_micro fn, ...) {
  (void)loc;
  void* args[BTC_MAX_ARGS] = {0};
  va_list ap;
  va_start(ap, fn);
  for (int i = 0; i < argc && i < BTC_MAX_ARGS; ++i) args[i] = va_arg(ap, void*);
  va_end(ap);
  if (argc > BTC_MAX_ARGS) __builtin_trap(); /* never emitted by our pipeline */
  team_t tm = {fn, argc, args, 1, 0, 0};
  if (g_run_jobs && g_num_threads && !t_team && !(g_in_region && g_in_region())) {
    tm.n = g_num_threads();
  }
  if (tm.n <= 1) {
    tm.n = 1;
    run_member(0, &tm, 0);
    return;
  }
  g_run_jobs(0, run_member, tm.n, 0, &tm, 0); /* job_size 0: every job reads the team */
}

/* The calling thread's block of [*lower, *upper] (inclusive, step incr > 0) under kmp_sch_static
 * or kmp_sch_static_chunked; *stride is the distance to its next chunk. */
#define STATIC_INIT(NAME, T, ST)                                                           \
  BTC_EXPORT void NAME(ident_t* loc, int32_t gtid, int32_t sched, int32_t* last, T* lower, \
                       T* upper, ST* stride, ST incr, ST chunk) {                          \
    (void)loc;                                                                             \
    (void)gtid;                                                                            \
    const int64_t n = BTC_THREADS(), t = BTC_THREAD();                                     \
    const T lo = *lower, hi = *upper;                                                      \
    const T step = (T)(incr > 0 ? incr : 1);                                               \
    const T trips = hi < lo ? 0 : (T)((hi - lo) / step + 1);                               \
    if (n == 1 || trips == 0) {                                                            \
      *last = trips > 0;                                                                   \
      *stride = (ST)(trips * step);                                                        \
      return;                                                                              \
    }                                                                                      \
    if (sched == kSchedStaticChunked && chunk > 0) {                                       \
      *lower = lo + (T)(t * chunk) * step;                                                 \
      *upper = *lower + (T)(chunk - 1) * step;                                             \
      if (*upper > hi) *upper = hi;                                                        \
      *stride = (ST)((T)(n * chunk) * step);                                               \
      *last = ((trips - 1) / (T)chunk) % (T)n == (T)t;                                     \
      return;                                                                              \
    }                                                                                      \
    const T base = trips / (T)n, extra = trips % (T)n;                                     \
    const T first = (T)t * base + ((T)t < extra ? (T)t : extra);                           \
    const T count = base + ((T)t < extra ? 1 : 0);                                         \
    if (count == 0) { /* more threads than iterations: an empty block */                   \
      *lower = hi + step;                                                                  \
      *upper = hi;                                                                         \
      *last = 0;                                                                           \
    } else {                                                                               \
      *lower = lo + first * step;                                                          \
      *upper = *lower + (count - 1) * step;                                                \
      *last = first + count == trips;                                                      \
    }                                                                                      \
    *stride = (ST)(trips * step);                                                          \
  }

STATIC_INIT(__kmpc_for_static_init_4, int32_t, int32_t)
STATIC_INIT(__kmpc_for_static_init_4u, uint32_t, int32_t)
STATIC_INIT(__kmpc_for_static_init_8, int64_t, int64_t)
STATIC_INIT(__kmpc_for_static_init_8u, uint64_t, int64_t)

BTC_EXPORT void __kmpc_for_static_fini(ident_t* loc, int32_t gtid) {
  (void)loc;
  (void)gtid;
}

BTC_EXPORT void __kmpc_barrier(ident_t* loc, int32_t gtid) {
  (void)loc;
  (void)gtid;
  team_t* tm = t_team;
  if (!tm || tm->n <= 1) return;
  /* the sense flips only once all n arrived, this thread included: read before arriving */
  const int sense = atomic_load_explicit(&tm->sense, memory_order_acquire);
  if (atomic_fetch_add_explicit(&tm->arrived, 1, memory_order_acq_rel) == tm->n - 1) {
    atomic_store_explicit(&tm->arrived, 0, memory_order_relaxed);
    atomic_store_explicit(&tm->sense, !sense, memory_order_release);
    return;
  }
  /* every member holds a thread of its own (the pool's jobs run at once): waiting is short */
  for (int k = 0; atomic_load_explicit(&tm->sense, memory_order_acquire) == sense; ++k) {
    if (k < BTC_SPINS) {
      BTC_RELAX();
    } else {
      sched_yield();
    }
  }
}

/* How many threads a fork runs on now: the pool's budget (1 when unattached). */
BTC_EXPORT int btc_omp_max_threads(void) { return g_num_threads ? g_num_threads() : 1; }
