// cuda/nn_common.cuh: device helpers shared by nn.cu and nn_fused.cu (row kernels): strided ->
// contiguous staging, per-thread chunks of a row with 16-byte vector loads, online max/sum
// merging, and the v1/v2 kernel switch.  Include only from those two files.
#pragma once

#include <cstdlib>
#include <cstring>
#include <utility>

#include "common.cuh"

namespace bt::cuda::nn {

// Kernel version, read per call so tests and benches can flip it: BT_CUDA_NN_VERSION=1|2|3
// (BT_CUDA_NN_V1=1 also means 1).  1: the simple reference kernels; 2: block-per-row kernels with
// 16-byte loads; 3 (layer norm fwd / bwd, add_layer_norm, softmax fwd): one warp per row with the
// row in registers, used where it applies (16-bit / fp32, aligned rows up to kV3MaxPerLane * 32
// elements), else 2.  kDefaultNnVersion is the default.
constexpr int kDefaultNnVersion = 3;
inline int nn_version() {
  const char* v1 = std::getenv("BT_CUDA_NN_V1");
  if (v1 && v1[0] && std::strcmp(v1, "0") != 0) return 1;
  const char* e = std::getenv("BT_CUDA_NN_VERSION");
  if (e && (e[0] == '1' || e[0] == '2' || e[0] == '3') && !e[1]) return e[0] - '0';
  return kDefaultNnVersion;
}
inline bool use_v1() { return nn_version() == 1; }

template <typename T>
__global__ void gather_contiguous(const T* __restrict__ src, StridedOffset off, T* __restrict__ dst,
                                  int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    dst[i] = src[off(i)];
  }
}

// t itself when contiguous (or undefined), else a contiguous copy made on `s`.
inline Tensor contiguous_on(const Tensor& t, const char* op, cudaStream_t s) {
  if (!t.defined() || t.is_contiguous()) return t;
  Tensor c = empty_tensor(t.shape(), t.dtype(), t.device(), op);
  const int64_t n = t.numel();
  if (n == 0) return c;
  const StridedOffset off = make_offset(t, op);
  dispatch_cuda_all(t.dtype(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const int threads = 256;
    gather_contiguous<T><<<elementwise_blocks(n, threads, t.device().index), threads, 0, s>>>(
        static_cast<const T*>(t.data_ptr(op)), off, static_cast<T*>(c.data_ptr(op)), n);
    BT_CUDA_LAUNCH_CHECK(op);
  });
  return c;
}

// Whether a 2-D tensor's rows can be read in place: unit column stride, row stride >= 0 (the
// kernels then take the row stride; a narrow of a padded (N, Vp) tensor needs no copy).
inline bool rows_in_place(const Tensor& t) {
  return t.ndim() == 2 && t.strides()[1] == 1 && t.strides()[0] >= 0;
}

// Statistics type (mean, rstd, lse): double for double inputs, float otherwise.
template <typename T>
using stat_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <int N>
using ic = std::integral_constant<int, N>;

// Calls f(i, ic<N>) over this thread's chunks of a row of C elements starting at `p`: with V > 1,
// elements before the first 16-byte boundary and after the last one come as N = 1, the rest as
// N = V (a 16-byte access).  Every array the functor touches must share p's alignment (the host
// checks, else launches V = 1).  Chunks stride by blockDim.x.
template <int V, typename T, typename F>
__device__ __forceinline__ void row_chunks(const T* p, int64_t C, F&& f) {
  const int tid = threadIdx.x, nt = blockDim.x;
  if constexpr (V == 1) {
    for (int64_t i = tid; i < C; i += nt) f(i, ic<1>{});
  } else {
    int64_t head = ((16 - (reinterpret_cast<uintptr_t>(p) & 15)) & 15) / sizeof(T);
    if (head > C) head = C;
    for (int64_t i = tid; i < head; i += nt) f(i, ic<1>{});
    const int64_t nv = (C - head) / V;
    for (int64_t v = tid; v < nv; v += nt) f(head + v * V, ic<V>{});
    for (int64_t i = head + nv * V + tid; i < C; i += nt) f(i, ic<1>{});
  }
}

template <int N, typename T>
__device__ __forceinline__ void load_n(const T* p, math_t<T>* out) {
  if constexpr (N * sizeof(T) == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = convert<math_t<T>>(e[k]);
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) out[k] = convert<math_t<T>>(p[k]);
  }
}
template <int N, typename T>
__device__ __forceinline__ void store_n(T* p, const math_t<T>* in) {
  if constexpr (N * sizeof(T) == 16) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int k = 0; k < N; ++k) e[k] = convert<T>(in[k]);
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = convert<T>(in[k]);
  }
}

// 16 / sizeof(T) when every pointer is 16-byte aligned alike and rows of C elements keep that
// alignment class per row index (same C and element size for all, so it suffices to compare the
// bases), else 1.
template <typename T>
inline int vec_width(std::initializer_list<const void*> ptrs) {
  uintptr_t a0 = 0;
  bool first = true;
  for (const void* p : ptrs) {
    if (!p) continue;
    const uintptr_t a = reinterpret_cast<uintptr_t>(p) & 15;
    if (first) a0 = a, first = false;
    if (a != a0) return 1;
  }
  return static_cast<int>(16 / sizeof(T));
}
// Runs f(ic<V>) with the runtime width (1, 2, 4 or 8).
template <typename F>
inline void dispatch_vec(int v, F&& f) {
  switch (v) {
    case 8:
      f(ic<8>{});
      break;
    case 4:
      f(ic<4>{});
      break;
    case 2:
      f(ic<2>{});
      break;
    default:
      f(ic<1>{});
      break;
  }
}

// Threads per row block: enough for one chunk each, a multiple of 32, at most `cap`.
inline int row_threads(int64_t C, int V, int cap = 1024) {
  int64_t t = ceil_div(C, V);
  t = ceil_div(t, 32) * 32;
  if (t < 32) t = 32;
  if (t > cap) t = cap;
  return static_cast<int>(t);
}

// Online softmax state: running max m and sum s of exp(x - m).
template <typename A>
__device__ __forceinline__ void ms_add(A& m, A& s, A v) {
  if (v == -INFINITY) return;
  if (v > m) {
    s = s * exp(m - v) + A(1);
    m = v;
  } else {
    s += exp(v - m);
  }
}
template <typename A>
__device__ __forceinline__ void ms_merge(A& m, A& s, A m2, A s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) {
    m = m2;
    s = s2;
    return;
  }
  if (m2 > m) {
    s = s * exp(m - m2) + s2;
    m = m2;
  } else {
    s += s2 * exp(m2 - m);
  }
}
// Block-wide merge (blockDim.x a multiple of 32); every thread gets the result.  scratch: 64 A.
template <typename A>
__device__ __forceinline__ void block_ms(A& m, A& s, A* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const A m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    ms_merge(m, s, m2, s2);
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
  if (lane == 0) scratch[warp] = m, scratch[32 + warp] = s;
  __syncthreads();
  A mm = -INFINITY, ss = 0;
  for (int w = 0; w < nw; ++w) ms_merge(mm, ss, scratch[w], scratch[32 + w]);  // fixed order
  m = mm;
  s = ss;
  __syncthreads();
}

// ---- v3: one warp per row, the row in registers --------------------------------------------
// Lane l holds the 16-byte vectors j * 32 + l (j < NV) of its row: V = 16 / sizeof(T) elements
// each, so a warp's access per j is 512 contiguous bytes.  Rows must be whole vectors (C % V == 0)
// and every array 16-byte aligned; NV * V <= kV3MaxPerLane keeps the row in registers.
constexpr int kV3MaxPerLane = 96;
constexpr int kV3Warps = 4;  // rows (warps) per block of the forward kernels

// Runs f(ic<V>, ic<NV>) with the smallest supported NV covering a row of C, and returns true;
// false (f not run) when v3 does not apply: 8-byte elements, C % V != 0, a misaligned pointer or
// a row longer than MaxPerLane elements per lane (what fits in registers).
template <typename T, int MaxPerLane = kV3MaxPerLane, typename F>
inline bool dispatch_v3(int64_t C, std::initializer_list<const void*> ptrs, F&& f) {
  if constexpr (sizeof(T) == 8) {
    return false;
  } else {
    constexpr int V = static_cast<int>(16 / sizeof(T));
    if (C <= 0 || C % V != 0) return false;
    for (const void* p : ptrs) {
      if (p && (reinterpret_cast<uintptr_t>(p) & 15) != 0) return false;
    }
    const int64_t nv = ceil_div(C, int64_t(32) * V);
    auto run = [&](auto nvtag) {
      constexpr int NV = decltype(nvtag)::value;
      if constexpr (NV * V <= MaxPerLane) {
        f(ic<V>{}, nvtag);
        return true;
      } else {
        return false;
      }
    };
    if (nv <= 1) return run(ic<1>{});
    if (nv <= 2) return run(ic<2>{});
    if (nv <= 3) return run(ic<3>{});
    if (nv <= 4) return run(ic<4>{});
    if (nv <= 6) return run(ic<6>{});
    if (nv <= 8) return run(ic<8>{});
    if (nv <= 12) return run(ic<12>{});
    if (nv <= 16) return run(ic<16>{});
    if (nv <= 24) return run(ic<24>{});
    return false;
  }
}

// Column of lane `lane`'s j-th vector.
template <int V>
__device__ __forceinline__ int64_t v3_col(int j, int lane) {
  return (int64_t(j) * 32 + lane) * V;
}

}  // namespace bt::cuda::nn
