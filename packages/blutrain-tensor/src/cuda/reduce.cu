// cuda/reduce.cu: reductions (sum, mean, max, min, var) and argmax/argmin on CUDA.
//
// Semantics are the CPU's (src/cpu/reduce.cpp): sum of ints/bool -> int64 (accumulated in int64),
// mean/var get floating inputs from the front, var divides by max(R - correction, 0),
// max/min propagate NaN, argmax/argmin return the first index of the extreme value, or of the
// first NaN.  Accumulators: float for 16-bit and float32 sums (tree order, so results differ from
// the CPU's float64 accumulation within rounding), double for float64, double (Welford/Chan) for
// var of every dtype, int64 for ints.
//
// Every reduction is (nout outputs) x (R reduced elements): the kept dims and the reduced dims
// each get a coalesced StridedOffset, so any set of dims of any strided view works without a copy.
// Two kernels (each templated on an Op: init / push / combine / finish):
//   - reduce_rows: one warp (or one block, for long rows) per output, lanes striding over the
//     reduced elements; 16-byte loads when they are contiguous (the last-dim case).
//   - reduce_cols: the innermost kept dim is contiguous (the bias gradient: a sum over dim 0 of
//     (N, C)): threads own columns (16-byte vectors of them), the 8 warps of a block own rows, so
//     every row load is coalesced.
// Both split R into G chunks when needed to fill the GPU (full sums, bias gradients); chunk
// partials go to a temporary buffer and a finalize kernel combines them in a fixed order.  G
// depends on the shape only and nothing uses atomics, so results are bitwise reproducible run to
// run (and across GPUs).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <type_traits>

#include "../backend.h"
#include "../primitives.h"
#include "common.cuh"

namespace bt {
namespace {

using cuda::convert;
using cuda::math_t;
using cuda::StridedOffset;

// ---- kernels --------------------------------------------------------------------------------

template <typename A>
__device__ __forceinline__ A shfl_xor(A v, int o) {
  if constexpr (std::is_same_v<A, bool>) {
    return __shfl_xor_sync(0xffffffffu, static_cast<int>(v), o) != 0;
  } else if constexpr (std::is_integral_v<A> && sizeof(A) == 8) {
    return static_cast<A>(__shfl_xor_sync(0xffffffffu, static_cast<long long>(v), o));
  } else if constexpr (std::is_integral_v<A> && sizeof(A) < 4) {
    return static_cast<A>(__shfl_xor_sync(0xffffffffu, static_cast<int>(v), o));
  } else {
    return __shfl_xor_sync(0xffffffffu, v, o);
  }
}

template <typename A>
__device__ __forceinline__ bool is_nan(A v) {
  if constexpr (std::is_floating_point_v<A>) {
    return v != v;
  } else {
    return false;
  }
}

template <typename A>
__device__ __forceinline__ A lowest_value() {
  if constexpr (std::is_floating_point_v<A>) {
    return -static_cast<A>(INFINITY);
  } else if constexpr (sizeof(A) == 4) {
    return static_cast<A>(-2147483647 - 1);
  } else {
    return static_cast<A>(-9223372036854775807LL - 1);
  }
}
template <typename A>
__device__ __forceinline__ A highest_value() {
  if constexpr (std::is_floating_point_v<A>) {
    return static_cast<A>(INFINITY);
  } else if constexpr (sizeof(A) == 4) {
    return static_cast<A>(2147483647);
  } else {
    return static_cast<A>(9223372036854775807LL);
  }
}

template <typename T>
constexpr bool is_float_v = std::is_floating_point_v<math_t<T>>;

// Accumulator of a sum: double for float64, float for the other floats, int64 for ints/bool.
template <typename T>
using sum_acc_t = std::conditional_t<std::is_same_v<T, double>, double,
                                     std::conditional_t<is_float_v<T>, float, int64_t>>;
// The type max/min/argmax compare in: float for 16-bit floats, int for bool/uint8.
template <typename T>
using cmp_t = std::conditional_t<is_float_v<T> || (sizeof(T) >= 4), math_t<T>, int>;

template <typename T, typename O>
struct SumOp {
  using A = sum_acc_t<T>;
  bool mean;
  double count;
  __device__ A init() const { return A(0); }
  __device__ A push(A a, T v, int64_t) const { return a + convert<A>(v); }
  __device__ A combine(A a, A b) const { return a + b; }
  __device__ A shfl(A a, int o) const { return shfl_xor(a, o); }
  __device__ O finish(A a) const {
    if (mean) return convert<O>(static_cast<double>(a) / count);
    return convert<O>(a);
  }
};

template <typename T, bool kMax>
struct MaxOp {
  using A = cmp_t<T>;
  __device__ A init() const { return kMax ? lowest_value<A>() : highest_value<A>(); }
  __device__ A combine(A a, A b) const {
    if (is_nan(a)) return a;
    if (is_nan(b)) return b;
    return kMax ? (b > a ? b : a) : (b < a ? b : a);
  }
  __device__ A push(A a, T v, int64_t) const { return combine(a, convert<A>(v)); }
  __device__ A shfl(A a, int o) const { return shfl_xor(a, o); }
  __device__ T finish(A a) const { return convert<T>(a); }
};

struct VarAcc {
  double n, mean, m2;
};
template <typename T>
struct VarOp {
  using A = VarAcc;
  double correction;
  __device__ A init() const { return {0.0, 0.0, 0.0}; }
  __device__ A push(A a, T v, int64_t) const {  // Welford
    const double x = static_cast<double>(convert<math_t<T>>(v));
    const double n = a.n + 1.0, d = x - a.mean, mean = a.mean + d / n;
    return {n, mean, a.m2 + d * (x - mean)};
  }
  __device__ A combine(A a, A b) const {  // Chan et al.
    if (b.n == 0) return a;
    if (a.n == 0) return b;
    const double n = a.n + b.n, d = b.mean - a.mean;
    return {n, a.mean + d * (b.n / n), a.m2 + b.m2 + d * d * (a.n * b.n / n)};
  }
  __device__ A shfl(A a, int o) const {
    return {shfl_xor(a.n, o), shfl_xor(a.mean, o), shfl_xor(a.m2, o)};
  }
  __device__ T finish(A a) const {
    const double denom = fmax(a.n - correction, 0.0);  // (as the CPU: inf or 0 / 0)
    return convert<T>(a.n == 0 ? static_cast<double>(NAN) : a.m2 / denom);
  }
};

template <typename V>
struct ArgAcc {
  V v;
  int64_t i;
};
// First index of the extreme value; any NaN beats a number and the first NaN wins (the CPU's
// rule).  combine is commutative and associative, so the tree order gives the serial answer.
template <typename T, bool kMax>
struct ArgOp {
  using V = cmp_t<T>;
  using A = ArgAcc<V>;
  __device__ A init() const {
    return {kMax ? lowest_value<V>() : highest_value<V>(), 9223372036854775807LL};
  }
  __device__ A combine(A a, A b) const {
    const bool an = is_nan(a.v), bn = is_nan(b.v);
    if (an || bn) {
      if (an && bn) return a.i <= b.i ? a : b;
      return an ? a : b;
    }
    if (kMax ? (b.v > a.v) : (b.v < a.v)) return b;
    if (kMax ? (a.v > b.v) : (a.v < b.v)) return a;
    return a.i <= b.i ? a : b;
  }
  __device__ A push(A a, T v, int64_t r) const { return combine(a, A{convert<V>(v), r}); }
  __device__ A shfl(A a, int o) const {
    return {shfl_xor(a.v, o),
            static_cast<int64_t>(__shfl_xor_sync(0xffffffffu, static_cast<long long>(a.i), o))};
  }
  __device__ int64_t finish(A a) const { return a.i; }
};

// Offset of element r of a StridedOffset without the div/mod for the 0- and 1-D cases.
__device__ __forceinline__ int64_t off_of(const StridedOffset& so, int64_t r) {
  if (so.ndim == 0) return r;
  if (so.ndim == 1) return r * so.strides[0];
  return so(r);
}

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

template <typename Op, typename A>
__device__ __forceinline__ A warp_combine(const Op& op, A a) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) a = op.combine(a, op.shfl(a, o));
  return a;
}

// v1: one warp (lanes == 32) or one block (lanes == blockDim.x) per output.  grid.y = G chunks of
// R; with G > 1 each chunk writes partial[o * G + g].  VEC > 1: reduced elements contiguous and
// 16-byte aligned for every output, chunk % VEC == 0.
template <typename T, typename O, typename Op, int VEC>
__global__ void reduce_rows_kernel(const T* __restrict__ x, O* __restrict__ out,
                                   typename Op::A* __restrict__ partial, int64_t nout, int64_t R,
                                   int64_t chunk, int lanes, StridedOffset koff, StridedOffset roff,
                                   Op op) {
  using A = typename Op::A;
  const int64_t o = static_cast<int64_t>(blockIdx.x) * (blockDim.x / lanes) + threadIdx.x / lanes;
  if (o >= nout) return;  // uniform over a warp (warp mode) or the block (block mode)
  const int t = threadIdx.x % lanes;
  const int64_t g = blockIdx.y, r0 = g * chunk, r1 = min(R, r0 + chunk);
  const T* base = x + off_of(koff, o);
  A acc = op.init();
  if constexpr (VEC > 1) {
    for (int64_t r = r0 + static_cast<int64_t>(t) * VEC; r < r1;
         r += static_cast<int64_t>(lanes) * VEC) {
      const Vec<T, VEC> w = *reinterpret_cast<const Vec<T, VEC>*>(base + r);
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc = op.push(acc, w.v[k], r + k);
    }
  } else {
    if (roff.ndim == 0) {
      for (int64_t r = r0 + t; r < r1; r += lanes) acc = op.push(acc, base[r], r);
    } else {
      for (int64_t r = r0 + t; r < r1; r += lanes) acc = op.push(acc, base[off_of(roff, r)], r);
    }
  }
  acc = warp_combine(op, acc);
  if (lanes > 32) {
    __shared__ alignas(16) unsigned char raw[32 * sizeof(A)];
    A* sm = reinterpret_cast<A*>(raw);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    if (lane == 0) sm[warp] = acc;
    __syncthreads();
    if (warp != 0) return;
    acc = lane < nwarps ? sm[lane] : op.init();
    acc = warp_combine(op, acc);
  }
  if (t != 0) return;
  if (gridDim.y == 1) {
    out[o] = op.finish(acc);
  } else {
    partial[o * gridDim.y + g] = acc;
  }
}

constexpr int kColRows = 8;  // warps per block of the column kernel

// v2 (the leading-dims case): output (a, c) = reduce over r of x[kouter(a) + roff(r) + c].
// Block (32, kColRows); blockIdx.x = a * colblocks + column block; each thread owns VEC
// consecutive columns and walks rows threadIdx.y, +kColRows, ... of chunk blockIdx.y.  The rows'
// partials meet in shared memory in warp order.  G > 1: partial[g * nout + a * N + c].
template <typename T, typename O, typename Op, int VEC>
__global__ void __launch_bounds__(32 * kColRows)
    reduce_cols_kernel(const T* __restrict__ x, O* __restrict__ out,
                       typename Op::A* __restrict__ partial, int64_t N, int64_t colblocks,
                       int64_t nout, int64_t R, int64_t chunk, StridedOffset kouter,
                       StridedOffset roff, Op op) {
  using A = typename Op::A;
  __shared__ alignas(16) unsigned char raw[kColRows * 32 * VEC * sizeof(A)];
  A* sm = reinterpret_cast<A*>(raw);
  const int64_t a = blockIdx.x / colblocks, cb = blockIdx.x % colblocks;
  const int64_t c0 = (cb * 32 + threadIdx.x) * VEC;
  const int64_t g = blockIdx.y, r0 = g * chunk, r1 = min(R, r0 + chunk);
  A acc[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc[k] = op.init();
  if (c0 < N) {
    const T* base = x + off_of(kouter, a) + c0;
#pragma unroll 4
    for (int64_t r = r0 + threadIdx.y; r < r1; r += kColRows) {
      const T* p = base + off_of(roff, r);
      if constexpr (VEC > 1) {
        const Vec<T, VEC> w = *reinterpret_cast<const Vec<T, VEC>*>(p);
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] = op.push(acc[k], w.v[k], r);
      } else {
        acc[0] = op.push(acc[0], *p, r);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < VEC; ++k) sm[(threadIdx.y * 32 + threadIdx.x) * VEC + k] = acc[k];
  __syncthreads();
  if (threadIdx.y != 0 || c0 >= N) return;
  for (int y = 1; y < kColRows; ++y) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = op.combine(acc[k], sm[(y * 32 + threadIdx.x) * VEC + k]);
  }
  const int64_t ob = a * N + c0;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    if (gridDim.y == 1) {
      out[ob + k] = op.finish(acc[k]);
    } else {
      partial[g * nout + ob + k] = acc[k];
    }
  }
}

// Combines partial[o * G + g] over g: one warp per output.
template <typename O, typename Op>
__global__ void finalize_rows_kernel(const typename Op::A* __restrict__ partial,
                                     O* __restrict__ out, int64_t nout, int64_t G, Op op) {
  const int64_t o = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (o >= nout) return;
  const int lane = threadIdx.x % 32;
  typename Op::A acc = op.init();
  for (int64_t g = lane; g < G; g += 32) acc = op.combine(acc, partial[o * G + g]);
  acc = warp_combine(op, acc);
  if (lane == 0) out[o] = op.finish(acc);
}

// Combines partial[g * nout + o] over g: block (32, kColRows) per 32 outputs, rows of the block
// striding over g, then combined in row order.
template <typename O, typename Op>
__global__ void __launch_bounds__(32 * kColRows)
    finalize_cols_kernel(const typename Op::A* __restrict__ partial, O* __restrict__ out,
                         int64_t nout, int64_t G, Op op) {
  using A = typename Op::A;
  __shared__ alignas(16) unsigned char raw[kColRows * 32 * sizeof(A)];
  A* sm = reinterpret_cast<A*>(raw);
  const int64_t o = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  A acc = op.init();
  if (o < nout) {
#pragma unroll 4
    for (int64_t g = threadIdx.y; g < G; g += kColRows)
      acc = op.combine(acc, partial[g * nout + o]);
  }
  sm[threadIdx.y * 32 + threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y != 0 || o >= nout) return;
  for (int y = 1; y < kColRows; ++y) acc = op.combine(acc, sm[y * 32 + threadIdx.x]);
  out[o] = op.finish(acc);
}

// ---- launchers ------------------------------------------------------------------------------

struct Dims {
  Shape size;
  Strides stride;
};
// Drops size-1 dims and merges neighbours that are one run in memory (as make_offset does).
Dims coalesce(const Shape& shape, const Strides& strides) {
  Dims r;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    if (!r.size.empty() && r.stride.back() == shape[d] * strides[d]) {
      r.size.back() *= shape[d];
      r.stride.back() = strides[d];
    } else {
      r.size.push_back(shape[d]);
      r.stride.push_back(strides[d]);
    }
  }
  return r;
}

int64_t round_up(int64_t a, int64_t b) { return cuda::ceil_div(a, b) * b; }

constexpr int64_t kTargetBlocks = 1024;

bool force_v1() {
  const char* e = std::getenv("BT_CUDA_REDUCE_V1");
  return e != nullptr && e[0] == '1';
}  // shape-only split target (determinism across GPUs)

// Reduces x over the reduced dims (kept/reduced split given) into out (contiguous, nout elems).
template <typename T, typename O, typename Op>
void run_reduce(const Tensor& x, const Tensor& out, const std::vector<bool>& reduced, Op op,
                const char* nm) {
  using A = typename Op::A;
  Shape ks, rs;
  Strides kst, rst;
  int64_t nout = 1, R = 1;
  for (int64_t d = 0; d < x.ndim(); ++d) {
    if (reduced[d]) {
      rs.push_back(x.shape()[d]);
      rst.push_back(x.strides()[d]);
      R *= x.shape()[d];
    } else {
      ks.push_back(x.shape()[d]);
      kst.push_back(x.strides()[d]);
      nout *= x.shape()[d];
    }
  }
  if (nout == 0) return;
  cudaStream_t st = cuda::stream(out.device(), nm);
  const int device = out.device().index;
  const T* xp = R == 0 ? nullptr : static_cast<const T*>(x.data_ptr(nm));
  O* op_out = static_cast<O*>(out.data_ptr(nm));
  const Dims kc = coalesce(ks, kst), rc = coalesce(rs, rst);
  const StridedOffset roff = cuda::make_offset(rc.size, rc.stride, nm);
  (void)device;
  const bool v1 = force_v1();

  // Column kernel: innermost kept dim contiguous and wide enough to fill a warp's loads.
  if (!v1 && R > 1 && !kc.size.empty() && kc.stride.back() == 1 && kc.size.back() >= 16) {
    const int64_t N = kc.size.back();
    const Shape os(kc.size.begin(), kc.size.end() - 1);
    const Strides ost(kc.stride.begin(), kc.stride.end() - 1);
    const StridedOffset kouter = cuda::make_offset(os, ost, nm);
    const int64_t nouter = nout / N;
    constexpr int kV = sizeof(A) > 8 ? 1 : std::min<int>(8, std::max<int>(1, 16 / sizeof(T)));
    bool vec = kV > 1 && N % kV == 0 && reinterpret_cast<uintptr_t>(xp) % 16 == 0;
    for (auto s : rc.stride) vec = vec && s % kV == 0;
    for (auto s : ost) vec = vec && s % kV == 0;
    auto launch = [&](auto vtag) {
      constexpr int V = decltype(vtag)::value;
      const int64_t colblocks = cuda::ceil_div(N, 32 * V);
      const int64_t xblocks = colblocks * nouter;
      int64_t G = std::clamp<int64_t>(cuda::ceil_div(kTargetBlocks / 2, xblocks), 1,
                                      std::max<int64_t>(1, R / 64));
      G = std::min<int64_t>(G, 1024);
      const int64_t chunk = cuda::ceil_div(R, G);
      G = cuda::ceil_div(R, chunk);
      if (xblocks > 2147483647) throw NotImplementedError(std::string("[") + nm + "] too large");
      Tensor tmp;
      A* part = nullptr;
      if (G > 1) {
        tmp = empty_tensor({static_cast<int64_t>(G * nout * sizeof(A))}, DType::UInt8, out.device(),
                           nm);
        part = static_cast<A*>(tmp.data_ptr(nm));
      }
      reduce_cols_kernel<T, O, Op, V>
          <<<dim3(static_cast<unsigned>(xblocks), static_cast<unsigned>(G)), dim3(32, kColRows), 0,
             st>>>(xp, op_out, part, N, colblocks, nout, R, chunk, kouter, roff, op);
      BT_CUDA_LAUNCH_CHECK(nm);
      if (G > 1) {
        finalize_cols_kernel<O, Op>
            <<<static_cast<unsigned>(cuda::ceil_div(nout, 32)), dim3(32, kColRows), 0, st>>>(
                part, op_out, nout, G, op);
        BT_CUDA_LAUNCH_CHECK(nm);
      }
    };
    if (vec) {
      launch(std::integral_constant<int, kV>{});
    } else {
      launch(std::integral_constant<int, 1>{});
    }
    return;
  }

  // Row kernel.
  const StridedOffset koff = cuda::make_offset(kc.size, kc.stride, nm);
  constexpr int kV = std::max<int>(1, 16 / sizeof(T));
  bool vec =
      !v1 && kV > 1 && roff.ndim == 0 && R % kV == 0 && reinterpret_cast<uintptr_t>(xp) % 16 == 0;
  for (auto s : kc.stride) vec = vec && s % kV == 0;
  const int threads = 256;
  const int lanes = (R > 4096 && !v1) ? threads : 32;
  const int64_t per_block = threads / lanes;
  const int64_t xblocks = cuda::ceil_div(nout, per_block);
  if (xblocks > 2147483647) throw NotImplementedError(std::string("[") + nm + "] too large");
  auto launch = [&](auto vtag) {
    constexpr int V = decltype(vtag)::value;
    const int64_t step = static_cast<int64_t>(lanes) * V * 8;  // >= 8 loads per thread per chunk
    int64_t G = std::clamp<int64_t>(cuda::ceil_div(kTargetBlocks, xblocks), 1,
                                    std::max<int64_t>(1, R / step));
    G = v1 ? 1 : std::min<int64_t>(G, 1024);
    const int64_t chunk = R == 0 ? 0 : round_up(cuda::ceil_div(R, G), V);
    G = R == 0 ? 1 : cuda::ceil_div(R, chunk);
    Tensor tmp;
    A* part = nullptr;
    if (G > 1) {
      tmp = empty_tensor({static_cast<int64_t>(G * nout * sizeof(A))}, DType::UInt8, out.device(),
                         nm);
      part = static_cast<A*>(tmp.data_ptr(nm));
    }
    reduce_rows_kernel<T, O, Op, V>
        <<<dim3(static_cast<unsigned>(xblocks), static_cast<unsigned>(G)), threads, 0, st>>>(
            xp, op_out, part, nout, R, chunk, lanes, koff, roff, op);
    BT_CUDA_LAUNCH_CHECK(nm);
    if (G > 1) {
      finalize_rows_kernel<O, Op><<<static_cast<unsigned>(cuda::ceil_div(nout, 8)), 256, 0, st>>>(
          part, op_out, nout, G, op);
      BT_CUDA_LAUNCH_CHECK(nm);
    }
  };
  if (vec) {
    launch(std::integral_constant<int, kV>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
}

void check_out_dtype(const Tensor& out, DType want, const char* nm) {
  if (out.dtype() != want) {
    throw RuntimeError(std::string("[") + nm + "] internal: output dtype " +
                       dtype_name(out.dtype()) + ", expected " + dtype_name(want));
  }
}

}  // namespace

void Reduce::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  const Tensor& x = in[0];
  const char* nm = name();
  std::vector<bool> reduced(x.ndim(), false);
  double count = 1;
  for (auto d : dims) {
    reduced[d] = true;
    count *= static_cast<double>(x.shape()[d]);
  }
  cuda::dispatch_cuda_all(x.dtype(), nm, [&](auto tag) {
    using T = typename decltype(tag)::type;
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Mean: {
        using O = std::conditional_t<is_float_v<T>, T, int64_t>;
        check_out_dtype(out[0], is_float_v<T> ? x.dtype() : DType::Int64, nm);
        run_reduce<T, O>(x, out[0], reduced, SumOp<T, O>{op == ReduceOp::Mean, count}, nm);
        break;
      }
      case ReduceOp::Max:
        check_out_dtype(out[0], x.dtype(), nm);
        run_reduce<T, T>(x, out[0], reduced, MaxOp<T, true>{}, nm);
        break;
      case ReduceOp::Min:
        check_out_dtype(out[0], x.dtype(), nm);
        run_reduce<T, T>(x, out[0], reduced, MaxOp<T, false>{}, nm);
        break;
      case ReduceOp::Var:
        if constexpr (is_float_v<T>) {
          check_out_dtype(out[0], x.dtype(), nm);
          run_reduce<T, T>(x, out[0], reduced, VarOp<T>{correction}, nm);
        } else {
          throw TypeError(std::string("[") + nm + "] expects a floating input, got " +
                          dtype_name(x.dtype()));
        }
        break;
    }
  });
}

void ArgReduce::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  const Tensor& x = in[0];
  const char* nm = name();
  check_out_dtype(out[0], DType::Int64, nm);
  std::vector<bool> reduced(x.ndim(), false);
  if (x.ndim() > 0) reduced[dim] = true;
  cuda::dispatch_cuda_all(x.dtype(), nm, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (is_max) {
      run_reduce<T, int64_t>(x, out[0], reduced, ArgOp<T, true>{}, nm);
    } else {
      run_reduce<T, int64_t>(x, out[0], reduced, ArgOp<T, false>{}, nm);
    }
  });
}

}  // namespace bt
