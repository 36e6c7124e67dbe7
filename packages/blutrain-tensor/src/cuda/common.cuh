// cuda/common.cuh: device-side helpers shared by the kernel files (include only from .cu files).
//   - CUDA element types for blutrain dtypes (bt::bfloat16 and bt::float16 are layout-compatible
//     with __nv_bfloat16 and __half: 16-bit patterns), conversions through float;
//   - dispatch over dtypes with CUDA types;
//   - StridedOffset: element offsets of a strided view from a linear (row-major) index, with the
//     view's dims coalesced first so the common cases run as 1-D loops;
//   - warp and block reductions;
//   - programmatic dependent launch (a kernel starting during its predecessor's tail).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <type_traits>
#include <utility>

#include "../dtype.h"
#include "../tensor.h"
#include "runtime.h"

namespace bt::cuda {

// ---- element types ----------------------------------------------------------------------------
template <typename T>
struct cuda_type {
  using type = T;
};
template <>
struct cuda_type<bfloat16> {
  using type = __nv_bfloat16;
};
template <>
struct cuda_type<float16> {
  using type = __half;
};
template <typename T>
using cuda_t = typename cuda_type<T>::type;

// The type arithmetic runs in: float for 16-bit floats, the type itself otherwise.
template <typename T>
struct math_type {
  using type = T;
};
template <>
struct math_type<__nv_bfloat16> {
  using type = float;
};
template <>
struct math_type<__half> {
  using type = float;
};
template <typename T>
using math_t = typename math_type<T>::type;

template <typename To, typename From>
__device__ __forceinline__ To convert(From v) {
  if constexpr (std::is_same_v<To, From>) {
    return v;
  } else if constexpr (std::is_same_v<From, __nv_bfloat16>) {
    return convert<To>(__bfloat162float(v));
  } else if constexpr (std::is_same_v<From, __half>) {
    return convert<To>(__half2float(v));
  } else if constexpr (std::is_same_v<To, __nv_bfloat16>) {
    return __float2bfloat16_rn(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, __half>) {
    return __float2half_rn(static_cast<float>(v));
  } else if constexpr (std::is_same_v<To, bool>) {
    return v != From(0);
  } else {
    return static_cast<To>(v);
  }
}
template <typename T>
__device__ __forceinline__ math_t<T> load_math(const T* p) {
  return convert<math_t<T>>(*p);
}

// dispatch_cuda(dtype, "op", [&](auto tag) { using T = typename decltype(tag)::type; ... })
// gives T = the CUDA element type (__nv_bfloat16, __half, float, ...).
template <typename F>
decltype(auto) dispatch_cuda_all(DType d, const char* op, F&& f) {
  return dispatch_all(d, op, [&](auto tag) {
    using B = typename decltype(tag)::type;
    return f(type_tag<cuda_t<B>>{});
  });
}
template <typename F>
decltype(auto) dispatch_cuda_float(DType d, const char* op, F&& f) {
  return dispatch_float(d, op, [&](auto tag) {
    using B = typename decltype(tag)::type;
    return f(type_tag<cuda_t<B>>{});
  });
}

// ---- strided views ----------------------------------------------------------------------------
constexpr int kMaxDims = 12;

// Offsets (in elements) of a strided view, from the linear row-major index of an element.
struct StridedOffset {
  int ndim = 0;  // 0: contiguous (offset == linear index)
  int64_t sizes[kMaxDims];
  int64_t strides[kMaxDims];
  __device__ __forceinline__ int64_t operator()(int64_t linear) const {
    if (ndim == 0) return linear;
    int64_t off = 0;
#pragma unroll 4
    for (int d = ndim - 1; d >= 0; --d) {
      const int64_t s = sizes[d];
      off += (linear % s) * strides[d];
      linear /= s;
    }
    return off;
  }
};

// Coalesces `shape`/`strides` (dims of size 1 dropped, mergeable neighbours merged) into an
// offset calculator; ndim 0 means the view is contiguous.  Throws naming `op` past kMaxDims.
StridedOffset make_offset(const Shape& shape, const Strides& strides, const char* op);
inline StridedOffset make_offset(const Tensor& t, const char* op) {
  return make_offset(t.shape(), t.strides(), op);
}

// ---- reductions -------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <typename T>
__device__ __forceinline__ T warp_max(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` holds 32 values; the call ends with a barrier, so scratch may be reused after it.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T r = lane < nwarps ? scratch[lane] : T(0);
  r = warp_sum(r);
  __syncthreads();
  return r;
}
template <typename T>
__device__ __forceinline__ T block_max(T v, T* scratch, T lowest) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
  v = warp_max(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  T r = lane < nwarps ? scratch[lane] : lowest;
  r = warp_max(r);
  __syncthreads();
  return r;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// ---- programmatic dependent launch ------------------------------------------------------------
// Note [programmatic dependent launch]
// A kernel started by launch_dependent() on Hopper may begin while the kernel before it on the
// stream is still finishing: its launch, block setup and reads of older inputs overlap that
// kernel's tail (a few microseconds a kernel boundary).  Such a kernel calls
// grid_dependency_wait() before it reads anything the previous kernel wrote, and before it
// writes global memory at all: the caching allocator may hand it memory that the previous kernel
// is still reading (freed on the host once that kernel was queued).  grid_dependents_launch() in
// the earlier kernel lets the dependent be scheduled before that kernel's blocks exit (the wait
// still waits for all of them).  BT_CUDA_PDL=0 in the environment launches normally.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void grid_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

inline bool pdl_enabled() {  // read at each launch, so a test can compare both ways
  const char* e = std::getenv("BT_CUDA_PDL");
  return !(e && e[0] == '0');
}

// kern<<<grid, block, smem, st>>>(args...), allowed to overlap the previous kernel when
// `dependent` (the caller knows the device is Hopper and kern waits as the Note says).
template <typename... KArgs, typename... Args>
void launch_dependent(bool dependent, void (*kern)(KArgs...), dim3 grid, dim3 block, size_t smem,
                      cudaStream_t st, const char* op, Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cfg.attrs = &attr;
  cfg.numAttrs = dependent && pdl_enabled() ? 1 : 0;
  BT_CUDA_CHECK(op, cudaLaunchKernelEx(&cfg, kern, std::forward<Args>(args)...));
}

}  // namespace bt::cuda
