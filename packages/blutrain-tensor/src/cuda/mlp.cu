// cuda/mlp.cu: the GELU MLP's elementwise backward (linear_gelu_linear, src/autocast.h).
//
// du = dh * gelu_tanh'(pre), in place on dh (the fresh output of the dh = dy W2 GEMM), and with
// bgrad db = column sums of du. It replaces cuBLASLt's DGELU(_BGRAD) epilogue, which on sm_90
// runs as a separate kernel at ~1 TB/s; this one reads dh and pre and writes du once (16-byte
// vectors) and folds the column sums into the same pass:
//   - v1 (reference, any shape/alignment): one element per iteration, then a column-sum kernel
//     (one thread per column, rows in order);
//   - v2 (N a multiple of the vector width, 16-byte aligned rows): a block covers 32 column
//     vectors x 8 rows of a 64-row chunk (GPT-2: 3072 blocks, so the last wave is a small
//     fraction); each thread accumulates its columns over its rows, the 8 row-threads are summed
//     in shared memory in a fixed order, one partial row per chunk; a second kernel sums the
//     chunks in a fixed order. The chunking depends only on (M, N), so db is bitwise
//     deterministic (no atomics).  On sm_90+ the second kernel launches as a programmatic
//     dependent of the first (resident and waiting when the first ends: ~1-2 us a pair, 48 pairs
//     a GPT-2 step).  With the GELU each thread keeps U = 2 rows' loads in flight (a batch's
//     loads go out before any math or store; registers capped at 80, 3 blocks an SM: U = 4
//     spilled there), 4% faster than one row at a time (BT_CUDA_DGELU_ROWS=1, read per call);
//     the column sums alone keep U = 1 (U = 4 measured 9% slower: fewer resident warps).  The
//     sums take the rows in the same order for every U (the same db bits).
// Math in float for 16-bit and float32 (double for float64), as the CPU's gelu_tanh_backward.
// column_sums runs v2's column-sum pass alone: a linear layer's bias gradient on CUDA (in place
// of cuBLASLt's BGRAD epilogue, which runs as a separate kernel that re-reads the gradient at
// about half of this one's speed; BLUTRAIN_BGRAD=cublaslt keeps it).
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>

#include "../autocast.h"
#include "../backend.h"
#include "common.cuh"

namespace bt {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kColThreads = 32;  // threads along the columns of a v2 block (one warp)
constexpr int kRowThreads = 8;   // threads along the rows
constexpr int kChunkRows = 64;   // rows per v2 chunk (grows when M needs > 65535 chunks)

// ================================ kernels ======================================================

// gelu_tanh'(x) = 0.5 (1 + t) + 0.5 k x (1 - t^2) (1 + 3 c x^2), t = tanh(k (x + c x^3)).
template <typename C>
__device__ __forceinline__ C gelu_tanh_grad(C x) {
  const C k = C(0.7978845608028654), c = C(0.044715);
  const C x2 = x * x;
  const C t = tanh(k * x * (C(1) + c * x2));
  return C(0.5) * (C(1) + t) + C(0.5) * k * x * (C(1) - t * t) * (C(1) + C(3) * c * x2);
}

// v1: d[i] = d[i] * gelu'(pre[i]), one element per iteration.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    dgelu_v1(int64_t n, T* __restrict__ d, const T* __restrict__ pre) {
  using C = math_t<T>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    d[i] = convert<T>(convert<C>(d[i]) * gelu_tanh_grad(convert<C>(pre[i])));
  }
}

// v1 column sums: db[j] = sum_i d[i, j], rows in order (the reference for v2's db); db in T or
// float32 (B).
template <typename T, typename B = T>
__global__ void __launch_bounds__(kThreads)
    column_sum_v1(int64_t M, int64_t N, const T* __restrict__ d, B* __restrict__ db) {
  using C = math_t<T>;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= N) return;
  C s = C(0);
  for (int64_t i = 0; i < M; ++i) s += convert<C>(d[i * N + j]);
  db[j] = convert<B>(s);
}

template <int N, typename T>
struct alignas(16) Pack {
  T v[N];
};

// v2: block (kColThreads, kRowThreads) over columns [blockIdx.x * 32 * V, +32 V) and rows
// [blockIdx.y * chunk, +chunk); V = 16 bytes of T; each thread loads U of its rows, then works
// on them (rows r, r + 8, ..., in order). With BGRAD, writes partial[blockIdx.y, :] =
// column sums of the rounded du over the chunk (threads' rows summed in a fixed order).  Without
// GELU (a linear layer's bias gradient): only the column sums of d, which is left as it is.
template <typename T, bool BGRAD, bool GELU = true, int U = GELU ? 2 : 1>
__global__ void __launch_bounds__(kColThreads* kRowThreads, U > 1 ? 3 : 0)
    dgelu_v2(int64_t M, int64_t N, int64_t chunk, T* __restrict__ d, const T* __restrict__ pre,
             math_t<T>* __restrict__ partial) {
  static_assert(BGRAD || GELU, "nothing to do");
  using C = math_t<T>;
  constexpr int V = 16 / sizeof(T);
  using P = Pack<V, T>;
  __shared__ C red[BGRAD ? kRowThreads : 1][BGRAD ? kColThreads * V : 1];
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * kColThreads + threadIdx.x) * V;
  const bool col_ok = col < N;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * chunk;
  const int64_t r1 = r0 + chunk < M ? r0 + chunk : M;
  C acc[V];
#pragma unroll
  for (int k = 0; k < V; ++k) acc[k] = C(0);
  if (col_ok) {
    for (int64_t r = r0 + threadIdx.y; r < r1; r += int64_t(kRowThreads) * U) {
      P g[U], x[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {  // the batch's loads first: U rows in flight
        const int64_t ru = r + u * kRowThreads;
        if (ru < r1) {
          g[u] = *reinterpret_cast<const P*>(d + ru * N + col);
          if constexpr (GELU) x[u] = *reinterpret_cast<const P*>(pre + ru * N + col);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t ru = r + u * kRowThreads;
        if (ru >= r1) break;
        if constexpr (GELU) {
          P o;
#pragma unroll
          for (int k = 0; k < V; ++k) {
            o.v[k] = convert<T>(convert<C>(g[u].v[k]) * gelu_tanh_grad(convert<C>(x[u].v[k])));
            if constexpr (BGRAD) acc[k] += convert<C>(o.v[k]);
          }
          *reinterpret_cast<P*>(d + ru * N + col) = o;
        } else {
#pragma unroll
          for (int k = 0; k < V; ++k) acc[k] += convert<C>(g[u].v[k]);
        }
      }
    }
  }
  if constexpr (BGRAD) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // column_sum_partials may launch now; it waits for this grid's end
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
#pragma unroll
    for (int k = 0; k < V; ++k) red[threadIdx.y][threadIdx.x * V + k] = acc[k];
    __syncthreads();
    // Thread (x, y) finalises columns y, y + 8, ... of the block's 32 V (fixed order over rows).
    for (int c = threadIdx.y * kColThreads + threadIdx.x; c < kColThreads * V;
         c += kColThreads * kRowThreads) {
      const int64_t j = static_cast<int64_t>(blockIdx.x) * kColThreads * V + c;
      if (j < N) {
        C s = C(0);
#pragma unroll
        for (int y = 0; y < kRowThreads; ++y) s += red[y][c];
        partial[static_cast<int64_t>(blockIdx.y) * N + j] = s;
      }
    }
  }
}

// db[j] = sum over chunks of partial[c, j]: block (32 columns, 8 lanes); lane l sums chunks l,
// l + 8, ... in order, then the 8 lanes are added in order (a fixed tree: deterministic).
template <typename T, typename B = T>
__global__ void __launch_bounds__(kColThreads* kRowThreads)
    column_sum_partials(int64_t chunks, int64_t N, const math_t<T>* __restrict__ partial,
                        B* __restrict__ db) {
  using C = math_t<T>;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  // a programmatic dependent of dgelu_v2: wait for its partials (a no-op in a plain launch)
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  __shared__ C red[kRowThreads][kColThreads];
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kColThreads + threadIdx.x;
  C s = C(0);
  if (j < N) {
    for (int64_t c = threadIdx.y; c < chunks; c += kRowThreads) s += partial[c * N + j];
  }
  red[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && j < N) {
    C t = C(0);
#pragma unroll
    for (int y = 0; y < kRowThreads; ++y) t += red[y][threadIdx.x];
    db[j] = convert<B>(t);
  }
}

// ================================ launchers ====================================================

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// db = the chunks' partial sums added, as a programmatic dependent of the dgelu_v2 launch just
// before it on `st` (compute capability 9+; a plain launch elsewhere).
template <typename T, typename B>
void launch_column_sum_partials(int64_t chunks, int64_t N, const math_t<T>* partial, B* db,
                                cudaStream_t st, int device, const char* op) {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute at;
  cfg.gridDim = dim3(static_cast<unsigned>(ceil_div(N, kColThreads)));
  cfg.blockDim = dim3(kColThreads, kRowThreads);
  cfg.stream = st;
  if (device_info(device).major >= 9) {
    at.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at.val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = &at;
    cfg.numAttrs = 1;
  }
  BT_CUDA_CHECK(op, cudaLaunchKernelEx(&cfg, column_sum_partials<T, B>, chunks, N, partial, db));
}

// Rows a v2 GELU thread keeps in flight: 2, or 1 with BT_CUDA_DGELU_ROWS=1 (read per call: tests
// and the benchmark compare the two).
bool v2_batched() {
  const char* e = std::getenv("BT_CUDA_DGELU_ROWS");
  return !(e && std::string(e) == "1");
}

// The v2 grid: chunks of rows that depend only on (M, N) (the same db bits on every run).
int64_t v2_chunk_rows(int64_t M) {
  int64_t chunk = kChunkRows;
  if (ceil_div(M, chunk) > 65535) chunk = ceil_div(ceil_div(M, 65535), kRowThreads) * kRowThreads;
  return chunk;
}

}  // namespace

bool bias_grad_by_kernel() {
  const char* e = std::getenv("BLUTRAIN_BGRAD");  // read per call: tests switch it
  return !(e && std::string(e) == "cublaslt");
}

bool column_sums_apply(const Tensor& g) {
  if (g.ndim() != 2 || !g.is_contiguous() || g.dtype() == DType::Float64 ||
      !is_floating(g.dtype()) || g.shape()[0] == 0) {
    return false;
  }
  const int64_t V = 16 / static_cast<int64_t>(itemsize(g.dtype()));
  return g.shape()[1] % V == 0 && aligned16(g.data_ptr("column_sums"));
}

void column_sums(const Tensor& g, const Tensor& db, const char* op) {
  const int64_t M = g.shape()[0], N = g.shape()[1];
  if (!column_sums_apply(g) || db.shape() != Shape{N} || !db.is_contiguous() ||
      (db.dtype() != g.dtype() && db.dtype() != DType::Float32)) {
    throw RuntimeError(std::string("[") + op + "] internal: column_sums got " +
                       shape_str(g.shape()) + " and " + shape_str(db.shape()));
  }
  if (N == 0) return;
  cudaStream_t st = stream(g.device(), op);
  dispatch_cuda_float(g.dtype(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = math_t<T>;
    constexpr int V = 16 / sizeof(T);
    const int64_t chunk = v2_chunk_rows(M), chunks = ceil_div(M, chunk);
    const dim3 grid(static_cast<unsigned>(ceil_div(N / V, kColThreads)),
                    static_cast<unsigned>(chunks));
    const dim3 block(kColThreads, kRowThreads);
    Tensor partial = empty_tensor({chunks, N}, DType::Float32, g.device(), op);
    C* pa = static_cast<C*>(partial.data_ptr(op));
    dgelu_v2<T, true, false>
        <<<grid, block, 0, st>>>(M, N, chunk, static_cast<T*>(g.data_ptr(op)), nullptr, pa);
    BT_CUDA_LAUNCH_CHECK(op);
    const int dev = g.device().index;
    if (db.dtype() == g.dtype()) {
      launch_column_sum_partials<T, T>(chunks, N, pa, db.data<T>(op), st, dev, op);
    } else {
      launch_column_sum_partials<T, float>(chunks, N, pa, db.data<float>(op), st, dev, op);
    }
  });
}

void column_sums_any(const Tensor& g, const Tensor& db, const char* op) {
  if (column_sums_apply(g)) return column_sums(g, db, op);
  const int64_t M = g.shape()[0], N = g.shape()[1];
  if (N == 0) return;
  cudaStream_t st = stream(g.device(), op);
  if (M == 0) {
    BT_CUDA_CHECK(op, cudaMemsetAsync(db.data_ptr(op), 0, db.numel() * itemsize(db.dtype()), st));
    return;
  }
  dispatch_cuda_float(g.dtype(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* gp = static_cast<const T*>(g.data_ptr(op));
    const unsigned blocks = static_cast<unsigned>(ceil_div(N, kThreads));
    if (db.dtype() == g.dtype()) {
      column_sum_v1<T><<<blocks, kThreads, 0, st>>>(M, N, gp, db.data<T>(op));
    } else {
      column_sum_v1<T, float><<<blocks, kThreads, 0, st>>>(M, N, gp, db.data<float>(op));
    }
    BT_CUDA_LAUNCH_CHECK(op);
  });
}

void gelu_tanh_backward_inplace(const Tensor& d, const Tensor& pre, const Tensor& db,
                                const char* op) {
  if (d.ndim() != 2 || pre.shape() != d.shape() || !d.is_contiguous() || !pre.is_contiguous() ||
      pre.dtype() != d.dtype() ||
      (db.defined() && (db.shape() != Shape{d.shape()[1]} ||
                        (db.dtype() != d.dtype() && db.dtype() != DType::Float32)))) {
    throw RuntimeError(std::string("[") + op +
                       "] internal: dgelu expects contiguous (M, N) dh and pre of one dtype, got " +
                       shape_str(d.shape()) + " and " + shape_str(pre.shape()));
  }
  const int64_t M = d.shape()[0], N = d.shape()[1];
  if (N == 0) return;
  cudaStream_t st = stream(d.device(), op);
  const int dev = d.device().index;
  dispatch_cuda_float(d.dtype(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = math_t<T>;
    constexpr int V = 16 / sizeof(T);
    // db in d's dtype, or float32 for a float32 master (Note [cached casts]): bp or bp32
    const bool wide = db.defined() && db.dtype() != d.dtype();
    T* bp = db.defined() && !wide ? static_cast<T*>(db.data_ptr(op)) : nullptr;
    float* bp32 = wide ? static_cast<float*>(db.data_ptr(op)) : nullptr;
    if (M == 0) {  // column sums over no rows
      if (db.defined())
        BT_CUDA_CHECK(op,
                      cudaMemsetAsync(db.data_ptr(op), 0, db.numel() * itemsize(db.dtype()), st));
      return;
    }
    T* dp = static_cast<T*>(d.data_ptr(op));
    const T* pp = static_cast<const T*>(pre.data_ptr(op));
    const bool v2 = lgl_impl() != LglImpl::KernelV1 && N % V == 0 && aligned16(dp) && aligned16(pp);
    if (!v2) {
      const int blocks = elementwise_blocks(M * N, kThreads, dev);
      dgelu_v1<T><<<blocks, kThreads, 0, st>>>(M * N, dp, pp);
      BT_CUDA_LAUNCH_CHECK(op);
      const unsigned blocks_n = static_cast<unsigned>(ceil_div(N, kThreads));
      if (bp) column_sum_v1<T><<<blocks_n, kThreads, 0, st>>>(M, N, dp, bp);
      if (bp32) column_sum_v1<T, float><<<blocks_n, kThreads, 0, st>>>(M, N, dp, bp32);
      if (db.defined()) BT_CUDA_LAUNCH_CHECK(op);
      return;
    }
    // Chunks depend only on (M, N): the same grid, hence the same db bits, on every run.
    const int64_t chunk = v2_chunk_rows(M);
    const int64_t chunks = ceil_div(M, chunk);
    const dim3 grid(static_cast<unsigned>(ceil_div(N / V, kColThreads)),
                    static_cast<unsigned>(chunks));
    const dim3 block(kColThreads, kRowThreads);
    if (db.defined()) {
      const DType acc_dt = std::is_same<C, double>::value ? DType::Float64 : DType::Float32;
      Tensor partial = empty_tensor({chunks, N}, acc_dt, d.device(), op);
      C* pa = static_cast<C*>(partial.data_ptr(op));
      if (v2_batched()) {
        dgelu_v2<T, true><<<grid, block, 0, st>>>(M, N, chunk, dp, pp, pa);
      } else {
        dgelu_v2<T, true, true, 1><<<grid, block, 0, st>>>(M, N, chunk, dp, pp, pa);
      }
      BT_CUDA_LAUNCH_CHECK(op);
      if (bp) launch_column_sum_partials<T, T>(chunks, N, pa, bp, st, dev, op);
      if (bp32) launch_column_sum_partials<T, float>(chunks, N, pa, bp32, st, dev, op);
    } else {
      if (v2_batched()) {
        dgelu_v2<T, false><<<grid, block, 0, st>>>(M, N, chunk, dp, pp, nullptr);
      } else {
        dgelu_v2<T, false, true, 1><<<grid, block, 0, st>>>(M, N, chunk, dp, pp, nullptr);
      }
      BT_CUDA_LAUNCH_CHECK(op);
    }
  });
}

}  // namespace cuda
}  // namespace bt
