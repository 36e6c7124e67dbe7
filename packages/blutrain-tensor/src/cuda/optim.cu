// cuda/optim.cu: multi-tensor optimizer kernels (optim.h): AdamW, global gradient norm, clip
// coefficient, in-place scaling.
//
// Multi-tensor launches: the host builds a table of up to kMaxAdamW / kMaxList tensors (pointers,
// sizes, per-tensor weight decay, first block of each tensor) and passes it BY VALUE as a
// __grid_constant__ kernel parameter (CUDA 12.1+ allows 32 KB of parameters; the table is read
// from the constant bank, no copy to device memory, so a captured CUDA graph holds it too).  Each
// block owns one chunk of kOptimChunk elements of one tensor and finds its tensor by a binary
// search over the block starts.  Longer lists are split into several launches.
//
// Scalars that change between steps (lr, step, grad scale, clip coefficient) may live in device
// memory: thread 0 of each block reads them and derives the per-step coefficients (double
// precision, as the host would), so a graph replay picks up new values without re-capture.
//
// Float math uses explicit round-to-nearest intrinsics (no FMA contraction), in the same order as
// src/cpu/optim.cpp, so float32 results match the CPU backend bit for bit.
//
// Gradient norm: per-block partial sums of squares (float accumulation; double for float64) into
// a double buffer, then one block sums the partials in a fixed order: deterministic.
#include <algorithm>
#include <cmath>
#include <map>

#include "../backend.h"
#include "../optim.h"
#include "common.cuh"

namespace bt {

namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;
constexpr int kMaxAdamW = 448;  // tensors per AdamW launch
constexpr int kMaxList = 1024;  // tensors per norm / scale launch
static_assert(kOptimChunk % (kThreads * kVec) == 0, "chunk must be a multiple of a block's vector");

// ---- tables (kernel parameters) ---------------------------------------------------------------
struct AdamWTable {
  void* p[kMaxAdamW];
  const void* g[kMaxAdamW];
  void* m[kMaxAdamW];
  void* v[kMaxAdamW];
  int64_t numel[kMaxAdamW];
  double wd[kMaxAdamW];
  void* copy[kMaxAdamW];  // float32 params: the 16-bit cast to rewrite, or null
  int block_start[kMaxAdamW + 1];
  uint8_t vec[kMaxAdamW];        // all the pointers aligned for kVec-wide loads
  uint8_t copy_kind[kMaxAdamW];  // CopyKind
  int n;
};
enum CopyKind : uint8_t { kNoCopy = 0, kBf16Copy = 1, kHalfCopy = 2 };
struct ListTable {
  void* t[kMaxList];
  int64_t numel[kMaxList];
  int block_start[kMaxList + 1];
  uint8_t vec[kMaxList];
  int n;
};
// Kernel parameters must stay under 32764 bytes (CUDA 12.1+, Volta+); leave room for the rest.
static_assert(sizeof(AdamWTable) <= 31 * 1024, "AdamW table exceeds the kernel parameter limit");
static_assert(sizeof(ListTable) <= 31 * 1024, "list table exceeds the kernel parameter limit");

struct AdamWArgs {
  const float* lr_ptr;     // null: use lr
  const float* step_ptr;   // null: use step
  const float* scale_ptr;  // null: no grad scale
  double lr, step, beta1, beta2, eps;
  double step_size, bias2_sqrt;  // lr / (1 - beta1^step), sqrt(1 - beta2^step) when host-known
};

// ---- device helpers -----------------------------------------------------------------------------
template <typename T>
struct alignas(kVec * sizeof(T)) Vec {
  T v[kVec];
};

__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float sqrt_rn(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ double sqrt_rn(double a) { return __dsqrt_rn(a); }

// The tensor owning block b: the last i with block_start[i] <= b (tables hold no empty tensors).
__device__ __forceinline__ int find_tensor(const int* block_start, int n, int b) {
  int lo = 0, hi = n;
  while (hi - lo > 1) {
    const int mid = (lo + hi) >> 1;
    if (block_start[mid] <= b) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

template <typename M>
struct AdamWCoef {
  M step_size, b2s, gscale, dfac, b1c, b2, b2c, eps;
  bool use_scale, decay;
};

// One element, operation for operation as AdamW::eval_cpu.
template <typename M>
__device__ __forceinline__ void adamw_elem(M& p, M g, M& m, M& v, const AdamWCoef<M>& c) {
  if (c.use_scale) g = mul_rn(g, c.gscale);
  if (c.decay) p = mul_rn(p, c.dfac);
  m = add_rn(m, mul_rn(sub_rn(g, m), c.b1c));
  v = add_rn(mul_rn(v, c.b2), mul_rn(mul_rn(g, g), c.b2c));
  const M denom = add_rn(div_rn(sqrt_rn(v), c.b2s), c.eps);
  p = sub_rn(p, mul_rn(div_rn(m, denom), c.step_size));
}

// Per-step coefficients, from device scalars where given (called by one thread).
template <typename M>
__device__ __forceinline__ AdamWCoef<M> adamw_coef(const AdamWArgs& a, double wd) {
  double lr = a.lr, step_size = a.step_size, b2s = a.bias2_sqrt;
  if (a.lr_ptr || a.step_ptr) {
    if (a.lr_ptr) lr = static_cast<double>(*a.lr_ptr);
    const double step = a.step_ptr ? static_cast<double>(*a.step_ptr) : a.step;
    step_size = lr / (1.0 - pow(a.beta1, step));
    b2s = sqrt(1.0 - pow(a.beta2, step));
  }
  AdamWCoef<M> c;
  c.step_size = static_cast<M>(step_size);
  c.b2s = static_cast<M>(b2s);
  c.use_scale = a.scale_ptr != nullptr;
  c.gscale = c.use_scale ? static_cast<M>(*a.scale_ptr) : M(1);
  c.decay = wd != 0;
  c.dfac = static_cast<M>(1.0 - lr * wd);
  c.b1c = static_cast<M>(1.0 - a.beta1);
  c.b2 = static_cast<M>(a.beta2);
  c.b2c = static_cast<M>(1.0 - a.beta2);
  c.eps = static_cast<M>(a.eps);
  return c;
}

// The updated float32 param's cast into its kept 16-bit copy (Note [cached casts]): the same
// round-to-nearest conversion as the astype kernel's.
template <typename T>
__device__ __forceinline__ void store_copy(void* copy, int kind, int64_t i, T p) {
  if constexpr (std::is_same_v<T, float>) {
    if (kind == kBf16Copy) static_cast<__nv_bfloat16*>(copy)[i] = convert<__nv_bfloat16>(p);
    if (kind == kHalfCopy) static_cast<__half*>(copy)[i] = convert<__half>(p);
  }
}
template <typename C, typename T>
__device__ __forceinline__ void store_copy_vec(void* copy, int64_t i, const Vec<T>& p) {
  Vec<C> c;
#pragma unroll
  for (int k = 0; k < kVec; ++k) c.v[k] = convert<C>(p.v[k]);
  *reinterpret_cast<Vec<C>*>(static_cast<C*>(copy) + i) = c;
}
template <typename T>
__device__ __forceinline__ void store_copy(void* copy, int kind, int64_t i, const Vec<T>& p) {
  if constexpr (std::is_same_v<T, float>) {
    if (kind == kBf16Copy) store_copy_vec<__nv_bfloat16>(copy, i, p);
    if (kind == kHalfCopy) store_copy_vec<__half>(copy, i, p);
  }
}

// ---- kernels ----------------------------------------------------------------------------------
// v1: the simple reference: one launch per tensor, one element per thread, scalar loads.
template <typename T, typename S>
__global__ void adamw_kernel_v1(T* p, const T* g, S* m, S* v, int64_t n, double wd, void* copy,
                                int copy_kind, const AdamWArgs a) {
  using M = math_t<T>;
  const AdamWCoef<M> c = adamw_coef<M>(a, wd);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    M pi = convert<M>(p[i]), mi = static_cast<M>(m[i]), vi = static_cast<M>(v[i]);
    adamw_elem<M>(pi, convert<M>(g[i]), mi, vi, c);
    p[i] = convert<T>(pi);
    m[i] = static_cast<S>(mi);
    v[i] = static_cast<S>(vi);
    store_copy(copy, copy_kind, i, p[i]);
  }
}

// v2: multi-tensor, one chunk per block, kVec-wide loads where the tensor's pointers allow.
template <typename T, typename S>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel_v2(const __grid_constant__ AdamWTable tab, const AdamWArgs a) {
  using M = math_t<T>;
  __shared__ AdamWCoef<M> s_coef;
  const int b = blockIdx.x;
  const int t = find_tensor(tab.block_start, tab.n, b);
  if (threadIdx.x == 0) s_coef = adamw_coef<M>(a, tab.wd[t]);
  __syncthreads();
  const AdamWCoef<M> c = s_coef;
  T* p = static_cast<T*>(tab.p[t]);
  const T* g = static_cast<const T*>(tab.g[t]);
  S* m = static_cast<S*>(tab.m[t]);
  S* v = static_cast<S*>(tab.v[t]);
  void* copy = tab.copy[t];
  const int copy_kind = tab.copy_kind[t];
  const int64_t start = static_cast<int64_t>(b - tab.block_start[t]) * kOptimChunk;
  const int64_t end = min(tab.numel[t], start + kOptimChunk);
  int64_t tail = start;
  if (tab.vec[t]) {
    tail = start + (end - start) / kVec * kVec;
    for (int64_t i = start + threadIdx.x * kVec; i < tail; i += kThreads * kVec) {
      Vec<T> pv = *reinterpret_cast<const Vec<T>*>(p + i);
      const Vec<T> gv = *reinterpret_cast<const Vec<T>*>(g + i);
      Vec<S> mv = *reinterpret_cast<const Vec<S>*>(m + i);
      Vec<S> vv = *reinterpret_cast<const Vec<S>*>(v + i);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        M pk = convert<M>(pv.v[k]), mk = static_cast<M>(mv.v[k]), vk = static_cast<M>(vv.v[k]);
        adamw_elem<M>(pk, convert<M>(gv.v[k]), mk, vk, c);
        pv.v[k] = convert<T>(pk);
        mv.v[k] = static_cast<S>(mk);
        vv.v[k] = static_cast<S>(vk);
      }
      *reinterpret_cast<Vec<T>*>(p + i) = pv;
      *reinterpret_cast<Vec<S>*>(m + i) = mv;
      *reinterpret_cast<Vec<S>*>(v + i) = vv;
      store_copy(copy, copy_kind, i, pv);
    }
  }
  for (int64_t i = tail + threadIdx.x; i < end; i += kThreads) {
    M pi = convert<M>(p[i]), mi = static_cast<M>(m[i]), vi = static_cast<M>(v[i]);
    adamw_elem<M>(pi, convert<M>(g[i]), mi, vi, c);
    p[i] = convert<T>(pi);
    m[i] = static_cast<S>(mi);
    v[i] = static_cast<S>(vi);
    store_copy(copy, copy_kind, i, p[i]);
  }
}

// Stage 1 of the norm: partials[b] = sum of squares of block b's chunk (A = float or double).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    sumsq_partials_kernel(const __grid_constant__ ListTable tab, double* partials) {
  using A = math_t<T>;
  __shared__ A scratch[32];
  const int b = blockIdx.x;
  const int t = find_tensor(tab.block_start, tab.n, b);
  const T* x = static_cast<const T*>(tab.t[t]);
  const int64_t start = static_cast<int64_t>(b - tab.block_start[t]) * kOptimChunk;
  const int64_t end = min(tab.numel[t], start + kOptimChunk);
  A s = 0;
  int64_t tail = start;
  if (tab.vec[t]) {
    tail = start + (end - start) / kVec * kVec;
    for (int64_t i = start + threadIdx.x * kVec; i < tail; i += kThreads * kVec) {
      const Vec<T> xv = *reinterpret_cast<const Vec<T>*>(x + i);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const A y = convert<A>(xv.v[k]);
        s += y * y;
      }
    }
  }
  for (int64_t i = tail + threadIdx.x; i < end; i += kThreads) {
    const A y = convert<A>(x[i]);
    s += y * y;
  }
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) partials[b] = static_cast<double>(s);
}

// Stage 2: one block sums the partials in a fixed order, out = sqrt(total).
template <typename O>
__global__ void __launch_bounds__(1024)
    norm_finish_kernel(const double* partials, int64_t n, O* out) {
  __shared__ double scratch[32];
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += partials[i];
  s = block_sum(s, scratch);
  if (threadIdx.x == 0) *out = static_cast<O>(sqrt(s));
}

// min(max_norm / (norm + eps), 1) in float, NaN propagating (as ClipCoef::eval_cpu).
template <typename N>
__global__ void clip_coef_kernel(const N* norm, float max_norm, float eps, float* out) {
  const float n = static_cast<float>(convert<float>(*norm));
  const float c = __fdiv_rn(max_norm, __fadd_rn(n, eps));
  *out = (c < 1.0f || c != c) ? c : 1.0f;
}

// x *= T(coef) in the math type (as mul(x, astype(coef, x.dtype()))).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    scale_kernel(const __grid_constant__ ListTable tab, const float* coef) {
  using M = math_t<T>;
  const M c = convert<M>(convert<T>(*coef));
  if (c == M(1)) return;  // x * 1 = x: loss.backward()'s unit seed, a clip that did not clip
  const int b = blockIdx.x;
  const int t = find_tensor(tab.block_start, tab.n, b);
  T* x = static_cast<T*>(tab.t[t]);
  const int64_t start = static_cast<int64_t>(b - tab.block_start[t]) * kOptimChunk;
  const int64_t end = min(tab.numel[t], start + kOptimChunk);
  int64_t tail = start;
  if (tab.vec[t]) {
    tail = start + (end - start) / kVec * kVec;
    for (int64_t i = start + threadIdx.x * kVec; i < tail; i += kThreads * kVec) {
      Vec<T> xv = *reinterpret_cast<const Vec<T>*>(x + i);
#pragma unroll
      for (int k = 0; k < kVec; ++k) xv.v[k] = convert<T>(mul_rn(convert<M>(xv.v[k]), c));
      *reinterpret_cast<Vec<T>*>(x + i) = xv;
    }
  }
  for (int64_t i = tail + threadIdx.x; i < end; i += kThreads) {
    x[i] = convert<T>(mul_rn(convert<M>(x[i]), c));
  }
}

// ---- launchers --------------------------------------------------------------------------------
bool aligned(const void* ptr, size_t elem) {
  return reinterpret_cast<uintptr_t>(ptr) % (kVec * elem) == 0;
}
int chunks_of(int64_t numel) { return static_cast<int>(ceil_div(numel, kOptimChunk)); }

// Calls launch(table, blocks, first_block) once per table of at most Max tensors / INT_MAX blocks.
template <typename Table, int Max, typename Fill, typename Launch>
void for_each_table(const std::vector<size_t>& idx, const std::vector<int64_t>& numel, Fill&& fill,
                    Launch&& launch) {
  Table tab;
  tab.n = 0;
  int blocks = 0;
  int64_t first = 0;
  auto flush = [&]() {
    if (tab.n == 0) return;
    tab.block_start[tab.n] = blocks;
    launch(tab, blocks, first);
    first += blocks;
    tab.n = 0;
    blocks = 0;
  };
  for (size_t i : idx) {
    const int nb = chunks_of(numel[i]);
    if (tab.n == Max || static_cast<int64_t>(blocks) + nb > (int64_t{1} << 30)) flush();
    fill(tab, tab.n, i);
    tab.numel[tab.n] = numel[i];
    tab.block_start[tab.n] = blocks;
    blocks += nb;
    ++tab.n;
  }
  flush();
}

}  // namespace
}  // namespace cuda

void AdamW::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>&) {
  using namespace cuda;
  const Device dev = in[0].device();
  cudaStream_t st = stream(dev, name());
  size_t k = has_copies ? 5 * n : 4 * n;
  AdamWArgs a{};
  a.lr = lr;
  a.step = step;
  a.beta1 = beta1;
  a.beta2 = beta2;
  a.eps = eps;
  a.lr_ptr = has_lr ? in[k++].data<float>(name()) : nullptr;
  a.step_ptr = has_step ? in[k++].data<float>(name()) : nullptr;
  a.scale_ptr = has_scale ? in[k++].data<float>(name()) : nullptr;
  a.step_size = lr / (1.0 - std::pow(beta1, step));
  a.bias2_sqrt = std::sqrt(1.0 - std::pow(beta2, step));
  std::vector<size_t> idx;
  std::vector<int64_t> numel(n);
  for (size_t i = 0; i < n; ++i) {
    numel[i] = in[i].numel();
    if (numel[i] > 0) idx.push_back(i);
  }
  if (idx.empty()) return;
  // The kept 16-bit cast of param i (float32 params only), or null.
  auto copy_of = [&](size_t i) -> std::pair<void*, uint8_t> {
    if (!has_copies || in[0].dtype() != DType::Float32 || !in[4 * n + i].defined()) {
      return {nullptr, kNoCopy};
    }
    const Tensor& c = in[4 * n + i];
    return {c.data_ptr(name()), c.dtype() == DType::BFloat16 ? kBf16Copy : kHalfCopy};
  };
  dispatch_cuda_float(in[0].dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
    if (optim_kernel_version() == 1) {
      for (size_t i : idx) {
        const int blocks = elementwise_blocks(numel[i], kThreads, dev.index);
        const auto [copy, kind] = copy_of(i);
        adamw_kernel_v1<T, S><<<blocks, kThreads, 0, st>>>(
            in[i].data<T>(name()), in[n + i].data<T>(name()), in[2 * n + i].data<S>(name()),
            in[3 * n + i].data<S>(name()), numel[i], weight_decays[i], copy, kind, a);
        BT_CUDA_LAUNCH_CHECK(name());
      }
      return;
    }
    for_each_table<AdamWTable, kMaxAdamW>(
        idx, numel,
        [&](AdamWTable& tab, int j, size_t i) {
          tab.p[j] = in[i].data_ptr(name());
          tab.g[j] = in[n + i].data_ptr(name());
          tab.m[j] = in[2 * n + i].data_ptr(name());
          tab.v[j] = in[3 * n + i].data_ptr(name());
          tab.wd[j] = weight_decays[i];
          const auto [copy, kind] = copy_of(i);
          tab.copy[j] = copy;
          tab.copy_kind[j] = kind;
          tab.vec[j] = aligned(tab.p[j], sizeof(T)) && aligned(tab.g[j], sizeof(T)) &&
                       aligned(tab.m[j], sizeof(S)) && aligned(tab.v[j], sizeof(S)) &&
                       (!copy || aligned(copy, 2));
        },
        [&](const AdamWTable& tab, int blocks, int64_t) {
          adamw_kernel_v2<T, S><<<blocks, kThreads, 0, st>>>(tab, a);
          BT_CUDA_LAUNCH_CHECK(name());
        });
  });
}

void GradNorm::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  using namespace cuda;
  const Device dev = out[0].device();
  cudaStream_t st = stream(dev, name());
  // Group by dtype (in list order within a group: the reduction order is fixed by the list).
  std::map<DType, std::vector<size_t>> groups;
  std::vector<int64_t> numel(in.size());
  int64_t total_blocks = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    numel[i] = in[i].numel();
    if (numel[i] == 0) continue;
    groups[in[i].dtype()].push_back(i);
    total_blocks += chunks_of(numel[i]);
  }
  Tensor partials = empty_tensor({std::max<int64_t>(total_blocks, 1)}, DType::Float64, dev, name());
  double* pp = partials.data<double>(name());
  int64_t base = 0;
  for (auto& grp : groups) {
    const std::vector<size_t>& idx = grp.second;
    dispatch_cuda_float(grp.first, name(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      for_each_table<ListTable, kMaxList>(
          idx, numel,
          [&](ListTable& tab, int j, size_t i) {
            tab.t[j] = in[i].data_ptr(name());
            tab.vec[j] = aligned(tab.t[j], sizeof(T));
          },
          [&](const ListTable& tab, int blocks, int64_t) {
            sumsq_partials_kernel<T><<<blocks, kThreads, 0, st>>>(tab, pp + base);
            BT_CUDA_LAUNCH_CHECK(name());
            base += blocks;
          });
    });
  }
  if (out[0].dtype() == DType::Float64) {
    norm_finish_kernel<double><<<1, 1024, 0, st>>>(pp, total_blocks, out[0].data<double>(name()));
  } else {
    norm_finish_kernel<float><<<1, 1024, 0, st>>>(pp, total_blocks, out[0].data<float>(name()));
  }
  BT_CUDA_LAUNCH_CHECK(name());
}

void ClipCoef::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  using namespace cuda;
  cudaStream_t st = stream(out[0].device(), name());
  dispatch_cuda_float(in[0].dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    clip_coef_kernel<T><<<1, 1, 0, st>>>(in[0].data<T>(name()), static_cast<float>(max_norm),
                                         static_cast<float>(eps), out[0].data<float>(name()));
    BT_CUDA_LAUNCH_CHECK(name());
  });
}

void ScaleInplace::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>&) {
  using namespace cuda;
  const size_t n = in.size() - 1;
  const Device dev = in[n].device();
  cudaStream_t st = stream(dev, name());
  const float* coef = in[n].data<float>(name());
  std::map<DType, std::vector<size_t>> groups;
  std::vector<int64_t> numel(n);
  for (size_t i = 0; i < n; ++i) {
    numel[i] = in[i].numel();
    if (numel[i] > 0) groups[in[i].dtype()].push_back(i);
  }
  for (auto& grp : groups) {
    const std::vector<size_t>& idx = grp.second;
    dispatch_cuda_float(grp.first, name(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      for_each_table<ListTable, kMaxList>(
          idx, numel,
          [&](ListTable& tab, int j, size_t i) {
            tab.t[j] = in[i].data_ptr(name());
            tab.vec[j] = aligned(tab.t[j], sizeof(T));
          },
          [&](const ListTable& tab, int blocks, int64_t) {
            scale_kernel<T><<<blocks, kThreads, 0, st>>>(tab, coef);
            BT_CUDA_LAUNCH_CHECK(name());
          });
    });
  }
}

}  // namespace bt
