// CPU backend: OpenBLAS (scipy-openblas32 wheel, symbols prefixed scipy_) does the products;
// epilogues are plain loops over rows that the compiler vectorises.
//
// Why dlopen and not a link-time dependency: the wheel's library would otherwise need an
// rpath into another wheel's directory, which breaks under --target installs, editable
// installs and any layout where the two packages do not sit side by side in one
// site-packages. The Python module finds the library through `scipy_openblas32` itself and
// passes its path (load_blas), which holds wherever pip put it; C users pass a path, set
// $BLUTRAIN_LINALG_BLAS, or rely on the loader's search path.
//
// fp16/bf16 inputs, and fp32 inputs in the tf32 / fast-bf16 / fast-f16 modes, are converted
// (and rounded, to emulate the GPU's tensor-core operand precision) into fp32 buffers, then
// multiplied by sgemm with fp32 accumulation; outputs of another dtype go through an fp32
// scratch and are rounded once at the end.
//
// Note [GEMM blocks]
// With a caller's parallel loop installed (set_cpu_parallel_for: blutrain-tensor's pool),
// OpenBLAS is held at one thread and a GEMM's output is cut into blocks of rows (never of the
// columns or of k); each block is one single-threaded OpenBLAS call, claimed by whichever of the
// loop's threads is free. Why not OpenBLAS's own threading (its jobs, even on our pool):
//  - Load. Its threads each own a fixed share of the output and wait on each other's packed
//    panels, so when the OS deschedules one (another process wants the core) the others wait:
//    the GEMM runs at the speed of the slowest core. On 2 cores with one busy process, a second
//    thread made the tiny GPT-2 step 34% slower (608 -> 813 ms). Claimed blocks go to the thread
//    that runs; a descheduled one delays the GEMM by at most the block it holds.
//  - Bits. Its threaded GEMM cuts k differently from its single-threaded one (2048x513 @
//    513x1024 float32: 63% of the elements differ between 1 and 2 threads). A row block
//    computes each of its elements exactly as the whole single-threaded call does, so a GEMM's
//    result no longer depends on the thread count, because:
//    (a) OpenBLAS cuts k by k alone, and walks the rows (its "N" after the row-major swap) in
//        groups of a fixed multiple of its unroll from the first row: block edges are
//        multiples of kRowAlign = 96 (cuts at multiples of 96 keep the bits of OpenBLAS
//        0.3.34's SkylakeX, Haswell / Zen and SandyBridge kernels, float32 and float64, whose
//        row groups are 12 or 24 rows; cuts at multiples of 32 or 64 do not), and the last
//        block ends with the matrix.
//        Column cuts do not keep them: how the last columns' partial tile is computed
//        depends on where the column range starts (its "M" blocking), differently per kernel;
//    (b) no block takes one of OpenBLAS's paths for small problems that the whole call did
//        not take, or the reverse: the AVX-512 "direct" SGEMM (row-major NN, alpha 1, beta 0,
//        m n k < 28 * 512^2 = 7.3M) and the small-matrix kernels (m n k <= 100^3 on
//        SkylakeX). Only GEMMs of kMinSplitMacs or more are cut (never direct), blocks have
//        about kMinBlockMacs or more, and blocks are passed in column-major form (what OpenBLAS
//        turns the row-major call into), which the direct kernel's test never takes.
//    blutrain-tensor's tests/test_tensor_threads.py compares bits with OpenBLAS's own call.
//  - Cost. Each block packs op(B) again, where the threaded GEMM shares the packed panels:
//    cheap while op(B) stays in cache, a stream from memory when it does not (GPT-2's head,
//    128 x 50304: 10 blocks of 96 rows cost 80% more CPU than one call). plan_blocks weighs
//    that against balance: the block height whose blocks finish first on an idle machine,
//    counting half a block more for a thread the OS holds up in the middle of one.
//    The rows of a GEMM too short to cut (m < 192) run on one thread: a cut of the columns
//    would change the bits.
// A batch of GEMMs too small to cut runs whole items in parallel instead (each one call).
#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <new>
#include <string>
#include <vector>

#include "../half.h"
#include "../linalg_internal.h"

namespace blutrain::linalg {

namespace {

enum { kRowMajor = 101, kColMajor = 102, kNoTrans = 111, kTrans = 112 };

// Note [GEMM blocks]
constexpr int64_t kRowAlign = 96;          // rows: block edges are multiples of it (a)
constexpr double kMinBlockMacs = 1 << 22;  // multiply-adds of a block (4.2M, ~0.1 ms on 1 core)
constexpr double kMinSplitMacs = 2 * kMinBlockMacs;  // a GEMM cut at all (above 7.3M: (b))
constexpr double kCachedBytes = 8 << 20;  // op(B) bytes that stay in cache (an L3's share)
// What one more repacking of op(B) costs, in rows of the product's own compute: measured for
// GPT-2's head (op(B) 25 MiB, from memory) ~20 (NN) to ~90 (NT) rows; a few rows from cache.
constexpr double kPackRowsCached = 8, kPackRowsUncached = 64;
constexpr int64_t kMaxBlocks = 64;  // blocks of one GEMM at most
using sgemm_fn = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int,
                          float, float*, int);
using dgemm_fn = void (*)(int, int, int, int, int, int, double, const double*, int, const double*,
                          int, double, double*, int);
using set_threads_fn = void (*)(int);
using set_callback_fn = void (*)(bt_linalg_threads_fn);

struct Blas {
  std::mutex mu;
  void* handle = nullptr;
  sgemm_fn sgemm = nullptr;
  dgemm_fn dgemm = nullptr;
  set_threads_fn set_threads = nullptr;
  set_callback_fn set_callback = nullptr;   // OpenBLAS >= 0.3.27: caller-managed threads
  bt_linalg_threads_fn callback = nullptr;  // what the caller asked for (installed at load)
  // Note [GEMM blocks]: the caller's parallel loop; set, OpenBLAS runs on one thread.
  std::atomic<bt_linalg_parallel_fn> parallel{nullptr};
  std::atomic<int64_t> block_gemms{0};
  std::string tried;  // what was tried, for the error message
};
Blas& blas() {
  static Blas b;
  return b;
}

// OpenBLAS's own thread count: one under blocks (Note [GEMM blocks]), else the option's.
void apply_threads_locked(Blas& b) {
  if (!b.set_threads) return;
  if (b.parallel.load()) {
    b.set_threads(1);
  } else if (options().num_threads > 0) {
    b.set_threads((int)options().num_threads);
  }
}

int open_blas_locked(Blas& b, const char* path) {
  void* h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* e = dlerror();
    b.tried += std::string("\n  ") + path + ": " + (e ? e : "not found");
    return BT_LINALG_EBLAS;
  }
  auto s = (sgemm_fn)dlsym(h, "scipy_cblas_sgemm");
  auto d = (dgemm_fn)dlsym(h, "scipy_cblas_dgemm");
  if (!s || !d) {
    b.tried += std::string("\n  ") + path + ": has no scipy_cblas_sgemm/dgemm";
    dlclose(h);
    return BT_LINALG_EBLAS;
  }
  b.handle = h;
  b.sgemm = s;
  b.dgemm = d;
  b.set_threads = (set_threads_fn)dlsym(h, "scipy_openblas_set_num_threads");
  b.set_callback = (set_callback_fn)dlsym(h, "scipy_openblas_set_threads_callback_function");
  apply_threads_locked(b);
  if (b.set_callback && b.callback) b.set_callback(b.callback);
  return BT_LINALG_OK;
}

int ensure_blas() {
  Blas& b = blas();
  std::lock_guard<std::mutex> lk(b.mu);
  if (b.sgemm) return BT_LINALG_OK;
  if (const char* e = std::getenv("BLUTRAIN_LINALG_BLAS"); e && *e)
    if (open_blas_locked(b, e) == BT_LINALG_OK) return BT_LINALG_OK;
  if (open_blas_locked(b, "libscipy_openblas.so") == BT_LINALG_OK) return BT_LINALG_OK;
  return fail(BT_LINALG_EBLAS,
              "[gemm] the CPU BLAS (scipy-openblas32) could not be loaded: pip install "
              "scipy-openblas32, or set BLUTRAIN_LINALG_BLAS to libscipy_openblas.so. Tried:" +
                  b.tried);
}

// ---- element access ---------------------------------------------------------------------
inline float load_f(const void* p, int dt, int64_t i) {
  switch (dt) {
    case BT_LINALG_F32:
      return static_cast<const float*>(p)[i];
    case BT_LINALG_F64:
      return float(static_cast<const double*>(p)[i]);
    case BT_LINALG_F16:
      return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    default:
      return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
  }
}
inline double load_d(const void* p, int dt, int64_t i) {
  return dt == BT_LINALG_F64 ? static_cast<const double*>(p)[i] : double(load_f(p, dt, i));
}
template <class T>
inline T load(const void* p, int dt, int64_t i) {
  if constexpr (sizeof(T) == 8)
    return load_d(p, dt, i);
  else
    return load_f(p, dt, i);
}
template <class T>
inline void store(void* p, int dt, int64_t i, T v) {
  switch (dt) {
    case BT_LINALG_F32:
      static_cast<float*>(p)[i] = float(v);
      break;
    case BT_LINALG_F64:
      static_cast<double*>(p)[i] = double(v);
      break;
    case BT_LINALG_F16:
      static_cast<uint16_t*>(p)[i] = f32_to_f16(float(v));
      break;
    default:
      static_cast<uint16_t*>(p)[i] = f32_to_bf16(float(v));
      break;
  }
}
inline const char* at(const void* p, int dt, int64_t elems) {
  return static_cast<const char*>(p) + elems * int64_t(dtype_size(dt));
}
inline char* at(void* p, int dt, int64_t elems) {
  return static_cast<char*>(p) + elems * int64_t(dtype_size(dt));
}

// Copies a stored rows x cols matrix into a dense fp32 buffer, rounding as the mode says.
void to_f32(const void* src, int dt, int64_t ld, int64_t rows, int64_t cols, int compute,
            std::vector<float>& dst) {
  dst.resize(size_t(std::max<int64_t>(rows * cols, 1)));
  const bool f32_in = dt == BT_LINALG_F32;
  for (int64_t i = 0; i < rows; ++i) {
    float* o = dst.data() + i * cols;
    if (f32_in) {
      const float* s = static_cast<const float*>(src) + i * ld;
      switch (compute) {
        case BT_LINALG_COMPUTE_TF32:
          for (int64_t j = 0; j < cols; ++j) o[j] = round_tf32(s[j]);
          break;
        case BT_LINALG_COMPUTE_FAST_BF16:
          for (int64_t j = 0; j < cols; ++j) o[j] = round_bf16(s[j]);
          break;
        case BT_LINALG_COMPUTE_FAST_F16:
          for (int64_t j = 0; j < cols; ++j) o[j] = round_f16(s[j]);
          break;
        default:
          std::copy(s, s + cols, o);
      }
    } else {
      for (int64_t j = 0; j < cols; ++j) o[j] = load_f(src, dt, i * ld + j);
    }
  }
}

template <class T>
void blas_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
               const T* b, int64_t ldb, T beta, T* c, int64_t ldc) {
  const int oa = ta ? kTrans : kNoTrans, ob = tb ? kTrans : kNoTrans;
  if constexpr (sizeof(T) == 8)
    blas().dgemm(kRowMajor, oa, ob, int(m), int(n), int(k), alpha, a, int(lda), b, int(ldb), beta,
                 c, int(ldc));
  else
    blas().sgemm(kRowMajor, oa, ob, int(m), int(n), int(k), alpha, a, int(lda), b, int(ldb), beta,
                 c, int(ldc));
}

// ---- blocks (Note [GEMM blocks]) ----------------------------------------------------------

// The GEMM's threads under blocks: 1 when no parallel loop is installed (OpenBLAS threads it).
int block_threads() {
  if (!blas().parallel.load(std::memory_order_acquire)) return 1;
  return int(std::max<int64_t>(options().num_threads, 1));
}

struct Blocks {
  int64_t rows;       // rows of a block (the last one also takes the remainder)
  int64_t count = 1;  // blocks
};

// The row blocks of an m x n x k GEMM on `threads` threads: one block when the GEMM is small,
// else the kRowAlign-multiple block height whose blocks, handed out in order to the least-loaded
// thread (what claiming does on an idle machine), finish first, counting each block's
// repacking of op(B) (kPackRows*) and half its own length (what a thread the OS deschedules in
// the middle of one holds up on a loaded machine).
Blocks plan_blocks(int64_t m, int64_t n, int64_t k, int threads, size_t elem) {
  const double macs = double(m) * double(n) * double(k);
  if (threads <= 1 || macs < kMinSplitMacs || m < 2 * kRowAlign) return {m};
  const bool cached = double(k) * double(n) * double(elem) <= kCachedBytes;
  const double pack = cached ? kPackRowsCached : kPackRowsUncached;  // in rows of compute
  const int64_t min_rows = std::max<int64_t>(
      kRowAlign,
      int64_t(std::ceil(kMinBlockMacs / (double(n) * double(k)) / kRowAlign)) * kRowAlign);
  Blocks best{m};
  double best_time = double(m);  // one block
  std::vector<double> busy(static_cast<size_t>(threads));
  for (int64_t rows = min_rows; rows <= m / 2; rows += kRowAlign) {
    const int64_t count = m / rows;  // the last block takes the remainder (< rows)
    if (count > kMaxBlocks) continue;
    std::fill(busy.begin(), busy.end(), 0.0);
    for (int64_t i = 0; i < count; ++i) {
      const double len = double(i + 1 == count ? m - i * rows : rows);
      *std::min_element(busy.begin(), busy.end()) += len + pack;
    }
    const double last = double(m - (count - 1) * rows);
    const double time =
        *std::max_element(busy.begin(), busy.end()) + 0.5 * std::max(last, double(rows));
    if (time < best_time) {
      best_time = time;
      best = {rows, count};
    }
  }
  return best;
}

// C = alpha op(A) op(B) + beta C by row blocks of `plan`, each in the column-major form of the
// row-major call (Note [GEMM blocks] (b)).
template <class T>
struct BlockJob {
  Blocks plan;
  bool ta, tb;
  int64_t m, n, k;
  T alpha;
  const T* a;
  int64_t lda;
  const T* b;
  int64_t ldb;
  T beta;
  T* c;
  int64_t ldc;

  void run(int64_t block) const {
    const int64_t i0 = block * plan.rows;
    const int mi = int(block + 1 == plan.count ? m - i0 : plan.rows);
    const T* ab = a + (ta ? i0 : i0 * lda);
    T* cb = c + i0 * ldc;
    const int ob = tb ? kTrans : kNoTrans, oa = ta ? kTrans : kNoTrans;  // C^T = op(B)^T op(A)^T
    if constexpr (sizeof(T) == 8)
      blas().dgemm(kColMajor, ob, oa, int(n), mi, int(k), alpha, b, int(ldb), ab, int(lda), beta,
                   cb, int(ldc));
    else
      blas().sgemm(kColMajor, ob, oa, int(n), mi, int(k), alpha, b, int(ldb), ab, int(lda), beta,
                   cb, int(ldc));
  }
};

// The product by blocks on the parallel loop when it is worth cutting, else one call.
template <class T>
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, T alpha, const T* a, int64_t lda,
          const T* b, int64_t ldb, T beta, T* c, int64_t ldc, int threads) {
  const Blocks plan = plan_blocks(m, n, k, threads, sizeof(T));
  const bt_linalg_parallel_fn parallel = blas().parallel.load(std::memory_order_acquire);
  if (plan.count < 2 || !parallel) {
    blas_gemm<T>(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  blas().block_gemms.fetch_add(1, std::memory_order_relaxed);
  const BlockJob<T> job{plan, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc};
  parallel(
      plan.count,
      [](void* ctx, int64_t begin, int64_t end) {
        const auto* j = static_cast<const BlockJob<T>*>(ctx);
        for (int64_t i = begin; i < end; ++i) j->run(i);
      },
      const_cast<BlockJob<T>*>(&job));
}

// One batch item. T is the accumulation type (float, or double for f64 inputs). `threads`:
// how many threads its GEMM may take (1 inside a batch run item by item in parallel).
template <class T>
int run_one(const bt_linalg_gemm_desc& d, int64_t bi, std::vector<double>& bgrad_acc, int threads) {
  constexpr int kAccDt = sizeof(T) == 8 ? BT_LINALG_F64 : BT_LINALG_F32;
  const int64_t m = d.m, n = d.n, k = d.k;
  const int64_t ar = d.transa ? k : m, ac = d.transa ? m : k;
  const int64_t br = d.transb ? n : k, bc = d.transb ? k : n;
  const void* A = at(d.a.ptr, d.a.dtype, bi * d.a.batch_stride);
  const void* B = at(d.b.ptr, d.b.dtype, bi * d.b.batch_stride);
  void* D = at(const_cast<void*>(d.d.ptr), d.d.dtype, bi * d.d.batch_stride);
  const void* C = d.beta != 0.0 ? at(d.c.ptr, d.c.dtype, bi * d.c.batch_stride) : nullptr;

  // Operands: raw when BLAS can take them as they are, else converted fp32 copies.
  std::vector<float> abuf, bbuf;
  const T* Ap = static_cast<const T*>(A);
  const T* Bp = static_cast<const T*>(B);
  int64_t lda = d.a.ld, ldb = d.b.ld;
  const bool convert =
      kAccDt == BT_LINALG_F32 &&
      (d.a.dtype != BT_LINALG_F32 || d.compute == BT_LINALG_COMPUTE_TF32 ||
       d.compute == BT_LINALG_COMPUTE_FAST_BF16 || d.compute == BT_LINALG_COMPUTE_FAST_F16);
  if (convert && k > 0) {
    to_f32(A, d.a.dtype, d.a.ld, ar, ac, d.compute, abuf);
    to_f32(B, d.b.dtype, d.b.ld, br, bc, d.compute, bbuf);
    Ap = reinterpret_cast<const T*>(abuf.data());
    Bp = reinterpret_cast<const T*>(bbuf.data());
    lda = std::max<int64_t>(ac, 1);
    ldb = std::max<int64_t>(bc, 1);
  }

  // Z (accumulator-typed m x n): D itself when D has the accumulator's dtype, else scratch.
  std::vector<T> zbuf;
  T* Z;
  int64_t ldz;
  if (d.d.dtype == kAccDt) {
    Z = static_cast<T*>(D);
    ldz = d.d.ld;
  } else {
    zbuf.resize(size_t(std::max<int64_t>(m * n, 1)));
    Z = zbuf.data();
    ldz = n;
  }
  if (C && static_cast<const void*>(C) != static_cast<void*>(Z)) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) Z[i * ldz + j] = load<T>(C, d.c.dtype, i * d.c.ld + j);
  }
  const T beta = C ? T(d.beta) : T(0);
  if (m > 0 && n > 0) {
    if (k > 0) {
      gemm<T>(d.transa, d.transb, m, n, k, T(d.alpha), Ap, lda, Bp, ldb, beta, Z, ldz, threads);
    } else {  // empty sum: Z = beta C (BLAS conventions differ on k = 0, so do it here)
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j)
          Z[i * ldz + j] = beta == T(0) ? T(0) : beta * Z[i * ldz + j];
    }
  }

  // Epilogue, row by row.
  const int e = d.epilogue;
  const void* bias =
      epi_has_bias(e) ? at(d.bias.ptr, d.bias.dtype, bi * d.bias.batch_stride) : nullptr;
  void* aux = (epi_writes_aux(e) || epi_reads_aux(e))
                  ? at(const_cast<void*>(d.aux.ptr), d.aux.dtype, bi * d.aux.batch_stride)
                  : nullptr;
  std::vector<T> brow;
  if (bias) {
    brow.resize(size_t(n));
    for (int64_t j = 0; j < n; ++j) brow[j] = load<T>(bias, d.bias.dtype, j);
  }
  for (int64_t i = 0; i < m; ++i) {
    T* z = Z + i * ldz;
    if (bias)
      for (int64_t j = 0; j < n; ++j) z[j] += brow[j];
    if (epi_writes_aux(e)) {
      if (d.aux.dtype == kAccDt) {
        std::copy(z, z + n, static_cast<T*>(aux) + i * d.aux.ld);
      } else {
        for (int64_t j = 0; j < n; ++j) store<T>(aux, d.aux.dtype, i * d.aux.ld + j, z[j]);
      }
    }
    if (epi_has_gelu(e))
      for (int64_t j = 0; j < n; ++j) z[j] = gelu<T>(z[j]);
    if (epi_reads_aux(e))
      for (int64_t j = 0; j < n; ++j) z[j] *= dgelu<T>(load<T>(aux, d.aux.dtype, i * d.aux.ld + j));
    if (e == BT_LINALG_EPI_DGELU_BGRAD)
      for (int64_t j = 0; j < n; ++j) bgrad_acc[j] += double(z[j]);
  }
  if (e == BT_LINALG_EPI_BGRAD_A) {  // row sums of op(A), from the unrounded inputs
    for (int64_t r = 0; r < ar; ++r)
      for (int64_t c = 0; c < ac; ++c)
        bgrad_acc[d.transa ? c : r] += load_d(A, d.a.dtype, r * d.a.ld + c);
  } else if (e == BT_LINALG_EPI_BGRAD_B) {  // column sums of op(B)
    for (int64_t r = 0; r < br; ++r)
      for (int64_t c = 0; c < bc; ++c)
        bgrad_acc[d.transb ? r : c] += load_d(B, d.b.dtype, r * d.b.ld + c);
  }
  if (Z != static_cast<T*>(D)) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) store<T>(D, d.d.dtype, i * d.d.ld + j, Z[i * ldz + j]);
  }
  if (epi_has_bgrad(e)) {
    void* g = at(const_cast<void*>(d.bgrad.ptr), d.bgrad.dtype, bi * d.bgrad.batch_stride);
    for (size_t j = 0; j < bgrad_acc.size(); ++j)
      store<double>(g, d.bgrad.dtype, int64_t(j), bgrad_acc[j]);
  }
  return BT_LINALG_OK;
}

}  // namespace

int cpu_load_blas(const char* path) {
  if (!path) return fail(BT_LINALG_EINVAL, "[load_blas] path is NULL");
  Blas& b = blas();
  std::lock_guard<std::mutex> lk(b.mu);
  if (b.sgemm) return BT_LINALG_OK;  // first one wins: two OpenBLAS thread pools would fight
  if (open_blas_locked(b, path) != BT_LINALG_OK)
    return fail(BT_LINALG_EBLAS, "[load_blas] could not load the CPU BLAS:" + b.tried);
  return BT_LINALG_OK;
}

int cpu_set_num_threads(int n) {
  Blas& b = blas();
  std::lock_guard<std::mutex> lk(b.mu);
  if (n > 0) apply_threads_locked(b);
  return BT_LINALG_OK;
}

int cpu_set_threads_callback(bt_linalg_threads_fn run) {
  Blas& b = blas();
  std::lock_guard<std::mutex> lk(b.mu);
  b.callback = run;
  if (!b.sgemm) return BT_LINALG_OK;  // installed when the BLAS is opened
  if (!b.set_callback)
    return fail(BT_LINALG_ENOTSUP,
                "[set_cpu_threads_callback] the loaded BLAS has no threads callback (OpenBLAS "
                ">= 0.3.27 has one); it keeps its own threads");
  // OpenBLAS reads the pointer at each parallel call; set it while no GEMM runs (at import).
  b.set_callback(run);
  return BT_LINALG_OK;
}

int cpu_set_parallel_for(bt_linalg_parallel_fn run) {
  Blas& b = blas();
  std::lock_guard<std::mutex> lk(b.mu);
  b.parallel.store(run, std::memory_order_release);
  apply_threads_locked(b);
  return BT_LINALG_OK;
}

int64_t cpu_block_gemms() { return blas().block_gemms.load(); }

namespace {

// One batch item with its own bias-gradient accumulator.
int run_item(const bt_linalg_gemm_desc& d, int64_t bi, int threads) {
  std::vector<double> acc(epi_has_bgrad(d.epilogue) ? size_t(bgrad_len(d)) : 0, 0.0);
  return d.a.dtype == BT_LINALG_F64 ? run_one<double>(d, bi, acc, threads)
                                    : run_one<float>(d, bi, acc, threads);
}

// A batch whose items are too small to cut into blocks: whole items on the parallel loop.
struct BatchJob {
  const bt_linalg_gemm_desc* d;
  std::atomic<int> rc{BT_LINALG_OK};
};

}  // namespace

int cpu_gemm(const bt_linalg_gemm_desc& d) {
  if (int rc = ensure_blas()) return rc;
  const int64_t lim = 0x7fffffff;  // scipy-openblas32 takes 32-bit ints
  for (int64_t v : {d.m, d.n, d.k, d.a.ld, d.b.ld, d.d.ld, d.c.ld})
    if (v > lim)
      return failf(BT_LINALG_EINVAL,
                   "[gemm] m=%lld n=%lld k=%lld: a size or leading dimension exceeds the CPU "
                   "BLAS's 32-bit limit",
                   (long long)d.m, (long long)d.n, (long long)d.k);
  const int threads = block_threads();
  bt_linalg_parallel_fn parallel = blas().parallel.load(std::memory_order_acquire);
  if (d.batch > 1 && threads > 1 && parallel && plan_blocks(d.m, d.n, d.k, threads, 4).count < 2) {
    BatchJob job{&d};
    parallel(
        d.batch,
        [](void* ctx, int64_t begin, int64_t end) {
          auto* j = static_cast<BatchJob*>(ctx);
          for (int64_t bi = begin; bi < end; ++bi) {
            int rc;
            try {
              rc = run_item(*j->d, bi, 1);
            } catch (const std::bad_alloc&) {
              rc = BT_LINALG_ENOMEM;
            }
            if (rc) j->rc.store(rc);
          }
        },
        &job);
    if (int rc = job.rc.load())
      return rc == BT_LINALG_ENOMEM ? fail(rc, "[gemm] out of memory for a batch item's scratch")
                                    : rc;
    return BT_LINALG_OK;
  }
  for (int64_t bi = 0; bi < d.batch; ++bi) {
    if (int rc = run_item(d, bi, threads)) return rc;
  }
  return BT_LINALG_OK;
}

}  // namespace blutrain::linalg
