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
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "../half.h"
#include "../linalg_internal.h"

namespace blutrain::linalg {

namespace {

enum { kRowMajor = 101, kNoTrans = 111, kTrans = 112 };
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
  set_callback_fn set_callback = nullptr;  // OpenBLAS >= 0.3.27: caller-managed threads
  bt_linalg_threads_fn callback = nullptr;  // what the caller asked for (installed at load)
  std::string tried;  // what was tried, for the error message
};
Blas& blas() {
  static Blas b;
  return b;
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
  if (b.set_threads && options().num_threads > 0) b.set_threads((int)options().num_threads);
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

// One batch item. T is the accumulation type (float, or double for f64 inputs).
template <class T>
int run_one(const bt_linalg_gemm_desc& d, int64_t bi, std::vector<double>& bgrad_acc) {
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
      blas_gemm<T>(d.transa, d.transb, m, n, k, T(d.alpha), Ap, lda, Bp, ldb, beta, Z, ldz);
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
  if (b.set_threads && n > 0) b.set_threads(n);
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

int cpu_gemm(const bt_linalg_gemm_desc& d) {
  if (int rc = ensure_blas()) return rc;
  const int64_t lim = 0x7fffffff;  // scipy-openblas32 takes 32-bit ints
  for (int64_t v : {d.m, d.n, d.k, d.a.ld, d.b.ld, d.d.ld, d.c.ld})
    if (v > lim)
      return failf(BT_LINALG_EINVAL,
                   "[gemm] m=%lld n=%lld k=%lld: a size or leading dimension exceeds the CPU "
                   "BLAS's 32-bit limit",
                   (long long)d.m, (long long)d.n, (long long)d.k);
  std::vector<double> acc;
  for (int64_t bi = 0; bi < d.batch; ++bi) {
    acc.assign(epi_has_bgrad(d.epilogue) ? size_t(bgrad_len(d)) : 0, 0.0);
    int rc = d.a.dtype == BT_LINALG_F64 ? run_one<double>(d, bi, acc) : run_one<float>(d, bi, acc);
    if (rc) return rc;
  }
  return BT_LINALG_OK;
}

}  // namespace blutrain::linalg
