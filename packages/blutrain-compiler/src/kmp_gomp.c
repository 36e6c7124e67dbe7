/* kmp_gomp.c: the five OpenMP runtime entry points that LLVM's OpenMPIRBuilder emits for the
 * compiled CPU kernels' parallel loops, served by GCC's libgomp.
 *
 * Policy: the CPU pipeline lowers each fused kernel's outermost parallel loops through upstream
 * passes (affine-parallelize -> scf.parallel -> convert-scf-to-openmp), and LLVM translates
 * omp.parallel / omp.wsloop into calls of LLVM's OpenMP runtime ABI (libomp's __kmpc_*). libomp
 * is not installable from PyPI here, while libgomp is already in the process: blutrain.tensor's
 * eager CPU kernels run on it. So these entry points map a fork onto a libgomp parallel region:
 * compiled and eager kernels share one thread pool and one thread count (OMP_NUM_THREADS), and
 * never oversubscribe each other. Only what the translation of a statically scheduled worksharing
 * loop calls is here: fork, the thread number, static init / fini, barrier. Scheduling is
 * libomp's kmp_sch_static: thread t of n takes the t-th of n contiguous, near-equal blocks of the
 * iteration space, so each element is computed by exactly one thread with the same arithmetic as
 * the serial loop (results are bitwise those of the serial code).
 *
 * A fork inside a parallel region (a kernel called from a user's OpenMP thread) runs on a team
 * of one, as libgomp's nesting default does. Built without OpenMP, every fork runs the body
 * once, on the calling thread, with the whole iteration space.
 *
 * Loaded with RTLD_GLOBAL by backend_cpu.py before any compiled code, so both the JIT and the
 * cached kernel libraries resolve these names here (or in a real libomp loaded earlier, which
 * serves them just as well).
 */
#include <stdarg.h>
#include <stdint.h>

#ifdef _OPENMP
#include <omp.h>
#define BTC_THREAD() omp_get_thread_num()
#define BTC_THREADS() omp_get_num_threads()
#else
#define BTC_THREAD() 0
#define BTC_THREADS() 1
#endif

#define BTC_EXPORT __attribute__((visibility("default")))
#define BTC_MAX_ARGS 32 /* captured values an outlined region may take (MLIR passes a few) */

typedef struct ident ident_t; /* libomp's source-location record: unused here */
typedef void (*kmpc_micro)(int32_t *gtid, int32_t *btid, ...);

enum { kSchedStaticChunked = 33, kSchedStatic = 34 };

BTC_EXPORT int32_t __kmpc_global_thread_num(ident_t *loc) {
  (void)loc;
  return BTC_THREAD();
}

/* Calls fn(&tid, &tid, args[0..argc)) on this thread: a switch on argc (C cannot forward a
 * va_list into a variadic call). */
static void call_micro(kmpc_micro fn, int32_t tid, int argc, void **a) {
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
    case 0: fn(&g, &b); break;
    case 1: fn(&g, &b, A1); break;
    case 2: fn(&g, &b, A2); break;
    case 3: fn(&g, &b, A3); break;
    case 4: fn(&g, &b, A4); break;
    case 5: fn(&g, &b, A5); break;
    case 6: fn(&g, &b, A6); break;
    case 7: fn(&g, &b, A7); break;
    case 8: fn(&g, &b, A8); break;
    default: {
      /* more than 8 captured values: up to 32, the rest passed as trailing pointers (extra
       * variadic arguments are ignored by the callee) */
      fn(&g, &b, A8, a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15], a[16], a[17], a[18],
         a[19], a[20], a[21], a[22], a[23], a[24], a[25], a[26], a[27], a[28], a[29], a[30],
         a[31]);
    }
  }
}

BTC_EXPORT void __kmpc_fork_call(ident_t *loc, int32_t argc, kmpc_micro fn, ...) {
  (void)loc;
  void *args[BTC_MAX_ARGS] = {0};
  va_list ap;
  va_start(ap, fn);
  for (int i = 0; i < argc && i < BTC_MAX_ARGS; ++i) args[i] = va_arg(ap, void *);
  va_end(ap);
  if (argc > BTC_MAX_ARGS) __builtin_trap(); /* never emitted by our pipeline */
#ifdef _OPENMP
#pragma omp parallel
  call_micro(fn, BTC_THREAD(), argc, args);
#else
  call_micro(fn, 0, argc, args);
#endif
}

/* The calling thread's block of [*lower, *upper] (inclusive, step incr > 0) under kmp_sch_static
 * or kmp_sch_static_chunked; *stride is the distance to its next chunk. */
#define STATIC_INIT(NAME, T, ST)                                                                \
  BTC_EXPORT void NAME(ident_t *loc, int32_t gtid, int32_t sched, int32_t *last, T *lower,     \
                       T *upper, ST *stride, ST incr, ST chunk) {                              \
    (void)loc;                                                                                 \
    (void)gtid;                                                                                \
    const int64_t n = BTC_THREADS(), t = BTC_THREAD();                                         \
    const T lo = *lower, hi = *upper;                                                          \
    const T step = (T)(incr > 0 ? incr : 1);                                                   \
    const T trips = hi < lo ? 0 : (T)((hi - lo) / step + 1);                                   \
    if (n == 1 || trips == 0) {                                                                \
      *last = trips > 0;                                                                       \
      *stride = (ST)(trips * step);                                                            \
      return;                                                                                  \
    }                                                                                          \
    if (sched == kSchedStaticChunked && chunk > 0) {                                           \
      *lower = lo + (T)(t * chunk) * step;                                                     \
      *upper = *lower + (T)(chunk - 1) * step;                                                 \
      if (*upper > hi) *upper = hi;                                                            \
      *stride = (ST)((T)(n * chunk) * step);                                                   \
      *last = ((trips - 1) / (T)chunk) % (T)n == (T)t;                                         \
      return;                                                                                  \
    }                                                                                          \
    const T base = trips / (T)n, extra = trips % (T)n;                                         \
    const T first = (T)t * base + ((T)t < extra ? (T)t : extra);                               \
    const T count = base + ((T)t < extra ? 1 : 0);                                             \
    if (count == 0) { /* more threads than iterations: an empty block */                       \
      *lower = hi + step;                                                                      \
      *upper = hi;                                                                             \
      *last = 0;                                                                               \
    } else {                                                                                   \
      *lower = lo + first * step;                                                              \
      *upper = *lower + (count - 1) * step;                                                    \
      *last = first + count == trips;                                                          \
    }                                                                                          \
    *stride = (ST)(trips * step);                                                              \
  }

STATIC_INIT(__kmpc_for_static_init_4, int32_t, int32_t)
STATIC_INIT(__kmpc_for_static_init_4u, uint32_t, int32_t)
STATIC_INIT(__kmpc_for_static_init_8, int64_t, int64_t)
STATIC_INIT(__kmpc_for_static_init_8u, uint64_t, int64_t)

BTC_EXPORT void __kmpc_for_static_fini(ident_t *loc, int32_t gtid) {
  (void)loc;
  (void)gtid;
}

BTC_EXPORT void __kmpc_barrier(ident_t *loc, int32_t gtid) {
  (void)loc;
  (void)gtid;
#ifdef _OPENMP
#pragma omp barrier
#endif
}

/* How many threads a fork runs on (for the benchmark and the tests). */
BTC_EXPORT int btc_omp_max_threads(void) {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}
