// cuda/elementwise.cu: creation, copies, random numbers and elementwise ops on CUDA.
//
// Semantics are the CPU kernels' (src/cpu/elementwise.cpp): the same compute types (float for the
// 16-bit floats, the type itself otherwise), the same NaN rules (maximum/minimum propagate NaN,
// relu/sign map NaN to 0), integer pow by squaring, and Philox numbers from random.h so Random and
// Dropout give the CPU's numbers for a (seed, offset).  Float32 exp/tanh use CUDA's libdevice
// (within ~1 ulp of the CPU's Cephes polynomials).
//
// One generic launcher (launch_elementwise) runs a functor over N typed inputs and one output:
//   - flat path: every operand contiguous (or all sharing one dense layout): a grid-stride loop
//     over 16-byte vectors (scalar when a pointer is misaligned), then a scalar tail;
//   - strided path: per-operand offsets from the linear index (broadcast inputs have stride 0;
//     the outermost dim needs no division, so scalar and row broadcasts stay cheap).
// Both run with 32-bit index math when every offset fits (much cheaper division), 64-bit otherwise.
// The row-broadcast kernel launches one wave: the blocks resident at once (occupancy, per kernel),
// so no partial second wave runs at a fraction of the bandwidth.  (The same sizing and a 4x
// unrolled flat loop measured 1-7% slower for the flat path on the H200, casts to fp32 most.)
// Flat 16-bit -> fp32 casts have an opt-in kernel (cast_widen_v3, BT_CUDA_CAST_VERSION=3) whose
// warp stores are contiguous; bench/cast_check.sh times it against v2 and bandwidth baselines.
// Launchers are left out under BT_ELEMENTWISE_KERNELS_ONLY (that harness).
#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>

#include "../backend.h"
#include "../primitives.h"
#include "../pymath.h"
#include "../random.h"
#include "common.cuh"
#include "device_errors.h"

namespace bt {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// ================================ kernels ======================================================

// ---- offsets ----------------------------------------------------------------------------------
// StridedOffset with a chosen index type; the outermost dim takes the quotient as is (no modulo).
template <typename I>
struct Off {
  int ndim = 0;  // 0: contiguous
  I sizes[kMaxDims];
  I strides[kMaxDims];
  __device__ __forceinline__ I operator()(I linear) const {
    if (ndim == 0) return linear;
    I off = 0;
#pragma unroll 4
    for (int d = ndim - 1; d > 0; --d) {
      const I s = sizes[d];
      const I q = linear / s;
      off += (linear - q * s) * strides[d];
      linear = q;
    }
    return off + linear * strides[0];
  }
};

template <typename I>
Off<I> to_off(const StridedOffset& so) {
  Off<I> o;
  o.ndim = so.ndim;
  for (int d = 0; d < so.ndim; ++d) {
    o.sizes[d] = static_cast<I>(so.sizes[d]);
    o.strides[d] = static_cast<I>(so.strides[d]);
  }
  return o;
}

// Largest element offset a view reaches (strides are never negative in blutrain).
int64_t max_offset(const Tensor& t) {
  int64_t m = 0;
  for (int64_t d = 0; d < t.ndim(); ++d) {
    if (t.shape()[d] > 1) m += (t.shape()[d] - 1) * t.strides()[d];
  }
  return m;
}

// ---- vector loads/stores ----------------------------------------------------------------------
template <int B>
struct chunk;
template <>
struct chunk<1> {
  using type = uint8_t;
};
template <>
struct chunk<2> {
  using type = uint16_t;
};
template <>
struct chunk<4> {
  using type = uint32_t;
};
template <>
struct chunk<8> {
  using type = uint2;
};
template <>
struct chunk<16> {
  using type = uint4;
};

// N elements starting at p (p aligned to min(16, N * sizeof(T)) bytes).
template <int N, typename T>
__device__ __forceinline__ void vload(const T* p, T (&v)[N]) {
  constexpr int kBytes = N * static_cast<int>(sizeof(T));
  constexpr int kCB = kBytes < 16 ? kBytes : 16;
  using C = typename chunk<kCB>::type;
  C tmp[kBytes / kCB];
#pragma unroll
  for (int k = 0; k < kBytes / kCB; ++k) tmp[k] = reinterpret_cast<const C*>(p)[k];
  memcpy(static_cast<void*>(v), tmp, kBytes);
}
template <int N, typename T>
__device__ __forceinline__ void vstore(T* p, const T (&v)[N]) {
  constexpr int kBytes = N * static_cast<int>(sizeof(T));
  constexpr int kCB = kBytes < 16 ? kBytes : 16;
  using C = typename chunk<kCB>::type;
  C tmp[kBytes / kCB];
  memcpy(tmp, static_cast<const void*>(v), kBytes);
#pragma unroll
  for (int k = 0; k < kBytes / kCB; ++k) reinterpret_cast<C*>(p)[k] = tmp[k];
}

// ---- generic elementwise kernels --------------------------------------------------------------
// v1: the reference: one element per iteration, every operand through its offsets.
template <typename I, typename T>
struct Arg {
  const T* __restrict__ p;
  Off<I> off;
};

template <typename I, typename F, typename O, typename... Ts>
__global__ void __launch_bounds__(kThreads)
    elementwise_strided_v1(I n, F f, O* __restrict__ out, Off<I> oo, Arg<I, Ts>... in) {
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  for (I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[oo(i)] = f(in.p[in.off(i)]...);
  }
}

// v2: every operand flat (contiguous, or all in one dense layout) and 16-byte aligned: N elements
// per iteration through 16-byte vectors, then a scalar tail (misaligned views take v1).
template <int N, typename T>
struct Vec {
  T v[N];
};

template <int N, typename I, typename F, typename O, typename... Ts>
__global__ void __launch_bounds__(kThreads)
    elementwise_flat_v2(I n, F f, O* __restrict__ out, const Ts* __restrict__... in) {
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  const I tid = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x;
  const I nvec = n / N;
  for (I v = tid; v < nvec; v += stride) {
    const I base = v * N;
    O r[N];
    // The lambda's by-value parameters are the per-input register arrays.
    [&](auto... vals) {
      (vload<N>(in + base, vals.v), ...);
#pragma unroll
      for (int k = 0; k < N; ++k) r[k] = f(vals.v[k]...);
    }(Vec<N, Ts>{}...);
    vstore<N>(out + base, r);
  }
  for (I i = nvec * N + tid; i < n; i += stride) out[i] = f(in[i]...);
}

// v4 (copies and casts only): both operands run contiguously along their last L elements, rows
// anywhere (a permute that keeps the last dim, e.g. (B, T, H, D) -> (B, H, T, D), or a slice):
// N elements per thread through 16-byte vectors, the row offsets' divisions once per vector rather
// than once per element as in v1.  Every row start is vector-aligned (the host checks).
// kU vectors per thread and iteration, all loads first (rows land scattered in DRAM).  On the
// H200's heads transpose kU 4 measured the same as kU 1 (1.55 TB/s, bf16, 50 MB moved).
template <int N, int kU, typename F, typename O, typename S>
__global__ void __launch_bounds__(kThreads)
    copy_rows_v4(uint32_t nvec, uint32_t row_vecs, F f, O* __restrict__ out, Off<uint32_t> oo,
                 const S* __restrict__ in, Off<uint32_t> io) {
  const uint32_t stride = gridDim.x * blockDim.x;
  for (uint32_t v0 = blockIdx.x * blockDim.x + threadIdx.x; v0 < nvec; v0 += kU * stride) {
    S x[kU][N];
    uint32_t dst[kU];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint32_t v = v0 + u * stride;
      if (v < nvec) {
        const uint32_t row = v / row_vecs, col = (v - row * row_vecs) * N;
        vload<N>(in + io(row) + col, x[u]);
        dst[u] = oo(row) + col;
      }
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (v0 + u * stride < nvec) {
        O r[N];
#pragma unroll
        for (int k = 0; k < N; ++k) r[k] = f(x[u][k]);
        vstore<N>(out + dst[u], r);
      }
    }
  }
}

// v3: out = f(x, b) (f(b, x) when B_FIRST) with x and out contiguous and b one row of L = lv * N
// elements repeated over the rows (a bias: stride 0 over the leading dims). Thread t keeps column
// vector t % lv of b in registers and walks rows t / lv, + rows_step, ..., 4 rows per iteration
// (loads first, for memory parallelism): no per-element index math, b read once per thread.
template <int N, bool B_FIRST, typename F, typename O, typename T>
__global__ void __launch_bounds__(kThreads)
    elementwise_rowbcast_v3(uint32_t rows, uint32_t lv, uint32_t rows_step, F f,
                            O* __restrict__ out, const T* __restrict__ x, const T* __restrict__ b) {
  const uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
  const uint32_t cv = t % lv;
  uint32_t r = t / lv;
  if (r >= rows_step) return;
  const uint32_t L = lv * N;
  T bv[N];
  vload<N>(b + cv * N, bv);
  constexpr int kU = 4;
  for (; r < rows; r += kU * rows_step) {
    T xv[kU][N];
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint32_t rr = r + u * rows_step;
      if (rr < rows) vload<N>(x + rr * L + cv * N, xv[u]);
    }
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const uint32_t rr = r + u * rows_step;
      if (rr < rows) {
        O o[N];
#pragma unroll
        for (int k = 0; k < N; ++k) o[k] = B_FIRST ? f(bv[k], xv[u][k]) : f(xv[u][k], bv[k]);
        vstore<N>(out + rr * L + cv * N, o);
      }
    }
  }
}

// ---- op functors ------------------------------------------------------------------------------
template <UnaryOp OP, typename C>
__device__ __forceinline__ C unary_fn(C x) {
  if constexpr (!std::is_floating_point<C>::value) {
    // Integer/bool forms of the ops that allow them (the front casts the rest to float).
    if constexpr (OP == UnaryOp::Neg) return static_cast<C>(-x);
    // (unsigned types: x < 0 never holds; spelled out to keep the compiler quiet)
    if constexpr (OP == UnaryOp::Abs && std::is_signed<C>::value) {
      return x < 0 ? static_cast<C>(-x) : x;
    }
    if constexpr (OP == UnaryOp::Relu) return x > 0 ? x : C(0);
    if constexpr (OP == UnaryOp::Sign && std::is_signed<C>::value) {
      return static_cast<C>((x > 0) - (x < 0));
    }
    if constexpr (OP == UnaryOp::Sign && !std::is_signed<C>::value) return static_cast<C>(x > 0);
    if constexpr (OP == UnaryOp::LogicalNot) return static_cast<C>(!x);
    return x;
  } else {
    constexpr bool f32 = std::is_same<C, float>::value;
    if constexpr (OP == UnaryOp::Neg) return -x;
    if constexpr (OP == UnaryOp::Exp) return exp(x);
    if constexpr (OP == UnaryOp::Log) return log(x);
    if constexpr (OP == UnaryOp::Sqrt) return sqrt(x);
    if constexpr (OP == UnaryOp::Rsqrt) return C(1) / sqrt(x);
    if constexpr (OP == UnaryOp::Tanh) return tanh(x);
    if constexpr (OP == UnaryOp::Abs) return x < C(0) ? -x : x;
    if constexpr (OP == UnaryOp::Sigmoid) return C(1) / (C(1) + exp(-x));
    if constexpr (OP == UnaryOp::Relu) return x < C(0) ? C(0) : x;  // NaN stays NaN (as numpy)
    if constexpr (OP == UnaryOp::Sin) return sin(x);
    if constexpr (OP == UnaryOp::Cos) return cos(x);
    if constexpr (OP == UnaryOp::Erf) return erf(x);
    if constexpr (OP == UnaryOp::GeluErf) {
      return C(0.5) * x * (C(1) + erf(x * C(0.70710678118654752440)));
    }
    if constexpr (OP == UnaryOp::GeluTanh) {
      const C k = C(0.7978845608028654);  // sqrt(2/pi)
      if constexpr (f32) {
        // tanhf is the costly part; the polynomial is cheap next to the memory traffic.
        return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
      } else {
        return C(0.5) * x * (C(1) + tanh(k * (x + C(0.044715) * x * x * x)));
      }
    }
    if constexpr (OP == UnaryOp::Sign) return C((x > C(0)) - (x < C(0)));
    if constexpr (OP == UnaryOp::LogicalNot) return C(!x);
    return x;
  }
}

// gelu_tanh for 16-bit floats: 0.5 x (1 + tanh(u)) = x / (1 + e^(-2u)), one MUFU ex2 and one
// reciprocal instead of tanhf (the op was issue-bound at bf16 bandwidth).  Within ~1e-6 relative
// of the tanh form (closer to exact in the negative tail, where 1 + tanh(u) cancels), far below
// a 16-bit ulp; same inf / NaN results (-inf: NaN as the CPU's -inf * 0).
__device__ __forceinline__ float gelu_tanh_fast(float x) {
  const float u = 0.7978845608028654f * fmaf(0.044715f * x, x * x, x);
  float e;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(u * -2.8853900817779268f));  // -2 log2(e) u
  return __fdividef(x, 1.0f + e);
}

template <UnaryOp OP, typename T, typename O>
struct UnaryF {
  __device__ __forceinline__ O operator()(T x) const {
    using C = math_t<T>;
    if constexpr (OP == UnaryOp::GeluTanh && sizeof(T) == 2 && std::is_same_v<C, float>) {
      return convert<O>(gelu_tanh_fast(convert<C>(x)));
    } else {
      return convert<O>(unary_fn<OP, C>(convert<C>(x)));
    }
  }
};

template <typename C>
__device__ __forceinline__ C ipow(C b, C e) {
  if constexpr (std::is_signed<C>::value) {
    if (e < 0) return (b == 1) ? C(1) : (b == C(-1) ? ((e % 2) ? C(-1) : C(1)) : C(0));
  }
  C r = 1;
  while (e) {
    if (e & 1) r = static_cast<C>(r * b);
    b = static_cast<C>(b * b);
    e = static_cast<C>(e >> 1);
  }
  return r;
}

template <BinaryOp OP, typename C>
__device__ __forceinline__ auto binary_fn(C a, C b) {
  if constexpr (OP == BinaryOp::Add) return static_cast<C>(a + b);
  if constexpr (OP == BinaryOp::Sub) return static_cast<C>(a - b);
  if constexpr (OP == BinaryOp::Mul) return static_cast<C>(a * b);
  if constexpr (OP == BinaryOp::Div) {
    if constexpr (std::is_floating_point<C>::value) {
      return static_cast<C>(a / b);
    } else {
      // Never reached (the front makes div float); avoids a trap on a zero divisor.
      return b == C(0) ? C(0) : static_cast<C>(a / b);
    }
  }
  if constexpr (OP == BinaryOp::Pow) {
    if constexpr (std::is_floating_point<C>::value) {
      return static_cast<C>(pow(a, b));
    } else if constexpr (std::is_same<C, bool>::value) {
      return static_cast<C>(a || !b);
    } else {
      return ipow<C>(a, b);
    }
  }
  if constexpr (OP == BinaryOp::Maximum) return (a != a) ? a : ((b != b) ? b : (a > b ? a : b));
  if constexpr (OP == BinaryOp::Minimum) return (a != a) ? a : ((b != b) ? b : (a < b ? a : b));
  if constexpr (OP == BinaryOp::FloorDiv) return pymath::floor_divide<C>(a, b);
  if constexpr (OP == BinaryOp::Mod) return pymath::remainder<C>(a, b);
  if constexpr (OP == BinaryOp::Eq) return a == b;
  if constexpr (OP == BinaryOp::Ne) return a != b;
  if constexpr (OP == BinaryOp::Lt) return a < b;
  if constexpr (OP == BinaryOp::Le) return a <= b;
  if constexpr (OP == BinaryOp::Gt) return a > b;
  if constexpr (OP == BinaryOp::Ge) return a >= b;
  if constexpr (OP == BinaryOp::And) return static_cast<bool>(a) && static_cast<bool>(b);
  if constexpr (OP == BinaryOp::Or) return static_cast<bool>(a) || static_cast<bool>(b);
}

template <BinaryOp OP, typename T, typename O>
struct BinaryF {
  __device__ __forceinline__ O operator()(T a, T b) const {
    using C = math_t<T>;
    return convert<O>(binary_fn<OP, C>(convert<C>(a), convert<C>(b)));
  }
};

// Integer // and %: a zero divisor gives 0 there and records a device error (the first one),
// which check_index_errors raises as ZeroDivisionError at the next sync.
template <BinaryOp OP, typename T>
struct IntDivF {
  DeviceErrorSink err;  // (names the op the user called: floor_divide, remainder_, %, ...)
  __device__ __forceinline__ T operator()(T a, T b) const {
    if (b == T(0)) {
      record_device_error(err, 0, 0);
      return T(0);
    }
    return binary_fn<OP, T>(a, b);
  }
};

// CPU copy_raw: static_cast<D>(static_cast<compute_t<S>>(s)).
template <typename S, typename D>
struct CastF {
  __device__ __forceinline__ D operator()(S s) const { return convert<D>(convert<math_t<S>>(s)); }
};

template <typename T>
struct CopyF {
  __device__ __forceinline__ T operator()(T s) const { return s; }
};

template <typename T>
struct FillF {
  T v;
  __device__ __forceinline__ T operator()() const { return v; }
};

template <typename T>
struct WhereF {
  __device__ __forceinline__ T operator()(bool c, T a, T b) const { return c ? a : b; }
};

template <typename T>
struct MaskedFillF {
  T v;
  __device__ __forceinline__ T operator()(T a, bool m) const { return m ? v : a; }
};

// ---- creation and random kernels --------------------------------------------------------------
// Explicit _rn arithmetic: the CPU computes start + i * step without an FMA, so must we.
template <typename I, typename T>
__global__ void __launch_bounds__(kThreads) arange_v1(I n, double start, double step, T* out) {
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  for (I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double v = __dadd_rn(start, __dmul_rn(static_cast<double>(i), step));
    out[i] = convert<T>(convert<math_t<T>>(v));
  }
}

// arange with integral start and step: start + i * step in int64 (unsigned, so the wrap-around
// of i * step for a negative start still lands on the exact value, which the front checked fits).
template <typename I, typename T>
__global__ void __launch_bounds__(kThreads)
    arange_int_v1(I n, uint64_t start, uint64_t step, T* out) {
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  for (I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t v = static_cast<int64_t>(start + static_cast<uint64_t>(i) * step);
    if constexpr (std::is_integral<T>::value) {
      out[i] = static_cast<T>(v);
    } else {
      out[i] = convert<T>(static_cast<math_t<T>>(v));
    }
  }
}

// Element i's value before the cast, exactly as Random::eval_cpu computes it.
template <RandKind K, bool F64>
__device__ __forceinline__ double random_value(uint64_t seed, uint64_t offset, uint64_t i, double a,
                                               double b) {
  if constexpr (K == RandKind::Uniform) {
    const double u = F64 ? philox::uniform_f64(seed, offset, i)
                         : static_cast<double>(philox::uniform_f32(seed, offset, i));
    return __dadd_rn(a, __dmul_rn(__dsub_rn(b, a), u));
  } else if constexpr (K == RandKind::Normal) {
    return __dadd_rn(a, __dmul_rn(b, philox::normal(seed, offset, i)));
  } else {
    return 0;  // randint_v1
  }
}

// One element per iteration; Philox is ~60 integer ops, cheap next to a random init's rarity.
template <RandKind K, bool F64, typename I, typename T>
__global__ void __launch_bounds__(kThreads)
    random_v1(I n, uint64_t seed, uint64_t offset, double a, double b, T* out) {
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  for (I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double v = random_value<K, F64>(seed, offset, static_cast<uint64_t>(i), a, b);
    out[i] = convert<T>(convert<math_t<T>>(v));
  }
}

// randint: low + bits % range in int64, as Random::eval_cpu.
template <typename I, typename T>
__global__ void __launch_bounds__(kThreads)
    randint_v1(I n, uint64_t seed, uint64_t offset, uint64_t low, uint64_t range, T* out) {
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  for (I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint64_t r = philox::bits(seed, offset, static_cast<uint64_t>(i)) % range;
    const int64_t v = static_cast<int64_t>(low + r);
    if constexpr (std::is_integral<T>::value) {
      out[i] = static_cast<T>(v);
    } else {
      out[i] = convert<T>(static_cast<math_t<T>>(v));
    }
  }
}

// Dropout, v1: one element per iteration (the reference).
template <typename I, typename T>
__global__ void __launch_bounds__(kThreads)
    dropout_v1(I n, uint64_t seed, uint64_t offset, float p, math_t<T> scale,
               const T* __restrict__ x, Off<I> xo, T* __restrict__ out) {
  using C = math_t<T>;
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  for (I i = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const bool keep = philox::uniform_f32(seed, offset, static_cast<uint64_t>(i)) >= p;
    out[i] = convert<T>(keep ? convert<C>(x[xo(i)]) * scale : C(0));
  }
}

// Dropout, v2: four elements per thread from one Philox call (its four words).
template <typename I, typename T>
__global__ void __launch_bounds__(kThreads)
    dropout_v2(I n, uint64_t seed, uint64_t offset, float p, math_t<T> scale,
               const T* __restrict__ x, Off<I> xo, T* __restrict__ out) {
  using C = math_t<T>;
  const I stride = static_cast<I>(gridDim.x) * blockDim.x;
  const I ngroups = (n + 3) / 4;
  for (I g = static_cast<I>(blockIdx.x) * blockDim.x + threadIdx.x; g < ngroups; g += stride) {
    const philox::U4 w = philox::philox4x32_10(seed, offset + static_cast<uint64_t>(g));
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const I i = g * 4 + k;
      if (i < n) {
        const bool keep = philox::u32_to_unit_float(w.x[k]) >= p;
        out[i] = convert<T>(keep ? convert<C>(x[xo(i)]) * scale : C(0));
      }
    }
  }
}

// ---- widening casts, v3: 16-bit float -> fp32 on flat tensors -------------------------------
// v2 gives a thread 8 elements: one 16-byte load and two 16-byte stores 16 bytes apart, so each
// store instruction of a warp covers 1 KB with half of every 32-byte sector (twice the sectors
// per instruction of a contiguous one).  v3: LB-byte loads (LB = 8: 4 elements, so each store
// is one contiguous 512-byte warp access; 16: as v2), U vectors per thread per iteration, loads
// first (bytes in flight), on a one-wave grid-stride grid; kCs: streaming (evict-first) stores;
// kNa: L1::no_allocate loads.  Exact (a 16-bit float widens exactly).  Off by default
// (BT_CUDA_CAST_VERSION=3 runs it): bench/cast_check.cu times the configurations.
template <int LB>
struct raw_words {
  uint32_t w[LB / 4];
};
template <int LB, bool kNa>
__device__ __forceinline__ raw_words<LB> ld_words(const void* p) {
  raw_words<LB> r;
  if constexpr (LB == 16) {
    if constexpr (kNa) {
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(r.w[0]), "=r"(r.w[1]), "=r"(r.w[2]), "=r"(r.w[3])
                   : "l"(p));
    } else {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
      r.w[0] = v.x, r.w[1] = v.y, r.w[2] = v.z, r.w[3] = v.w;
    }
  } else {
    static_assert(LB == 8, "8- or 16-byte loads");
    if constexpr (kNa) {
      asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];"
                   : "=r"(r.w[0]), "=r"(r.w[1])
                   : "l"(p));
    } else {
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
      r.w[0] = v.x, r.w[1] = v.y;
    }
  }
  return r;
}
// The two 16-bit floats of a word (low half first) as float: exact.
template <typename S>
__device__ __forceinline__ float2 widen2(uint32_t w) {
  if constexpr (std::is_same_v<S, __nv_bfloat16>) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    static_assert(std::is_same_v<S, __half>, "bf16 / fp16 only");
    __half2 h;
    memcpy(&h, &w, 4);
    return __half22float2(h);
  }
}
template <bool kCs>
__device__ __forceinline__ void st_float4(float* p, const float4& v) {
  if constexpr (kCs) {
    __stcs(reinterpret_cast<float4*>(p), v);
  } else {
    *reinterpret_cast<float4*>(p) = v;
  }
}

template <int LB, int U, bool kCs, bool kNa, typename S>
__global__ void __launch_bounds__(kThreads)
    cast_widen_v3(uint32_t n, const S* __restrict__ in, float* __restrict__ out) {
  constexpr int E = LB / 2;  // elements per vector
  const uint32_t stride = gridDim.x * blockDim.x;
  const uint32_t nvec = n / E;
  const uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x;
  for (uint32_t v0 = tid; v0 < nvec; v0 += U * stride) {
    raw_words<LB> r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t v = v0 + u * stride;
      if (v < nvec) r[u] = ld_words<LB, kNa>(in + size_t(v) * E);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t v = v0 + u * stride;
      if (v < nvec) {
#pragma unroll
        for (int q = 0; q < LB / 8; ++q) {  // one float4 (two words) per 8 input bytes
          const float2 a = widen2<S>(r[u].w[2 * q]), b = widen2<S>(r[u].w[2 * q + 1]);
          st_float4<kCs>(out + size_t(v) * E + 4 * q, make_float4(a.x, a.y, b.x, b.y));
        }
      }
    }
  }
  for (uint32_t i = nvec * E + tid; i < n; i += stride) out[i] = convert<float>(in[i]);
}
// The configuration copy_cast runs (default; BT_CUDA_CAST_VERSION=2 selects v2): 8-byte loads,
// one vector a thread, a full grid.  Measured on the H200 (bench/cast_check.cu): 100% of a D2D
// copy of the same bytes at 16x1024x768 and x3072, against 71% / 65% for v2 (the one-wave, U4 and
// 16-byte-load forms: 60-97%).
constexpr int kWidenLoadBytes = 8, kWidenUnroll = 1;
constexpr bool kWidenStreamStores = false, kWidenNoAllocate = false;

#ifndef BT_ELEMENTWISE_KERNELS_ONLY  // (bench/cast_check.cu includes the kernels only)
// ================================ launchers ====================================================

template <typename T>
const T* cptr(const Tensor& t, const char* op) {
  return static_cast<const T*>(t.data_ptr(op));
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// One wave of a grid-stride kernel: min(blocks for one item per thread, resident blocks of
// `kernel` at kThreads).  `per_sm` caches the occupancy (a static of the caller's instantiation:
// one per kernel); the device-wide cap of elementwise_blocks (8 per SM) assumed 32 registers.
template <typename K>
int one_wave_blocks(K kernel, int64_t items, int dev, int& per_sm, const char* nm) {
  if (per_sm == 0) {
    int b = 0;
    BT_CUDA_CHECK(nm, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, kThreads, 0));
    per_sm = std::max(1, b);
  }
  const int64_t needed = std::max<int64_t>(1, ceil_div(items, int64_t(kThreads)));
  return static_cast<int>(std::min(needed, int64_t(per_sm) * device_info(dev).sm_count));
}

template <typename O, typename... Ts>
constexpr int vec_width() {
  // Elements per thread-iteration: 16 bytes of the narrowest operand, at most 64 bytes of the
  // widest (so a float64 -> bool compare does not hold 256 bytes in registers).
  constexpr size_t mn = std::min({sizeof(O), sizeof(Ts)...});
  constexpr size_t mx = std::max({sizeof(O), sizeof(Ts)...});
  constexpr size_t n = 16 / mn;
  return static_cast<int>(n * mx > 64 ? 64 / mx : n);
}

// Runs out[i] = f(in[i]...) over the output's elements (inputs already broadcast to its shape).
template <typename O, typename... Ts, typename F, size_t... Is>
void launch_elementwise_impl(const char* nm, const F& f, const Tensor& out,
                             const std::array<Tensor, sizeof...(Ts)>& ins,
                             std::index_sequence<Is...>) {
  const int64_t n = out.numel();
  if (n == 0) return;
  const int dev = out.device().index;
  cudaStream_t st = stream(out.device(), nm);
  O* o = static_cast<O*>(out.data_ptr(nm));
  std::tuple<const Ts*...> ptrs{cptr<Ts>(ins[Is], nm)...};
  (void)ptrs;

  // Three kernels per functor (compile time): flat vectors with 32-bit indices when every
  // operand is flat and 16-byte aligned; otherwise the strided kernel with 32- or 64-bit index
  // math (a contiguous operand costs no division there: its offset is the index).
  const bool fits32 = n <= std::numeric_limits<int32_t>::max();
  bool flat = out.is_contiguous() && (ins[Is].is_contiguous() && ... && true);
  if (!flat && is_dense(out)) {
    // Every operand in the output's one dense layout: walk memory in order.
    flat = ((ins[Is].strides() == out.strides()) && ... && true);
  }
  flat = flat && aligned16(o) && (aligned16(std::get<Is>(ptrs)) && ... && true);
  if (flat && fits32) {
    constexpr int kN = vec_width<O, Ts...>();
    using I = uint32_t;
    const int blocks = elementwise_blocks(ceil_div(n, kN), kThreads, dev);
    elementwise_flat_v2<kN, I, F, O, Ts...>
        <<<blocks, kThreads, 0, st>>>(static_cast<I>(n), f, o, std::get<Is>(ptrs)...);
  } else {
    const StridedOffset oo = make_offset(out, nm);
    const std::array<StridedOffset, sizeof...(Ts)> io{make_offset(ins[Is], nm)...};
    bool small = fits32 && max_offset(out) <= std::numeric_limits<int32_t>::max();
    for (const auto& t : ins) small = small && max_offset(t) <= std::numeric_limits<int32_t>::max();
    const int blocks = elementwise_blocks(n, kThreads, dev);
    if (small) {
      using I = uint32_t;
      elementwise_strided_v1<I, F, O, Ts...>
          <<<blocks, kThreads, 0, st>>>(static_cast<I>(n), f, o, to_off<I>(oo),
                                        Arg<I, Ts>{std::get<Is>(ptrs), to_off<I>(io[Is])}...);
    } else {
      using I = int64_t;
      elementwise_strided_v1<I, F, O, Ts...>
          <<<blocks, kThreads, 0, st>>>(static_cast<I>(n), f, o, to_off<I>(oo),
                                        Arg<I, Ts>{std::get<Is>(ptrs), to_off<I>(io[Is])}...);
    }
  }
  BT_CUDA_LAUNCH_CHECK(nm);
}

template <typename O, typename... Ts, typename F>
void launch_elementwise(const char* nm, const F& f, const Tensor& out,
                        const std::array<Tensor, sizeof...(Ts)>& ins) {
  launch_elementwise_impl<O, Ts...>(nm, f, out, ins, std::index_sequence_for<Ts...>{});
}

// Cast kernel version, read per call: cast_widen_v3 for flat 16-bit -> fp32 casts (default, or
// BT_CUDA_CAST_VERSION=3); BT_CUDA_CAST_VERSION=2 (or 1) runs the generic flat kernel (v2).
int cast_version() {
  const char* e = std::getenv("BT_CUDA_CAST_VERSION");
  return e && (e[0] == '1' || e[0] == '2') && !e[1] ? 2 : 3;
}

// dst (fp32) = src (bf16 / fp16) through cast_widen_v3 when asked for and both are contiguous,
// 16-byte aligned and 32-bit indexable; false (nothing launched) otherwise.
template <typename S>
bool try_cast_widen(const Tensor& dst, const Tensor& src, const char* nm) {
  const int64_t n = dst.numel();
  if (cast_version() != 3 || n == 0 || n > std::numeric_limits<int32_t>::max() ||
      src.numel() != n || !dst.is_contiguous() || !src.is_contiguous()) {
    return false;
  }
  const S* ip = cptr<S>(src, nm);
  float* op = static_cast<float*>(dst.data_ptr(nm));
  if (!aligned16(ip) || !aligned16(op)) return false;
  auto kern = cast_widen_v3<kWidenLoadBytes, kWidenUnroll, kWidenStreamStores, kWidenNoAllocate, S>;
  // A full grid (one vector a thread; the kernel's loop covers any remainder).
  const int64_t threads_needed = ceil_div(n / (kWidenLoadBytes / 2), kWidenUnroll);
  const int blocks =
      static_cast<int>(std::max<int64_t>(1, ceil_div(threads_needed, int64_t(kThreads))));
  kern<<<blocks, kThreads, 0, stream(dst.device(), nm)>>>(static_cast<uint32_t>(n), ip, op);
  BT_CUDA_LAUNCH_CHECK(nm);
  return true;
}

// dst = f(src) through copy_rows_v4 when it applies: not both flat, both contiguous over the same
// trailing L elements (L a multiple of the vector width), every row start vector-aligned, 32-bit
// offsets; false (nothing launched) otherwise.
template <typename O, typename S, typename F>
bool try_copy_rows(const Tensor& dst, const Tensor& src, const F& f, const char* nm) {
  constexpr int kN = vec_width<O, S>();
  const int64_t n = dst.numel();
  if (n == 0 || n > std::numeric_limits<int32_t>::max() ||
      (dst.is_contiguous() && src.is_contiguous()) ||
      max_offset(dst) > std::numeric_limits<int32_t>::max() ||
      max_offset(src) > std::numeric_limits<int32_t>::max()) {
    return false;
  }
  const Shape& sh = dst.shape();
  const Strides &so = dst.strides(), &si = src.strides();
  int64_t d = dst.ndim() - 1, L = 1;
  for (; d >= 0; --d) {  // the trailing dims contiguous in both
    if (sh[d] == 1) continue;
    if (so[d] != L || si[d] != L) break;
    L *= sh[d];
  }
  if (L % kN != 0 || L == n) return false;
  Shape lead(sh.begin(), sh.begin() + (d + 1));
  Strides lo(so.begin(), so.begin() + (d + 1)), li(si.begin(), si.begin() + (d + 1));
  for (int64_t k = 0; k <= d; ++k) {
    if (lo[k] % kN != 0 || li[k] % kN != 0) return false;  // a row start off the vector grid
  }
  O* o = static_cast<O*>(dst.data_ptr(nm));
  const S* ip = cptr<S>(src, nm);
  if (!aligned16(o) || !aligned16(ip)) return false;
  constexpr int kU = 4;
  const int64_t nvec = n / kN;
  const int blocks = elementwise_blocks(ceil_div(nvec, int64_t(kU)), kThreads, dst.device().index);
  copy_rows_v4<kN, kU, F, O, S><<<blocks, kThreads, 0, stream(dst.device(), nm)>>>(
      static_cast<uint32_t>(nvec), static_cast<uint32_t>(L / kN), f, o,
      to_off<uint32_t>(make_offset(lead, lo, nm)), ip, to_off<uint32_t>(make_offset(lead, li, nm)));
  BT_CUDA_LAUNCH_CHECK(nm);
  return true;
}

// dst = src (same shape, any strides), casting from src's dtype to dst's.
void copy_cast_impl(const Tensor& dst, const Tensor& src, const char* nm) {
  dispatch_cuda_all(dst.dtype(), nm, [&](auto dtag) {
    using D = typename decltype(dtag)::type;
    dispatch_cuda_all(src.dtype(), nm, [&](auto stag) {
      using S = typename decltype(stag)::type;
      if constexpr (std::is_same<D, float>::value &&
                    (std::is_same<S, __nv_bfloat16>::value || std::is_same<S, __half>::value)) {
        if (try_cast_widen<S>(dst, src, nm)) return;
      }
      if constexpr (std::is_same<D, S>::value) {
        if (try_copy_rows<D, S>(dst, src, CopyF<D>{}, nm)) return;
        launch_elementwise<D, S>(nm, CopyF<D>{}, dst, {src});
      } else {
        if (try_copy_rows<D, S>(dst, src, CastF<S, D>{}, nm)) return;
        launch_elementwise<D, S>(nm, CastF<S, D>{}, dst, {src});
      }
    });
  });
}

// The CPU's host-side value cast (Scalar::as: exact for integers), as CUDA bits.
template <typename B>
cuda_t<B> host_value(const Scalar& v) {
  const B hv = v.template as<B>();
  cuda_t<B> r;
  std::memcpy(static_cast<void*>(&r), &hv, sizeof(B));
  return r;
}

template <UnaryOp OP>
void unary_launch(const Tensor& x, const Tensor& out, const char* nm) {
  dispatch_cuda_all(x.dtype(), nm, [&](auto tag) {
    using T = typename decltype(tag)::type;
    constexpr bool int_ok = OP == UnaryOp::Neg || OP == UnaryOp::Abs || OP == UnaryOp::Relu ||
                            OP == UnaryOp::Sign || OP == UnaryOp::LogicalNot;
    if constexpr (!std::is_floating_point<math_t<T>>::value && !int_ok) {
      throw RuntimeError(std::string("[") + nm + "] internal: integer input to a float-only op");
    } else {
      if constexpr (OP == UnaryOp::LogicalNot) {
        if (out.dtype() != DType::Bool) {
          throw RuntimeError(std::string("[") + nm + "] internal: logical_not must output bool");
        }
        launch_elementwise<bool, T>(nm, UnaryF<OP, T, bool>{}, out, {x});
      } else {
        if (out.dtype() != x.dtype()) {
          throw RuntimeError(std::string("[") + nm + "] internal: output dtype differs from input");
        }
        launch_elementwise<T, T>(nm, UnaryF<OP, T, T>{}, out, {x});
      }
    }
  });
}

// L when t reads element i (row-major over its shape) at offset i % L: contiguous over its
// trailing dims (L elements) and stride 0 over the leading ones (a broadcast row); else 0.
int64_t row_broadcast_len(const Tensor& t) {
  const Shape& sh = t.shape();
  const Strides& st = t.strides();
  int64_t L = 1, d = t.ndim() - 1;
  for (; d >= 0; --d) {
    if (sh[d] == 1) continue;
    if (st[d] != L) break;
    L *= sh[d];
  }
  for (; d >= 0; --d) {
    if (sh[d] != 1 && st[d] != 0) return 0;
  }
  return L;
}

// The v3 fast path for out = f(a, b) with one operand contiguous and the other a broadcast row
// whose length is a multiple of the vector width; false when it does not apply.
template <typename O, typename T, typename F>
bool try_rowbcast(const char* nm, const F& f, const Tensor& out, const Tensor& a, const Tensor& b) {
  constexpr int kN = vec_width<O, T, T>();
  const int64_t n = out.numel();
  if (n == 0 || n > std::numeric_limits<int32_t>::max() || !out.is_contiguous()) return false;
  const bool a_flat = a.is_contiguous(), b_flat = b.is_contiguous();
  if (a_flat == b_flat) return false;  // both flat: the flat kernel; neither: strided
  const Tensor& x = a_flat ? a : b;
  const Tensor& row = a_flat ? b : a;
  const int64_t L = row_broadcast_len(row);
  if (L == 0 || L % kN != 0 || L >= n) return false;
  O* o = static_cast<O*>(out.data_ptr(nm));
  const T* xp = cptr<T>(x, nm);
  const T* bp = cptr<T>(row, nm);
  if (!aligned16(o) || !aligned16(xp) || !aligned16(bp)) return false;
  const int dev = out.device().index;
  const int64_t rows = n / L, lv = L / kN;
  auto launch = [&](auto kern, int& per_sm) {
    // threads of one wave, a whole number of rows_step rows (thread t: column t % lv)
    const int64_t want = int64_t(one_wave_blocks(kern, n / kN, dev, per_sm, nm)) * kThreads;
    const int64_t rows_step = std::max<int64_t>(1, std::min(rows, want / lv));
    const int blocks = static_cast<int>(ceil_div(rows_step * lv, kThreads));
    kern<<<blocks, kThreads, 0, stream(out.device(), nm)>>>(
        static_cast<uint32_t>(rows), static_cast<uint32_t>(lv), static_cast<uint32_t>(rows_step), f,
        o, xp, bp);
    BT_CUDA_LAUNCH_CHECK(nm);
  };
  static int per_sm[2] = {0, 0};
  if (a_flat) {
    launch(elementwise_rowbcast_v3<kN, false, F, O, T>, per_sm[0]);
  } else {
    launch(elementwise_rowbcast_v3<kN, true, F, O, T>, per_sm[1]);
  }
  return true;
}

template <BinaryOp OP>
void binary_launch(const Tensor& x, const Tensor& y, const Tensor& out, const char* nm) {
  constexpr bool to_bool = OP >= BinaryOp::Eq;  // comparisons, and, or
  if (x.dtype() != y.dtype() || (to_bool ? out.dtype() != DType::Bool : out.dtype() != x.dtype())) {
    throw RuntimeError(std::string("[") + nm + "] internal: unexpected dtypes " +
                       dtype_name(x.dtype()) + ", " + dtype_name(y.dtype()) + " -> " +
                       dtype_name(out.dtype()));
  }
  dispatch_cuda_all(x.dtype(), nm, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using O = std::conditional_t<to_bool, bool, T>;
    // Combinations the front never makes get no kernel (compile time): div is float-only,
    // and/or cast to bool first, sub of bools is an error.
    constexpr bool is_float = std::is_floating_point<math_t<T>>::value;
    constexpr bool is_bool = std::is_same<T, bool>::value;
    constexpr bool pydiv = OP == BinaryOp::FloorDiv || OP == BinaryOp::Mod;
    constexpr bool made = (OP == BinaryOp::Div)                         ? is_float
                          : (OP == BinaryOp::And || OP == BinaryOp::Or) ? is_bool
                          : (OP == BinaryOp::Sub || pydiv)              ? !is_bool
                                                                        : true;
    if constexpr (made && pydiv && !is_float) {
      const int kind = OP == BinaryOp::FloorDiv ? kDeviceErrorFloorDiv : kDeviceErrorRemainder;
      launch_elementwise<O, T, T>(
          nm, IntDivF<OP, T>{device_error_sink(out.device().index, kind, nm)}, out, {x, y});
    } else if constexpr (made) {
      // Bias-style broadcasts (x op row) of the arithmetic ops on floats: the v3 fast path.
      constexpr bool arith =
          OP == BinaryOp::Add || OP == BinaryOp::Sub || OP == BinaryOp::Mul || OP == BinaryOp::Div;
      if constexpr (arith && is_float && !to_bool) {
        if (try_rowbcast<O, T>(nm, BinaryF<OP, T, O>{}, out, x, y)) return;
      }
      launch_elementwise<O, T, T>(nm, BinaryF<OP, T, O>{}, out, {x, y});
    } else {
      throw RuntimeError(std::string("[") + nm + "] internal: no CUDA kernel for " +
                         dtype_name(x.dtype()) + " inputs (the front casts them)");
    }
  });
}

template <typename Launch>
void with_index(int64_t n, Launch&& l) {
  if (n <= std::numeric_limits<int32_t>::max()) {
    l(type_tag<uint32_t>{});
  } else {
    l(type_tag<int64_t>{});
  }
}

}  // namespace

// The exported entry of runtime.h (copy_ and in-place ops on CUDA tensors).
void copy_cast(const Tensor& dst, const Tensor& src, const char* op) {
  copy_cast_impl(dst, src, op);
}
}  // namespace cuda

// ---- creation ---------------------------------------------------------------------------------
void Full::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>& out) {
  dispatch_all(out[0].dtype(), name(), [&](auto tag) {
    using B = typename decltype(tag)::type;
    using T = cuda::cuda_t<B>;
    cuda::launch_elementwise<T>(name(), cuda::FillF<T>{cuda::host_value<B>(value)}, out[0], {});
  });
}

void Arange::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>& out) {
  const int64_t n = out[0].numel();
  if (n == 0) return;
  cudaStream_t st = cuda::stream(out[0].device(), name());
  const int blocks = cuda::elementwise_blocks(n, cuda::kThreads, out[0].device().index);
  cuda::dispatch_cuda_all(out[0].dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = static_cast<T*>(out[0].data_ptr(name()));
    cuda::with_index(n, [&](auto itag) {
      using I = typename decltype(itag)::type;
      if (exact()) {
        cuda::arange_int_v1<I, T><<<blocks, cuda::kThreads, 0, st>>>(
            static_cast<I>(n), static_cast<uint64_t>(start.i), static_cast<uint64_t>(step.i), o);
      } else {
        cuda::arange_v1<I, T>
            <<<blocks, cuda::kThreads, 0, st>>>(static_cast<I>(n), start.v, step.v, o);
      }
    });
  });
  BT_CUDA_LAUNCH_CHECK(name());
}

void Random::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>& out) {
  const int64_t n = out[0].numel();
  if (n == 0) return;
  cudaStream_t st = cuda::stream(out[0].device(), name());
  const int blocks = cuda::elementwise_blocks(n, cuda::kThreads, out[0].device().index);
  const bool f64 = out[0].dtype() == DType::Float64;
  cuda::dispatch_cuda_all(out[0].dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = static_cast<T*>(out[0].data_ptr(name()));
    cuda::with_index(n, [&](auto itag) {
      using I = typename decltype(itag)::type;
      const I ni = static_cast<I>(n);
      if (kind == RandKind::Uniform) {
        if (f64) {
          cuda::random_v1<RandKind::Uniform, true, I, T>
              <<<blocks, cuda::kThreads, 0, st>>>(ni, seed, offset, a, b, o);
        } else {
          cuda::random_v1<RandKind::Uniform, false, I, T>
              <<<blocks, cuda::kThreads, 0, st>>>(ni, seed, offset, a, b, o);
        }
      } else if (kind == RandKind::Normal) {
        cuda::random_v1<RandKind::Normal, false, I, T>
            <<<blocks, cuda::kThreads, 0, st>>>(ni, seed, offset, a, b, o);
      } else {
        cuda::randint_v1<I, T><<<blocks, cuda::kThreads, 0, st>>>(
            ni, seed, offset, static_cast<uint64_t>(int_low), int_range, o);
      }
    });
  });
  BT_CUDA_LAUNCH_CHECK(name());
}

// ---- copies -----------------------------------------------------------------------------------
void AsType::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  cuda::copy_cast(out[0], in[0], name());
}

void SliceScatter::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  cuda::copy_cast(out[0], in[0], name());
  Slice sl(dim, start, stop, step);
  Tensor view = sl.eval_view({out[0]});
  cuda::copy_cast(view, in[1], name());
}

// ---- unary / binary ---------------------------------------------------------------------------
void Unary::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  switch (op) {
#define BT_CASE(N)                                         \
  case UnaryOp::N:                                         \
    cuda::unary_launch<UnaryOp::N>(in[0], out[0], name()); \
    break;
    // clang-format off
    BT_CASE(Neg) BT_CASE(Exp) BT_CASE(Log) BT_CASE(Sqrt) BT_CASE(Rsqrt) BT_CASE(Tanh)
    BT_CASE(Abs) BT_CASE(Sigmoid) BT_CASE(Relu) BT_CASE(Sin) BT_CASE(Cos) BT_CASE(GeluTanh)
    BT_CASE(GeluErf) BT_CASE(Erf) BT_CASE(LogicalNot) BT_CASE(Sign)
    // clang-format on
#undef BT_CASE
  }
}

void Binary::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  switch (op) {
#define BT_CASE(N)                                                  \
  case BinaryOp::N:                                                 \
    cuda::binary_launch<BinaryOp::N>(in[0], in[1], out[0], name()); \
    break;
    // clang-format off
    BT_CASE(Add) BT_CASE(Sub) BT_CASE(Mul) BT_CASE(Div) BT_CASE(Pow) BT_CASE(Maximum)
    BT_CASE(Minimum) BT_CASE(FloorDiv) BT_CASE(Mod) BT_CASE(Eq) BT_CASE(Ne) BT_CASE(Lt) BT_CASE(Le)
    BT_CASE(Gt) BT_CASE(Ge) BT_CASE(And) BT_CASE(Or)
    // clang-format on
#undef BT_CASE
  }
}

void Where::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  dispatch_all(out[0].dtype(), name(), [&](auto tag) {
    using T = cuda::cuda_t<typename decltype(tag)::type>;
    cuda::launch_elementwise<T, bool, T, T>(name(), cuda::WhereF<T>{}, out[0],
                                            {in[0], in[1], in[2]});
  });
}

void MaskedFill::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  dispatch_all(out[0].dtype(), name(), [&](auto tag) {
    using B = typename decltype(tag)::type;
    using T = cuda::cuda_t<B>;
    cuda::launch_elementwise<T, T, bool>(name(), cuda::MaskedFillF<T>{cuda::host_value<B>(value)},
                                         out[0], {in[0], in[1]});
  });
}

void Dropout::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  const int64_t n = out[0].numel();
  if (n == 0) return;
  cudaStream_t st = cuda::stream(out[0].device(), name());
  const cuda::StridedOffset xo = cuda::make_offset(in[0], name());
  bool small = n <= std::numeric_limits<int32_t>::max() &&
               cuda::max_offset(in[0]) <= std::numeric_limits<int32_t>::max();
  const int blocks =
      cuda::elementwise_blocks(cuda::ceil_div(n, 4), cuda::kThreads, out[0].device().index);
  const float pf = static_cast<float>(p);
  cuda::dispatch_cuda_float(out[0].dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = cuda::math_t<T>;
    const C scale = C(1.0 / (1.0 - p));
    const T* x = static_cast<const T*>(in[0].data_ptr(name()));
    T* o = static_cast<T*>(out[0].data_ptr(name()));
    if (small) {
      using I = uint32_t;
      cuda::dropout_v2<I, T><<<blocks, cuda::kThreads, 0, st>>>(static_cast<I>(n), seed, offset, pf,
                                                                scale, x, cuda::to_off<I>(xo), o);
    } else {
      using I = int64_t;
      cuda::dropout_v2<I, T><<<blocks, cuda::kThreads, 0, st>>>(static_cast<I>(n), seed, offset, pf,
                                                                scale, x, cuda::to_off<I>(xo), o);
    }
  });
  BT_CUDA_LAUNCH_CHECK(name());
}

#else   // BT_ELEMENTWISE_KERNELS_ONLY
}  // namespace
}  // namespace cuda
#endif  // BT_ELEMENTWISE_KERNELS_ONLY

}  // namespace bt
