// Launchers of the CUDA kernels in epilogue_kernels.cu. They run the epilogues that cuBLASLt
// cannot fuse for a given combination (dtype, alignment, batch, k = 0), so every descriptor
// the front accepts has a CUDA path. All take a stream and only enqueue; they return a
// cudaError_t value (as int) of the launch.
#pragma once

#include <cstddef>
#include <cstdint>

namespace blutrain::linalg::kern {

// A strided batch of row-major matrices: element (b, i, j) at ptr[b*bs + i*ld + j].
struct Mat {
  const void* ptr;
  int64_t ld, bs;
  int dtype;  // bt_linalg_dtype
};

// dst (acc type) = scale * src, converting; scale == 0 writes zeros without reading src.
int convert_scale(Mat src, Mat dst, int64_t rows, int64_t cols, int64_t batch, double scale,
                  void* stream);

// The epilogue over Z (acc type, in place): z += bias; aux = z; z = gelu(z); z *= gelu'(aux);
// then D = z (converted) when D is not Z. `flags` bits: 1 bias, 2 write aux, 4 gelu, 8 dgelu.
enum { kBias = 1, kAuxOut = 2, kGelu = 4, kDgelu = 8 };
int epilogue(Mat z, Mat d, Mat bias, Mat aux, int flags, int64_t rows, int64_t cols, int64_t batch,
             void* stream);

// out[b, j] = sum_i x[b, i, j] (column sums), via partial sums in `scratch`
// (colsum_scratch_bytes of it). out is written in out.dtype; out.bs separates batch items.
size_t colsum_scratch_bytes(int64_t rows, int64_t cols, int64_t batch);
int colsum(Mat x, Mat out, int64_t rows, int64_t cols, int64_t batch, void* scratch, void* stream);
// out[b, i] = sum_j x[b, i, j] (row sums).
int rowsum(Mat x, Mat out, int64_t rows, int64_t cols, int64_t batch, void* stream);

// float32 D = alpha op(A) op(B) + beta C on TF32 tensor cores, 3xTF32 (gemm_tf32x3.cu, Note
// [3xTF32]). Row-major, as bt_linalg_gemm_desc: op(A) (m, k), op(B) (k, n), D and C (m, n).
struct Tf32x3Problem {
  int64_t m, n, k, batch;
  int transa, transb;
  const float* a;
  int64_t lda, bsa;
  const float* b;
  int64_t ldb, bsb;
  const float* c;  // read when beta != 0 (may equal d)
  int64_t ldc, bsc;
  float* d;
  int64_t ldd, bsd;
  double alpha, beta;
};
// Whether the kernel takes the problem (16-byte aligned A and B, ld and batch strides of A and B
// multiples of 4, non-empty).
bool gemm_tf32x3_supported(const Tf32x3Problem& p);
// Split-K workspace the call wants on device `dev` (0: none); without it the call runs unsplit.
size_t gemm_tf32x3_workspace_bytes(const Tf32x3Problem& p, int dev);
int gemm_tf32x3(const Tf32x3Problem& p, int dev, void* workspace, void* stream);

}  // namespace blutrain::linalg::kern
