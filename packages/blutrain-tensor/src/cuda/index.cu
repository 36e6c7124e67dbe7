// cuda/index.cu: index_select, index_add, gather, scatter_add and cat on CUDA.
//
// Semantics are the CPU's (src/cpu/index.cpp).  Inputs may be strided views (StridedOffset); the
// output is contiguous.
//
// Index range policy (no host sync in a kernel path): indices are checked on the device.  An
// out-of-range index never touches memory: index_select/gather write 0 for that element,
// index_add/scatter_add skip it.  The first bad index is recorded in a per-device error record
// (op, value, size); bt::cuda::check_index_errors(device) reads and clears it and raises
// IndexError("[op] index V is out of range for a dim of size S (detected on the GPU)").  It syncs
// the stream, so it belongs at points that synchronise anyway: the lead calls it from
// backend::synchronize() and from device-to-host copies (.item(), .numpy(), to("cpu")).  It costs
// nothing unless an index kernel was issued from the host since the last check (a per-device
// "armed" flag), so kernels replayed from a CUDA graph are only checked at the next eager index
// op's check.
//
// Determinism: index_add always runs a deterministic algorithm, and scatter_add does when
// bt::deterministic_algorithms() is on (otherwise it uses atomicAdd where the dtype has one).
// The deterministic scheme (embedding backward: weight (V, C), ~16k token ids with repeats):
//   1. keys = index value (invalid -> sentinel D, sorted last), values = position; stable
//      cub::DeviceRadixSort over the bits D needs.  Equal keys keep position order.
//   2. piece pass: sorted positions are cut into chunks of kChunk; per (chunk, column) a thread
//      sums each run of equal keys inside the chunk ("piece") in position order and writes the sum
//      to partial[piece start] (a piece never spans two chunks, so a hot index is split into
//      ~count/kChunk pieces processed in parallel).
//   3. segment pass: for the first position p of every key, per column: sum the pieces of the key
//      (at p, then at each following chunk start while the key continues), in order, and add the
//      total to the output row once.
// Sums run in float (double for float64, int64 for ints) and are added to the output once, so a
// 16-bit output is rounded once rather than after every add as on the CPU (within tolerance).
// scatter_add uses the same scheme with key = flat output offset and one column.
// BT_CUDA_INDEX_V1=1 (read per call) forces the scalar reference paths (index_select: one thread
// per element, no 16-byte row copies; index_add: one column per thread); the tests compare
// against it.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <cub/device/device_radix_sort.cuh>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "../backend.h"
#include "../primitives.h"
#include "common.cuh"
#include "device_errors.h"

namespace bt {
namespace cuda {
void check_index_errors(int device);
}  // namespace cuda

namespace {

using cuda::convert;
using cuda::math_t;
using cuda::StridedOffset;

enum IndexOpCode : int { kIndexSelect = 1, kIndexAdd, kGather, kScatterAdd };

using cuda::IndexErrorRecord;  // runtime.h (shared with nn.cu's cross_entropy target check)
__device__ IndexErrorRecord g_index_error;
std::atomic<bool> g_armed[cuda::kMaxDevices];  // an index kernel ran since the last check

void arm(const Tensor& t) { g_armed[t.device().index].store(true, std::memory_order_relaxed); }

// ---- kernels --------------------------------------------------------------------------------

__device__ __forceinline__ int64_t off_of(const StridedOffset& so, int64_t r) {
  if (so.ndim == 0) return r;
  if (so.ndim == 1) return r * so.strides[0];
  return so(r);
}

// The index at p, wrapped into [0, size); -1 (and the error record set) when out of range.
// `code`: cuda::device_error_code's (the kind and the op the user called); embedding's indices
// (kind kIndexErrorEmbedding) must be in [0, size).
template <typename I>
__device__ __forceinline__ int64_t load_index(const I* p, int64_t size, int code) {
  const int64_t v = static_cast<int64_t>(*p);
  const bool embedding = (code & cuda::kDeviceErrorKindMask) == cuda::kIndexErrorEmbedding;
  if (v < (embedding ? 0 : -size) || v >= size) {
    if (atomicCAS(&g_index_error.flag, 0, code) == 0) {
      g_index_error.value = v;
      g_index_error.size = size;
    }
    return -1;
  }
  return v < 0 ? v + size : v;
}

template <int ES>
struct bits {
  using type = std::conditional_t<
      ES == 1, uint8_t,
      std::conditional_t<ES == 2, uint16_t, std::conditional_t<ES == 4, uint32_t, uint64_t>>>;
};

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Vec {
  T v[VEC];
};

// out (outer, J, inner) = x[o, idx[j], i].  E is the copy unit (an element, or a uint4 of them
// when x is contiguous and rows are 16-byte multiples); inner counts E units.
template <typename E, typename I>
__global__ void index_select_kernel(const E* __restrict__ x, const I* __restrict__ idx,
                                    int64_t istride, E* __restrict__ out, int64_t n, int64_t J,
                                    int64_t D, int64_t inner, StridedOffset xoff, int code) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = e % inner, t = e / inner, j = t % J, o = t / J;
    const int64_t v = load_index(idx + j * istride, D, code);
    E r{};
    if (v >= 0) {
      r = x[off_of(xoff, (o * D + v) * inner + i)];
    }
    out[e] = r;
  }
}

// v2 of the above for long rows (the embedding forward): a block per output row (grid-stride over
// rows), threads over the row, so no per-element division; one index load per row.
template <typename E, typename I>
__global__ void index_select_rows_kernel(const E* __restrict__ x, const I* __restrict__ idx,
                                         int64_t istride, E* __restrict__ out, int64_t rows,
                                         int64_t J, int64_t D, int64_t inner, StridedOffset xoff,
                                         int code) {
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t j = row % J, o = row / J;
    const int64_t v = load_index(idx + j * istride, D, code);
    E* dst = out + row * inner;
    if (v < 0) {
      for (int64_t i = threadIdx.x; i < inner; i += blockDim.x) dst[i] = E{};
      continue;
    }
    const int64_t base = (o * D + v) * inner;
    if (xoff.ndim == 0) {
      const E* src = x + base;
      for (int64_t i = threadIdx.x; i < inner; i += blockDim.x) dst[i] = src[i];
    } else {
      for (int64_t i = threadIdx.x; i < inner; i += blockDim.x) dst[i] = x[off_of(xoff, base + i)];
    }
  }
}

struct GatherGeom {
  int nd;
  int dim;
  int64_t ishape[cuda::kMaxDims];
  int64_t istride[cuda::kMaxDims];
  int64_t xstride[cuda::kMaxDims];
  int64_t dsize;  // x.shape[dim]
  int code;       // the device error code (load_index)
};

// out[e] (shape of index) = x[coords of e with dim replaced by index[e]].
template <typename E, typename I>
__global__ void gather_kernel(const E* __restrict__ x, const I* __restrict__ idx,
                              E* __restrict__ out, int64_t n, GatherGeom g) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t rem = e, ioff = 0, xoff = 0, cd = 0;
    for (int d = g.nd - 1; d >= 0; --d) {
      const int64_t c = rem % g.ishape[d];
      rem /= g.ishape[d];
      ioff += c * g.istride[d];
      if (d == g.dim) {
        cd = c;
      } else {
        xoff += c * g.xstride[d];
      }
    }
    (void)cd;
    const int64_t v = load_index(idx + ioff, g.dsize, g.code);
    E r{};
    if (v >= 0) {
      r = x[xoff + v * g.xstride[g.dim]];
    }
    out[e] = r;
  }
}

// Strided -> contiguous copy of n elements (the base of index_add/scatter_add, cat pieces).
// dst element of source element e: (e / run) * dpitch + e % run (+ dst already offset).
template <typename E>
__global__ void copy_strided_kernel(const E* __restrict__ src, E* __restrict__ dst, int64_t n,
                                    StridedOffset soff, int64_t run, int64_t dpitch) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[(e / run) * dpitch + e % run] = src[off_of(soff, e)];
  }
}

// Sort keys for index_add: key = wrapped index (D when invalid), value = position.
template <typename I>
__global__ void index_keys_kernel(const I* __restrict__ idx, int64_t istride, int64_t J, int64_t D,
                                  unsigned long long* __restrict__ keys, int* __restrict__ vals,
                                  int code) {
  const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (j >= J) return;
  const int64_t v = load_index(idx + j * istride, D, code);
  keys[j] = v < 0 ? static_cast<unsigned long long>(D) : static_cast<unsigned long long>(v);
  vals[j] = static_cast<int>(j);
}

// The range check alone, for an op whose output is empty (Note [empty outputs check indices]).
template <typename I>
__global__ void check_index_kernel(const I* __restrict__ idx, int64_t n, StridedOffset ioff,
                                   int64_t size, int code) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    (void)load_index(idx + off_of(ioff, e), size, code);
  }
}

struct ScatterGeom {
  int nd;
  int dim;
  int64_t ishape[cuda::kMaxDims];
  int64_t istride[cuda::kMaxDims];
  int64_t ostride[cuda::kMaxDims];  // contiguous strides of the output
  int64_t dsize;
  int64_t onumel;
  int code;  // the device error code (load_index)
};

template <typename I>
__device__ __forceinline__ int64_t scatter_dest(const I* idx, int64_t e, const ScatterGeom& g) {
  int64_t rem = e, ioff = 0, off = 0;
  for (int d = g.nd - 1; d >= 0; --d) {
    const int64_t c = rem % g.ishape[d];
    rem /= g.ishape[d];
    ioff += c * g.istride[d];
    if (d != g.dim) off += c * g.ostride[d];
  }
  const int64_t v = load_index(idx + ioff, g.dsize, g.code);
  return v < 0 ? -1 : off + v * g.ostride[g.dim];
}

template <typename I>
__global__ void scatter_keys_kernel(const I* __restrict__ idx, int64_t n, ScatterGeom g,
                                    unsigned long long* __restrict__ keys, int* __restrict__ vals) {
  const int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (e >= n) return;
  const int64_t dst = scatter_dest(idx, e, g);
  keys[e] =
      dst < 0 ? static_cast<unsigned long long>(g.onumel) : static_cast<unsigned long long>(dst);
  vals[e] = static_cast<int>(e);
}

// Non-deterministic scatter_add: one atomicAdd per source element.
template <typename T, typename I>
__global__ void scatter_add_atomic_kernel(const T* __restrict__ src, StridedOffset soff,
                                          const I* __restrict__ idx, int64_t n, ScatterGeom g,
                                          T* __restrict__ out) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < n;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t dst = scatter_dest(idx, e, g);
    if (dst < 0) continue;
    const T v = src[off_of(soff, e)];
    if constexpr (std::is_same_v<T, int64_t>) {
      atomicAdd(reinterpret_cast<unsigned long long*>(out + dst),
                static_cast<unsigned long long>(v));
    } else {
      atomicAdd(out + dst, v);
    }
  }
}

// Accumulator of the index_add / scatter_add sums.
template <typename T>
using add_acc_t =
    std::conditional_t<std::is_same_v<T, double>, double,
                       std::conditional_t<std::is_floating_point_v<math_t<T>>, float, int64_t>>;

constexpr int kChunk = 16;  // sorted positions per piece-pass thread

// Geometry of the sorted add: items j in [0, J) (sorted: keys[p], vals[p]); columns c in
// [0, ncol) with ncol = outer * inner / VEC; the source element of (item j, column (o, i)) is
// src[soff((o * J + j) * inner + i)], the destination out[(o * D + key) * inner + i].
struct AddGeom {
  int64_t J, D, outer, inner, ncol;
};

template <typename T, int VEC>
__device__ __forceinline__ void load_src(const T* src, const StridedOffset& soff, int64_t lin,
                                         add_acc_t<T> (&v)[VEC]) {
  using A = add_acc_t<T>;
  if constexpr (VEC > 1) {
    const Vec<T, VEC> w = *reinterpret_cast<const Vec<T, VEC>*>(src + lin);
#pragma unroll
    for (int k = 0; k < VEC; ++k) v[k] = convert<A>(w.v[k]);
  } else {
    v[0] = convert<A>(src[off_of(soff, lin)]);
  }
}

// Piece pass (step 2 of the header): block per chunk of sorted positions, threads over columns.
template <typename T, int VEC>
__global__ void add_pieces_kernel(const T* __restrict__ src, StridedOffset soff,
                                  const unsigned long long* __restrict__ keys,
                                  const int* __restrict__ vals, AddGeom g,
                                  add_acc_t<T>* __restrict__ partial) {
  using A = add_acc_t<T>;
  const int64_t p0 = static_cast<int64_t>(blockIdx.x) * kChunk;
  const int64_t p1 = min(g.J, p0 + kChunk);
  const int64_t inner_v = g.inner / VEC;
  for (int64_t c = threadIdx.x; c < g.ncol; c += blockDim.x) {
    const int64_t o = c / inner_v, i = (c % inner_v) * VEC;
    A acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = A(0);
    int64_t start = p0;
    unsigned long long cur = keys[p0];
    if (cur >= static_cast<unsigned long long>(g.D)) return;  // only invalid items left
    for (int64_t p = p0; p < p1; ++p) {
      const unsigned long long key = keys[p];
      if (key != cur) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) partial[(start * g.ncol + c) * VEC + k] = acc[k];
        if (key >= static_cast<unsigned long long>(g.D)) {
          start = -1;
          break;
        }
        cur = key;
        start = p;
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] = A(0);
      }
      A v[VEC];
      load_src<T, VEC>(src, soff, (o * g.J + vals[p]) * g.inner + i, v);
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[k] += v[k];
    }
    if (start >= 0) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) partial[(start * g.ncol + c) * VEC + k] = acc[k];
    }
  }
}

// Segment pass (step 3): block per sorted position; only the first position of each key works.
template <typename T, int VEC>
__global__ void add_segments_kernel(const unsigned long long* __restrict__ keys, AddGeom g,
                                    const add_acc_t<T>* __restrict__ partial, T* __restrict__ out) {
  using A = add_acc_t<T>;
  const int64_t p = blockIdx.x;
  const unsigned long long key = keys[p];
  if (key >= static_cast<unsigned long long>(g.D)) return;
  if (p > 0 && keys[p - 1] == key) return;
  const int64_t inner_v = g.inner / VEC;
  for (int64_t c = threadIdx.x; c < g.ncol; c += blockDim.x) {
    const int64_t o = c / inner_v, i = (c % inner_v) * VEC;
    A acc[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[k] = partial[(p * g.ncol + c) * VEC + k];
    for (int64_t q = (p / kChunk + 1) * kChunk; q < g.J && keys[q] == key; q += kChunk) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) acc[k] += partial[(q * g.ncol + c) * VEC + k];
    }
    T* dst = out + (o * g.D + static_cast<int64_t>(key)) * g.inner + i;
#pragma unroll
    for (int k = 0; k < VEC; ++k) dst[k] = convert<T>(convert<A>(dst[k]) + acc[k]);
  }
}

// ---- launchers ------------------------------------------------------------------------------

constexpr int kThreads = 256;

unsigned grid_for(int64_t n, const Tensor& t) {
  return static_cast<unsigned>(
      std::max(1, cuda::elementwise_blocks(std::max<int64_t>(n, 1), kThreads, t.device().index)));
}

template <typename F>
decltype(auto) dispatch_bytes(size_t es, const char* op, F&& f) {
  switch (es) {
    case 1:
      return f(type_tag<uint8_t>{});
    case 2:
      return f(type_tag<uint16_t>{});
    case 4:
      return f(type_tag<uint32_t>{});
    case 8:
      return f(type_tag<uint64_t>{});
  }
  throw RuntimeError(std::string("[") + op + "] internal: unexpected element size");
}

template <typename F>
decltype(auto) dispatch_index(const Tensor& idx, const char* op, F&& f) {
  if (idx.dtype() == DType::Int64) return f(type_tag<int64_t>{});
  if (idx.dtype() == DType::Int32) return f(type_tag<int32_t>{});
  throw TypeError(std::string("[") + op + "] index must be int32 or int64, got " +
                  dtype_name(idx.dtype()));
}

void split3(const Shape& s, int64_t dim, int64_t& outer, int64_t& mid, int64_t& inner) {
  outer = 1;
  inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= s[d];
  mid = s[dim];
  for (int64_t d = dim + 1; d < static_cast<int64_t>(s.size()); ++d) inner *= s[d];
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

bool force_v1() {
  const char* e = std::getenv("BT_CUDA_INDEX_V1");
  return e != nullptr && e[0] == '1';
}

void check_ndim(const Tensor& t, const char* op) {
  if (t.ndim() > cuda::kMaxDims) {
    throw NotImplementedError(std::string("[") + op + "] CUDA kernels support at most " +
                              std::to_string(cuda::kMaxDims) + " dims, got " +
                              std::to_string(t.ndim()));
  }
}

// Note [empty outputs check indices]: the CPU range-checks every index whatever the output's
// size (cpu/index.cpp), so an op whose output is empty (index_add into a (0,) base, index_select
// of a (5, 0) table) still checks its indices on the device, recording the first bad one as the
// op's own kernels do; without it CUDA accepted what the CPU refused (the fuzz, session 54).
// Nothing reads an empty result back, so no later host read would raise the error for this
// op: outside a graph capture it syncs and raises here, at the call, as the CPU does (a rare
// case, so the sync costs nothing that matters); under capture the next eager check raises it.
void check_indices_only(const Tensor& idx, int64_t size, int code, const char* op) {
  const int64_t n = idx.numel();
  if (n == 0) return;
  check_ndim(idx, op);
  cudaStream_t st = cuda::stream(idx.device(), op);
  const StridedOffset ioff = cuda::make_offset(idx, op);
  arm(idx);
  dispatch_index(idx, op, [&](auto itag) {
    using I = typename decltype(itag)::type;
    check_index_kernel<I><<<grid_for(n, idx), kThreads, 0, st>>>(
        static_cast<const I*>(idx.data_ptr(op)), n, ioff, size, code);
    BT_CUDA_LAUNCH_CHECK(op);
  });
  if (!cuda::capturing(idx.device().index)) {
    BT_CUDA_CHECK(op, cudaStreamSynchronize(st));
    cuda::check_index_errors(idx.device().index);
  }
}

// Copies src (any strided view) into dst as rows: element e of src goes to
// dst[(e / run) * dpitch + e % run].  Contiguous sources use cudaMemcpy2DAsync.
void copy_rows(const Tensor& src, void* dst, int64_t run, int64_t dpitch, cudaStream_t st,
               const char* op) {
  const int64_t n = src.numel();
  if (n == 0 || run == 0) return;
  const size_t es = itemsize(src.dtype());
  const void* sp = src.data_ptr(op);
  if (src.is_contiguous() && run == dpitch) {
    if (sp != dst) {
      BT_CUDA_CHECK(op, cudaMemcpyAsync(dst, sp, n * es, cudaMemcpyDeviceToDevice, st));
    }
    return;
  }
  if (src.is_contiguous() && dpitch * es <= (1u << 30)) {  // pitches well inside the 2-D limits
    BT_CUDA_CHECK(op, cudaMemcpy2DAsync(dst, dpitch * es, sp, run * es, run * es, n / run,
                                        cudaMemcpyDeviceToDevice, st));
    return;
  }
  const StridedOffset so = cuda::make_offset(src, op);
  dispatch_bytes(es, op, [&](auto tag) {
    using E = typename decltype(tag)::type;
    copy_strided_kernel<E><<<grid_for(n, src), kThreads, 0, st>>>(
        static_cast<const E*>(sp), static_cast<E*>(dst), n, so, run, dpitch);
    BT_CUDA_LAUNCH_CHECK(op);
  });
}

int end_bit_for(int64_t maxkey) {
  int b = 1;
  while (b < 64 && (static_cast<unsigned long long>(maxkey) >> b) != 0) ++b;
  return b;
}

// Sorts (keys, vals) in place-ish: returns the sorted buffers (stable radix sort).
struct Sorted {
  Tensor keys, vals, tmp_in_k, tmp_in_v;
};
void sort_pairs(Tensor& keys_in, Tensor& vals_in, int64_t n, int64_t maxkey, Sorted& s,
                cudaStream_t st, const Tensor& like, const char* op) {
  s.keys = scratch_tensor({n}, DType::Int64, like.device(), op);
  s.vals = scratch_tensor({n}, DType::Int32, like.device(), op);
  auto* ki = static_cast<unsigned long long*>(keys_in.data_ptr(op));
  auto* ko = static_cast<unsigned long long*>(s.keys.data_ptr(op));
  auto* vi = static_cast<int*>(vals_in.data_ptr(op));
  auto* vo = static_cast<int*>(s.vals.data_ptr(op));
  size_t bytes = 0;
  const int eb = end_bit_for(maxkey);
  BT_CUDA_CHECK(op, cub::DeviceRadixSort::SortPairs(nullptr, bytes, ki, ko, vi, vo,
                                                    static_cast<int>(n), 0, eb, st));
  Tensor tmp = scratch_tensor({static_cast<int64_t>(std::max<size_t>(bytes, 1))}, DType::UInt8,
                              like.device(), op);
  BT_CUDA_CHECK(op, cub::DeviceRadixSort::SortPairs(tmp.data_ptr(op), bytes, ki, ko, vi, vo,
                                                    static_cast<int>(n), 0, eb, st));
}

// Steps 2 and 3 of the header's scheme: out[(o*D + key)*inner + i] += sums of src items.
template <typename T>
void sorted_add(const Tensor& src, const Sorted& s, AddGeom g, Tensor& out, cudaStream_t st,
                const char* op) {
  using A = add_acc_t<T>;
  const T* sp = static_cast<const T*>(src.data_ptr(op));
  T* outp = static_cast<T*>(out.data_ptr(op));
  const auto* keys = static_cast<const unsigned long long*>(s.keys.data_ptr(op));
  const auto* vals = static_cast<const int*>(s.vals.data_ptr(op));
  constexpr int kV = (std::is_floating_point_v<math_t<T>> && sizeof(T) <= 8)
                         ? 16 / static_cast<int>(sizeof(T))
                         : 1;
  const bool vec = kV > 1 && !force_v1() && src.is_contiguous() && g.inner % kV == 0 &&
                   aligned16(sp) && aligned16(outp);
  auto launch = [&](auto vtag) {
    constexpr int V = decltype(vtag)::value;
    AddGeom gv = g;
    gv.ncol = g.outer * g.inner / V;
    const StridedOffset soff = cuda::make_offset(src, op);
    Tensor part = scratch_tensor({static_cast<int64_t>(g.J * gv.ncol * V * sizeof(A))},
                                 DType::UInt8, out.device(), op);
    A* pp = static_cast<A*>(part.data_ptr(op));
    const int threads =
        static_cast<int>(std::clamp<int64_t>(cuda::ceil_div(gv.ncol, 32) * 32, 32, 256));
    add_pieces_kernel<T, V><<<static_cast<unsigned>(cuda::ceil_div(g.J, kChunk)), threads, 0, st>>>(
        sp, soff, keys, vals, gv, pp);
    BT_CUDA_LAUNCH_CHECK(op);
    add_segments_kernel<T, V><<<static_cast<unsigned>(g.J), threads, 0, st>>>(keys, gv, pp, outp);
    BT_CUDA_LAUNCH_CHECK(op);
  };
  if (vec) {
    launch(std::integral_constant<int, kV>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
}

}  // namespace

namespace backend {
// What IndexAdd::eval_gpu takes from scratch_tensor, in its order (each rounded up to 256
// bytes, as the scope hands them out): keys, positions, sorted keys and positions, cub's
// temporary storage, the partial sums.
int64_t index_add_scratch_bytes(Device d, int64_t J, int64_t D, int64_t cols, DType dtype) {
  if (d.type != Device::CUDA || J <= 0 || cols <= 0) return 0;
  auto up = [](int64_t n) { return (n + 255) / 256 * 256; };
  size_t cub_bytes = 0;
  BT_CUDA_CHECK("index_add", cub::DeviceRadixSort::SortPairs(
                                 nullptr, cub_bytes, static_cast<unsigned long long*>(nullptr),
                                 static_cast<unsigned long long*>(nullptr),
                                 static_cast<int*>(nullptr), static_cast<int*>(nullptr),
                                 static_cast<int>(J), 0, end_bit_for(D), cudaStream_t{}));
  const int64_t acc = dtype == DType::Float64 ? 8 : is_floating(dtype) ? 4 : 8;
  return 2 * up(J * 8) + 2 * up(J * 4) + up(std::max<int64_t>(cub_bytes, 1)) + up(J * cols * acc);
}
}  // namespace backend

namespace cuda {
IndexErrorRecord* index_error_record(int device) {
  static IndexErrorRecord* addr[kMaxDevices] = {};  // symbol address per device, looked up once
  if (!addr[device]) {
    set_device(device, "index");
    void* p = nullptr;
    BT_CUDA_CHECK("index", cudaGetSymbolAddress(&p, g_index_error));
    addr[device] = static_cast<IndexErrorRecord*>(p);
  }
  g_armed[device].store(true, std::memory_order_relaxed);
  return addr[device];
}

namespace {
// Note [device errors name the op the user called]: op names by id (0: none).  Ids are handed
// out on first use and never reused; a process meets a few dozen names.  Beyond kMaxOpIds the
// code carries no name and the error names the kind's primitive, as before.
constexpr int kMaxOpIds = (1 << (31 - cuda::kDeviceErrorKindBits)) - 1;
std::mutex g_op_names_mutex;
std::vector<std::string> g_op_names{""};  // guarded by g_op_names_mutex

int op_id(const char* op) {
  if (!op || !*op) return 0;
  std::lock_guard<std::mutex> lock(g_op_names_mutex);
  for (size_t i = 1; i < g_op_names.size(); ++i) {
    if (g_op_names[i] == op) return static_cast<int>(i);
  }
  if (static_cast<int>(g_op_names.size()) > kMaxOpIds) return 0;
  g_op_names.emplace_back(op);
  return static_cast<int>(g_op_names.size() - 1);
}

std::string op_name(int id) {
  std::lock_guard<std::mutex> lock(g_op_names_mutex);
  return id > 0 && id < static_cast<int>(g_op_names.size()) ? g_op_names[id] : std::string();
}
}  // namespace

int device_error_code(int kind, const char* op) {
  const char* outer = detail::outer_op();
  return kind | (op_id(outer ? outer : op) << kDeviceErrorKindBits);
}

DeviceErrorSink device_error_sink(int device, int kind, const char* op) {
  return DeviceErrorSink(index_error_record(device), device_error_code(kind, op));
}

void check_index_errors(int device) {
  if (device < 0 || device >= kMaxDevices ||
      !g_armed[device].exchange(false, std::memory_order_relaxed)) {
    return;
  }
  const char* op = "index";
  cudaStream_t st = stream(device, op);
  IndexErrorRecord rec{};
  BT_CUDA_CHECK(op, cudaMemcpyFromSymbolAsync(&rec, g_index_error, sizeof(rec), 0,
                                              cudaMemcpyDeviceToHost, st));
  BT_CUDA_CHECK(op, cudaStreamSynchronize(st));
  if (rec.flag == 0) return;
  const IndexErrorRecord zero{};
  BT_CUDA_CHECK(op, cudaMemcpyToSymbolAsync(g_index_error, &zero, sizeof(zero), 0,
                                            cudaMemcpyHostToDevice, st));
  BT_CUDA_CHECK(op, cudaStreamSynchronize(st));
  // The record names the op the user called when the kernel was launched: the op syncing now
  // (to, item, ...) must not rename it (Note [the op the user called]).
  OpScopeReset named_by_the_record;
  const int kind = rec.flag & kDeviceErrorKindMask;
  std::string nm = op_name(rec.flag >> kDeviceErrorKindBits);
  if (kind == kDeviceErrorFloorDiv || kind == kDeviceErrorRemainder) {
    if (nm.empty()) nm = kind == kDeviceErrorFloorDiv ? "floor_divide" : "remainder";
    throw ZeroDivisionError("[" + nm +
                            "] integer division by zero (detected on the GPU; those elements "
                            "are 0)");
  }
  const char* names[] = {"?",           "index_select",  "index_add", "gather",
                         "scatter_add", "cross_entropy", "?",         "?",
                         "embedding"};
  if (nm.empty()) nm = (kind >= 1 && kind <= 8) ? names[kind] : names[0];
  throw IndexError("[" + nm + "] index " + std::to_string(rec.value) +
                   " is out of range for a dim of size " + std::to_string(rec.size) +
                   (kind == kIndexErrorCrossEntropy
                        ? " (a target; detected on the GPU; that row's loss is NaN)"
                        : " (detected on the GPU; the element was skipped)"));
}
}  // namespace cuda

void IndexSelect::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  const char* nm = name();
  const Tensor& x = in[0];
  const Tensor& idx = in[1];
  int64_t outer, D, inner;
  split3(x.shape(), dim, outer, D, inner);
  const int64_t J = idx.numel(), n = out[0].numel();
  const int code =
      cuda::device_error_code(embedding ? cuda::kIndexErrorEmbedding : kIndexSelect, nm);
  if (n == 0) {
    check_indices_only(idx, D, code, nm);
    return;
  }
  check_ndim(x, nm);
  cudaStream_t st = cuda::stream(out[0].device(), nm);
  const size_t es = itemsize(x.dtype());
  const void* xp = x.data_ptr(nm);
  void* outp = out[0].data_ptr(nm);
  const int64_t istride = idx.ndim() == 0 ? 0 : idx.strides()[0];
  arm(out[0]);
  dispatch_index(idx, nm, [&](auto itag) {
    using I = typename decltype(itag)::type;
    const I* ip = static_cast<const I*>(idx.data_ptr(nm));
    const bool v1 = force_v1();
    const int64_t rows = outer * J;
    auto launch_rows = [&](auto etag, const void* xs, void* os, int64_t in_units,
                           const StridedOffset& xo) {
      using E = typename decltype(etag)::type;
      const int threads =
          static_cast<int>(std::min<int64_t>(256, cuda::ceil_div(in_units, 32) * 32));
      index_select_rows_kernel<E, I>
          <<<static_cast<unsigned>(std::min<int64_t>(rows, 1 << 20)), threads, 0, st>>>(
              static_cast<const E*>(xs), ip, istride, static_cast<E*>(os), rows, J, D, in_units, xo,
              code);
      BT_CUDA_LAUNCH_CHECK(nm);
    };
    if (!v1 && x.is_contiguous() && (inner * es) % 16 == 0 && aligned16(xp) && aligned16(outp)) {
      launch_rows(type_tag<uint4>{}, xp, outp, static_cast<int64_t>(inner * es / 16),
                  StridedOffset{});
      return;
    }
    const StridedOffset xoff = cuda::make_offset(x, nm);
    dispatch_bytes(es, nm, [&](auto tag) {
      using E = typename decltype(tag)::type;
      if (!v1 && inner >= 64) {
        launch_rows(tag, xp, outp, inner, xoff);
        return;
      }
      index_select_kernel<E, I><<<grid_for(n, x), kThreads, 0, st>>>(static_cast<const E*>(xp), ip,
                                                                     istride, static_cast<E*>(outp),
                                                                     n, J, D, inner, xoff, code);
      BT_CUDA_LAUNCH_CHECK(nm);
    });
  });
}

void IndexAdd::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  const char* nm = name();
  Tensor& o = out[0];
  const Tensor& idx = in[1];
  const Tensor& src = in[2];
  int64_t outer, D, inner;
  split3(o.shape(), dim, outer, D, inner);
  if (o.numel() == 0) {
    check_indices_only(idx, D, cuda::device_error_code(kIndexAdd, nm), nm);
    return;
  }
  check_ndim(in[0], nm);
  check_ndim(src, nm);
  cudaStream_t st = cuda::stream(o.device(), nm);
  copy_rows(in[0], o.data_ptr(nm), o.numel(), o.numel(), st, nm);
  const int64_t J = idx.numel();
  if (J == 0) return;
  if (J >= 2147483647) throw NotImplementedError("[index_add] more than 2^31 indices");
  const int64_t istride = idx.ndim() == 0 ? 0 : idx.strides()[0];
  arm(o);
  Tensor keys = scratch_tensor({J}, DType::Int64, o.device(), nm);
  Tensor vals = scratch_tensor({J}, DType::Int32, o.device(), nm);
  dispatch_index(idx, nm, [&](auto itag) {
    using I = typename decltype(itag)::type;
    index_keys_kernel<I><<<static_cast<unsigned>(cuda::ceil_div(J, kThreads)), kThreads, 0, st>>>(
        static_cast<const I*>(idx.data_ptr(nm)), istride, J, D,
        static_cast<unsigned long long*>(keys.data_ptr(nm)), static_cast<int*>(vals.data_ptr(nm)),
        cuda::device_error_code(kIndexAdd, nm));
    BT_CUDA_LAUNCH_CHECK(nm);
  });
  Sorted s;
  sort_pairs(keys, vals, J, D, s, st, o, nm);
  cuda::dispatch_cuda_all(o.dtype(), nm, [&](auto tag) {
    using T = typename decltype(tag)::type;
    sorted_add<T>(src, s, AddGeom{J, D, outer, inner, 0}, o, st, nm);
  });
}

void Gather::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  const char* nm = name();
  const Tensor& x = in[0];
  const Tensor& idx = in[1];
  const int64_t n = out[0].numel();
  if (n == 0) return;
  check_ndim(idx, nm);
  cudaStream_t st = cuda::stream(out[0].device(), nm);
  GatherGeom g{};
  g.nd = static_cast<int>(idx.ndim());
  g.dim = static_cast<int>(dim);
  g.dsize = x.shape()[dim];
  g.code = cuda::device_error_code(kGather, nm);
  for (int d = 0; d < g.nd; ++d) {
    g.ishape[d] = idx.shape()[d];
    g.istride[d] = idx.strides()[d];
    g.xstride[d] = x.strides()[d];
  }
  const void* xp = x.numel() == 0 ? nullptr : x.data_ptr(nm);
  arm(out[0]);
  dispatch_index(idx, nm, [&](auto itag) {
    using I = typename decltype(itag)::type;
    dispatch_bytes(itemsize(x.dtype()), nm, [&](auto tag) {
      using E = typename decltype(tag)::type;
      gather_kernel<E, I><<<grid_for(n, x), kThreads, 0, st>>>(
          static_cast<const E*>(xp), static_cast<const I*>(idx.data_ptr(nm)),
          static_cast<E*>(out[0].data_ptr(nm)), n, g);
      BT_CUDA_LAUNCH_CHECK(nm);
    });
  });
}

void ScatterAdd::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  const char* nm = name();
  Tensor& o = out[0];
  const Tensor& idx = in[1];
  const Tensor& src = in[2];
  if (o.numel() == 0) {
    check_indices_only(idx, o.shape()[dim], cuda::device_error_code(kScatterAdd, nm), nm);
    return;
  }
  check_ndim(idx, nm);
  check_ndim(src, nm);
  cudaStream_t st = cuda::stream(o.device(), nm);
  copy_rows(in[0], o.data_ptr(nm), o.numel(), o.numel(), st, nm);
  const int64_t n = idx.numel();
  if (n == 0) return;
  if (n >= 2147483647) throw NotImplementedError("[scatter_add] more than 2^31 indices");
  ScatterGeom g{};
  g.nd = static_cast<int>(idx.ndim());
  g.dim = static_cast<int>(dim);
  g.dsize = o.shape()[dim];
  g.onumel = o.numel();
  g.code = cuda::device_error_code(kScatterAdd, nm);
  const Strides os = contiguous_strides(o.shape());
  for (int d = 0; d < g.nd; ++d) {
    g.ishape[d] = idx.shape()[d];
    g.istride[d] = idx.strides()[d];
    g.ostride[d] = os[d];
  }
  const DType dt = o.dtype();
  arm(o);
  const bool has_atomic = dt == DType::Float32 || dt == DType::Float64 || dt == DType::Float16 ||
                          dt == DType::BFloat16 || dt == DType::Int32 || dt == DType::Int64;
  if (!deterministic_algorithms() && has_atomic) {
    const StridedOffset soff = cuda::make_offset(src, nm);
    dispatch_index(idx, nm, [&](auto itag) {
      using I = typename decltype(itag)::type;
      cuda::dispatch_cuda_all(dt, nm, [&](auto tag) {
        using T = typename decltype(tag)::type;
        if constexpr (std::is_same_v<T, bool> || std::is_same_v<T, uint8_t>) {
          throw RuntimeError("[scatter_add] internal: no atomic for this dtype");
        } else {
          scatter_add_atomic_kernel<T, I><<<grid_for(n, o), kThreads, 0, st>>>(
              static_cast<const T*>(src.data_ptr(nm)), soff,
              static_cast<const I*>(idx.data_ptr(nm)), n, g, static_cast<T*>(o.data_ptr(nm)));
          BT_CUDA_LAUNCH_CHECK(nm);
        }
      });
    });
    return;
  }
  Tensor keys = scratch_tensor({n}, DType::Int64, o.device(), nm);
  Tensor vals = scratch_tensor({n}, DType::Int32, o.device(), nm);
  dispatch_index(idx, nm, [&](auto itag) {
    using I = typename decltype(itag)::type;
    scatter_keys_kernel<I><<<static_cast<unsigned>(cuda::ceil_div(n, kThreads)), kThreads, 0, st>>>(
        static_cast<const I*>(idx.data_ptr(nm)), n, g,
        static_cast<unsigned long long*>(keys.data_ptr(nm)), static_cast<int*>(vals.data_ptr(nm)));
    BT_CUDA_LAUNCH_CHECK(nm);
  });
  Sorted s;
  sort_pairs(keys, vals, n, o.numel(), s, st, o, nm);
  cuda::dispatch_cuda_all(dt, nm, [&](auto tag) {
    using T = typename decltype(tag)::type;
    // Items are source elements (J = n, one column); key = flat output offset.
    sorted_add<T>(src, s, AddGeom{n, o.numel(), 1, 1, 0}, o, st, nm);
  });
}

void Concatenate::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  const char* nm = name();
  Tensor& o = out[0];
  if (o.numel() == 0) return;
  int64_t outer, Dout, inner;
  split3(o.shape(), dim, outer, Dout, inner);
  cudaStream_t st = cuda::stream(o.device(), nm);
  char* dst = static_cast<char*>(o.data_ptr(nm));
  const size_t es = itemsize(o.dtype());
  int64_t at = 0;
  for (const Tensor& t : in) {
    const int64_t D = t.shape()[dim];
    if (t.numel() > 0) {
      check_ndim(t, nm);
      copy_rows(t, dst + at * inner * es, D * inner, Dout * inner, st, nm);
    }
    at += D;
  }
}

}  // namespace bt
