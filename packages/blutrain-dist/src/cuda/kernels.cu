// cuda/kernels.cu: the elementwise kernels a reduction needs around NCCL, on the comm stream.
//
// Kernels first, then launchers.  Grid-stride loops over 64-bit indices; 16-bit floats are
// converted to float (exact), divisions go through double and round once into the element type
// (Note [exact average]).
//
// Note [exact average]: AVG is SUM then x / n.  Computing q = x / n in double and rounding q
// to the element type gives the correctly rounded quotient for every float type and any n
// below 2^28: the double quotient can only land on a rounding midpoint of the narrower type if
// the exact one does.  NCCL's own ncclAvg multiplies by a rounded 1/n instead (not exact for
// n = 3, 5, 6, 7, ...).
//
// Note [ordered sum]: the deterministic reductions sum the ranks' contributions k = 0..n-1 in a
// fixed tree that does not depend on which rank adds: tree(lo, hi) = tree(lo, lo + p) +
// tree(lo + p, hi), p the largest power of two below hi - lo.  It is the shape that a binary
// counter of gradient accumulation builds ((g0 + g1) + g2 for three, (g0 + g1) + (g2 + g3) for
// four), so a rank's contribution summed over its micro-batches is a subtree, and a global batch
// split over 1, 2 or 4 ranks is summed in the same order to the bit.  Every addition rounds to
// the element type, as blutrain.tensor's own add does.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../nccl_lib.h"

namespace bt::dist {
namespace {

constexpr int kThreads = 256;     // threads per block
constexpr int kMaxBlocks = 4096;  // grid-stride beyond this
constexpr int kMaxChunks = 1024;  // ranks an ordered sum takes (its stack holds 11 subtrees)

template <typename T>
struct Num {  // element <-> float/double conversions
  __device__ static double to_d(T v) { return static_cast<double>(v); }
  __device__ static T from_d(double v) { return static_cast<T>(v); }
  __device__ static T add(T a, T b) { return a + b; }
};
template <>
struct Num<__half> {
  __device__ static double to_d(__half v) { return static_cast<double>(__half2float(v)); }
  __device__ static __half from_d(double v) { return __double2half(v); }
  __device__ static __half add(__half a, __half b) {
    return __float2half_rn(__half2float(a) + __half2float(b));
  }
};
template <>
struct Num<__nv_bfloat16> {
  __device__ static double to_d(__nv_bfloat16 v) {
    return static_cast<double>(__bfloat162float(v));
  }
  __device__ static __nv_bfloat16 from_d(double v) { return __double2bfloat16(v); }
  __device__ static __nv_bfloat16 add(__nv_bfloat16 a, __nv_bfloat16 b) {
    return __float2bfloat16_rn(__bfloat162float(a) + __bfloat162float(b));
  }
};

// ---- kernels ---------------------------------------------------------------------------------
template <typename T>
__global__ void divide_kernel(T* buf, size_t n, double divisor) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(blockDim.x) * gridDim.x)
    buf[i] = Num<T>::from_d(Num<T>::to_d(buf[i]) / divisor);
}

template <typename S, typename D>
__global__ void cast_kernel(const S* src, D* dst, size_t n, double divisor) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(blockDim.x) * gridDim.x) {
    const double v = Num<S>::to_d(src[i]);
    dst[i] = Num<D>::from_d(divisor > 1 ? v / divisor : v);
  }
}

// Note [ordered sum]: an explicit stack replays the binary counter: leaf k is pushed, then
// while the top two hold subtrees of equal size they are merged; at the end the stack is folded
// from the top (the smaller, later subtrees first).
template <typename T>
__global__ void ordered_sum_kernel(const T* src, int nchunks, size_t chunk, T* dst,
                                   double divisor) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < chunk;
       i += size_t(blockDim.x) * gridDim.x) {
    T val[11];
    int size[11];
    int top = 0;
    for (int k = 0; k < nchunks; ++k) {
      val[top] = src[size_t(k) * chunk + i];
      size[top] = 1;
      ++top;
      while (top >= 2 && size[top - 1] == size[top - 2]) {
        val[top - 2] = Num<T>::add(val[top - 2], val[top - 1]);
        size[top - 2] *= 2;
        --top;
      }
    }
    while (top >= 2) {
      val[top - 2] = Num<T>::add(val[top - 2], val[top - 1]);
      --top;
    }
    dst[i] = divisor > 1 ? Num<T>::from_d(Num<T>::to_d(val[0]) / divisor) : val[0];
  }
}

// ---- launchers -----------------------------------------------------------------------------
int blocks_for(size_t n) {
  const size_t b = (n + kThreads - 1) / kThreads;
  return static_cast<int>(b < kMaxBlocks ? (b ? b : 1) : kMaxBlocks);
}

template <typename F>
void dispatch_float(int dtype, const char* op, F&& f) {
  switch (dtype) {
    case 4:
      f(__half{});
      break;
    case 5:
      f(__nv_bfloat16{});
      break;
    case 6:
      f(float{});
      break;
    case 7:
      f(double{});
      break;
    default:
      fail(BT_DIST_EINVAL,
           std::string("[") + op + "] needs a floating dtype, got " + dtype_name(dtype));
  }
}

}  // namespace

void divide(void* buf, size_t n, int dtype, int divisor, int device, void* stream) {
  if (n == 0 || divisor == 1) return;
  if (divisor < 1) fail(BT_DIST_EINVAL, "[divide] divisor must be >= 1");
  BT_DIST_CUDA_CHECK("divide", cudaSetDevice(device));
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_float(dtype, "divide", [&](auto tag) {
    using T = decltype(tag);
    divide_kernel<T><<<blocks_for(n), kThreads, 0, s>>>(static_cast<T*>(buf), n, double(divisor));
  });
  BT_DIST_CUDA_CHECK("divide", cudaGetLastError());
}

void cast(const void* src, int src_dtype, void* dst, int dst_dtype, size_t n, int divisor,
          int device, void* stream) {
  if (n == 0) return;
  BT_DIST_CUDA_CHECK("cast", cudaSetDevice(device));
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_float(src_dtype, "cast", [&](auto stag) {
    using S = decltype(stag);
    dispatch_float(dst_dtype, "cast", [&](auto dtag) {
      using D = decltype(dtag);
      cast_kernel<S, D><<<blocks_for(n), kThreads, 0, s>>>(
          static_cast<const S*>(src), static_cast<D*>(dst), n, double(divisor));
    });
  });
  BT_DIST_CUDA_CHECK("cast", cudaGetLastError());
}

void ordered_sum(const void* src, int nchunks, size_t chunk, void* dst, int dtype, int divisor,
                 int device, void* stream) {
  if (nchunks < 1 || nchunks > kMaxChunks)
    fail(BT_DIST_EINVAL, "[ordered_sum] chunk count " + std::to_string(nchunks) +
                             " is not in [1, " + std::to_string(kMaxChunks) + "]");
  if (chunk == 0) return;
  BT_DIST_CUDA_CHECK("ordered_sum", cudaSetDevice(device));
  auto s = static_cast<cudaStream_t>(stream);
  dispatch_float(dtype, "ordered_sum", [&](auto tag) {
    using T = decltype(tag);
    ordered_sum_kernel<T><<<blocks_for(chunk), kThreads, 0, s>>>(
        static_cast<const T*>(src), nchunks, chunk, static_cast<T*>(dst), double(divisor));
  });
  BT_DIST_CUDA_CHECK("ordered_sum", cudaGetLastError());
}

}  // namespace bt::dist
