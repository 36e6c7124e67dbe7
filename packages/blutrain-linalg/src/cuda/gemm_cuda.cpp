// CUDA backend: cuBLASLt with fused epilogues, algorithm choice cached per problem key.
//
// Layout. The API is row-major; cuBLASLt is column-major. A row-major (m, n) matrix with row
// stride ld is the column-major (n, m) matrix with the same ld, so D = op(A) op(B) is computed
// as the column-major D^T = op(B)^T op(A)^T: swap the operands (and their trans flags), swap
// m and n. Row-major "bias over columns" is then cuBLASLt's bias over rows, row-major column
// sums are cuBLASLt's DGELU_BGRAD, BGRAD_A (row sums of op(A)) is cuBLASLt's BGRADB.
//
// Plans. A call runs "fused" (one cublasLtMatmul with the epilogue) when cuBLASLt offers an
// algorithm for the combination, else "unfused": a plain cublasLtMatmul into an fp32 (fp64)
// Z, then our kernels (kernels.h) for the epilogue, conversion and bias-gradient reductions.
// Every descriptor the front accepts thus has a CUDA path; the decision is cached.
//
// Algorithm cache. Key: the problem without its pointers (sizes, trans, lds, batch strides,
// dtypes, compute, epilogue, pointer alignments, workspace cap) under a prefix naming the
// cuBLASLt version and the GPU, so a file filled on one machine serves another of the same
// kind and is ignored elsewhere. Value: the cublasLtMatmulAlgo_t bytes, its workspace size,
// fused or not. With "autotune" set, a new key times up to 32 heuristic candidates on the
// caller's stream, each run after an L2 flush; a winner other than the heuristic's first
// must beat it by 2% and also hold up back to back (this is the one place the library
// synchronises the host, once per new key, never while the stream is capturing a CUDA graph,
// and never when D aliases C or the aux it reads: re-running would change the result). New
// entries are written to the cache file (atomically: temp file + rename). Each thread keeps
// its recent problems' descriptors and entries (the fast path), so a repeated call does no
// string formatting, locking or descriptor creation.
//
// Memory. cuBLASLt's workspace is one block per (device, stream), the "workspace_bytes" cap,
// kept for the process's life (as cuBLAS keeps its own). Other scratch is taken per call and
// freed right after the work is enqueued: the allocator is stream-ordered, so the block is
// reused only by later work on that stream. Both come from blutrain-alloc's table on the
// caller's stream; without the table, from cudaMallocAsync/cudaFreeAsync.
#include <cuda_runtime.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "../linalg_internal.h"
#include "blutrain/alloc.h"
#include "cublaslt_loader.h"
#include "kernels.h"

namespace blutrain::linalg {

namespace {

#define BT_CUDA_CHECK(expr)                                                                        \
  do {                                                                                             \
    cudaError_t e_ = (expr);                                                                       \
    if (e_ != cudaSuccess)                                                                         \
      return failf(BT_LINALG_ECUDA, "[gemm] %s failed: %s (%s:%d)", #expr, cudaGetErrorString(e_), \
                   __FILE__, __LINE__);                                                            \
  } while (0)

#define BT_LT_CHECK(expr)                                                  \
  do {                                                                     \
    cublasStatus_t s_ = (expr);                                            \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                       \
      return failf(BT_LINALG_ECUDA, "[gemm] %s failed: %s (%s:%d)", #expr, \
                   F->cublasLtGetStatusString(s_), __FILE__, __LINE__);    \
  } while (0)

const lt::Funcs* F = nullptr;
std::atomic<const bt_alloc_api*> g_alloc{nullptr};

// ---- devices ----------------------------------------------------------------------------------
struct DeviceState {
  bool ready = false;
  cublasLtHandle_t handle = nullptr;
  std::string prefix;  // cache-key prefix: cuBLASLt version and GPU
  int l2_bytes = 0;    // evicted between timed runs when autotuning
  int cc = 0;          // compute capability, major * 10 + minor
};
std::mutex g_dev_mu;
std::vector<DeviceState> g_devs;
int g_dev_count = -1;

int device_state(int dev, DeviceState** out) {
  std::lock_guard<std::mutex> lk(g_dev_mu);
  if (g_dev_count < 0) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      cudaGetLastError();  // clear the sticky-free error so later calls can retry
      return failf(BT_LINALG_ENOCUDA, "[gemm] no usable CUDA device: %s", cudaGetErrorString(e));
    }
    g_dev_count = n;
    g_devs.resize(size_t(n));
  }
  if (g_dev_count == 0) return fail(BT_LINALG_ENOCUDA, "[gemm] no CUDA device is present");
  if (dev >= g_dev_count)
    return failf(BT_LINALG_EINVAL, "[gemm] device %d does not exist (%d CUDA devices)", dev,
                 g_dev_count);
  DeviceState& s = g_devs[size_t(dev)];
  if (!s.ready) {
    cudaDeviceProp prop;
    BT_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
    // The handle is created with `dev`'s primary context current (cudaSetDevice makes it so).
    int prev = -1;
    BT_CUDA_CHECK(cudaGetDevice(&prev));
    BT_CUDA_CHECK(cudaSetDevice(dev));
    cublasStatus_t st = F->cublasLtCreate(&s.handle);
    if (prev != dev) cudaSetDevice(prev);
    if (st != CUBLAS_STATUS_SUCCESS)
      return failf(BT_LINALG_ECUDA, "[gemm] cublasLtCreate failed: %s",
                   F->cublasLtGetStatusString(st));
    std::string name = prop.name;
    for (char& c : name)
      if (c == ' ' || c == '\t' || c == '|') c = '_';
    s.prefix = "lt" + std::to_string(F->cublasLtGetVersion()) + "|sm" +
               std::to_string(prop.major * 10 + prop.minor) + "|" + name + "|t2|";
    s.l2_bytes = prop.l2CacheSize;
    s.cc = prop.major * 10 + prop.minor;
    s.ready = true;
  }
  *out = &s;
  return BT_LINALG_OK;
}

struct DeviceGuard {
  int prev = -1;
  bool changed = false;
  int set(int dev) {
    BT_CUDA_CHECK(cudaGetDevice(&prev));
    if (prev != dev) {
      BT_CUDA_CHECK(cudaSetDevice(dev));
      changed = true;
    }
    return BT_LINALG_OK;
  }
  ~DeviceGuard() {
    if (changed) cudaSetDevice(prev);
  }
};

// ---- scratch memory ---------------------------------------------------------------------------
struct Scratch {
  void* p = nullptr;
  bool via_alloc = false;
  cudaStream_t stream = nullptr;
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() {
    if (!p) return;
    if (via_alloc)
      g_alloc.load()->free(p);
    else
      cudaFreeAsync(p, stream);
  }
  int get(int dev, size_t bytes, cudaStream_t s) {
    stream = s;
    if (bytes == 0) return BT_LINALG_OK;
    const bt_alloc_api* a = options().use_alloc ? g_alloc.load() : nullptr;
    if (a) {
      if (a->malloc(dev, bytes, s, &p) == 0) {
        via_alloc = true;
        return BT_LINALG_OK;
      }
      return failf(BT_LINALG_ENOMEM, "[gemm] could not allocate %zu bytes of scratch: %s", bytes,
                   a->last_error());
    }
    cudaError_t e = cudaMallocAsync(&p, bytes, s);
    if (e != cudaSuccess) {
      p = nullptr;
      return failf(BT_LINALG_ENOMEM, "[gemm] cudaMallocAsync(%zu) failed: %s", bytes,
                   cudaGetErrorString(e));
    }
    return BT_LINALG_OK;
  }
};

// ---- per-stream cuBLASLt workspace -------------------------------------------------------------
// cuBLAS keeps one workspace per handle and hands all of it to every call. We do the same per
// (device, stream): every call, and the autotuner's timing of it, then runs with the same
// workspace as torch.matmul's cuBLAS (a kernel may behave differently given more than its
// minimum), and a repeated call allocates nothing. The block is used on its stream only
// (stream-ordered, so calls never overlap on it) and is kept for the life of the process, as
// cuBLAS and PyTorch keep theirs. Like theirs, it is keyed by the stream's handle: a stream
// destroyed with work pending and a new one given the same handle would share it.
struct StreamWorkspace {
  int dev;
  cudaStream_t s;
  void* p;
  size_t bytes;
  bool via_alloc;
};
std::mutex g_ws_mu;
std::vector<StreamWorkspace> g_ws;

// The stream's workspace of at least `bytes`, or nullptr when none can be had (a new one is
// not made while the stream captures a graph, or memory is short): the caller then allocates
// the algorithm's own minimum for the call.
void* stream_workspace(int dev, cudaStream_t s, size_t bytes) {
  if (bytes == 0) return nullptr;
  const bt_alloc_api* a = options().use_alloc ? g_alloc.load() : nullptr;
  std::lock_guard<std::mutex> lk(g_ws_mu);
  StreamWorkspace* have = nullptr;
  for (StreamWorkspace& w : g_ws)
    if (w.dev == dev && w.s == s) have = &w;
  if (have && have->bytes >= bytes && have->via_alloc == (a != nullptr)) return have->p;
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(s, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone) {
    cudaGetLastError();
    return nullptr;
  }
  void* p = nullptr;
  if (a) {
    if (a->malloc(dev, bytes, s, &p) != 0) return nullptr;
  } else if (cudaMallocAsync(&p, bytes, s) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  if (have) {  // too small (the cap grew) or from the other allocator: replace, stream-ordered
    if (have->via_alloc)
      g_alloc.load()->free(have->p);
    else
      cudaFreeAsync(have->p, s);
    *have = StreamWorkspace{dev, s, p, bytes, a != nullptr};
  } else {
    g_ws.push_back(StreamWorkspace{dev, s, p, bytes, a != nullptr});
  }
  return p;
}

// ---- the column-major problem handed to cuBLASLt ---------------------------------------------
struct LtProblem {
  int64_t M, N, K, batch;
  int opA, opB;  // 0 N, 1 T (cuBLASLt's operands)
  const void* A;
  int64_t lda, bsA;
  const void* B;
  int64_t ldb, bsB;
  int dt_in;  // A and B
  const void* C;
  int64_t ldc, bsC;
  void* D;
  int64_t ldd, bsD;
  int dt_out;  // C and D
  double alpha, beta;
  int compute;
  uint32_t epi;      // cublasLtEpilogue_t
  const void* bias;  // bias, or the bgrad output
  int bias_dt;
  void* aux;
  int64_t ld_aux;
  int aux_dt;
};

cudaDataType_t cuda_type(int dt) {
  switch (dt) {
    case BT_LINALG_F32:
      return CUDA_R_32F;
    case BT_LINALG_F64:
      return CUDA_R_64F;
    case BT_LINALG_F16:
      return CUDA_R_16F;
    default:
      return CUDA_R_16BF;
  }
}

void compute_types(int dt_in, int compute, cublasComputeType_t* ct, cudaDataType_t* st) {
  if (dt_in == BT_LINALG_F64) {
    *ct = CUBLAS_COMPUTE_64F;
    *st = CUDA_R_64F;
    return;
  }
  *st = CUDA_R_32F;
  *ct = CUBLAS_COMPUTE_32F;
  if (dt_in == BT_LINALG_F32) {
    if (compute == BT_LINALG_COMPUTE_TF32)
      *ct = CUBLAS_COMPUTE_32F_FAST_TF32;
    else if (compute == BT_LINALG_COMPUTE_FAST_BF16)
      *ct = CUBLAS_COMPUTE_32F_FAST_16BF;
    else if (compute == BT_LINALG_COMPUTE_FAST_F16)
      *ct = CUBLAS_COMPUTE_32F_FAST_16F;
  }
}

uint32_t align_of(const void* p, int64_t bs_bytes, int64_t batch) {
  uintptr_t v = reinterpret_cast<uintptr_t>(p);
  if (batch > 1) v |= uintptr_t(bs_bytes);
  uint32_t a = 256;
  while (a > 1 && (v % a)) a >>= 1;
  return a;
}

struct LtObjects {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtObjects() {
    if (pref) F->cublasLtMatmulPreferenceDestroy(pref);
    if (d) F->cublasLtMatrixLayoutDestroy(d);
    if (c) F->cublasLtMatrixLayoutDestroy(c);
    if (b) F->cublasLtMatrixLayoutDestroy(b);
    if (a) F->cublasLtMatrixLayoutDestroy(a);
    if (op) F->cublasLtMatmulDescDestroy(op);
  }
};

int make_layout(cublasLtMatrixLayout_t* l, int dt, int64_t rows, int64_t cols, int64_t ld,
                int64_t batch, int64_t bs) {
  BT_LT_CHECK(F->cublasLtMatrixLayoutCreate(l, cuda_type(dt), uint64_t(rows), uint64_t(cols), ld));
  if (batch > 1) {
    int32_t bc = int32_t(batch);
    BT_LT_CHECK(F->cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &bc,
                                                    sizeof bc));
    BT_LT_CHECK(F->cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                    &bs, sizeof bs));
  }
  return BT_LINALG_OK;
}

int build(const LtProblem& p, LtObjects& o) {
  cublasComputeType_t ct;
  cudaDataType_t st;
  compute_types(p.dt_in, p.compute, &ct, &st);
  BT_LT_CHECK(F->cublasLtMatmulDescCreate(&o.op, ct, st));
  int32_t ta = p.opA ? CUBLAS_OP_T : CUBLAS_OP_N, tb = p.opB ? CUBLAS_OP_T : CUBLAS_OP_N;
  BT_LT_CHECK(F->cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  BT_LT_CHECK(F->cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  if (p.epi != CUBLASLT_EPILOGUE_DEFAULT) {
    uint32_t e = p.epi;
    BT_LT_CHECK(
        F->cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &e, sizeof e));
  }
  if (p.bias) {
    int32_t bt = cuda_type(p.bias_dt);
    BT_LT_CHECK(F->cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt,
                                                  sizeof bt));
  }
  if (p.aux) {
    BT_LT_CHECK(F->cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                                  &p.ld_aux, sizeof p.ld_aux));
    int32_t at = cuda_type(p.aux_dt);
    BT_LT_CHECK(F->cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE,
                                                  &at, sizeof at));
  }
  // Stored shapes: an operand with op T is stored (cols, rows) of op's (rows, cols).
  if (int rc =
          make_layout(&o.a, p.dt_in, p.opA ? p.K : p.M, p.opA ? p.M : p.K, p.lda, p.batch, p.bsA))
    return rc;
  if (int rc =
          make_layout(&o.b, p.dt_in, p.opB ? p.N : p.K, p.opB ? p.K : p.N, p.ldb, p.batch, p.bsB))
    return rc;
  if (int rc = make_layout(&o.c, p.dt_out, p.M, p.N, p.ldc, p.batch, p.bsC)) return rc;
  if (int rc = make_layout(&o.d, p.dt_out, p.M, p.N, p.ldd, p.batch, p.bsD)) return rc;
  BT_LT_CHECK(F->cublasLtMatmulPreferenceCreate(&o.pref));
  uint64_t ws = uint64_t(options().workspace_bytes);
  BT_LT_CHECK(F->cublasLtMatmulPreferenceSetAttribute(
      o.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  const int64_t ei = int64_t(dtype_size(p.dt_in)), eo = int64_t(dtype_size(p.dt_out));
  uint32_t al[4] = {align_of(p.A, p.bsA * ei, p.batch), align_of(p.B, p.bsB * ei, p.batch),
                    align_of(p.C, p.bsC * eo, p.batch), align_of(p.D, p.bsD * eo, p.batch)};
  const cublasLtMatmulPreferenceAttributes_t which[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4; ++i)
    BT_LT_CHECK(F->cublasLtMatmulPreferenceSetAttribute(o.pref, which[i], &al[i], sizeof al[i]));
  return BT_LINALG_OK;
}

// The per-call part of the descriptor: epilogue pointers.
int set_pointers(const LtProblem& p, LtObjects& o) {
  if (p.bias)
    BT_LT_CHECK(F->cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &p.bias,
                                                  sizeof p.bias));
  if (p.aux)
    BT_LT_CHECK(F->cublasLtMatmulDescSetAttribute(o.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                                  &p.aux, sizeof p.aux));
  return BT_LINALG_OK;
}

std::string make_key(const DeviceState& ds, const LtProblem& p) {
  const int64_t ei = int64_t(dtype_size(p.dt_in)), eo = int64_t(dtype_size(p.dt_out));
  // Batch strides are part of the layouts (and so of the key) only for batches.
  const bool bt = p.batch > 1;
  char buf[640];
  snprintf(buf, sizeof buf,
           "M%lld,N%lld,K%lld,b%lld,op%d%d,ld%lld/%lld/%lld/%lld,bs%lld/%lld/%lld/%lld,dt%d/%d,c%d,"
           "e%u,bias%d,aux%d/%lld,al%u/%u/%u/%u,ws%lld",
           (long long)p.M, (long long)p.N, (long long)p.K, (long long)p.batch, p.opA, p.opB,
           (long long)p.lda, (long long)p.ldb, (long long)p.ldc, (long long)p.ldd,
           (long long)(bt ? p.bsA : 0), (long long)(bt ? p.bsB : 0), (long long)(bt ? p.bsC : 0),
           (long long)(bt ? p.bsD : 0), p.dt_in, p.dt_out, p.compute, p.epi,
           p.bias ? p.bias_dt : -1, p.aux ? p.aux_dt : -1, (long long)p.ld_aux,
           align_of(p.A, p.bsA * ei, p.batch), align_of(p.B, p.bsB * ei, p.batch),
           align_of(p.C, p.bsC * eo, p.batch), align_of(p.D, p.bsD * eo, p.batch),
           (long long)options().workspace_bytes);
  return ds.prefix + buf;
}

// ---- the algorithm cache ----------------------------------------------------------------------
struct Entry {
  bool fused = false;     // an algorithm exists (else: run unfused)
  bool tuned = false;     // chosen by measuring, not only by the heuristic
  bool verified = false;  // loaded from a file: check once with cublasLtMatmulAlgoCheck
  size_t ws = 0;
  cublasLtMatmulAlgo_t algo{};
};
std::mutex g_cache_mu;
std::unordered_map<std::string, Entry> g_cache;
bool g_cache_loaded = false;
// Bumped, under g_cache_mu, whenever g_cache changes: per-thread copies of entries (the fast
// path below) are then re-read once.
std::atomic<uint64_t> g_gen{1};
std::atomic<int64_t> g_hits{0}, g_misses{0}, g_fallbacks{0}, g_tf32x3{0};

std::string to_hex(const void* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  const auto* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) {
    s += d[b[i] >> 4];
    s += d[b[i] & 15];
  }
  return s;
}
bool from_hex(const std::string& s, void* p, size_t n) {
  if (s.size() != 2 * n) return false;
  auto* b = static_cast<unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) {
    unsigned v;
    if (sscanf(s.c_str() + 2 * i, "%2x", &v) != 1) return false;
    b[i] = (unsigned char)v;
  }
  return true;
}

// Note [No iostreams]: the cache file is read and written with stdio. The GPU machine's GCC
// links libstdc++ statically, and there an ofstream in this library crashed in num_put (its
// locale was never initialised); stdio has no such state.
void load_cache_locked() {
  if (g_cache_loaded) return;
  g_cache_loaded = true;
  g_gen.fetch_add(1);
  FILE* f = fopen(cache_path().c_str(), "r");
  if (!f) return;
  char* line = nullptr;
  size_t cap = 0;
  ssize_t len;
  while ((len = getline(&line, &cap, f)) > 0) {
    std::string s(line, size_t(len));
    while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
    if (s.empty() || s[0] == '#') continue;
    const size_t tab = s.find('\t');
    if (tab == std::string::npos) continue;
    int fused = 0;
    unsigned long long ws = 0;
    char hex[160];
    if (sscanf(s.c_str() + tab + 1, "%d %llu %159s", &fused, &ws, hex) != 3) continue;
    Entry e;
    e.fused = fused != 0;
    e.tuned = fused == 2;
    e.ws = size_t(ws);
    if (e.fused && !from_hex(hex, &e.algo, sizeof e.algo)) continue;
    g_cache.emplace(s.substr(0, tab), e);
  }
  free(line);
  fclose(f);
}

int mkdirs(const std::string& dir) {
  for (size_t i = 1; i <= dir.size(); ++i) {
    if (i == dir.size() || dir[i] == '/') {
      std::string sub = dir.substr(0, i);
      if (mkdir(sub.c_str(), 0755) != 0 && errno != EEXIST) return -1;
    }
  }
  return 0;
}

int save_cache_locked() {
  const std::string path = cache_path();
  const size_t slash = path.rfind('/');
  if (slash != std::string::npos && mkdirs(path.substr(0, slash)) != 0)
    return failf(BT_LINALG_EINVAL, "[save_cache] cannot create the directory of %s: %s",
                 path.c_str(), strerror(errno));
  const std::string tmp = path + ".tmp" + std::to_string(getpid());
  FILE* f = fopen(tmp.c_str(), "w");
  if (!f) return failf(BT_LINALG_EINVAL, "[save_cache] cannot write %s", tmp.c_str());
  bool ok = fprintf(f,
                    "# blutrain-linalg cuBLASLt algorithm cache v1: key\tfused(0 no, 1 "
                    "heuristic, 2 measured) workspace algo\n") > 0;
  for (const auto& [k, e] : g_cache) {
    const std::string hex = e.fused ? to_hex(&e.algo, sizeof e.algo) : std::string("-");
    ok = ok && fprintf(f, "%s\t%d %llu %s\n", k.c_str(), e.fused ? (e.tuned ? 2 : 1) : 0,
                       (unsigned long long)e.ws, hex.c_str()) > 0;
  }
  ok = (fclose(f) == 0) && ok;
  if (!ok) {
    remove(tmp.c_str());
    return failf(BT_LINALG_EINVAL, "[save_cache] writing %s failed", tmp.c_str());
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    remove(tmp.c_str());
    return failf(BT_LINALG_EINVAL, "[save_cache] cannot replace %s: %s", path.c_str(),
                 strerror(errno));
  }
  return BT_LINALG_OK;
}

// ---- the per-thread fast path -----------------------------------------------------------------
// A training loop repeats a few problems, and a GEMM of tens of microseconds cannot afford
// tens of microseconds of host work. Each thread keeps, per problem (a plain struct compared
// bytewise), the string key, the cuBLASLt descriptors and the cache entry it last read; the
// entry is reused while the cache's generation is unchanged. A hit thus costs no snprintf,
// no mutex and no descriptor creation, only two attribute sets for the epilogue pointers.
struct FastKey {
  int64_t M, N, K, batch, lda, ldb, ldc, ldd, bsA, bsB, bsC, bsD, ld_aux, ws;
  int32_t opA, opB, dt_in, dt_out, compute, bias_dt, aux_dt, dev;
  uint32_t epi, al[4], pad;
};

FastKey fast_key(int dev, const LtProblem& p) {
  FastKey k;
  std::memset(&k, 0, sizeof k);  // padding too: keys are compared and hashed bytewise
  const bool bt = p.batch > 1;
  k.M = p.M, k.N = p.N, k.K = p.K, k.batch = p.batch;
  k.lda = p.lda, k.ldb = p.ldb, k.ldc = p.ldc, k.ldd = p.ldd;
  k.bsA = bt ? p.bsA : 0, k.bsB = bt ? p.bsB : 0, k.bsC = bt ? p.bsC : 0, k.bsD = bt ? p.bsD : 0;
  k.ld_aux = p.aux ? p.ld_aux : 0;
  k.ws = options().workspace_bytes;
  k.opA = p.opA, k.opB = p.opB, k.dt_in = p.dt_in, k.dt_out = p.dt_out, k.compute = p.compute;
  k.bias_dt = p.bias ? p.bias_dt : -1;
  k.aux_dt = p.aux ? p.aux_dt : -1;
  k.dev = dev;
  k.epi = p.epi;
  const int64_t ei = int64_t(dtype_size(p.dt_in)), eo = int64_t(dtype_size(p.dt_out));
  k.al[0] = align_of(p.A, p.bsA * ei, p.batch);
  k.al[1] = align_of(p.B, p.bsB * ei, p.batch);
  k.al[2] = align_of(p.C, p.bsC * eo, p.batch);
  k.al[3] = align_of(p.D, p.bsD * eo, p.batch);
  return k;
}
struct FastKeyHash {
  size_t operator()(const FastKey& k) const {
    uint64_t w[sizeof(FastKey) / 8];
    std::memcpy(w, &k, sizeof w);
    uint64_t h = 1469598103934665603ull;
    for (uint64_t x : w) h = (h ^ x) * 1099511628211ull;
    return size_t(h ^ (h >> 29));
  }
};
struct FastKeyEq {
  bool operator()(const FastKey& a, const FastKey& b) const {
    return std::memcmp(&a, &b, sizeof a) == 0;
  }
};
static_assert(sizeof(FastKey) % 8 == 0, "FastKeyHash reads whole words");

struct Slot {
  std::string key;   // the persisted cache's key
  LtObjects objs;    // descriptors, layouts, preference for this problem
  Entry entry;       // the cache entry as last read
  uint64_t gen = 0;  // g_gen when `entry` was read (0: never)
};

int slot_for(const DeviceState& ds, int dev, const LtProblem& p, Slot** out) {
  thread_local std::unordered_map<FastKey, std::unique_ptr<Slot>, FastKeyHash, FastKeyEq> t_slots;
  const FastKey fk = fast_key(dev, p);
  auto it = t_slots.find(fk);
  if (it == t_slots.end()) {
    if (t_slots.size() >= 512) t_slots.clear();  // bound memory for shape-churning callers
    auto sl = std::make_unique<Slot>();
    if (int rc = build(p, sl->objs)) return rc;
    sl->key = make_key(ds, p);
    it = t_slots.emplace(fk, std::move(sl)).first;
  }
  if (int rc = set_pointers(p, it->second->objs)) return rc;
  *out = it->second.get();
  return BT_LINALG_OK;
}

// ---- autotuning -------------------------------------------------------------------------------
struct Events {
  std::vector<cudaEvent_t> ev;
  ~Events() {
    for (cudaEvent_t e : ev) cudaEventDestroy(e);
  }
  bool make(size_t n) {
    while (ev.size() < n) {
      cudaEvent_t e;
      if (cudaEventCreate(&e) != cudaSuccess) return false;
      ev.push_back(e);
    }
    return true;
  }
};

// What a candidate is timed with: the problem, its objects, a workspace big enough for every
// candidate, and (optionally) a buffer whose overwriting evicts the operands from L2.
struct TuneCtx {
  const DeviceState* ds;
  const LtProblem* p;
  const LtObjects* o;
  void* ws;
  size_t ws_bytes;
  void* flush;
  size_t flush_bytes;
  cudaStream_t s;
  Events events;
  float alpha_f = 0, beta_f = 0;  // the scalars for fp32-scaled problems
};

// Runs `reps` timed launches of `algo` (each between its own two events, after an L2 flush
// when there is a flush buffer) and appends their times in ms; false on any failure.
bool time_runs(TuneCtx& t, const cublasLtMatmulAlgo_t& algo, int reps, std::vector<float>* out) {
  if (reps <= 0) return true;
  if (!t.events.make(2 * size_t(reps))) return false;
  const LtProblem& p = *t.p;
  const LtObjects& o = *t.o;
  float alpha_f = float(p.alpha), beta_f = float(p.beta);
  const void* al = p.dt_in == BT_LINALG_F64 ? (const void*)&p.alpha : &alpha_f;
  const void* be = p.dt_in == BT_LINALG_F64 ? (const void*)&p.beta : &beta_f;
  for (int r = 0; r < reps; ++r) {
    if (t.flush && cudaMemsetAsync(t.flush, r & 0xff, t.flush_bytes, t.s) != cudaSuccess)
      return false;
    if (cudaEventRecord(t.events.ev[2 * size_t(r)], t.s) != cudaSuccess) return false;
    if (F->cublasLtMatmul(t.ds->handle, o.op, al, p.A, o.a, p.B, o.b, be, p.C, o.c, p.D, o.d, &algo,
                          t.ws, t.ws_bytes, t.s) != CUBLAS_STATUS_SUCCESS)
      return false;
    if (cudaEventRecord(t.events.ev[2 * size_t(r) + 1], t.s) != cudaSuccess) return false;
  }
  if (cudaEventSynchronize(t.events.ev[2 * size_t(reps) - 1]) != cudaSuccess) return false;
  for (int r = 0; r < reps; ++r) {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, t.events.ev[2 * size_t(r)], t.events.ev[2 * size_t(r) + 1]) !=
        cudaSuccess)
      return false;
    out->push_back(ms);
  }
  return true;
}

float median(std::vector<float> v) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  const size_t h = v.size() / 2;
  return v.size() % 2 ? v[h] : 0.5f * (v[h - 1] + v[h]);
}

// Enough runs for about a millisecond of kernel time, within [lo, hi].
int reps_for(float ms, int lo, int hi) {
  const int want = ms > 0 ? int(1.0f / ms) + 1 : hi;
  return std::max(lo, std::min(hi, want));
}

void log_candidate(const char* what, int i, const cublasLtMatmulHeuristicResult_t& r,
                   const std::vector<float>& samples, float score) {
  int32_t cfg[8] = {-1, -1, -1, -1, -1, -1, -1, -1};
  const cublasLtMatmulAlgoConfigAttributes_t which[8] = {CUBLASLT_ALGO_CONFIG_ID,
                                                         CUBLASLT_ALGO_CONFIG_TILE_ID,
                                                         CUBLASLT_ALGO_CONFIG_STAGES_ID,
                                                         CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                                                         CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                                                         CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING,
                                                         CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION,
                                                         CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID};
  if (F->cublasLtMatmulAlgoConfigGetAttribute)
    for (int j = 0; j < 8; ++j) {
      uint32_t v = 0;  // every attribute read here is 32 bits wide
      size_t got = 0;
      if (F->cublasLtMatmulAlgoConfigGetAttribute(&r.algo, which[j], &v, sizeof v, &got) ==
          CUBLAS_STATUS_SUCCESS)
        cfg[j] = int32_t(v);
    }
  fprintf(stderr,
          "[autotune] %s #%-2d algo=%d tile=%d stages=%d splitk=%d red=%d swz=%d custom=%d "
          "cluster=%d ws=%zu waves=%.2f runs=%zu median=%.4f ms\n",
          what, i, cfg[0], cfg[1], cfg[2], cfg[3], cfg[4], cfg[5], cfg[6], cfg[7], r.workspaceSize,
          double(r.wavesCount), samples.size(), double(score));
}

// Picks the fastest of the heuristic's candidates by timing them on the caller's stream
// (this synchronises the host: once per new key). Stage 1 times every candidate, with more
// runs for short kernels and fewer for slow losers; stage 2 re-times the close finalists in
// interleaved rounds so that drift does not decide. Returns the index, or -1.
int pick_by_timing(TuneCtx& t, const std::vector<cublasLtMatmulHeuristicResult_t>& res, int got) {
  const int lo = int(options().autotune_reps);
  const bool log = options().autotune_log != 0;
  std::vector<std::vector<float>> samples(static_cast<size_t>(got));
  std::vector<float> score(size_t(got), -1);
  float best = -1;
  for (int i = 0; i < got; ++i) {
    std::vector<float> warm;
    if (!time_runs(t, res[size_t(i)].algo, 1, &warm)) {  // warm-up (module load), untrusted
      clear_error();
      cudaGetLastError();
      continue;
    }
    const int first = warm[0] > 2.0f ? 2 : lo;  // long kernels: little noise, much time
    std::vector<float>& v = samples[size_t(i)];
    if (!time_runs(t, res[size_t(i)].algo, first, &v)) {
      v.clear();
      cudaGetLastError();
      continue;
    }
    float est = median(v);
    if (best < 0 || est < 1.25f * best) {  // competitive: earn a steadier estimate
      const int more = reps_for(est, first, 200) - first;
      if (!time_runs(t, res[size_t(i)].algo, more, &v)) {
        v.clear();
        cudaGetLastError();
        continue;
      }
      est = median(v);
    }
    score[size_t(i)] = est;
    if (best < 0 || est < best) best = est;
    if (log) log_candidate("stage1", i, res[size_t(i)], v, est);
  }
  if (best < 0) return -1;
  std::vector<int> fin;
  for (int i = 0; i < got; ++i)
    if (score[size_t(i)] >= 0 && score[size_t(i)] <= 1.05f * best) fin.push_back(i);
  std::sort(fin.begin(), fin.end(),
            [&](int x, int y) { return score[size_t(x)] < score[size_t(y)]; });
  if (fin.size() > 4) fin.resize(4);
  if (fin.size() > 1) {
    for (int round = 0; round < 2; ++round)
      for (int i : fin) {
        std::vector<float>& v = samples[size_t(i)];
        if (!time_runs(t, res[size_t(i)].algo, reps_for(score[size_t(i)], std::min(lo, 2), 200),
                       &v))
          cudaGetLastError();
      }
    for (int i : fin) {
      score[size_t(i)] = median(samples[size_t(i)]);
      if (log) log_candidate("stage2", i, res[size_t(i)], samples[size_t(i)], score[size_t(i)]);
    }
  }
  int pick = -1;
  for (int i = 0; i < got; ++i)
    if (score[size_t(i)] >= 0 && (pick < 0 || score[size_t(i)] < score[size_t(pick)])) pick = i;
  // The heuristic's choice (what cuBLAS itself runs) stays unless beaten beyond noise...
  if (pick > 0 && score[0] >= 0 && score[size_t(pick)] > 0.98f * score[0]) pick = 0;
  // ...and unless the winner also holds up back to back (no flush, one pair of events per
  // batch, as a training loop runs it): one timing method alone must not move us off it.
  if (pick > 0 && score[0] >= 0) {
    std::vector<float> b2b[2];
    const int cand[2] = {pick, 0};
    const int reps = reps_for(score[0], 3, 200);
    void* keep_flush = t.flush;
    t.flush = nullptr;
    Events ev;
    bool ok = ev.make(2);
    for (int round = 0; round < 3 && ok; ++round)
      for (int j = 0; j < 2 && ok; ++j) {
        std::vector<float> one;
        ok = time_runs(t, res[size_t(cand[j])].algo, 1, &one);  // settle, untimed
        ok = ok && cudaEventRecord(ev.ev[0], t.s) == cudaSuccess;
        for (int r = 0; r < reps && ok; ++r)
          ok = F->cublasLtMatmul(
                   t.ds->handle, t.o->op,
                   t.p->dt_in == BT_LINALG_F64 ? (const void*)&t.p->alpha : (const void*)&t.alpha_f,
                   t.p->A, t.o->a, t.p->B, t.o->b,
                   t.p->dt_in == BT_LINALG_F64 ? (const void*)&t.p->beta : (const void*)&t.beta_f,
                   t.p->C, t.o->c, t.p->D, t.o->d, &res[size_t(cand[j])].algo, t.ws, t.ws_bytes,
                   t.s) == CUBLAS_STATUS_SUCCESS;
        ok = ok && cudaEventRecord(ev.ev[1], t.s) == cudaSuccess &&
             cudaEventSynchronize(ev.ev[1]) == cudaSuccess;
        float ms = 0;
        ok = ok && cudaEventElapsedTime(&ms, ev.ev[0], ev.ev[1]) == cudaSuccess;
        if (ok) b2b[j].push_back(ms / float(reps));
      }
    t.flush = keep_flush;
    if (!ok) cudaGetLastError();
    const float mp = median(b2b[0]), m0 = median(b2b[1]);
    if (log)
      fprintf(stderr, "[autotune] back to back: #%d %.4f ms, #0 %.4f ms\n", pick, double(mp),
              double(m0));
    if (!ok || mp < 0 || m0 < 0 || mp > 1.05f * m0) pick = 0;
  }
  if (log && pick >= 0)
    fprintf(stderr, "[autotune] picked #%d (%.4f ms; heuristic #0: %.4f ms)\n", pick,
            double(score[size_t(pick)]), double(score[0]));
  return pick;
}

// Runs the problem through cuBLASLt. Returns OK, or ENOTSUP when cuBLASLt has no algorithm
// for it (the caller then runs it unfused), or an error.
int lt_run(DeviceState& ds, int dev, const LtProblem& p, cudaStream_t s, bool may_autotune) {
  Slot* slot = nullptr;
  if (int rc = slot_for(ds, dev, p, &slot)) return rc;
  const LtObjects& o = slot->objs;
  const std::string& key = slot->key;
  Entry entry;
  bool have = false;
  if (slot->gen == g_gen.load(std::memory_order_acquire)) {  // the fast path
    entry = slot->entry;
    have = true;
  } else {
    std::lock_guard<std::mutex> lk(g_cache_mu);
    load_cache_locked();
    auto it = g_cache.find(key);
    if (it != g_cache.end()) {
      entry = it->second;
      have = true;
      if (entry.verified || !entry.fused) {
        slot->entry = entry;
        slot->gen = g_gen.load();
      }
    }
  }
  if (have && entry.fused && !entry.verified) {  // from the file: still valid here?
    cublasLtMatmulHeuristicResult_t chk{};
    if (F->cublasLtMatmulAlgoCheck(ds.handle, o.op, o.a, o.b, o.c, o.d, &entry.algo, &chk) ==
            CUBLAS_STATUS_SUCCESS &&
        chk.workspaceSize <= size_t(options().workspace_bytes)) {
      entry.verified = true;
      entry.ws = chk.workspaceSize;
      std::lock_guard<std::mutex> lk(g_cache_mu);
      g_cache[key] = entry;
      g_gen.fetch_add(1);
      slot->entry = entry;
      slot->gen = g_gen.load();
    } else {
      have = false;
    }
  }
  bool tune = options().autotune && may_autotune;
  if (have && tune && entry.fused && !entry.tuned) have = false;  // measure it now
  if (have) {
    g_hits++;
  } else {
    g_misses++;
    if (tune) {  // timing synchronises: never while the stream captures a graph
      cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
      if (cudaStreamIsCapturing(s, &cs) != cudaSuccess || cs != cudaStreamCaptureStatusNone) {
        cudaGetLastError();
        tune = false;
      }
    }
    const int want = tune ? int(options().autotune_candidates) : 1;
    std::vector<cublasLtMatmulHeuristicResult_t> res(static_cast<size_t>(want));
    int got = 0;
    cublasStatus_t st = F->cublasLtMatmulAlgoGetHeuristic(ds.handle, o.op, o.a, o.b, o.c, o.d,
                                                          o.pref, want, res.data(), &got);
    entry = Entry{};
    entry.verified = true;
    if (st == CUBLAS_STATUS_SUCCESS && got > 0) {
      entry.fused = true;
      entry.algo = res[0].algo;
      entry.ws = res[0].workspaceSize;
      entry.tuned = tune;
      if (got > 1) {  // measure the candidates on this stream
        size_t max_ws = 0;
        for (int i = 0; i < got; ++i) max_ws = std::max(max_ws, res[size_t(i)].workspaceSize);
        Scratch w, flush;
        TuneCtx t{&ds, &p, &o, nullptr, max_ws, nullptr, 0, s, {}, float(p.alpha), float(p.beta)};
        // Twice the L2: operands of the next run then come from memory, as in training.
        const size_t fl = options().autotune_flush_l2 ? 2 * size_t(ds.l2_bytes) : 0;
        // Timed with the workspace the calls will have (the stream's, see above).
        const size_t cap = size_t(options().workspace_bytes);
        if (void* sw = stream_workspace(dev, s, cap)) {
          t.ws = sw;
          t.ws_bytes = cap;
        }
        if (t.ws || w.get(dev, max_ws, s) == BT_LINALG_OK) {
          if (!t.ws) t.ws = w.p;
          if (fl && flush.get(dev, fl, s) == BT_LINALG_OK) {
            t.flush = flush.p;
            t.flush_bytes = fl;
          }
          const int pick = pick_by_timing(t, res, got);
          if (pick >= 0) {
            entry.algo = res[size_t(pick)].algo;
            entry.ws = res[size_t(pick)].workspaceSize;
          }
        }
        clear_error();
      }
    } else if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED &&
               !(st == CUBLAS_STATUS_INVALID_VALUE && p.epi != CUBLASLT_EPILOGUE_DEFAULT)) {
      // A fused epilogue cuBLASLt rejects as an invalid value (DGELU_BGRAD with a float32 bgrad
      // for a bf16 D, on cuBLASLt 13) runs unfused, as one it reports unsupported.
      return failf(BT_LINALG_ECUDA, "[gemm] cublasLtMatmulAlgoGetHeuristic failed: %s",
                   F->cublasLtGetStatusString(st));
    }
    std::lock_guard<std::mutex> lk(g_cache_mu);
    g_cache[key] = entry;
    g_gen.fetch_add(1);
    slot->entry = entry;
    slot->gen = g_gen.load();
    if (options().persist) save_cache_locked();  // best effort: a cache, not state
    clear_error();
  }
  if (!entry.fused) return BT_LINALG_ENOTSUP;

  // The stream's whole workspace, as the tuner timed it; else the algorithm's minimum.
  size_t ws_bytes = size_t(options().workspace_bytes);
  void* ws = stream_workspace(dev, s, ws_bytes);
  Scratch w;
  if (!ws) {
    if (int rc = w.get(dev, entry.ws, s)) return rc;
    ws = w.p;
    ws_bytes = entry.ws;
  }
  float alpha_f = float(p.alpha), beta_f = float(p.beta);
  const void* al = p.dt_in == BT_LINALG_F64 ? (const void*)&p.alpha : &alpha_f;
  const void* be = p.dt_in == BT_LINALG_F64 ? (const void*)&p.beta : &beta_f;
  cublasStatus_t st = F->cublasLtMatmul(ds.handle, o.op, al, p.A, o.a, p.B, o.b, be, p.C, o.c, p.D,
                                        o.d, &entry.algo, ws, ws_bytes, s);
  if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE) {
    // Refused at launch (nothing was enqueued): remember, and let the caller run unfused.
    std::lock_guard<std::mutex> lk(g_cache_mu);
    g_cache[key].fused = false;
    g_gen.fetch_add(1);
    slot->gen = 0;
    return BT_LINALG_ENOTSUP;
  }
  if (st != CUBLAS_STATUS_SUCCESS)
    return failf(BT_LINALG_ECUDA, "[gemm] cublasLtMatmul failed: %s (%s:%d)",
                 F->cublasLtGetStatusString(st), __FILE__, __LINE__);
  return BT_LINALG_OK;
}

// cuBLASLt's type support for C/D given A/B (its documented table, the subset we use).
bool lt_supports_out(int in, int out) {
  switch (in) {
    case BT_LINALG_F32:
      return out == BT_LINALG_F32;
    case BT_LINALG_F64:
      return out == BT_LINALG_F64;
    case BT_LINALG_F16:
      return out == BT_LINALG_F16 || out == BT_LINALG_F32;
    default:
      return out == BT_LINALG_BF16 || out == BT_LINALG_F32;
  }
}

uint32_t lt_epilogue(int e) {
  switch (e) {
    case BT_LINALG_EPI_BIAS:
      return CUBLASLT_EPILOGUE_BIAS;
    case BT_LINALG_EPI_GELU:
      return CUBLASLT_EPILOGUE_GELU;
    case BT_LINALG_EPI_BIAS_GELU:
      return CUBLASLT_EPILOGUE_GELU_BIAS;
    case BT_LINALG_EPI_GELU_AUX:
      return CUBLASLT_EPILOGUE_GELU_AUX;
    case BT_LINALG_EPI_BIAS_GELU_AUX:
      return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case BT_LINALG_EPI_DGELU:
      return CUBLASLT_EPILOGUE_DGELU;
    case BT_LINALG_EPI_DGELU_BGRAD:
      return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    // Row-major op(A) is cuBLASLt's B operand, and vice versa.
    case BT_LINALG_EPI_BGRAD_A:
      return CUBLASLT_EPILOGUE_BGRADB;
    case BT_LINALG_EPI_BGRAD_B:
      return CUBLASLT_EPILOGUE_BGRADA;
    default:
      return CUBLASLT_EPILOGUE_DEFAULT;
  }
}

// Whether the epilogue's side operands meet cuBLASLt's documented constraints; otherwise
// the call runs unfused rather than failing inside cuBLASLt.
bool fusable(const bt_linalg_gemm_desc& d) {
  const int e = d.epilogue;
  if (e == BT_LINALG_EPI_NONE) return true;
  if (!options().fused_epilogues || d.batch > 1 || d.k == 0) return false;
  const bool half_out = d.d.dtype == BT_LINALG_F16 || d.d.dtype == BT_LINALG_BF16;
  auto vec_ok = [&](const bt_linalg_matrix& v) {
    return (v.dtype == d.d.dtype || (half_out && v.dtype == BT_LINALG_F32)) &&
           reinterpret_cast<uintptr_t>(v.ptr) % 16 == 0;
  };
  if (epi_has_bias(e) && !vec_ok(d.bias)) return false;
  if (epi_has_bgrad(e) && !vec_ok(d.bgrad)) return false;
  if (epi_writes_aux(e) || epi_reads_aux(e)) {
    if (d.aux.dtype != d.d.dtype || d.aux.ld % 8 != 0 ||
        reinterpret_cast<uintptr_t>(d.aux.ptr) % 256 != 0)
      return false;
  }
  return true;
}

// Row-major descriptor -> column-major cuBLASLt problem.
LtProblem to_lt(const bt_linalg_gemm_desc& d) {
  LtProblem p{};
  p.M = d.n;
  p.N = d.m;
  p.K = d.k;
  p.batch = d.batch;
  p.opA = d.transb;
  p.A = d.b.ptr;
  p.lda = d.b.ld;
  p.bsA = d.b.batch_stride;
  p.opB = d.transa;
  p.B = d.a.ptr;
  p.ldb = d.a.ld;
  p.bsB = d.a.batch_stride;
  p.dt_in = d.a.dtype;
  p.D = const_cast<void*>(d.d.ptr);
  p.ldd = d.d.ld;
  p.bsD = d.d.batch_stride;
  p.dt_out = d.d.dtype;
  if (d.beta != 0.0) {
    p.C = d.c.ptr;
    p.ldc = d.c.ld;
    p.bsC = d.c.batch_stride;
  } else {  // not read: any valid layout will do
    p.C = p.D;
    p.ldc = p.ldd;
    p.bsC = p.bsD;
  }
  p.alpha = d.alpha;
  p.beta = d.beta;
  p.compute = d.compute;
  p.epi = lt_epilogue(d.epilogue);
  if (epi_has_bias(d.epilogue)) {
    p.bias = d.bias.ptr;
    p.bias_dt = d.bias.dtype;
  } else if (epi_has_bgrad(d.epilogue)) {
    p.bias = d.bgrad.ptr;
    p.bias_dt = d.bgrad.dtype;
  }
  if (epi_writes_aux(d.epilogue) || epi_reads_aux(d.epilogue)) {
    p.aux = const_cast<void*>(d.aux.ptr);
    p.ld_aux = d.aux.ld;
    p.aux_dt = d.aux.dtype;
  }
  return p;
}

kern::Mat kmat(const void* p, int64_t ld, int64_t bs, int dt) { return kern::Mat{p, ld, bs, dt}; }

// Whether a float32 GEMM goes to our 3xTF32 kernel (gemm_tf32x3.cu, Note [3xTF32]): fp32
// products (compute DEFAULT or FP32) on sm_80+, unless the "fp32_3xtf32" option is off. Its
// measured error is below cuBLAS SGEMM's; it runs 1.1-1.2x faster at GPT-2's shapes.
bool wants_tf32x3(const DeviceState& ds, const bt_linalg_gemm_desc& d) {
  return options().fp32_3xtf32 && ds.cc >= 80 && d.a.dtype == BT_LINALG_F32 &&
         (d.compute == BT_LINALG_COMPUTE_DEFAULT || d.compute == BT_LINALG_COMPUTE_FP32) &&
         d.k > 0 && d.m > 0 && d.n > 0;
}

kern::Tf32x3Problem tf32x3_problem(const bt_linalg_gemm_desc& g) {
  kern::Tf32x3Problem p{};
  p.m = g.m, p.n = g.n, p.k = g.k, p.batch = g.batch;
  p.transa = g.transa, p.transb = g.transb;
  p.a = static_cast<const float*>(g.a.ptr), p.lda = g.a.ld, p.bsa = g.a.batch_stride;
  p.b = static_cast<const float*>(g.b.ptr), p.ldb = g.b.ld, p.bsb = g.b.batch_stride;
  p.d = static_cast<float*>(const_cast<void*>(g.d.ptr)), p.ldd = g.d.ld, p.bsd = g.d.batch_stride;
  p.c = static_cast<const float*>(g.c.ptr), p.ldc = g.c.ld, p.bsc = g.c.batch_stride;
  p.alpha = g.alpha, p.beta = g.beta;
  return p;
}

// GEMM into an fp32 (fp64) Z, then our kernels for the epilogue and the reductions. With
// `tf32x3`, the GEMM is our 3xTF32 kernel where it takes the problem (else cuBLASLt's).
int run_unfused(DeviceState& ds, int dev, const bt_linalg_gemm_desc& d, cudaStream_t s,
                bool may_tune, bool tf32x3 = false) {
  const int e = d.epilogue;
  const int acc = d.a.dtype == BT_LINALG_F64 ? BT_LINALG_F64 : BT_LINALG_F32;
  const int64_t m = d.m, n = d.n, k = d.k, batch = d.batch;
  if (!tf32x3 && (e != BT_LINALG_EPI_NONE || d.d.dtype != acc)) g_fallbacks++;
  if (batch > 65535 &&
      (e == BT_LINALG_EPI_DGELU_BGRAD || e == BT_LINALG_EPI_BGRAD_A || e == BT_LINALG_EPI_BGRAD_B))
    return fail(BT_LINALG_ENOTSUP, "[gemm] bias gradients support at most 65535 batch items");

  Scratch zs;
  kern::Mat Z;
  if (d.d.dtype == acc) {
    Z = kmat(d.d.ptr, d.d.ld, d.d.batch_stride, acc);
  } else {
    if (int rc = zs.get(dev, size_t(batch * m * n) * dtype_size(acc), s)) return rc;
    Z = kmat(zs.p, n, m * n, acc);
  }
  const bool c_in_z = d.beta != 0.0 && d.c.ptr == Z.ptr && d.c.ld == Z.ld && d.c.dtype == acc;
  if (d.beta != 0.0 && !c_in_z) {
    int rc = kern::convert_scale(kmat(d.c.ptr, d.c.ld, d.c.batch_stride, d.c.dtype), Z, m, n, batch,
                                 1.0, s);
    BT_CUDA_CHECK(cudaError_t(rc));
  }
  if (k == 0 || m == 0 || n == 0) {  // empty sum: Z = beta C
    BT_CUDA_CHECK(cudaError_t(kern::convert_scale(Z, Z, m, n, batch, d.beta, s)));
  } else {
    bt_linalg_gemm_desc g = d;
    g.epilogue = BT_LINALG_EPI_NONE;
    g.d = bt_linalg_matrix{Z.ptr, Z.ld, Z.bs, acc, 0};
    if (d.beta != 0.0) g.c = g.d;
    const kern::Tf32x3Problem xp = tf32x3_problem(g);
    if (tf32x3 && kern::gemm_tf32x3_supported(xp)) {
      // Split-K partials: in the stream's workspace when they fit (stream-ordered like every
      // cuBLASLt call's use of it, and no allocator call a GEMM), else scratch for this call.
      const size_t need = kern::gemm_tf32x3_workspace_bytes(xp, dev);
      const size_t cap = size_t(options().workspace_bytes);
      void* wp = need && need <= cap ? stream_workspace(dev, s, cap) : nullptr;
      Scratch ws;
      if (need && !wp) {
        if (int rc = ws.get(dev, need, s)) return rc;
        wp = ws.p;
      }
      BT_CUDA_CHECK(cudaError_t(kern::gemm_tf32x3(xp, dev, wp, s)));
      g_tf32x3++;
    } else {
      LtProblem p = to_lt(g);
      int rc = lt_run(ds, dev, p, s, may_tune && d.beta == 0.0);
      if (rc == BT_LINALG_ENOTSUP)
        return failf(BT_LINALG_ENOTSUP,
                     "[gemm] cuBLASLt has no algorithm for %s inputs with m=%lld "
                     "n=%lld k=%lld",
                     dtype_name(d.a.dtype), (long long)m, (long long)n, (long long)k);
      if (rc) return rc;
    }
  }
  int flags = 0;
  if (epi_has_bias(e)) flags |= kern::kBias;
  if (epi_writes_aux(e)) flags |= kern::kAuxOut;
  if (epi_has_gelu(e)) flags |= kern::kGelu;
  if (epi_reads_aux(e)) flags |= kern::kDgelu;
  const kern::Mat D = kmat(d.d.ptr, d.d.ld, d.d.batch_stride, d.d.dtype);
  if (flags || D.ptr != Z.ptr) {
    const kern::Mat bias = kmat(d.bias.ptr, 0, d.bias.batch_stride, d.bias.dtype);
    const kern::Mat aux = kmat(d.aux.ptr, d.aux.ld, d.aux.batch_stride, d.aux.dtype);
    BT_CUDA_CHECK(cudaError_t(kern::epilogue(Z, D, bias, aux, flags, m, n, batch, s)));
  }
  if (epi_has_bgrad(e)) {
    const kern::Mat out = kmat(d.bgrad.ptr, 0, d.bgrad.batch_stride, d.bgrad.dtype);
    // What to reduce: D's pre-rounding values (Z), or op(A) / op(B) as stored.
    kern::Mat x;
    int64_t rows, cols;
    bool by_cols;
    if (e == BT_LINALG_EPI_DGELU_BGRAD) {
      x = Z, rows = m, cols = n, by_cols = true;
    } else if (e == BT_LINALG_EPI_BGRAD_A) {  // row sums of op(A)
      x = kmat(d.a.ptr, d.a.ld, d.a.batch_stride, d.a.dtype);
      rows = d.transa ? k : m, cols = d.transa ? m : k, by_cols = d.transa;
    } else {  // column sums of op(B)
      x = kmat(d.b.ptr, d.b.ld, d.b.batch_stride, d.b.dtype);
      rows = d.transb ? n : k, cols = d.transb ? k : n, by_cols = !d.transb;
    }
    if (by_cols) {
      Scratch part;
      if (int rc = part.get(dev, kern::colsum_scratch_bytes(rows, cols, batch), s)) return rc;
      BT_CUDA_CHECK(cudaError_t(kern::colsum(x, out, rows, cols, batch, part.p, s)));
    } else {
      BT_CUDA_CHECK(cudaError_t(kern::rowsum(x, out, rows, cols, batch, s)));
    }
  }
  return BT_LINALG_OK;
}

}  // namespace

int cuda_available() { return 1; }

int cuda_set_alloc_api(const void* t) {
  g_alloc.store(static_cast<const bt_alloc_api*>(t));
  return BT_LINALG_OK;
}

int cuda_get_stat(const char* name, int64_t* v) {
  const std::string n = name;
  if (n == "cache_hits")
    *v = g_hits.load();
  else if (n == "cache_misses")
    *v = g_misses.load();
  else if (n == "fallback_epilogues")
    *v = g_fallbacks.load();
  else if (n == "tf32x3_calls")
    *v = g_tf32x3.load();
  else if (n == "cache_entries") {
    std::lock_guard<std::mutex> lk(g_cache_mu);
    *v = int64_t(g_cache.size());
  } else
    return BT_LINALG_EINVAL;
  return BT_LINALG_OK;
}

int cuda_save_cache() {
  std::lock_guard<std::mutex> lk(g_cache_mu);
  return save_cache_locked();
}

int cuda_clear_cache(int also_file) {
  std::lock_guard<std::mutex> lk(g_cache_mu);
  g_cache.clear();
  g_cache_loaded = false;
  g_gen.fetch_add(1);
  if (also_file) remove(cache_path().c_str());
  return BT_LINALG_OK;
}

int cuda_gemm(const bt_linalg_gemm_desc& d) {
  if (!F && !(F = lt::load())) return BT_LINALG_ECUDA;
  DeviceState* ds = nullptr;
  if (int rc = device_state(d.device, &ds)) return rc;
  DeviceGuard guard;
  if (int rc = guard.set(d.device)) return rc;
  auto s = static_cast<cudaStream_t>(d.stream);

  // Autotuning re-runs the call: only when that is harmless (D aliases neither C nor the aux
  // it reads). lt_run also skips it while the stream captures a graph (it synchronises).
  const bool may_tune = options().autotune && !(d.beta != 0.0 && d.c.ptr == d.d.ptr) &&
                        !(epi_reads_aux(d.epilogue) && d.aux.ptr == d.d.ptr);
  // Only problems the kernel takes: the rest keep cuBLASLt's fused epilogues below.
  if (wants_tf32x3(*ds, d) && kern::gemm_tf32x3_supported(tf32x3_problem(d)))
    return run_unfused(*ds, d.device, d, s, may_tune, true);
  if (d.k > 0 && d.m > 0 && d.n > 0 && lt_supports_out(d.a.dtype, d.d.dtype) && fusable(d)) {
    int rc = lt_run(*ds, d.device, to_lt(d), s, may_tune);
    if (rc != BT_LINALG_ENOTSUP) return rc;
    clear_error();
  }
  return run_unfused(*ds, d.device, d, s, may_tune);
}

}  // namespace blutrain::linalg
