// CUDA kernels for the epilogues cuBLASLt does not fuse for a combination, and the
// reductions behind the bias gradients. Memory-bound elementwise work: one thread per
// element (grid-stride), loads and stores converted through float (double for f64).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "../linalg_internal.h"
#include "kernels.h"

namespace blutrain::linalg::kern {

namespace {

// ---- kernels ----------------------------------------------------------------------------------
template <class T>
__device__ __forceinline__ T ld_as(const void* p, int dt, int64_t i) {
  switch (dt) {
    case BT_LINALG_F32:
      return T(static_cast<const float*>(p)[i]);
    case BT_LINALG_F64:
      return T(static_cast<const double*>(p)[i]);
    case BT_LINALG_F16:
      return T(__half2float(static_cast<const __half*>(p)[i]));
    default:
      return T(__bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]));
  }
}
template <class T>
__device__ __forceinline__ void st_as(void* p, int dt, int64_t i, T v) {
  switch (dt) {
    case BT_LINALG_F32:
      static_cast<float*>(p)[i] = float(v);
      break;
    case BT_LINALG_F64:
      static_cast<double*>(p)[i] = double(v);
      break;
    case BT_LINALG_F16:
      static_cast<__half*>(p)[i] = __float2half_rn(float(v));
      break;
    default:
      static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(float(v));
      break;
  }
}

// GELU, tanh form, and its derivative; tanh (not tanhf's fast form) so the fallback agrees
// with the CPU to rounding.
template <class T>
__device__ __forceinline__ T gelu_d(T z) {
  const T t = tanh(T(0.7978845608028654) * (z + T(0.044715) * z * z * z));
  return T(0.5) * z * (T(1) + t);
}
template <class T>
__device__ __forceinline__ T dgelu_d(T z) {
  const T s = T(0.7978845608028654);
  const T t = tanh(s * (z + T(0.044715) * z * z * z));
  return T(0.5) * (T(1) + t) + T(0.5) * z * (T(1) - t * t) * s * (T(1) + T(3 * 0.044715) * z * z);
}

template <class T>
__global__ void convert_scale_kernel(Mat src, Mat dst, int64_t rows, int64_t cols, int64_t batch,
                                     T scale) {
  const int64_t total = rows * cols * batch;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = idx % cols, i = (idx / cols) % rows, b = idx / (rows * cols);
    T v = scale == T(0) ? T(0) : scale * ld_as<T>(src.ptr, src.dtype, b * src.bs + i * src.ld + j);
    st_as<T>(const_cast<void*>(dst.ptr), dst.dtype, b * dst.bs + i * dst.ld + j, v);
  }
}

template <class T>
__global__ void epilogue_kernel(Mat z, Mat d, Mat bias, Mat aux, int flags, int64_t rows,
                                int64_t cols, int64_t batch, bool write_d) {
  const int64_t total = rows * cols * batch;
  T* Z = static_cast<T*>(const_cast<void*>(z.ptr));
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = idx % cols, i = (idx / cols) % rows, b = idx / (rows * cols);
    const int64_t zi = b * z.bs + i * z.ld + j;
    T v = Z[zi];
    if (flags & kBias) v += ld_as<T>(bias.ptr, bias.dtype, b * bias.bs + j);
    const int64_t ai = b * aux.bs + i * aux.ld + j;
    if (flags & kAuxOut) st_as<T>(const_cast<void*>(aux.ptr), aux.dtype, ai, v);
    if (flags & kGelu) v = gelu_d<T>(v);
    if (flags & kDgelu) v *= dgelu_d<T>(ld_as<T>(aux.ptr, aux.dtype, ai));
    Z[zi] = v;
    if (write_d) st_as<T>(const_cast<void*>(d.ptr), d.dtype, b * d.bs + i * d.ld + j, v);
  }
}

constexpr int kColTile = 32, kRowThreads = 8, kMaxChunks = 128;

// Partial column sums: block (32, 8) covers 32 columns of one row chunk of one batch item.
template <class T>
__global__ void colsum_partial_kernel(Mat x, int64_t rows, int64_t cols, int64_t chunk_rows,
                                      T* partial, int64_t nchunks) {
  __shared__ T sm[kRowThreads][kColTile];
  const int64_t j = blockIdx.x * int64_t(kColTile) + threadIdx.x;
  const int64_t chunk = blockIdx.y, b = blockIdx.z;
  const int64_t r0 = chunk * chunk_rows, r1 = min(rows, r0 + chunk_rows);
  T acc = T(0);
  if (j < cols)
    for (int64_t i = r0 + threadIdx.y; i < r1; i += kRowThreads)
      acc += ld_as<T>(x.ptr, x.dtype, b * x.bs + i * x.ld + j);
  sm[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && j < cols) {
    for (int r = 1; r < kRowThreads; ++r) acc += sm[r][threadIdx.x];
    partial[(b * nchunks + chunk) * cols + j] = acc;
  }
}

template <class T>
__global__ void colsum_final_kernel(const T* partial, int64_t nchunks, int64_t cols, int64_t batch,
                                    Mat out) {
  const int64_t total = cols * batch;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t j = idx % cols, b = idx / cols;
    T acc = T(0);
    for (int64_t c = 0; c < nchunks; ++c) acc += partial[(b * nchunks + c) * cols + j];
    st_as<T>(const_cast<void*>(out.ptr), out.dtype, b * out.bs + j, acc);
  }
}

// One warp per row.
template <class T>
__global__ void rowsum_kernel(Mat x, Mat out, int64_t rows, int64_t cols, int64_t batch) {
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= rows * batch) return;
  const int64_t i = warp % rows, b = warp / rows;
  T acc = T(0);
  for (int64_t j = lane; j < cols; j += 32)
    acc += ld_as<T>(x.ptr, x.dtype, b * x.bs + i * x.ld + j);
  for (int off = 16; off > 0; off /= 2) acc += __shfl_down_sync(0xffffffffu, acc, off);
  if (lane == 0) st_as<T>(const_cast<void*>(out.ptr), out.dtype, b * out.bs + i, acc);
}

// ---- launch helpers ---------------------------------------------------------------------------
unsigned grid_for(int64_t total, int threads) {
  int64_t g = (total + threads - 1) / threads;
  const int64_t cap = 65536;  // grid-stride loops cover the rest
  return unsigned(g < 1 ? 1 : (g > cap ? cap : g));
}
bool is_f64(const Mat& m) { return m.dtype == BT_LINALG_F64; }
int64_t chunk_rows_for(int64_t rows) {
  int64_t c = (rows + kMaxChunks - 1) / kMaxChunks;
  return c < 64 ? 64 : c;
}

}  // namespace

int convert_scale(Mat src, Mat dst, int64_t rows, int64_t cols, int64_t batch, double scale,
                  void* stream) {
  const int64_t total = rows * cols * batch;
  if (total == 0) return cudaSuccess;
  auto s = static_cast<cudaStream_t>(stream);
  if (is_f64(dst))
    convert_scale_kernel<double>
        <<<grid_for(total, 256), 256, 0, s>>>(src, dst, rows, cols, batch, scale);
  else
    convert_scale_kernel<float>
        <<<grid_for(total, 256), 256, 0, s>>>(src, dst, rows, cols, batch, float(scale));
  return cudaGetLastError();
}

int epilogue(Mat z, Mat d, Mat bias, Mat aux, int flags, int64_t rows, int64_t cols, int64_t batch,
             void* stream) {
  const int64_t total = rows * cols * batch;
  if (total == 0) return cudaSuccess;
  auto s = static_cast<cudaStream_t>(stream);
  const bool write_d = d.ptr != z.ptr;
  if (is_f64(z))
    epilogue_kernel<double>
        <<<grid_for(total, 256), 256, 0, s>>>(z, d, bias, aux, flags, rows, cols, batch, write_d);
  else
    epilogue_kernel<float>
        <<<grid_for(total, 256), 256, 0, s>>>(z, d, bias, aux, flags, rows, cols, batch, write_d);
  return cudaGetLastError();
}

size_t colsum_scratch_bytes(int64_t rows, int64_t cols, int64_t batch) {
  const int64_t nchunks = (rows + chunk_rows_for(rows) - 1) / chunk_rows_for(rows);
  return size_t((nchunks < 1 ? 1 : nchunks) * cols * batch) * sizeof(double);
}

int colsum(Mat x, Mat out, int64_t rows, int64_t cols, int64_t batch, void* scratch, void* stream) {
  if (cols * batch == 0) return cudaSuccess;
  auto s = static_cast<cudaStream_t>(stream);
  const int64_t cr = chunk_rows_for(rows);
  int64_t nchunks = (rows + cr - 1) / cr;
  if (nchunks < 1) nchunks = 1;
  dim3 block(kColTile, kRowThreads);
  dim3 grid(unsigned((cols + kColTile - 1) / kColTile), unsigned(nchunks), unsigned(batch));
  const int64_t total = cols * batch;
  // Sums run in double for f64 data, else in float (the accumulation the GPU GEMM uses).
  if (is_f64(x)) {
    colsum_partial_kernel<double>
        <<<grid, block, 0, s>>>(x, rows, cols, cr, (double*)scratch, nchunks);
    colsum_final_kernel<double>
        <<<grid_for(total, 256), 256, 0, s>>>((double*)scratch, nchunks, cols, batch, out);
  } else {
    colsum_partial_kernel<float>
        <<<grid, block, 0, s>>>(x, rows, cols, cr, (float*)scratch, nchunks);
    colsum_final_kernel<float>
        <<<grid_for(total, 256), 256, 0, s>>>((float*)scratch, nchunks, cols, batch, out);
  }
  return cudaGetLastError();
}

int rowsum(Mat x, Mat out, int64_t rows, int64_t cols, int64_t batch, void* stream) {
  const int64_t warps = rows * batch;
  if (warps == 0) return cudaSuccess;
  auto s = static_cast<cudaStream_t>(stream);
  const int threads = 256;
  const unsigned grid = unsigned((warps * 32 + threads - 1) / threads);
  if (is_f64(x))
    rowsum_kernel<double><<<grid, threads, 0, s>>>(x, out, rows, cols, batch);
  else
    rowsum_kernel<float><<<grid, threads, 0, s>>>(x, out, rows, cols, batch);
  return cudaGetLastError();
}

}  // namespace blutrain::linalg::kern
