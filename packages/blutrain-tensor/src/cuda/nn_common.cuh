// cuda/nn_common.cuh: device helpers shared by the row kernels of nn_kernels.cuh and
// nn_fused_kernels.cuh (and the bench programs that include them): strided -> contiguous staging,
// per-thread chunks of a row with 16-byte vector loads, online max/sum merging, and the kernel
// version switch.
#pragma once

#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "common.cuh"

namespace bt::cuda::nn {

// Kernel version, read per call so tests and benches can flip it: BT_CUDA_NN_VERSION=2..6.  2:
// block-per-row kernels with 16-byte loads (they take every shape); 3 (layer norm fwd / bwd,
// add_layer_norm, softmax fwd, cross-entropy fwd / bwd): one warp (cross-entropy: one block) per
// row with the row in registers, used where it applies (16-bit / fp32, aligned rows up to
// kV3MaxPerLane * 32 elements), else 2; 4 (layer norm fwd / bwd, add_layer_norm; elsewhere as 3):
// 1-8 warps per row, at most kV4MaxPerLane elements per lane in registers, persistent single-pass
// backward.  Each falls back to the next lower version that applies.  Unset, the default is 4 for
// layer-norm rows longer than kV4MinDefaultC and 3 otherwise (measured on the H200 at GPT-2's
// shapes: v4 wins at C = 3072, v3 at C = 768), except the layer-norm backward, which picks per
// dtype / C / extra (ln_bwd_default in nn_fused_kernels.cuh: v5 or v6 where they measured best),
// and the layer-norm forward of 16-bit rows longer than kV4MinDefaultC, which runs v6
// (ln_fwd_v6_default in nn_kernels.cuh).  5 and 6: layer norm backward v5 / v6 where they apply,
// 6 also the forward v6, every other kernel (and these where they do not apply) as with the
// version unset.  The v1 references left the library for bench/nn_v1_kernels.cuh: 1 (and
// BT_CUDA_NN_V1) are errors, as is any other value, so a typo never runs the default unnoticed.
constexpr int kDefaultNnVersion = 4;
constexpr int64_t kV4MinDefaultC = 1024;
inline int nn_version_env() {          // 0 when unset
  OpScopeReset named_by_the_variable;  // the error names the setting, not the op that read it
  const char* v1 = std::getenv("BT_CUDA_NN_V1");
  if (v1 && v1[0] && std::strcmp(v1, "0") != 0) {
    throw ValueError(std::string("[BT_CUDA_NN_V1] the v1 reference kernels left the library ") +
                     "(packages/blutrain-tensor/bench/nn_v1_kernels.cuh): unset BT_CUDA_NN_V1");
  }
  const char* e = std::getenv("BT_CUDA_NN_VERSION");
  if (!e || !e[0]) return 0;
  if (e[0] >= '2' && e[0] <= '6' && !e[1]) return e[0] - '0';
  throw ValueError(std::string("[BT_CUDA_NN_VERSION] must be 2, 3, 4, 5 or 6 (or unset), got '") +
                   e + "'" +
                   (std::strcmp(e, "1") == 0
                        ? "; the v1 reference kernels are in packages/blutrain-tensor/bench/"
                          "nn_v1_kernels.cuh"
                        : ""));
}
inline int nn_version() {
  const int v = nn_version_env();
  return v ? v : kDefaultNnVersion;
}
// Layer norm (forward, backward) of rows of C: v4 when asked for, or by default for long rows
// (5 and 6 count as unset here: where the backward v5 / v6 do not apply, the default runs).
inline bool layernorm_v4(int64_t C) {
  const int v = nn_version_env();
  return v == 4 || ((v == 0 || v == 5 || v == 6) && C > kV4MinDefaultC);
}

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

// f(type_tag<T>) for the 16-bit float dtypes (the 16-bit side of the mixed layer norms, Note
// [float32 residual stream] in nn_fused.h); a TypeError naming op otherwise.
template <typename F>
inline void dispatch_cuda_half(DType d, const char* op, F&& f) {
  if (d == DType::BFloat16) {
    f(type_tag<__nv_bfloat16>{});
  } else if (d == DType::Float16) {
    f(type_tag<__half>{});
  } else {
    throw TypeError(std::string("[") + op + "] expects a 16-bit float dtype here, got " +
                    dtype_name(d));
  }
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
// Note [online softmax special values]: the two-pass reference (the CPU: m = max ignoring NaN,
// s = sum exp(x - m)) gives s = NaN when a NaN is in the row, or when m is +inf (exp(inf - inf));
// then every output is NaN, as PyTorch.  The online form must not lose either: a NaN seen while m
// is still -inf sits in s and is kept by the merges below (they add s rather than drop it), and a
// +inf maximum, whose "+1" term would hide exp(inf - inf), is handled once per row by ms_finish.
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
  if (m2 == -INFINITY) {  // s2 is 0, or NaN (a NaN was seen): keep it
    s += s2;
    return;
  }
  if (m == -INFINITY) {
    m = m2;
    s = s2 + s;
    return;
  }
  if (m2 > m) {
    s = s * exp(m - m2) + s2;
    m = m2;
  } else {
    s += s2 * exp(m2 - m);
  }
}
// The row's final (m, s) as the reference has them: an all -inf (or empty) row takes m = 0 (so
// x - m stays -inf, not NaN), and a +inf maximum makes s NaN.  Per row, in registers.
template <typename A>
__device__ __forceinline__ void ms_finish(A& m, A& s) {
  if (m == -INFINITY) m = 0;
  if (m == INFINITY) s = NAN;
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

// Whether rows of C elements of T are whole 16-byte words at every pointer of ptrs (nulls
// skipped): C a multiple of 16 / sizeof(T) and each pointer 16-byte aligned.  The v3, v4 and v5
// layouts all need it.
template <typename T>
inline bool rows_in_words16(int64_t C, std::initializer_list<const void*> ptrs) {
  if (C <= 0 || C % static_cast<int64_t>(16 / sizeof(T)) != 0) return false;
  for (const void* p : ptrs) {
    if (p && (reinterpret_cast<uintptr_t>(p) & 15) != 0) return false;
  }
  return true;
}

// Runs f(ic<V>, ic<NV>) with the smallest supported NV covering a row of C, and returns true;
// false (f not run) when v3 does not apply: 8-byte elements, C % V != 0, a misaligned pointer or
// a row longer than MaxPerLane elements per lane (what fits in registers).
template <typename T, int MaxPerLane = kV3MaxPerLane, typename F>
inline bool dispatch_v3(int64_t C, std::initializer_list<const void*> ptrs, F&& f) {
  if constexpr (sizeof(T) == 8) {
    return false;
  } else {
    constexpr int V = static_cast<int>(16 / sizeof(T));
    if (!rows_in_words16<T>(C, ptrs)) return false;
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

// ---- v4: a group of WPR warps per row (WPR = 1, 2, 4 or 8), kV4Warps warps per block ---------
// Group lane gl = (warp % WPR) * 32 + lane holds the 16-byte vectors j * 32 * WPR + gl (j < NV), so
// a group's access per j is 512 * WPR contiguous bytes.  WPR is the smallest giving at most
// kV4MaxPerLane elements per lane (few registers: several rows in flight per SM), so GPT-2's
// 768 and 3072 rows both run with NV = 3.  Same alignment rules as v3.
constexpr int kV4MaxPerLane = 24;
constexpr int kV4Warps = 8;      // warps per block of the forward kernel, and the largest WPR
constexpr int kV4BwdWarps = 16;  // of the backward: one block per SM, fewer dw / db partials

// Runs f(ic<V>, ic<NV>, ic<WPR>) and returns true, or false (f not run) where v4 does not apply
// (8-byte elements, C % V != 0, a misaligned pointer, C > 4 * 32 * kV4MaxPerLane).
template <typename T, typename F>
inline bool dispatch_v4(int64_t C, std::initializer_list<const void*> ptrs, F&& f) {
  if constexpr (sizeof(T) == 8) {
    return false;
  } else {
    constexpr int V = static_cast<int>(16 / sizeof(T));
    constexpr int MaxNV = kV4MaxPerLane / V;
    if (!rows_in_words16<T>(C, ptrs)) return false;
    const int64_t nvec = C / V;
    auto by_nv = [&](auto wtag) {
      constexpr int WPR = decltype(wtag)::value;
      const int64_t nv = ceil_div(nvec, int64_t(32) * WPR);
      if (nv <= 1) {
        f(ic<V>{}, ic<1>{}, wtag);
      } else if (nv <= 2) {
        f(ic<V>{}, ic<2>{}, wtag);
      } else if (nv <= 3) {
        f(ic<V>{}, ic<3>{}, wtag);
      } else {
        if constexpr (MaxNV >= 6) {
          if (nv <= 4) {
            f(ic<V>{}, ic<4>{}, wtag);
          } else {
            f(ic<V>{}, ic<6>{}, wtag);
          }
        }
      }
    };
    // WPR 8 (rows over 3072 elements) failed its GPU test (C = 6144): such rows take v3 / v2
    for (int wpr = 1; wpr <= 4; wpr *= 2) {
      if (ceil_div(nvec, int64_t(32) * wpr) > MaxNV) continue;
      switch (wpr) {
        case 1:
          by_nv(ic<1>{});
          break;
        case 2:
          by_nv(ic<2>{});
          break;
        case 4:
          by_nv(ic<4>{});
          break;
        default:
          by_nv(ic<8>{});
          break;
      }
      return true;
    }
    return false;
  }
}

// Column of group lane `gl`'s j-th vector.
template <int V, int WPR>
__device__ __forceinline__ int64_t v4_col(int j, int gl) {
  return (int64_t(j) * 32 * WPR + gl) * V;
}

// Sum of a and b over the WPR warps of this thread's row group (each warp's values already warp-
// reduced) in a block of NW warps.  red: 2 * NW floats of shared memory, double-buffered by the
// caller (successive calls alternate buffers, so one barrier per call suffices).  The barrier is
// the group's own named barrier (1 + group; 0 is __syncthreads'), so row groups of a block do not
// wait for each other; every thread of the group must call it.
template <int WPR, int NW>
__device__ __forceinline__ void group_sum2(float& a, float& b, float* red) {
  static_assert(WPR == 1 || NW / WPR < 16, "named barriers 1..15");
  if constexpr (WPR > 1) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32, g0 = warp / WPR * WPR;
    if (lane == 0) red[warp] = a, red[NW + warp] = b;
    asm volatile("bar.sync %0, %1;" ::"r"(1 + warp / WPR), "r"(WPR * 32) : "memory");
    a = 0, b = 0;
#pragma unroll
    for (int q = 0; q < WPR; ++q) a += red[g0 + q], b += red[NW + g0 + q];  // fixed order
  }
}

// Exact two-pass mean and rstd of the row a group of WPR warps holds as v[NV][V] floats (lane gl
// holds columns v4_col(j, gl)), leaving v centred (v - mean, taken once for the squares and the
// normalisation, which then only scales: bf16 4096 x 3072 80.6-81.6% of copy against 79.1-79.4%,
// session 18); s: the lane's sum of its elements, in order j, then k (the caller adds them as
// they load); live false: a row past R, which still joins the group barriers.  Layer-norm forward
// v4 and v6 share it, so they give the same statistics for the same layout.  red: the caller's
// __shared__ scratch.
template <int V, int NV, int WPR, int NW>
__device__ __forceinline__ float2 group_mean_rstd(float (&v)[NV][V], float s, bool live, int gl,
                                                  int64_t C, double eps, float (&red)[2][2 * NW]) {
  float ss = 0.f, dummy = 0.f;
  s = warp_sum(s);
  group_sum2<WPR, NW>(s, dummy, red[0]);
  const float mean = s / float(C);
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    if (live && v4_col<V, WPR>(j, gl) < C) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        v[j][k] -= mean;
        ss += v[j][k] * v[j][k];
      }
    }
  }
  ss = warp_sum(ss);
  group_sum2<WPR, NW>(ss, dummy, red[1]);
  return make_float2(mean, 1.f / sqrtf(ss / float(C) + float(eps)));
}

}  // namespace bt::cuda::nn

// ---- cross-entropy v3 (nn.cu / nn_fused.cu) ---------------------------------------------------
namespace bt::cuda::nn {

// One block of kCeThreads per row; each thread streams its 16-byte words of the row with
// kCeUnroll loads in flight (enough bytes in flight per SM at 6-8 resident blocks), exp as one
// FFMA + MUFU ex2 on log2e-scaled values.  Rows of 16-bit / fp32 logits up to kCeMaxC classes.
constexpr int kCeThreads = 256, kCeMaxThreads = 512;  // default; launch bound
constexpr int kCeUnroll = 4;
constexpr int64_t kCeMaxC = int64_t(1) << 30;  // column indices fit in int
constexpr float kLog2e = 1.4426950408889634f, kLn2 = 0.6931471805599453f;

// Note [huge logits]: the log2-unit sums take 2^(x log2e - ml) with one FFMA, and x log2e - ml is
// then off by up to half an ulp of ml.  That is nothing for ordinary logits, but past |x| ~ 2^31
// it overflows ex2 (a row [1e30, -1e30] gave a NaN or -inf loss; the backward's exp(x - lse) the
// same).  A row whose max (forward) or lse (backward) reaches kCeHuge in magnitude takes natural
// units instead: exp(x - m) in full precision, lse = m + log s (exact where m dominates, as on
// the CPU and in PyTorch).  Such rows pay a second pass over the row (forward) or take a second
// copy of the loop (backward); every other row runs the same instructions as before.
constexpr float kCeHuge = 1048576.f;  // 2^20, in logit units
__device__ __forceinline__ bool ce_huge(float m) { return isfinite(m) && fabsf(m) >= kCeHuge; }

// Note [lse to m's last bit]: ordinary rows keep log2 units, but rows whose max is large next to
// the loss (the H100 run of test_cross_entropy_of_huge_logits_matches_the_cpu: M ~ 2^20, 1e7)
// lost the loss to rounding twice: lse = (ML + log2 s) ln2 rounds to ML's ulp (0.125 at 2^20,
// then 1.0 at 1e7), and lse - xt kept that error (a loss of ln 2 came out 1.0).  So the kernels
// carry m and log s apart: nll = (m - xt) + log s, lse = m + log s rounded once (the CPU's value),
// where log s = (log2 s - e) ln2 and e = m log2e - fl(m log2e), exact by FMA.  The backward's
// exponent takes the same residual of fl(lse log2e).  A thread whose running max was huge
// before the row's max (a -1e30 logit first) holds an overflowed sum (inf * 0 = NaN after the
// rescale): it sums its values again against the row's max.
__device__ __forceinline__ float log2e_residual(float a, float al) {
  return isfinite(a) ? fmaf(a, kLog2e, -al) : 0.f;
}

// Threads per row block of the v3 kernels: kCeThreads, or BT_CUDA_CE_THREADS (a multiple of 32
// in [64, kCeMaxThreads]; for tuning sweeps), then no more than the row needs (>= 32).
inline int ce_threads(int64_t C, int V) {
  int cap = kCeThreads;
  if (const char* e = std::getenv("BT_CUDA_CE_THREADS")) {
    const int v = std::atoi(e);
    if (v >= 64 && v <= kCeMaxThreads && v % 32 == 0) cap = v;
  }
  return row_threads(C, V, cap);
}

// 2^x on the MUFU: ~2 ulp, subnormal results flush to 0 (a row's sum is >= 1 anyway).
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The 16 / sizeof(T) elements of a 16-byte word as float, and back (round to nearest even).
template <typename T>
__device__ __forceinline__ void unpack16(const uint4& raw, float* out) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      out[i] = __uint_as_float(w[i]);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    } else {
      static_assert(std::is_same_v<T, __half>, "unpack16: fp32 / bf16 / fp16 only");
      __half2 h;
      memcpy(&h, &w[i], 4);
      const float2 f = __half22float2(h);
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
}
template <typename T>
__device__ __forceinline__ uint4 pack16(const float* in) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      w[i] = __float_as_uint(in[i]);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
      memcpy(&w[i], &h, 4);
    } else {
      const __half2 h = __floats2half2_rn(in[2 * i], in[2 * i + 1]);
      memcpy(&w[i], &h, 4);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// 8 floats at p (32 bytes, 16-byte aligned) and back: the float32 side of a mixed row chunk
// (Note [float32 residual stream]), whose 16-bit side is one 16-byte word.
__device__ __forceinline__ void load8f(const float* p, float* out) {
  unpack16<float>(*reinterpret_cast<const uint4*>(p), out);
  unpack16<float>(*reinterpret_cast<const uint4*>(p + 4), out + 4);
}
__device__ __forceinline__ void store8f(float* p, const float* in) {
  *reinterpret_cast<uint4*>(p) = pack16<float>(in);
  *reinterpret_cast<uint4*>(p + 4) = pack16<float>(in + 4);
}

// Elements of a row starting at `p` before its first 16-byte boundary (at most C).
template <typename T>
__device__ __forceinline__ int ce_head(const T* p, int C) {
  const int h = static_cast<int>(((16 - (reinterpret_cast<uintptr_t>(p) & 15)) & 15) / sizeof(T));
  return h < C ? h : C;
}

// ---- row rings (layer-norm forward / backward v6) -------------------------------------------
// cp.async 16-byte copies into shared memory and 16-byte shared loads, addressed by 32-bit
// shared-memory offsets.
// Shared-memory addresses as 32-bit offsets (fewer registers than generic pointers).
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void async_copy16(unsigned smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem) : "memory");
}
__device__ __forceinline__ void async_copy4(unsigned smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem), "l"(gmem) : "memory");
}
// One 16-byte shared load (the compiler split plain uint4 reads of the ring into 4- and 8-byte
// ones); volatile keeps it after the cp.async.wait_group before it.
__device__ __forceinline__ uint4 lds16(unsigned smem) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(smem));
  return v;
}
__device__ __forceinline__ float2 lds8f(unsigned smem) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(v.x), "=f"(v.y) : "r"(smem));
  return v;
}
__device__ __forceinline__ void async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// This thread's copies of all but the newest N committed groups have landed.
template <int N>
__device__ __forceinline__ void async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// The ring copy of the v6 kernels (layer-norm forward and backward): this lane's 16-byte words
// (columns v4_col(j, gl)) of the row at element offset `off` of each source, source i into
// [slot + i * row_bytes, ...) of shared memory; null sources are skipped.  The caller commits.
template <int V, int NV, int WPR, typename T>
__device__ __forceinline__ void ring_copy_row(unsigned slot, unsigned row_bytes, int64_t off,
                                              int64_t C, int gl, const T* s0, const T* s1,
                                              const T* s2 = nullptr) {
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int64_t c = v4_col<V, WPR>(j, gl);
    if (c < C) {
      const unsigned cb = slot + static_cast<unsigned>(c * sizeof(T));
      async_copy16(cb, s0 + off + c);
      if (s1) async_copy16(cb + row_bytes, s1 + off + c);
      if (s2) async_copy16(cb + 2 * row_bytes, s2 + off + c);
    }
  }
}

// ---- v5 / v6 row layout: dispatch_v4's column mapping (v4_col), at most kV5MaxNV vectors per
// lane, WPR = 1, 2, 4 or 8 warps per row -------------------------------------------------------
constexpr int kV5MaxNV = 3;  // 16-byte vectors per lane and array

// Runs f(ic<NV>, ic<WPR>) (which returns whether it launched) and returns its result, or false
// (f not run) where v5 does not apply: 8-byte elements, C % V != 0, a misaligned pointer, rows
// over 8 * 32 * kV5MaxNV vectors.
template <typename T, typename F>
inline bool dispatch_v5(int64_t C, std::initializer_list<const void*> ptrs, F&& f) {
  if constexpr (sizeof(T) == 8) {
    return false;
  } else {
    constexpr int V = static_cast<int>(16 / sizeof(T));
    if (!rows_in_words16<T>(C, ptrs)) return false;
    const int64_t nvec = C / V;
    auto by_nv = [&](auto wtag) {
      constexpr int WPR = decltype(wtag)::value;
      const int64_t nv = ceil_div(nvec, int64_t(32) * WPR);
      static_assert(kV5MaxNV == 3, "by_nv covers NV 1..3");
      if (nv <= 1) return static_cast<bool>(f(ic<1>{}, wtag));
      if (nv <= 2) return static_cast<bool>(f(ic<2>{}, wtag));
      return static_cast<bool>(f(ic<3>{}, wtag));
    };
    if (nvec <= 32 * kV5MaxNV) return by_nv(ic<1>{});
    if (nvec <= 64 * kV5MaxNV) return by_nv(ic<2>{});
    if (nvec <= 128 * kV5MaxNV) return by_nv(ic<4>{});
    if (nvec <= 256 * kV5MaxNV) return by_nv(ic<8>{});
    return false;
  }
}

}  // namespace bt::cuda::nn
