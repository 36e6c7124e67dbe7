// Host-only stand-ins for the CUDA runtime, cuBLASLt and our kernels: "device" memory is host
// memory, cublasLtMatmul computes on the CPU with cuBLASLt's column-major semantics.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cassert>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "blutrain/linalg.h"
#include "cuda/kernels.h"
#include "half.h"

using namespace blutrain::linalg;

#define FAKE_API extern "C" __attribute__((visibility("default")))

// ---- runtime ----
FAKE_API cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
FAKE_API cudaError_t cudaGetDeviceProperties_v2(cudaDeviceProp* p, int) {
  memset(p, 0, sizeof *p);
  strcpy(p->name, "Fake GPU");
  p->major = 9;
  p->l2CacheSize = 1 << 16;  // small: the autotune flush path runs, cheaply
  return cudaSuccess;
}
FAKE_API cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int d) {
  return cudaGetDeviceProperties_v2(p, d);
}
static int g_dev = 0;
FAKE_API cudaError_t cudaGetDevice(int* d) {
  *d = g_dev;
  return cudaSuccess;
}
FAKE_API cudaError_t cudaSetDevice(int d) {
  g_dev = d;
  return cudaSuccess;
}
FAKE_API cudaError_t cudaMallocAsync(void** p, size_t n, cudaStream_t) {
  *p = malloc(n);
  memset(*p, 0xAB, n);
  return cudaSuccess;
}
FAKE_API cudaError_t cudaFreeAsync(void* p, cudaStream_t) {
  free(p);
  return cudaSuccess;
}
FAKE_API cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
  memset(p, v, n);
  return cudaSuccess;
}
FAKE_API cudaError_t cudaEventCreate(cudaEvent_t* e) {
  *e = (cudaEvent_t)malloc(8);
  return cudaSuccess;
}
FAKE_API cudaError_t cudaEventDestroy(cudaEvent_t e) {
  free(e);
  return cudaSuccess;
}
FAKE_API cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
FAKE_API cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
static float g_ms = 3;
FAKE_API cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t, cudaEvent_t) {
  *ms = g_ms;
  g_ms = g_ms * 0.7f + 0.1f;
  return cudaSuccess;
}
FAKE_API cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* s) {
  *s = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
FAKE_API const char* cudaGetErrorString(cudaError_t) { return "fake error"; }
FAKE_API cudaError_t cudaGetLastError(void) { return cudaSuccess; }

// ---- element helpers ----
static double ld_(const void* p, int dt, int64_t i) {
  switch (dt) {
    case BT_LINALG_F32:
      return ((const float*)p)[i];
    case BT_LINALG_F64:
      return ((const double*)p)[i];
    case BT_LINALG_F16:
      return f16_to_f32(((const uint16_t*)p)[i]);
    default:
      return bf16_to_f32(((const uint16_t*)p)[i]);
  }
}
static void st_(void* p, int dt, int64_t i, double v) {
  switch (dt) {
    case BT_LINALG_F32:
      ((float*)p)[i] = (float)v;
      break;
    case BT_LINALG_F64:
      ((double*)p)[i] = v;
      break;
    case BT_LINALG_F16:
      ((uint16_t*)p)[i] = f32_to_f16((float)v);
      break;
    default:
      ((uint16_t*)p)[i] = f32_to_bf16((float)v);
  }
}

// ---- kernels (host) ----
namespace blutrain::linalg::kern {
int convert_scale(Mat s, Mat d, int64_t r, int64_t c, int64_t b, double scale, void*) {
  for (int64_t x = 0; x < b; ++x)
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < c; ++j)
        st_((void*)d.ptr, d.dtype, x * d.bs + i * d.ld + j,
            scale == 0 ? 0.0 : scale * ld_(s.ptr, s.dtype, x * s.bs + i * s.ld + j));
  return 0;
}
int epilogue(Mat z, Mat d, Mat bias, Mat aux, int flags, int64_t r, int64_t c, int64_t b, void*) {
  for (int64_t x = 0; x < b; ++x)
    for (int64_t i = 0; i < r; ++i)
      for (int64_t j = 0; j < c; ++j) {
        int64_t zi = x * z.bs + i * z.ld + j;
        double v = ld_(z.ptr, z.dtype, zi);
        if (flags & kBias) v += ld_(bias.ptr, bias.dtype, x * bias.bs + j);
        int64_t ai = x * aux.bs + i * aux.ld + j;
        if (flags & kAuxOut) st_((void*)aux.ptr, aux.dtype, ai, v);
        if (flags & kGelu) v = gelu<double>(v);
        if (flags & kDgelu) v *= dgelu<double>(ld_(aux.ptr, aux.dtype, ai));
        st_((void*)z.ptr, z.dtype, zi, v);
        if (d.ptr != z.ptr) st_((void*)d.ptr, d.dtype, x * d.bs + i * d.ld + j, v);
      }
  return 0;
}
size_t colsum_scratch_bytes(int64_t r, int64_t c, int64_t b) { return size_t(c * b * 8 + 8); }
int colsum(Mat x, Mat out, int64_t r, int64_t c, int64_t b, void* scratch, void*) {
  assert(scratch);
  for (int64_t y = 0; y < b; ++y)
    for (int64_t j = 0; j < c; ++j) {
      double s = 0;
      for (int64_t i = 0; i < r; ++i) s += ld_(x.ptr, x.dtype, y * x.bs + i * x.ld + j);
      st_((void*)out.ptr, out.dtype, y * out.bs + j, s);
    }
  return 0;
}
int rowsum(Mat x, Mat out, int64_t r, int64_t c, int64_t b, void*) {
  for (int64_t y = 0; y < b; ++y)
    for (int64_t i = 0; i < r; ++i) {
      double s = 0;
      for (int64_t j = 0; j < c; ++j) s += ld_(x.ptr, x.dtype, y * x.bs + i * x.ld + j);
      st_((void*)out.ptr, out.dtype, y * out.bs + i, s);
    }
  return 0;
}
// The 3xTF32 GEMM, in double (its error is below fp32's; the driver's tolerance is fp32's).
bool gemm_tf32x3_supported(const Tf32x3Problem& p) {
  return p.lda % 4 == 0 && p.ldb % 4 == 0 && p.m > 0 && p.n > 0 && p.k > 0;
}
size_t gemm_tf32x3_workspace_bytes(const Tf32x3Problem& p, int) {
  return size_t(p.batch * p.m * p.n) * sizeof(float);  // as a split-K call would ask
}
int gemm_tf32x3(const Tf32x3Problem& p, int, void* ws, void*) {
  assert(ws);
  for (int64_t x = 0; x < p.batch; ++x)
    for (int64_t i = 0; i < p.m; ++i)
      for (int64_t j = 0; j < p.n; ++j) {
        double s = 0;
        for (int64_t kk = 0; kk < p.k; ++kk) {
          const float a =
              p.transa ? p.a[x * p.bsa + kk * p.lda + i] : p.a[x * p.bsa + i * p.lda + kk];
          const float b =
              p.transb ? p.b[x * p.bsb + j * p.ldb + kk] : p.b[x * p.bsb + kk * p.ldb + j];
          s += double(a) * double(b);
        }
        float* d = p.d + x * p.bsd + i * p.ldd + j;
        double v = p.alpha * s;
        if (p.beta != 0) v += p.beta * p.c[x * p.bsc + i * p.ldc + j];
        *d = float(v);
      }
  return 0;
}
}  // namespace blutrain::linalg::kern
