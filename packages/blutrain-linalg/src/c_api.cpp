// The backend-neutral front of blutrain-linalg: validates a gemm descriptor (shapes,
// leading dimensions, dtypes, epilogue operands), then hands it to the CPU or CUDA backend.
// Validation lives here once so both backends can trust their input.
#include <cstdarg>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

#include "linalg_internal.h"

namespace blutrain::linalg {

namespace {
thread_local std::string t_error;
std::mutex g_path_mu;
std::string g_cache_path;  // empty: default
}  // namespace

int fail(int code, const std::string& msg) {
  t_error = msg;
  return code;
}

int failf(int code, const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  t_error = buf;
  return code;
}

void clear_error() { t_error.clear(); }

Options& options() {
  static Options o;
  return o;
}

std::string cache_path() {
  std::lock_guard<std::mutex> lk(g_path_mu);
  if (!g_cache_path.empty()) return g_cache_path;
  std::string dir;
  if (const char* e = std::getenv("BLUTRAIN_CACHE_DIR"); e && *e) {
    dir = e;
  } else if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) {
    dir = std::string(x) + "/blutrain";
  } else if (const char* h = std::getenv("HOME"); h && *h) {
    dir = std::string(h) + "/.cache/blutrain";
  } else {
    dir = "/tmp/blutrain";
  }
  return dir + "/linalg/cublaslt_algos.txt";
}

namespace {

// Checks one stored matrix of `rows` x `cols` (row-major, unit column stride).
int check_matrix(const char* name, const bt_linalg_matrix& x, int64_t rows, int64_t cols,
                 int64_t batch, bool need_ptr) {
  if (dtype_size(x.dtype) == 0)
    return failf(BT_LINALG_EINVAL, "[gemm] %s has an invalid dtype code %d", name, x.dtype);
  if (x.ld < (cols > 1 ? cols : 1))
    return failf(BT_LINALG_EINVAL,
                 "[gemm] %s is stored (%lld, %lld) row-major but its row stride ld is %lld "
                 "(must be >= %lld)",
                 name, (long long)rows, (long long)cols, (long long)x.ld,
                 (long long)(cols > 1 ? cols : 1));
  if (batch > 1 && x.batch_stride < 0)
    return failf(BT_LINALG_EINVAL, "[gemm] %s has a negative batch stride %lld", name,
                 (long long)x.batch_stride);
  if (need_ptr && rows > 0 && cols > 0 && x.ptr == nullptr)
    return failf(BT_LINALG_EINVAL, "[gemm] %s is (%lld, %lld) but its pointer is NULL", name,
                 (long long)rows, (long long)cols);
  return BT_LINALG_OK;
}

int check_vector(const char* name, const bt_linalg_matrix& x, int64_t len) {
  if (dtype_size(x.dtype) == 0)
    return failf(BT_LINALG_EINVAL, "[gemm] %s has an invalid dtype code %d", name, x.dtype);
  if (len > 0 && x.ptr == nullptr)
    return failf(BT_LINALG_EINVAL, "[gemm] the epilogue needs %s (%lld values) but it is NULL",
                 name, (long long)len);
  if (x.batch_stride < 0)
    return failf(BT_LINALG_EINVAL, "[gemm] %s has a negative batch stride", name);
  return BT_LINALG_OK;
}

int validate(const bt_linalg_gemm_desc& d) {
  if (d.m < 0 || d.n < 0 || d.k < 0)
    return failf(BT_LINALG_EINVAL, "[gemm] negative size: m=%lld n=%lld k=%lld", (long long)d.m,
                 (long long)d.n, (long long)d.k);
  if (d.batch < 1)
    return failf(BT_LINALG_EINVAL, "[gemm] batch must be >= 1, got %lld", (long long)d.batch);
  if ((d.transa != 0 && d.transa != 1) || (d.transb != 0 && d.transb != 1))
    return failf(BT_LINALG_EINVAL, "[gemm] transa/transb must be 0 (N) or 1 (T), got %d/%d",
                 d.transa, d.transb);
  if (d.compute < BT_LINALG_COMPUTE_DEFAULT || d.compute > BT_LINALG_COMPUTE_FAST_F16)
    return failf(BT_LINALG_EINVAL, "[gemm] invalid compute mode %d", d.compute);
  if (d.epilogue < BT_LINALG_EPI_NONE || d.epilogue > BT_LINALG_EPI_BGRAD_B)
    return failf(BT_LINALG_EINVAL, "[gemm] invalid epilogue %d", d.epilogue);
  const int64_t ar = d.transa ? d.k : d.m, ac = d.transa ? d.m : d.k;
  const int64_t br = d.transb ? d.n : d.k, bc = d.transb ? d.k : d.n;
  int rc;
  if ((rc = check_matrix("A", d.a, ar, ac, d.batch, true))) return rc;
  if ((rc = check_matrix("B", d.b, br, bc, d.batch, true))) return rc;
  if ((rc = check_matrix("D", d.d, d.m, d.n, d.batch, true))) return rc;
  if (d.a.dtype != d.b.dtype)
    return failf(BT_LINALG_ENOTSUP, "[gemm] A is %s and B is %s: the inputs must share a dtype",
                 dtype_name(d.a.dtype), dtype_name(d.b.dtype));
  if (d.a.dtype == BT_LINALG_F64 && d.d.dtype != BT_LINALG_F64)
    return failf(BT_LINALG_ENOTSUP, "[gemm] float64 inputs need a float64 output, got %s",
                 dtype_name(d.d.dtype));
  if (d.beta != 0.0) {
    if ((rc = check_matrix("C", d.c, d.m, d.n, d.batch, true))) return rc;
    if (d.c.dtype != d.d.dtype)
      return failf(BT_LINALG_ENOTSUP, "[gemm] C is %s and D is %s: C must have D's dtype",
                   dtype_name(d.c.dtype), dtype_name(d.d.dtype));
  }
  const int e = d.epilogue;
  if (epi_has_bias(e) && (rc = check_vector("bias", d.bias, d.n))) return rc;
  if (epi_writes_aux(e) || epi_reads_aux(e)) {
    if ((rc = check_matrix("aux", d.aux, d.m, d.n, d.batch, true))) return rc;
  }
  if (epi_has_bgrad(e) && (rc = check_vector("bgrad", d.bgrad, bgrad_len(d)))) return rc;
  if (d.batch > 1) {  // outputs written per batch item must not share storage
    if (d.d.batch_stride == 0 && d.m > 0 && d.n > 0)
      return fail(BT_LINALG_EINVAL,
                  "[gemm] batch > 1 but D's batch stride is 0: items would "
                  "overwrite each other");
    if ((epi_writes_aux(e) && d.aux.batch_stride == 0) ||
        (epi_has_bgrad(e) && d.bgrad.batch_stride < bgrad_len(d)))
      return fail(BT_LINALG_EINVAL,
                  "[gemm] batch > 1: aux / bgrad need a batch stride that "
                  "separates the items");
  }
  if (d.device < -1)
    return failf(BT_LINALG_EINVAL, "[gemm] device must be -1 (CPU) or a CUDA ordinal, got %d",
                 d.device);
  return BT_LINALG_OK;
}

int api_gemm(const bt_linalg_gemm_desc* in) {
  if (!in) return fail(BT_LINALG_EINVAL, "[gemm] desc is NULL");
  // Accept a shorter (older) descriptor: copy what the caller knows, default the rest.
  bt_linalg_gemm_desc d;
  bt_linalg_gemm_desc_init(&d);
  const size_t min_size = offsetof(bt_linalg_gemm_desc, stream) + sizeof(void*);
  if (in->struct_size < min_size)
    return failf(BT_LINALG_EINVAL, "[gemm] desc.struct_size is %u, expected >= %zu",
                 in->struct_size, min_size);
  std::memcpy(&d, in, in->struct_size < sizeof d ? in->struct_size : sizeof d);
  d.struct_size = sizeof d;
  if (int rc = validate(d)) return rc;
  clear_error();
  return d.device < 0 ? cpu_gemm(d) : cuda_gemm(d);
}

int api_set_option(const char* name, int64_t v) {
  if (!name) return fail(BT_LINALG_EINVAL, "[set_option] name is NULL");
  Options& o = options();
  const std::string n = name;
  if (n == "autotune")
    o.autotune = v != 0;
  else if (n == "autotune_candidates")
    o.autotune_candidates = v < 1 ? 1 : (v > 64 ? 64 : v);
  else if (n == "autotune_reps")
    o.autotune_reps = v < 1 ? 1 : (v > 1000 ? 1000 : v);
  else if (n == "autotune_flush_l2")
    o.autotune_flush_l2 = v != 0;
  else if (n == "autotune_log")
    o.autotune_log = v != 0;
  else if (n == "workspace_bytes") {
    if (v < 0) return fail(BT_LINALG_EINVAL, "[set_option] workspace_bytes must be >= 0");
    o.workspace_bytes = v;
  } else if (n == "persist")
    o.persist = v != 0;
  else if (n == "fused_epilogues")
    o.fused_epilogues = v != 0;
  else if (n == "use_alloc")
    o.use_alloc = v != 0;
  else if (n == "fp32_3xtf32")
    o.fp32_3xtf32 = v != 0;
  else if (n == "num_threads") {
    if (v < 0) return fail(BT_LINALG_EINVAL, "[set_option] num_threads must be >= 0");
    o.num_threads = v;
    return cpu_set_num_threads((int)v);
  } else {
    return failf(BT_LINALG_EINVAL, "[set_option] unknown option '%s'", name);
  }
  return BT_LINALG_OK;
}

int api_get_option(const char* name, int64_t* v) {
  if (!name || !v) return fail(BT_LINALG_EINVAL, "[get_option] name and value must be non-NULL");
  const Options& o = options();
  const std::string n = name;
  if (n == "autotune")
    *v = o.autotune;
  else if (n == "autotune_candidates")
    *v = o.autotune_candidates;
  else if (n == "autotune_reps")
    *v = o.autotune_reps;
  else if (n == "autotune_flush_l2")
    *v = o.autotune_flush_l2;
  else if (n == "autotune_log")
    *v = o.autotune_log;
  else if (n == "workspace_bytes")
    *v = o.workspace_bytes;
  else if (n == "persist")
    *v = o.persist;
  else if (n == "num_threads")
    *v = o.num_threads;
  else if (n == "fused_epilogues")
    *v = o.fused_epilogues;
  else if (n == "use_alloc")
    *v = o.use_alloc;
  else if (n == "fp32_3xtf32")
    *v = o.fp32_3xtf32;
  else if (n == "cuda")
    *v = cuda_available();
  else if (n == "cpu_block_gemms")
    *v = cpu_block_gemms();
  else if (cuda_get_stat(name, v) == BT_LINALG_OK)
    return BT_LINALG_OK;
  else
    return failf(BT_LINALG_EINVAL, "[get_option] unknown option '%s'", name);
  return BT_LINALG_OK;
}

int api_set_cache_path(const char* path) {
  {
    std::lock_guard<std::mutex> lk(g_path_mu);
    g_cache_path = path ? path : "";
  }
  return cuda_clear_cache(0);  // forget entries of the old file; the new one loads lazily
}

int api_get_cache_path(char* buf, size_t cap, size_t* needed) {
  const std::string p = cache_path();
  if (needed) *needed = p.size() + 1;
  if (buf && cap > 0) {
    const size_t n = p.size() < cap - 1 ? p.size() : cap - 1;
    std::memcpy(buf, p.data(), n);
    buf[n] = 0;
  }
  return BT_LINALG_OK;
}

const char* api_last_error() { return t_error.c_str(); }
int api_save_cache() { return cuda_save_cache(); }
int api_clear_cache(int also_file) { return cuda_clear_cache(also_file); }
int api_set_alloc_api(const void* t) { return cuda_set_alloc_api(t); }
int api_load_blas(const char* path) { return cpu_load_blas(path); }
int api_set_cpu_threads_callback(bt_linalg_threads_fn run) { return cpu_set_threads_callback(run); }
int api_set_cpu_parallel_for(bt_linalg_parallel_fn run) { return cpu_set_parallel_for(run); }

const bt_linalg_api g_api = {
    BT_LINALG_ABI_VERSION,
    (uint32_t)sizeof(bt_linalg_api),
    api_last_error,
    api_gemm,
    api_set_option,
    api_get_option,
    api_set_cache_path,
    api_get_cache_path,
    api_save_cache,
    api_clear_cache,
    api_set_alloc_api,
    api_load_blas,
    api_set_cpu_threads_callback,
    api_set_cpu_parallel_for,
};

}  // namespace
}  // namespace blutrain::linalg

extern "C" {
const bt_linalg_api* bt_linalg_get_api(void) { return &blutrain::linalg::g_api; }
const char* bt_linalg_last_error(void) { return blutrain::linalg::api_last_error(); }
int bt_linalg_gemm(const bt_linalg_gemm_desc* d) { return blutrain::linalg::api_gemm(d); }
int bt_linalg_set_option(const char* n, int64_t v) {
  return blutrain::linalg::api_set_option(n, v);
}
int bt_linalg_get_option(const char* n, int64_t* v) {
  return blutrain::linalg::api_get_option(n, v);
}
}
