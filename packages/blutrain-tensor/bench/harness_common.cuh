// harness_common.cuh: the host helpers the standalone CUDA harnesses in bench/ share: the CK error
// check (prints the error and exits 2), device buffers (dmalloc / dcopy, `pad` spare bytes after
// the data; hcopy back), poison (0xff bytes: NaN in bf16 and fp32), rel_err (max |got - ref| /
// max |ref|), time_ms (cudaEvent median) and harness_selected (the BT_HARNESS_ONLY filter).  Define
// BT_HARNESS_THROW_STUB before the include (which must then follow the library sources: runtime.h
// declares it) to also get the bt::cuda::throw_cuda_error the launchers' BT_CUDA_CHECK calls,
// printing and exiting 2 instead of raising the library's Python exception.  Included by
// attn_problem.cuh (attn_tune.cu, attn_sm90_bwd_check.cu), attn_sm90_check.cu, attn_tf32_check.cu,
// cast_check.cu, ln_fwd_check.cu, ln_bwd_check.cu and nn_check.cu (the last three also through
// ln_harness.cuh).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#define CK(x)                                                                                      \
  do {                                                                                             \
    cudaError_t e_ = (x);                                                                          \
    if (e_ != cudaSuccess) {                                                                       \
      std::printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); \
      std::exit(2);                                                                                \
    }                                                                                              \
  } while (0)

#ifdef BT_HARNESS_THROW_STUB
[[noreturn]] void bt::cuda::throw_cuda_error(const char* op, const char* expr, cudaError_t err,
                                             const char* file, int line) {
  std::printf("CUDA error in %s: %s: %s at %s:%d\n", op, expr, cudaGetErrorString(err), file, line);
  std::exit(2);
}
#endif

// Whether a variant named `name` runs: BT_HARNESS_ONLY (comma-separated substrings) in the
// environment narrows a harness to some variants (ncu, compute-sanitizer); unset: all run.
static bool harness_selected(const char* name) {
  const char* only = std::getenv("BT_HARNESS_ONLY");
  if (!only || !*only) return true;
  const std::string list(only), nm(name);
  size_t b = 0;
  while (b <= list.size()) {
    const size_t e = std::min(list.find(',', b), list.size());
    if (e > b && nm.find(list.substr(b, e - b)) != std::string::npos) return true;
    b = e + 1;
  }
  return false;
}

// n elements of X, plus pad spare bytes (0: exactly n, so compute-sanitizer sees any overrun).
template <typename X>
static X* dmalloc(size_t n, size_t pad = 64) {
  X* d;
  CK(cudaMalloc(&d, n * sizeof(X) + pad));
  return d;
}
template <typename X>
static X* dcopy(const std::vector<X>& h, size_t pad = 64) {
  X* d = dmalloc<X>(h.size(), pad);
  CK(cudaMemcpy(d, h.data(), h.size() * sizeof(X), cudaMemcpyHostToDevice));
  return d;
}
template <typename X>
static std::vector<X> hcopy(const X* d, size_t n) {
  std::vector<X> h(n);
  CK(cudaMemcpy(h.data(), d, n * sizeof(X), cudaMemcpyDeviceToHost));
  return h;
}
static inline void poison(void* d, size_t bytes) { CK(cudaMemset(d, 0xff, bytes)); }  // NaN

// max |got(i) - ref[i]| / max(ref_floor, max |ref|); a non-finite got(i) gives inf.  With
// ref_floor 0 and an all-zero ref: max |got - ref| itself.
template <typename F>
static double rel_err(const std::vector<double>& ref, F got, double ref_floor = 1e-30) {
  double md = 0, mr = ref_floor;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double g = got(i);
    if (!std::isfinite(g)) return INFINITY;
    md = std::max(md, std::fabs(g - ref[i]));
    mr = std::max(mr, std::fabs(ref[i]));
  }
  return mr > 0 ? md / mr : md;
}

// cudaEvent timing on the default stream (ms): warmup calls of f and a device sync, then the
// median of reps samples, each one event pair around batch back-to-back calls, divided by batch.
template <typename F>
static float time_ms(F&& f, int warmup, int reps, int batch = 1) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) f();
  CK(cudaDeviceSynchronize());
  std::vector<float> ts;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(a));
    for (int i = 0; i < batch; ++i) f();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms / batch);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}
