// cpu/matmul.cpp: matmul / linear through blutrain-linalg's C ABI (the same call serves CUDA:
// the descriptor's device field picks the backend, so src/cuda/ only needs to pass its stream).
#include <algorithm>

#include "../autocast.h"
#include "../backend.h"
#include "../nn_fused.h"
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
  if (t.numel() == 0) {  // nothing is read: any layout (e.g. an empty expand view)
    op = BT_LINALG_OP_N;
    m.ld = std::max<int64_t>(cols, 1);
  } else if ((cols == 1 || cs == 1) && (rows == 1 || rs >= cols)) {
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

static const bt_linalg_api* linalg_api(const Primitive& p) {
  const auto* api = static_cast<const bt_linalg_api*>(linalg_hooks().api);
  if (!api) {
    throw RuntimeError(std::string("[") + p.name() + "] blutrain-linalg is not available (" +
                       linalg_hooks().unavailable_reason + "); install blutrain-linalg");
  }
  return api;
}

// bt.set_float32_matmul_precision, for float32 operands only (16-bit GEMMs always accumulate in
// fp32 on their own path; float64 stays float64).
static int32_t compute_mode(int32_t operand_dtype) {
  if (operand_dtype != BT_LINALG_F32) return BT_LINALG_COMPUTE_DEFAULT;
  switch (float32_matmul_precision()) {
    case MatmulPrecision::High:
      return BT_LINALG_COMPUTE_TF32;
    case MatmulPrecision::Medium:
      return BT_LINALG_COMPUTE_FAST_BF16;
    default:
      return BT_LINALG_COMPUTE_FP32;
  }
}

// D = op(A) op(B) for D (.., m, n) with A (.., m, k) and B (.., k, n) or (.., n, k) when
// trans_b; the caller sets the epilogue fields.
static bt_linalg_gemm_desc make_desc(const Primitive& p, const Tensor& A, bool trans_a,
                                     const Tensor& B, bool trans_b, const Tensor& D, void* stream) {
  bt_linalg_gemm_desc d;
  bt_linalg_gemm_desc_init(&d);
  d.device = D.device().is_cuda() ? D.device().index : -1;
  d.m = D.shape()[D.ndim() - 2];
  d.n = D.shape()[D.ndim() - 1];
  d.k = trans_a ? A.shape()[A.ndim() - 2] : A.shape()[A.ndim() - 1];
  d.batch = D.ndim() == 3 ? D.shape()[0] : 1;
  d.a = describe(A, trans_a, d.transa, p.name());
  d.b = describe(B, trans_b, d.transb, p.name());
  d.d.ptr = D.data_ptr(p.name());
  d.d.ld = std::max<int64_t>(d.n, 1);
  d.d.batch_stride = d.m * d.n;
  d.d.dtype = linalg_dtype(D.dtype(), p.name());
  d.c = d.d;
  d.compute = compute_mode(d.a.dtype);
  d.stream = stream;
  return d;
}

static bt_linalg_matrix vec(const Tensor& t, const Primitive& p) {
  bt_linalg_matrix v{};
  v.ptr = t.data_ptr(p.name());
  v.dtype = linalg_dtype(t.dtype(), p.name());
  v.ld = t.numel();
  return v;
}

static void call_gemm(const Primitive& p, const bt_linalg_gemm_desc& d) {
  if (d.batch == 0) return;  // bmm of an empty batch: nothing to write (linalg wants batch >= 1)
  const auto* api = linalg_api(p);
  if (api->gemm(&d) != 0) {
    throw RuntimeError(std::string("[") + p.name() + "] blutrain-linalg: " + api->last_error());
  }
}

static void run_gemm(Primitive& p, const std::vector<Tensor>& in, std::vector<Tensor>& out,
                     bool trans_b, bool has_bias, void* stream) {
  bt_linalg_gemm_desc d = make_desc(p, in[0], false, in[1], trans_b, out[0], stream);
  if (has_bias) {
    d.epilogue = BT_LINALG_EPI_BIAS;
    d.bias = vec(in[2], p);
  }
  call_gemm(p, d);
}

static bool is_16bit(DType d) { return d == DType::BFloat16 || d == DType::Float16; }

// h = gelu_tanh(pre) by the GeluTanh unary kernel of the device (the one a recompute reruns).
static void gelu_into(const Tensor& pre, Tensor& h, bool gpu) {
  Unary u(UnaryOp::GeluTanh);
  std::vector<Tensor> o{h};
  if (gpu) {
    u.eval_gpu({pre}, o);
  } else {
    u.eval_cpu({pre}, o);
  }
}

// The GELU in the GEMM's epilogue (GELU_AUX) for 16-bit types, where cuBLASLt fuses it; for
// float32/64 (no fused epilogue: cuBLASLt runs a slow extra kernel) GEMM(+bias) then our kernel.
static bool fused_gelu_forward(DType dt) { return is_16bit(dt) || lgl_impl() == LglImpl::Cublaslt; }

// D = gelu(x W^T + b) with aux = pre: one GEMM (fused) or GEMM into pre then gelu_into(h).
static void linear_gelu_aux(const Primitive& p, const Tensor& x, const Tensor& w,
                            const Tensor* bias, Tensor& h, Tensor& pre, bool fused, void* stream,
                            bool gpu) {
  bt_linalg_gemm_desc d = make_desc(p, x, false, w, true, fused ? h : pre, stream);
  if (bias) d.bias = vec(*bias, p);
  if (fused) {
    d.epilogue = bias ? BT_LINALG_EPI_BIAS_GELU_AUX : BT_LINALG_EPI_GELU_AUX;
    d.aux = d.d;
    d.aux.ptr = pre.data_ptr(p.name());
    call_gemm(p, d);
  } else {
    d.epilogue = bias ? BT_LINALG_EPI_BIAS : BT_LINALG_EPI_NONE;
    call_gemm(p, d);
    gelu_into(pre, h, gpu);
  }
}

// LinearGelu: y = gelu(x W^T + b), aux = pre-activation (out[1]).
static void run_linear_gelu(LinearGelu& p, const std::vector<Tensor>& in, std::vector<Tensor>& out,
                            void* stream, bool gpu) {
  linear_gelu_aux(p, in[0], in[1], p.has_bias ? &in[2] : nullptr, out[0], out[1],
                  fused_gelu_forward(out[0].dtype()), stream, gpu);
}

// LinearDgelu: dpre = (g W) * gelu'(pre), with bgrad db = column sums of dpre; the epilogue
// (CPU, Cublaslt) or a plain GEMM and our in-place kernel (CUDA).
static void run_linear_dgelu(LinearDgelu& p, const std::vector<Tensor>& in,
                             std::vector<Tensor>& out, void* stream, bool gpu) {
  bt_linalg_gemm_desc d = make_desc(p, in[0], false, in[1], false, out[0], stream);
  if (gpu && lgl_impl() != LglImpl::Cublaslt) {
#ifdef BT_WITH_CUDA
    call_gemm(p, d);
    cuda::gelu_tanh_backward_inplace(out[0], in[2], p.bgrad ? out[1] : Tensor(), p.name());
    return;
#endif
  }
  d.epilogue = p.bgrad ? BT_LINALG_EPI_DGELU_BGRAD : BT_LINALG_EPI_DGELU;
  d.aux = d.d;
  d.aux.ptr = in[2].data_ptr(p.name());
  d.aux.dtype = linalg_dtype(in[2].dtype(), p.name());
  if (p.bgrad) d.bgrad = vec(out[1], p);
  call_gemm(p, d);
}

// LinearGeluLinear: h = gelu(x W1^T + b1) (pre saved), y = h W2^T + b2. With recompute h is a
// temporary and always comes from the GeluTanh kernel (what the backward's recompute runs).
static void run_linear_gelu_linear(LinearGeluLinear& p, const std::vector<Tensor>& in,
                                   std::vector<Tensor>& out, void* stream, bool gpu) {
  const size_t ib1 = 3, ib2 = p.has_b1 ? 4 : 3;
  Tensor& pre = p.recompute ? out[1] : out[2];
  Tensor h = p.recompute ? empty_tensor(pre.shape(), pre.dtype(), pre.device(), p.name()) : out[1];
  const bool fused = !p.recompute && fused_gelu_forward(pre.dtype());
  linear_gelu_aux(p, in[0], in[1], p.has_b1 ? &in[ib1] : nullptr, h, pre, fused, stream, gpu);
  bt_linalg_gemm_desc d2 = make_desc(p, h, false, in[2], true, out[0], stream);
  if (p.has_b2) {
    d2.epilogue = BT_LINALG_EPI_BIAS;
    d2.bias = vec(in[ib2], p);
  }
  call_gemm(p, d2);
}

// LinearWeightGrad: dW = g^T x (N, K); db = row sums of g^T into out[1]: on CUDA our column-sum
// kernel after a plain GEMM where it applies (cuBLASLt runs BGRAD as a separate, slower kernel;
// see src/cuda/mlp.cu), else the GEMM's BGRAD_A epilogue.
static void run_linear_weight_grad(LinearWeightGrad& p, const std::vector<Tensor>& in,
                                   std::vector<Tensor>& out, void* stream, bool gpu) {
  bt_linalg_gemm_desc d = make_desc(p, in[0], true, in[1], false, out[0], stream);
  if (p.has_bias) {
#ifdef BT_WITH_CUDA
    if (gpu && cuda::bias_grad_by_kernel() && cuda::column_sums_apply(in[0])) {
      call_gemm(p, d);
      cuda::column_sums(in[0], out[1], p.name());
      return;
    }
#endif
    d.epilogue = BT_LINALG_EPI_BGRAD_A;
    d.bgrad = vec(out[1], p);
  }
  call_gemm(p, d);
}

// LinearCrossEntropy (Note [chunked classifier], autocast.h): per chunk of rows, the head GEMM
// into one (rows, Vp) buffer, the cross-entropy forward (row losses), its backward over the same
// buffer, then dx rows = dlogits W and dW (+)= dlogits^T x.  The cross-entropy, fill and
// reduction steps are those primitives' own kernels, run on the device's backend.
static void run_linear_cross_entropy(LinearCrossEntropy& p, const std::vector<Tensor>& in,
                                     std::vector<Tensor>& out, void* stream, bool gpu) {
  const Tensor &x = in[0], &w = in[1], &t = in[2];
  const int64_t N = x.shape()[0], K = x.shape()[1], Vp = w.shape()[0];
  const Device dev = x.device();
  const DType acc = out[0].dtype();
  auto run = [gpu](Primitive&& prim, const std::vector<Tensor>& ins, std::vector<Tensor> outs) {
    if (gpu) {
      prim.eval_gpu(ins, outs);
    } else {
      prim.eval_cpu(ins, outs);
    }
  };
  if (!gpu) {  // the CPU cross-entropy raises on a bad target; name its row in the whole batch
    const int64_t* tp = static_cast<const int64_t*>(t.data_ptr(p.name()));
    for (int64_t i = 0; i < N; ++i) {
      if (tp[i] != p.ignore_index && (tp[i] < 0 || tp[i] >= p.num_classes)) {
        throw IndexError("[linear_cross_entropy] target " + std::to_string(tp[i]) + " (row " +
                         std::to_string(i) + ") is out of range for " +
                         std::to_string(p.num_classes) + " classes (ignore_index is " +
                         std::to_string(p.ignore_index) + ")");
      }
    }
  }
  Tensor row_loss = empty_tensor({N}, acc, dev, p.name());
  const size_t idw = p.need_dx ? 2 : 1;
  // The mean's count of non-ignored rows and its inverse, the gradient of every row's loss.
  Tensor count, inverse;
  if (p.mean) {
    count = empty_tensor({}, acc, dev, p.name());
    inverse = empty_tensor({}, acc, dev, p.name());
    if (gpu) {
#ifdef BT_WITH_CUDA
      cuda::count_targets(t, p.ignore_index, count, inverse, p.name());
#endif
    } else {
      const int64_t* tp = static_cast<const int64_t*>(t.data_ptr(p.name()));
      const double n = static_cast<double>(
          std::count_if(tp, tp + N, [&](int64_t v) { return v != p.ignore_index; }));
      run(Full(n), {}, {count});
      run(Full(1.0 / n), {}, {inverse});  // inf for n = 0: ignored rows' gradients stay 0
    }
  }
  if (N > 0) {
    const int64_t rows = std::min(p.chunk_rows, N);
    const bool backward = p.need_dx || p.need_dw;
    Tensor buf = empty_tensor({rows, Vp}, x.dtype(), dev, p.name());
    Tensor grad_loss = inverse;  // every row's loss gradient: 1 / count for the mean, else 1
    if (backward && !p.mean) {
      grad_loss = empty_tensor({}, acc, dev, p.name());
      run(Full(1.0), {}, {grad_loss});
    }
    const DType sd = x.dtype() == DType::Float64 ? DType::Float64 : DType::Float32;
    for (int64_t r0 = 0; r0 < N; r0 += rows) {
      const int64_t n = std::min(rows, N - r0);
      const Tensor xc = make_view(x, {n, K}, x.strides(), x.offset() + r0 * x.strides()[0]);
      const Tensor tc = make_view(t, {n}, {1}, t.offset() + r0);
      const Tensor logits = make_view(buf, {n, Vp}, {Vp, 1}, buf.offset());
      const Tensor lse = empty_tensor({n}, sd, dev, p.name());
      call_gemm(p, make_desc(p, xc, false, w, true, logits, stream));
      const Tensor loss_rows = make_view(row_loss, {n}, {1}, r0);
      bool fused = false;  // forward and backward in one kernel (CUDA, where it applies)
#ifdef BT_WITH_CUDA
      fused = gpu && backward &&
              cuda::cross_entropy_fwd_bwd_inplace(logits, tc, lse, loss_rows, inverse,
                                                  p.num_classes, p.ignore_index, p.name());
#endif
      if (!fused) {
        run(CrossEntropy(p.ignore_index, 0, 0.0, p.num_classes), {logits, tc}, {loss_rows, lse});
        if (!backward) continue;
        // dlogits of the loss over the logits (each element read before it is written)
        run(CrossEntropyBackward(p.ignore_index, 2, 0.0, p.num_classes, true),
            {logits, tc, lse, grad_loss}, {logits});
      }
      if (p.need_dx) {
        const Tensor dxc = make_view(out[1], {n, K}, {K, 1}, out[1].offset() + r0 * K);
        call_gemm(p, make_desc(p, logits, false, w, false, dxc, stream));
      }
      if (p.need_dw) {
        bt_linalg_gemm_desc d = make_desc(p, logits, true, xc, false, out[idw], stream);
        d.beta = r0 == 0 ? 0.0 : 1.0;  // accumulate over chunks in dW's (wide) dtype
        call_gemm(p, d);
      }
    }
  } else if (p.need_dw) {  // no rows: a zero gradient
    run(Full(0.0), {}, {out[idw]});
  }
  if (!p.mean) {
    run(Reduce(ReduceOp::Sum, {0}, false), {row_loss}, {out[0]});
    return;
  }
  Tensor total = empty_tensor({}, acc, dev, p.name());
  run(Reduce(ReduceOp::Sum, {0}, false), {row_loss}, {total});
  run(Binary(BinaryOp::Div), {total, count}, {out[0]});  // 0 / 0 = nan with every row ignored
}

void Matmul::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  run_gemm(*this, in, out, trans_b, has_bias, nullptr);
}
void LinearGelu::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  run_linear_gelu(*this, in, out, nullptr, false);
}
void LinearWeightGrad::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  run_linear_weight_grad(*this, in, out, nullptr, false);
}
void LinearDgelu::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  run_linear_dgelu(*this, in, out, nullptr, false);
}
void LinearGeluLinear::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  run_linear_gelu_linear(*this, in, out, nullptr, false);
}
void LinearCrossEntropy::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  run_linear_cross_entropy(*this, in, out, nullptr, false);
}

#ifdef BT_WITH_CUDA
// blutrain-linalg runs the same descriptor on the device (cuBLASLt), on the device's current
// stream.
void Matmul::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  run_gemm(*this, in, out, trans_b, has_bias, backend::current_stream(out[0].device()));
}
void LinearGelu::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  run_linear_gelu(*this, in, out, backend::current_stream(out[0].device()), true);
}
void LinearWeightGrad::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  run_linear_weight_grad(*this, in, out, backend::current_stream(out[0].device()), true);
}
void LinearDgelu::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  run_linear_dgelu(*this, in, out, backend::current_stream(out[0].device()), true);
}
void LinearGeluLinear::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  run_linear_gelu_linear(*this, in, out, backend::current_stream(out[0].device()), true);
}
void LinearCrossEntropy::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  run_linear_cross_entropy(*this, in, out, backend::current_stream(out[0].device()), true);
}
#else
void LinearGelu::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
void LinearWeightGrad::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
void LinearDgelu::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
void LinearGeluLinear::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
void LinearCrossEntropy::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
#endif

}  // namespace bt
