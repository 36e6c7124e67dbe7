// cpu/matmul.cpp: matmul / linear through blutrain-linalg's C ABI (the same call serves CUDA:
// the descriptor's device field picks the backend, so src/cuda/ only needs to pass its stream).
#include "../primitives.h"
#include "blutrain/linalg.h"

namespace bt {

static int32_t linalg_dtype(DType d, const char* op) {
  switch (d) {
    case DType::Float32:
      return BT_LINALG_F32;
    case DType::Float64:
      return BT_LINALG_F64;
    case DType::Float16:
      return BT_LINALG_F16;
    case DType::BFloat16:
      return BT_LINALG_BF16;
    default:
      break;
  }
  throw TypeError(std::string("[") + op + "] blutrain-linalg has no kernel for " + dtype_name(d));
}

// Describes a logical (rows, cols) matrix (the last two dims of t) for the row-major GEMM:
// N with ld = row stride when columns are unit-stride, T with ld = column stride when rows are.
static bt_linalg_matrix describe(const Tensor& t, bool transpose_view, int32_t& op,
                                 const char* name) {
  const int64_t nd = t.ndim();
  int64_t rows = t.shape()[nd - 2], cols = t.shape()[nd - 1];
  int64_t rs = t.strides()[nd - 2], cs = t.strides()[nd - 1];
  if (transpose_view) {
    std::swap(rows, cols);
    std::swap(rs, cs);
  }
  bt_linalg_matrix m{};
  m.ptr = t.data_ptr(name);
  m.dtype = linalg_dtype(t.dtype(), name);
  m.batch_stride = nd == 3 ? t.strides()[0] : 0;
  if ((cols == 1 || cs == 1) && (rows == 1 || rs >= cols)) {
    op = BT_LINALG_OP_N;
    m.ld = rows == 1 ? std::max<int64_t>(cols, 1) : rs;
  } else if ((rows == 1 || rs == 1) && (cols == 1 || cs >= rows)) {
    op = BT_LINALG_OP_T;
    m.ld = cols == 1 ? std::max<int64_t>(rows, 1) : cs;
  } else {
    throw RuntimeError(std::string("[") + name +
                       "] internal: operand strides are not GEMM-compatible (front must copy)");
  }
  return m;
}

static void run_gemm(Primitive& p, const std::vector<Tensor>& in, std::vector<Tensor>& out,
                     bool trans_b, bool has_bias, void* stream) {
  const auto* api = static_cast<const bt_linalg_api*>(linalg_hooks().api);
  if (!api) {
    throw RuntimeError(std::string("[") + p.name() + "] blutrain-linalg is not available (" +
                       linalg_hooks().unavailable_reason + "); install blutrain-linalg");
  }
  const Tensor &A = in[0], &B = in[1];
  const Tensor& D = out[0];
  bt_linalg_gemm_desc d;
  bt_linalg_gemm_desc_init(&d);
  d.device = D.device().is_cuda() ? D.device().index : -1;
  d.m = D.shape()[D.ndim() - 2];
  d.n = D.shape()[D.ndim() - 1];
  d.k = A.shape()[A.ndim() - 1];
  d.batch = D.ndim() == 3 ? D.shape()[0] : 1;
  d.a = describe(A, false, d.transa, p.name());
  d.b = describe(B, trans_b, d.transb, p.name());
  d.d.ptr = D.data_ptr(p.name());
  d.d.ld = std::max<int64_t>(d.n, 1);
  d.d.batch_stride = d.m * d.n;
  d.d.dtype = linalg_dtype(D.dtype(), p.name());
  d.c = d.d;
  if (has_bias) {
    d.epilogue = BT_LINALG_EPI_BIAS;
    d.bias.ptr = in[2].data_ptr(p.name());
    d.bias.dtype = linalg_dtype(in[2].dtype(), p.name());
    d.bias.ld = d.n;
  }
  d.stream = stream;
  if (api->gemm(&d) != 0) {
    throw RuntimeError(std::string("[") + p.name() + "] blutrain-linalg: " + api->last_error());
  }
}

void Matmul::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  run_gemm(*this, in, out, trans_b, has_bias, nullptr);
}

#ifdef BT_WITH_CUDA
// blutrain-linalg runs the same descriptor on the device (cuBLASLt); the legacy default stream
// until tensors carry streams.
void Matmul::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  run_gemm(*this, in, out, trans_b, has_bias, nullptr);
}
#endif

}  // namespace bt
