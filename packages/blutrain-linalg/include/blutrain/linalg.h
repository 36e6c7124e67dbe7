/* blutrain/linalg.h: the C ABI of blutrain-linalg, BluTrain's GEMM library with
 * fused epilogues, on the CPU (OpenBLAS) and on CUDA (cuBLASLt).
 *
 * One call does
 *
 *     Z = alpha * op(A) @ op(B) + beta * C            (op in {N, T}, per batch)
 *     D = epilogue(Z)                                  (bias, GELU, GELU backward, ...)
 *
 * Layout: ROW-MAJOR, as numpy/torch users think. op(A) is (m, k), op(B) is (k, n),
 * C and D are (m, n). A with transa = N is stored (m, k) with row stride lda >= k;
 * with transa = T it is stored (k, m) with lda >= m (likewise B: N -> (k, n), ldb >= n;
 * T -> (n, k), ldb >= k). C and D are stored (m, n) with ldc, ldd >= n. The column
 * stride of every matrix is 1 (the unit stride a BLAS needs); a matrix whose rows are
 * contiguous but columns strided must be passed transposed. Internally the row-major
 * problem is mapped onto column-major BLAS / cuBLASLt as D^T = op(B)^T op(A)^T, which
 * costs nothing (no copies).
 *
 * Conventions (shared by every BluTrain package):
 *   - every function returns BT_LINALG_OK (0) or a negative BT_LINALG_E* code;
 *     bt_linalg_last_error() then holds a message for the calling thread that starts
 *     with the op, e.g. "[gemm] ...".
 *   - streams are void* (a cudaStream_t; NULL = the legacy default stream).
 *   - dependents never link against this library: they take the table bt_linalg_api
 *     from the Python module's `_C_API` capsule (blutrain/linalg_import.h) or from
 *     bt_linalg_get_api() when linking directly. The table and bt_linalg_gemm_desc are
 *     append-only: new members go at the end and bump BT_LINALG_ABI_VERSION's minor part;
 *     callers set desc.struct_size so an older caller's shorter struct still works.
 *   - CUDA calls never synchronise the host: work is enqueued on `stream`.
 */
#ifndef BLUTRAIN_LINALG_H
#define BLUTRAIN_LINALG_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define BT_LINALG_EXPORT __declspec(dllexport)
#else
#define BT_LINALG_EXPORT __attribute__((visibility("default")))
#endif

/* major << 16 | minor. A dependent built for major M accepts M.x with x >= its minor. */
#define BT_LINALG_ABI_VERSION ((1u << 16) | 2u)
#define BT_LINALG_CAPSULE_NAME "blutrain.linalg._C_API"

enum bt_linalg_status {
  BT_LINALG_OK = 0,
  BT_LINALG_EINVAL = -1,  /* bad argument: shape, leading dimension, dtype, pointer */
  BT_LINALG_ENOMEM = -2,  /* workspace or scratch allocation failed */
  BT_LINALG_ENOTSUP = -3, /* valid but unsupported combination (e.g. dtypes) */
  BT_LINALG_ENOCUDA = -4, /* built without CUDA, or no device present */
  BT_LINALG_ECUDA = -5,   /* a CUDA runtime / cuBLASLt call failed */
  BT_LINALG_EBLAS = -6    /* the CPU BLAS could not be loaded */
};

/* Element types (values fixed: stored in the persisted algorithm cache). */
typedef enum bt_linalg_dtype {
  BT_LINALG_F32 = 0,
  BT_LINALG_F64 = 1,
  BT_LINALG_F16 = 2,
  BT_LINALG_BF16 = 3
} bt_linalg_dtype;

typedef enum bt_linalg_op { BT_LINALG_OP_N = 0, BT_LINALG_OP_T = 1 } bt_linalg_op;

/* How products are formed. Accumulation is always fp32 or wider.
 *   DEFAULT:   the inputs' precision (fp32 inputs -> FP32; f16/bf16 inputs -> their own
 *              tensor-core path with fp32 accumulation; f64 -> fp64).
 *   FP32:      fp32-accurate products. On CUDA sm_80+ (option "fp32_3xtf32", default 1) by
 *              our 3xTF32 kernel: each operand split into two TF32 parts, three tensor-core
 *              products, partial sums promoted to fp32 every 32 k's; error against float64
 *              below cuBLAS SGEMM's, 1.1-1.2x its speed. Option 0 (or an operand cp.async
 *              cannot load: not 16-byte aligned, ld not a multiple of 4) uses cuBLAS SGEMM.
 *              An infinite operand then gives NaN rather than +-inf in the outputs it reaches.
 *   TF32:      fp32 in and out, operands rounded to tf32 (10-bit mantissa) on tensor
 *              cores; the CPU emulates it by rounding operands, so results match the GPU's
 *              error profile.
 *   FAST_BF16 / FAST_F16: fp32 in and out, operands rounded to bf16 / f16 (cuBLAS
 *              CUBLAS_COMPUTE_32F_FAST_16BF / _16F; the CPU emulates likewise).
 * Modes other than DEFAULT apply to fp32 inputs; f16/bf16 inputs ignore them. */
typedef enum bt_linalg_compute {
  BT_LINALG_COMPUTE_DEFAULT = 0,
  BT_LINALG_COMPUTE_FP32 = 1,
  BT_LINALG_COMPUTE_TF32 = 2,
  BT_LINALG_COMPUTE_FAST_BF16 = 3,
  BT_LINALG_COMPUTE_FAST_F16 = 4
} bt_linalg_compute;

/* Fused epilogues, in row-major terms (Z as above, shape (m, n)). GELU is the tanh form
 *   gelu(z) = 0.5 z (1 + tanh(sqrt(2/pi) (z + 0.044715 z^3))).
 *   NONE           D = Z
 *   BIAS           D = Z + bias            bias: n values, broadcast over the m rows
 *   GELU           D = gelu(Z)
 *   BIAS_GELU      D = gelu(Z + bias)
 *   GELU_AUX       D = gelu(Z);        aux = Z         (pre-activation saved for backward)
 *   BIAS_GELU_AUX  D = gelu(Z + bias); aux = Z + bias
 *   DGELU          D = Z * gelu'(aux)                  (aux: the saved pre-activation)
 *   DGELU_BGRAD    D = Z * gelu'(aux); bgrad[j] = sum_i D[i, j]   (column sums of D)
 *   BGRAD_A        D = Z; bgrad[i] = sum_k op(A)[i, k]  (m values: row sums of op(A))
 *   BGRAD_B        D = Z; bgrad[j] = sum_k op(B)[k, j]  (n values: column sums of op(B))
 * For a linear layer Y = X W^T + b (W is (out, in)) the backward is
 *   dX = dY W                  -> NONE, or DGELU(_BGRAD) when Y fed a GELU
 *   dW = dY^T X (transa = T)   -> BGRAD_A gives db = column sums of dY in the same call.
 * aux is (m, n) row-major with row stride ld_aux >= n. bgrad is written, not accumulated.
 * Epilogues are applied after alpha/beta. With batch > 1, D and a written aux need a non-zero
 * batch stride and bgrad a batch stride >= its length (one vector per item). */
typedef enum bt_linalg_epilogue {
  BT_LINALG_EPI_NONE = 0,
  BT_LINALG_EPI_BIAS = 1,
  BT_LINALG_EPI_GELU = 2,
  BT_LINALG_EPI_BIAS_GELU = 3,
  BT_LINALG_EPI_GELU_AUX = 4,
  BT_LINALG_EPI_BIAS_GELU_AUX = 5,
  BT_LINALG_EPI_DGELU = 6,
  BT_LINALG_EPI_DGELU_BGRAD = 7,
  BT_LINALG_EPI_BGRAD_A = 8,
  BT_LINALG_EPI_BGRAD_B = 9
} bt_linalg_epilogue;

/* One matrix operand: pointer, row stride (elements), batch stride (elements), type. */
typedef struct bt_linalg_matrix {
  const void* ptr;
  int64_t ld;           /* row stride in elements (row-major) */
  int64_t batch_stride; /* elements between consecutive batch items; 0 = shared by all */
  int32_t dtype;        /* bt_linalg_dtype */
  int32_t reserved_;
} bt_linalg_matrix;

typedef struct bt_linalg_gemm_desc {
  uint32_t struct_size;   /* sizeof(bt_linalg_gemm_desc) as the caller knows it */
  int32_t device;         /* -1: CPU (host memory); >= 0: the CUDA device of every pointer */
  int64_t m, n, k;        /* op(A) is (m, k), op(B) is (k, n); k may be 0 (then Z = beta C) */
  int64_t batch;          /* >= 1 */
  int32_t transa, transb; /* bt_linalg_op */
  bt_linalg_matrix a, b;
  bt_linalg_matrix c; /* read when beta != 0; ptr may equal d.ptr (in place) */
  bt_linalg_matrix d; /* output (ptr written); dtype may differ from a's */
  double alpha, beta;
  int32_t compute;        /* bt_linalg_compute */
  int32_t epilogue;       /* bt_linalg_epilogue */
  bt_linalg_matrix bias;  /* BIAS*: ptr to n values; ld unused; batch_stride 0 = shared */
  bt_linalg_matrix aux;   /* GELU_AUX (written) / DGELU (read): (m, n), ld >= n */
  bt_linalg_matrix bgrad; /* *BGRAD*: written, m (BGRAD_A) or n values; ld unused */
  void* stream;           /* cudaStream_t; ignored on the CPU */
} bt_linalg_gemm_desc;

/* Fill a descriptor with defaults: CPU, batch 1, alpha 1, beta 0, all dtypes F32. */
static inline void bt_linalg_gemm_desc_init(bt_linalg_gemm_desc* d) {
  memset(d, 0, sizeof(*d));
  d->struct_size = (uint32_t)sizeof(*d);
  d->device = -1;
  d->batch = 1;
  d->alpha = 1.0;
  d->beta = 0.0;
}

/* A caller-managed thread pool for the CPU BLAS (ABI 1.1), OpenBLAS's threads callback:
 * run(sync, dojob, n, job_size, jobs, arg) must call dojob(i, (char*)jobs + i * job_size, arg)
 * for every i in [0, n), each on its own thread and all at the same time (the jobs of one GEMM
 * wait on each other), and return when all are done. How many jobs a GEMM splits into is the
 * "num_threads" option. */
typedef void (*bt_linalg_dojob_fn)(int thread_index, void* job, int arg);
typedef void (*bt_linalg_threads_fn)(int sync, bt_linalg_dojob_fn dojob, int n, size_t job_size,
                                     void* jobs, int arg);

/* A caller's parallel loop for independent CPU work (ABI 1.2): run(n, fn, ctx) must call
 * fn(ctx, begin, end) over ranges that cover [0, n) exactly once, on any of its threads, in any
 * order (no item waits for another; a thread the OS delays may take none), and return when all
 * are done. fn never throws. With one installed, a CPU GEMM runs OpenBLAS single-threaded on
 * blocks of the output claimed through it ("num_threads" of them in flight at most): every
 * element is computed as at one thread (Note [GEMM blocks], src/cpu/gemm_cpu.cpp). */
typedef void (*bt_linalg_range_fn)(void* ctx, int64_t begin, int64_t end);
typedef void (*bt_linalg_parallel_fn)(int64_t n, bt_linalg_range_fn fn, void* ctx);

/* Settings for set_option / get_option (int64 values):
 *   "autotune"           0/1: time the top heuristic candidates once per new key (default 0)
 *   "autotune_candidates" how many cuBLASLt candidates to consider (default 32)
 *   "autotune_reps"      minimum timed repetitions per candidate (default 5; short kernels
 *                        get more, so each candidate is timed over about a millisecond)
 *   "autotune_flush_l2"  0/1: evict the L2 before each timed run (default 1)
 *   "autotune_log"       0/1: print every candidate's configuration and time to stderr
 *   "workspace_bytes"    cuBLASLt workspace cap per call (default 32 MiB)
 *   "persist"            0/1: write new algorithm choices to the cache file (default 1)
 *   "num_threads"        CPU threads of a GEMM (0 = OpenBLAS's default): OpenBLAS's own, or
 *                        with set_cpu_parallel_for the blocks in flight (OpenBLAS then runs on
 *                        one thread)
 *   "fused_epilogues"    0/1: 0 runs every CUDA epilogue as separate kernels (default 1)
 *   "use_alloc"          0/1: 0 takes CUDA scratch from cudaMallocAsync, not blutrain-alloc
 *   "fp32_3xtf32"        0/1: float32 GEMMs (DEFAULT / FP32) on CUDA by the 3xTF32 kernel
 *                        (default 1) or by cuBLAS SGEMM (0); epilogues then run as our kernels
 * Read-only (get_option): "cuda" (1 if built with CUDA), "cache_entries",
 *   "cache_hits", "cache_misses", "fallback_epilogues" (calls whose epilogue ran as a
 *   separate kernel because cuBLASLt lacked it for that combination), "tf32x3_calls" (GEMMs
 *   run by the 3xTF32 kernel), "cpu_block_gemms" (CPU GEMMs split into blocks, ABI 1.2). */
typedef struct bt_linalg_api {
  uint32_t abi_version;
  uint32_t struct_size; /* sizeof(bt_linalg_api) of the library that filled it */

  const char* (*last_error)(void);

  int (*gemm)(const bt_linalg_gemm_desc* desc);

  int (*set_option)(const char* name, int64_t value);
  int (*get_option)(const char* name, int64_t* value);

  /* Algorithm cache persisted as text under ~/.cache/blutrain/linalg (or
   * $BLUTRAIN_CACHE_DIR/linalg). path == NULL restores the default. */
  int (*set_cache_path)(const char* path);
  /* Copies the path into buf (NUL-terminated); *needed gets the length + 1. */
  int (*get_cache_path)(char* buf, size_t capacity, size_t* needed);
  int (*save_cache)(void);
  int (*clear_cache)(int also_file);

  /* The allocator used for CUDA workspaces (blutrain-alloc's table, as returned by
   * bt_alloc_import()); NULL: cuBLASLt runs without a workspace. The Python module sets
   * this at import. Held as a pointer: the table must outlive its use. */
  int (*set_alloc_api)(const void* bt_alloc_api_table);

  /* The CPU BLAS (OpenBLAS from the scipy-openblas32 wheel, symbols prefixed scipy_) is
   * opened with dlopen by path, not linked: the wheel then imports wherever pip put
   * scipy-openblas32 (--target, editable, other site dir) and a CUDA-only user never
   * needs it. The Python module passes the path at import; C users call this, or set
   * $BLUTRAIN_LINALG_BLAS, or let the first CPU call try "libscipy_openblas.so". */
  int (*load_blas)(const char* path);

  /* ABI 1.1. Runs the CPU BLAS's parallel work on the caller's threads (see
   * bt_linalg_threads_fn; blutrain-tensor passes its pool, so GEMMs and its own loops share one
   * thread budget); NULL gives the BLAS its own threads back. Installed now if the BLAS is
   * loaded, else when it is. BT_LINALG_ENOTSUP: the loaded BLAS has no such hook (OpenBLAS
   * before 0.3.27), and it keeps its own threads. */
  int (*set_cpu_threads_callback)(bt_linalg_threads_fn run);

  /* ABI 1.2. The caller's parallel loop (bt_linalg_parallel_fn) for CPU GEMMs, which then run
   * on blocks of the output, each by single-threaded OpenBLAS; NULL returns the threading to
   * OpenBLAS (its own threads or the threads callback above). Set it while no GEMM runs. */
  int (*set_cpu_parallel_for)(bt_linalg_parallel_fn run);
} bt_linalg_api;

/* Direct entry points (for C/C++ users who link libblutrain_linalg). */
BT_LINALG_EXPORT const bt_linalg_api* bt_linalg_get_api(void);
BT_LINALG_EXPORT const char* bt_linalg_last_error(void);
BT_LINALG_EXPORT int bt_linalg_gemm(const bt_linalg_gemm_desc* desc);
BT_LINALG_EXPORT int bt_linalg_set_option(const char* name, int64_t value);
BT_LINALG_EXPORT int bt_linalg_get_option(const char* name, int64_t* value);

#ifdef __cplusplus
}
#endif
#endif /* BLUTRAIN_LINALG_H */
