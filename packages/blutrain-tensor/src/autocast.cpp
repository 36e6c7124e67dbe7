// autocast.cpp: float32 matmul precision, linear_gelu's front and vjp (see autocast.h). The
// GEMM evals of LinearGelu / LinearWeightGrad live in src/cpu/matmul.cpp with Matmul's.
#include "autocast.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <tuple>

#include "autograd.h"
#include "capture.h"
#include "nn_fused.h"
#include "ops.h"
#include "optim.h"

namespace bt {

// ---- float32 matmul precision ------------------------------------------------------------------
static std::atomic<int> g_matmul_precision{static_cast<int>(MatmulPrecision::Highest)};

void set_float32_matmul_precision(MatmulPrecision p) {
  g_matmul_precision.store(static_cast<int>(p), std::memory_order_relaxed);
}
MatmulPrecision float32_matmul_precision() {
  return static_cast<MatmulPrecision>(g_matmul_precision.load(std::memory_order_relaxed));
}
MatmulPrecision parse_matmul_precision(const std::string& s) {
  if (s == "highest") return MatmulPrecision::Highest;
  if (s == "high") return MatmulPrecision::High;
  if (s == "medium") return MatmulPrecision::Medium;
  throw ValueError("[set_float32_matmul_precision] expected 'highest', 'high' or 'medium', got '" +
                   s + "'");
}
const char* matmul_precision_name(MatmulPrecision p) {
  switch (p) {
    case MatmulPrecision::High:
      return "high";
    case MatmulPrecision::Medium:
      return "medium";
    default:
      return "highest";
  }
}

// ---- float32 attention precision ---------------------------------------------------------------
static std::atomic<int> g_attention_precision{static_cast<int>(AttentionPrecision::Matmul)};

void set_float32_attention_precision(AttentionPrecision p) {
  g_attention_precision.store(static_cast<int>(p), std::memory_order_relaxed);
}
AttentionPrecision float32_attention_precision() {
  return static_cast<AttentionPrecision>(g_attention_precision.load(std::memory_order_relaxed));
}
AttentionPrecision parse_attention_precision(const std::string& s) {
  if (s == "matmul") return AttentionPrecision::Matmul;
  if (s == "scores") return AttentionPrecision::Scores;
  if (s == "highest") return AttentionPrecision::Highest;
  throw ValueError(
      "[set_float32_attention_precision] expected 'matmul' (follow the matmul precision), "
      "'scores' (3xTF32 for the scores Q K^T, the rest as the matmul precision) or 'highest' "
      "(3xTF32), got '" +
      s + "'");
}
const char* attention_precision_name(AttentionPrecision p) {
  switch (p) {
    case AttentionPrecision::Highest:
      return "highest";
    case AttentionPrecision::Scores:
      return "scores";
    default:
      return "matmul";
  }
}
bool float32_attention_exact() {
  return float32_attention_precision() == AttentionPrecision::Highest ||
         float32_matmul_precision() == MatmulPrecision::Highest;
}
bool float32_attention_scores_exact() {
  return float32_attention_exact() || float32_attention_precision() == AttentionPrecision::Scores;
}

// ---- linear_gelu_linear's implementation choice ------------------------------------------------
// -1: not read yet; -2: BLUTRAIN_LGL_EPILOGUE holds an unknown name (every use raises).
static std::atomic<int> g_lgl_impl{-1};

LglImpl parse_lgl_impl(const std::string& s) {
  if (s == "kernel") return LglImpl::Kernel;
  if (s == "cublaslt") return LglImpl::Cublaslt;
  if (s == "kernel_v1") return LglImpl::KernelV1;
  throw ValueError("[linear_gelu_linear] expected 'kernel', 'cublaslt' or 'kernel_v1', got '" + s +
                   "'");
}
const char* lgl_impl_name(LglImpl impl) {
  switch (impl) {
    case LglImpl::Cublaslt:
      return "cublaslt";
    case LglImpl::KernelV1:
      return "kernel_v1";
    default:
      return "kernel";
  }
}
LglImpl lgl_impl() {
  int v = g_lgl_impl.load(std::memory_order_relaxed);
  if (v == -1) {
    const char* env = std::getenv("BLUTRAIN_LGL_EPILOGUE");
    int parsed = 0;
    if (env && *env) {
      try {
        parsed = static_cast<int>(parse_lgl_impl(env));
      } catch (const ValueError&) {
        parsed = -2;
      }
    }
    int expected = -1;  // a concurrent set_lgl_impl wins
    g_lgl_impl.compare_exchange_strong(expected, parsed, std::memory_order_relaxed);
    v = g_lgl_impl.load(std::memory_order_relaxed);
  }
  if (v == -2) {
    throw ValueError(std::string("[linear_gelu_linear] BLUTRAIN_LGL_EPILOGUE='") +
                     std::getenv("BLUTRAIN_LGL_EPILOGUE") + "': expected 'kernel' or 'cublaslt'");
  }
  return static_cast<LglImpl>(v);
}
void set_lgl_impl(LglImpl impl) {
  g_lgl_impl.store(static_cast<int>(impl), std::memory_order_relaxed);
}

// ---- linear_gelu -----------------------------------------------------------------------------
// Operands the GEMM reads in place (unit stride along one of the two dims), else a copy; as
// ops.cpp's gemm_ready for the 2-D case.
static Tensor gemm_ready_2d(const Tensor& t) {
  const int64_t r = t.shape()[0], c = t.shape()[1];
  const int64_t rs = t.strides()[0], cs = t.strides()[1];
  const bool n_ok = (c == 1 || cs == 1) && (r == 1 || rs >= c);
  const bool t_ok = (r == 1 || rs == 1) && (c == 1 || cs >= r);
  return n_ok || t_ok ? t : contiguous(t);
}

static bool is_16bit(DType d) { return d == DType::BFloat16 || d == DType::Float16; }

DType weight_grad_dtype(const VjpArgs& a, size_t i, DType dt) {
  const bool wide = i < a.grad_dtypes.size() && a.grad_dtypes[i] == DType::Float32;
  return is_16bit(dt) && wide ? DType::Float32 : dt;
}

std::pair<Tensor, Tensor> linear_weight_grads(const VjpArgs& a, const Tensor& g, const Tensor& x,
                                              const Shape& weight_shape, size_t iw, bool want_db) {
  const DType dw = weight_grad_dtype(a, iw, g.dtype());
  std::vector<std::pair<Shape, DType>> meta{{weight_shape, dw}};
  if (want_db) meta.push_back({Shape{weight_shape[0]}, dw});
  auto r = apply(std::make_shared<LinearWeightGrad>(want_db), {gemm_ready_2d(g), gemm_ready_2d(x)},
                 meta, g.device());
  return {r[0], want_db ? r[1] : Tensor()};
}

Tensor gelu_tanh_backward(const Tensor& dy_in, const Tensor& pre_in) {
  // 16-bit: the derivative in float32 (its tanh and cubic lose too much in bf16).
  const DType dt = dy_in.dtype();
  const DType cd = is_16bit(dt) ? DType::Float32 : dt;
  return astype(gelu_tanh_grad(astype(pre_in, cd), astype(dy_in, cd)), dt);
}

Tensor linear_gelu(const Tensor& x, const Tensor& w, const Tensor& b) {
  OpScope scope("linear_gelu");  // Note [the op the user called]
  if (!x.defined() || !w.defined()) throw ValueError("[linear_gelu] input and weight are required");
  if (w.ndim() != 2)
    throw ValueError("[linear_gelu] weight must be 2-D (out, in), got " + shape_str(w.shape()));
  if (x.ndim() == 0 || x.shape().back() != w.shape()[1]) {
    throw ValueError("[linear_gelu] input of shape " + shape_str(x.shape()) + " has " +
                     (x.ndim() ? std::to_string(x.shape().back()) : std::string("no")) +
                     " features but weight " + shape_str(w.shape()) + " expects " +
                     std::to_string(w.shape()[1]));
  }
  if (b.defined() && b.shape() != Shape{w.shape()[0]}) {
    throw ValueError("[linear_gelu] bias has shape " + shape_str(b.shape()) + ", expected (" +
                     std::to_string(w.shape()[0]) + ",)");
  }
  if (x.device() != w.device() || (b.defined() && b.device() != x.device())) {
    throw ValueError("[linear_gelu] input, weight and bias must be on one device");
  }
  const DType dt = promote_types(x.dtype(), w.dtype());
  if (!is_floating(dt)) {
    throw TypeError(std::string("[linear_gelu] expects floating tensors, got ") +
                    dtype_name(x.dtype()) + " and " + dtype_name(w.dtype()));
  }
  const int64_t in = w.shape()[1], outf = w.shape()[0];
  Tensor x2 = gemm_ready_2d(as_rows(astype(x, dt)));
  std::vector<Tensor> ins{x2, gemm_ready_2d(astype(w, dt))};
  if (b.defined()) ins.push_back(contiguous(astype(b, dt)));
  const Shape s2{x2.shape()[0], outf};
  auto outs =
      apply(std::make_shared<LinearGelu>(b.defined()), ins, {{s2, dt}, {s2, dt}}, x.device());
  Shape os(x.shape().begin(), x.shape().end() - 1);
  os.push_back(outf);
  return reshape(outs[0], os);
}

std::vector<Tensor> LinearGelu::vjp(const VjpArgs& a) {
  // The front never returns pre, so its cotangent (zeros) is not added.
  const Tensor& x = a.inputs[0];
  const Tensor& w = a.inputs[1];
  const Tensor& pre = a.outputs[1];
  const Tensor dpre = gelu_tanh_backward(a.cotangents[0], pre);
  std::vector<Tensor> r(a.inputs.size());
  if (a.needs[0]) r[0] = matmul(dpre, w);
  const bool want_db = has_bias && a.needs[2];
  if (a.needs[1]) {
    auto [dw, db] = linear_weight_grads(a, dpre, x, w.shape(), 1, want_db);
    r[1] = dw;
    if (want_db) r[2] = db;
  } else if (want_db) {
    r[2] = sum(dpre, {0});
  }
  return r;
}

std::vector<Tensor> LinearWeightGrad::vjp(const VjpArgs& a) { return Primitive::vjp(a); }
std::vector<Tensor> LinearDgelu::vjp(const VjpArgs& a) { return Primitive::vjp(a); }

static void check_linear_args(const Tensor& x, const Tensor& w, const Tensor& b, const char* op) {
  if (w.ndim() != 2)
    throw ValueError(std::string("[") + op + "] weight must be 2-D (out, in), got " +
                     shape_str(w.shape()));
  if (x.ndim() == 0 || x.shape().back() != w.shape()[1]) {
    throw ValueError(std::string("[") + op + "] input of shape " + shape_str(x.shape()) +
                     " does not match weight " + shape_str(w.shape()));
  }
  if (b.defined() && b.shape() != Shape{w.shape()[0]}) {
    throw ValueError(std::string("[") + op + "] bias has shape " + shape_str(b.shape()) +
                     ", expected (" + std::to_string(w.shape()[0]) + ",)");
  }
  if (w.device() != x.device() || (b.defined() && b.device() != x.device())) {
    throw ValueError(std::string("[") + op + "] all tensors must be on one device");
  }
}

Tensor linear_gelu_linear(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                          const Tensor& b2, bool recompute) {
  OpScope scope("linear_gelu_linear");
  const char* op = "linear_gelu_linear";
  if (!x.defined() || !w1.defined() || !w2.defined())
    throw ValueError("[linear_gelu_linear] input, w1 and w2 are required");
  check_linear_args(x, w1, b1, op);
  if (w2.ndim() != 2 || w2.shape()[1] != w1.shape()[0]) {
    throw ValueError("[linear_gelu_linear] w2 " + shape_str(w2.shape()) + " does not take w1's " +
                     std::to_string(w1.shape()[0]) + " outputs");
  }
  if (w2.device() != x.device() || (b2.defined() && b2.device() != x.device()))
    throw ValueError("[linear_gelu_linear] all tensors must be on one device");
  if (b2.defined() && b2.shape() != Shape{w2.shape()[0]}) {
    throw ValueError("[linear_gelu_linear] b2 has shape " + shape_str(b2.shape()) + ", expected (" +
                     std::to_string(w2.shape()[0]) + ",)");
  }
  const DType dt = promote_types(promote_types(x.dtype(), w1.dtype()), w2.dtype());
  if (!is_floating(dt)) {
    throw TypeError(std::string("[linear_gelu_linear] expects floating tensors, got ") +
                    dtype_name(x.dtype()));
  }
  const int64_t K = w1.shape()[1], N1 = w1.shape()[0], N2 = w2.shape()[0];
  Tensor x2 = gemm_ready_2d(as_rows(astype(x, dt)));
  std::vector<Tensor> ins{x2, gemm_ready_2d(astype(w1, dt)), gemm_ready_2d(astype(w2, dt))};
  if (b1.defined()) ins.push_back(contiguous(astype(b1, dt)));
  if (b2.defined()) ins.push_back(contiguous(astype(b2, dt)));
  const int64_t M = x2.shape()[0];
  std::vector<std::pair<Shape, DType>> meta{{{M, N2}, dt}, {{M, N1}, dt}};
  if (!recompute) meta.push_back({{M, N1}, dt});  // h, then pre
  auto outs = apply(std::make_shared<LinearGeluLinear>(b1.defined(), b2.defined(), recompute), ins,
                    meta, x.device());
  Shape os(x.shape().begin(), x.shape().end() - 1);
  os.push_back(N2);
  return reshape(outs[0], os);
}

std::vector<Tensor> LinearGeluLinear::vjp(const VjpArgs& a) {
  // h and pre are not returned by the front: only y's cotangent flows.
  const Tensor &x = a.inputs[0], &w1 = a.inputs[1], &w2 = a.inputs[2];
  const Tensor& pre = recompute ? a.outputs[1] : a.outputs[2];
  const Tensor dy = gemm_ready_2d(a.cotangents[0]);
  const DType dt = dy.dtype();
  const size_t ib1 = 3, ib2 = has_b1 ? 4 : 3;
  std::vector<Tensor> r(a.inputs.size());
  const bool want_db1 = has_b1 && a.needs[ib1], want_db2 = has_b2 && a.needs[ib2];
  if (a.needs[2] || want_db2) {
    // With recompute, h is rebuilt by the kernel the forward used (same bits) and freed after
    // the dW2 GEMM.
    const Tensor h = recompute ? apply1(std::make_shared<Unary>(UnaryOp::GeluTanh), {pre},
                                        pre.shape(), pre.dtype(), pre.device())
                               : a.outputs[1];
    auto [dw2, db2] = linear_weight_grads(a, dy, h, w2.shape(), 2, want_db2);
    if (a.needs[2]) r[2] = dw2;
    if (want_db2) r[ib2] = db2;
  }
  if (a.needs[0] || a.needs[1] || want_db1) {
    const int64_t M = dy.shape()[0], N1 = w2.shape()[1];
    std::vector<std::pair<Shape, DType>> meta{{{M, N1}, dt}};
    // db1 in float32 for a float32 master from our column-sum kernels (the CPU: linalg's
    // epilogue); cuBLASLt's DGELU_BGRAD (LglImpl::Cublaslt on CUDA) keeps dpre's dtype
    const bool wide_db1 = !(dy.device().is_cuda() && lgl_impl() == LglImpl::Cublaslt);
    if (want_db1) meta.push_back({Shape{N1}, wide_db1 ? weight_grad_dtype(a, ib1, dt) : dt});
    auto d = apply(std::make_shared<LinearDgelu>(want_db1), {dy, w2, contiguous(pre)}, meta,
                   dy.device());
    const Tensor& dpre = d[0];
    if (want_db1) r[ib1] = d[1];
    if (a.needs[0]) r[0] = matmul(dpre, w1);
    if (a.needs[1]) r[1] = linear_weight_grads(a, dpre, x, w1.shape(), 1, false).first;
  }
  return r;
}

// ---- linear_cross_entropy (Note [chunked classifier]) -----------------------------------------
// Default chunk: logits of at most this many bytes.  Each chunk re-reads and re-writes the dW
// accumulator and runs its dx GEMM on fewer rows, so fewer, larger chunks are faster: on an H200
// at GPT-2's head (16384 x 50304 x 768, fwd + bwd) bf16 took 6.77 ms unchunked, 7.38 ms in
// 4096-row chunks (this default), 7.75 ms in 2368-row chunks (256 MiB); fp32 (TF32) 16.0 ms
// unchunked and 17.0 ms in 2048-row chunks, where memory matters more than that 0.3% of a step.
constexpr int64_t kChunkBytes = 512LL << 20;  // 512 MiB

Tensor linear_cross_entropy(const Tensor& x, const Tensor& w, const Tensor& target,
                            int64_t ignore_index, const std::string& reduction,
                            std::optional<int64_t> num_classes, std::optional<int64_t> chunk_size) {
  OpScope scope("linear_cross_entropy");
  const char* op = "linear_cross_entropy";
  if (!x.defined() || !w.defined() || !target.defined())
    throw ValueError("[linear_cross_entropy] input, weight and target are required");
  check_linear_args(x, w, Tensor(), op);
  const Shape rows_shape(x.shape().begin(), x.shape().end() - 1);
  if (target.shape() != rows_shape) {
    throw ValueError("[linear_cross_entropy] target has shape " + shape_str(target.shape()) +
                     ", expected input's leading dims " + shape_str(rows_shape) + " (input " +
                     shape_str(x.shape()) + ")");
  }
  if (target.device() != x.device())
    throw ValueError("[linear_cross_entropy] target must be on the input's device");
  if (is_floating(target.dtype()) || target.dtype() == DType::Bool) {
    throw TypeError(std::string("[linear_cross_entropy] target must hold integer class ids, got ") +
                    dtype_name(target.dtype()));
  }
  if (reduction != "mean" && reduction != "sum") {
    throw ValueError("[linear_cross_entropy] reduction must be 'mean' or 'sum', got '" + reduction +
                     "' (per-row losses: use linear + cross_entropy)");
  }
  const int64_t Vp = w.shape()[0], K = w.shape()[1];
  const int64_t V = num_classes.value_or(Vp);
  if (V < 1 || V > Vp) {
    throw ValueError("[linear_cross_entropy] num_classes " + std::to_string(V) +
                     " must be in [1, " + std::to_string(Vp) + "] (weight " + shape_str(w.shape()) +
                     ")");
  }
  if (chunk_size && *chunk_size < 1) {
    throw ValueError("[linear_cross_entropy] chunk_size must be >= 1, got " +
                     std::to_string(*chunk_size));
  }
  const DType dt = promote_types(x.dtype(), w.dtype());
  if (!is_floating(dt)) {
    throw TypeError(std::string("[linear_cross_entropy] expects floating tensors, got ") +
                    dtype_name(x.dtype()) + " and " + dtype_name(w.dtype()));
  }
  Tensor x2 = gemm_ready_2d(as_rows(astype(x, dt)));
  Tensor w2 = gemm_ready_2d(astype(w, dt));
  Tensor t = contiguous(reshape(astype(target, DType::Int64), {-1}));
  const int64_t N = x2.shape()[0];
  int64_t rows = chunk_size.value_or(0);
  if (!chunk_size) {  // even chunks of at most the byte budget, whole multiples of 64 rows
    const int64_t row_bytes = std::max<int64_t>(Vp * static_cast<int64_t>(itemsize(dt)), 1);
    const int64_t cap = std::max<int64_t>(kChunkBytes / row_bytes, 1);
    const int64_t chunks = std::max<int64_t>((N + cap - 1) / cap, 1);
    rows = ((N + chunks - 1) / chunks + 63) / 64 * 64;
  }
  rows = std::max<int64_t>(std::min(rows, N), 1);
  const DType acc = is_16bit(dt) ? DType::Float32 : dt;  // loss and dW accumulator
  const bool need_dx = grad_enabled() && x.requires_grad();
  const bool need_dw = grad_enabled() && w.requires_grad();
  std::vector<std::pair<Shape, DType>> meta{{Shape{}, acc}};
  if (need_dx) meta.push_back({x2.shape(), dt});
  if (need_dw) meta.push_back({w2.shape(), acc});
  // The mean over non-ignored rows (0/0 = nan when none): folded into the primitive, except in
  // float16, whose dlogits / count would fall into subnormals (Note [chunked classifier]).
  const bool fold_mean = reduction == "mean" && dt != DType::Float16;
  Tensor loss = apply(
      std::make_shared<LinearCrossEntropy>(ignore_index, V, rows, need_dx, need_dw, fold_mean),
      {x2, w2, t}, meta, x.device())[0];
  if (reduction == "sum" || fold_mean) return loss;
  return div(loss, sum(astype(binary(BinaryOp::Ne, t, Scalar{double(ignore_index), 1}), acc)));
}

std::vector<Tensor> LinearCrossEntropy::vjp(const VjpArgs& a) {
  // The forward saved the gradients of the loss: scale them by its cotangent.
  const Tensor& g = a.cotangents[0];
  std::vector<Tensor> r(a.in_meta.size());  // (no inputs are saved)
  const size_t idx = 1, idw = need_dx ? 2 : 1;
  const bool want_dx = need_dx && a.needs[0], want_dw = need_dw && a.needs[1];
  // On the node's last run nothing else can read them (Note [donating a saved input]): scale
  // them in place with the multi-tensor kernel, the same bits as the multiplications below.
  // (donatable() is asked before any copy of the saved handles exists.)
  bool in_place = a.last_run && !active_graph() && g.dtype() == DType::Float32;
  if (want_dx) in_place = in_place && donatable(a.outputs[idx]) && a.outputs[idx].is_contiguous();
  if (want_dw) in_place = in_place && donatable(a.outputs[idw]) && a.outputs[idw].is_contiguous();
  if (in_place && (want_dx || want_dw)) {
    if (want_dx) r[0] = a.outputs[idx];
    if (want_dw) r[1] = a.outputs[idw];
    std::vector<Tensor> wanted;
    for (const Tensor& t : {r[0], r[1]}) {
      if (t.defined()) wanted.push_back(t);
    }
    scale_(wanted, g);
  } else {
    if (want_dx) r[0] = mul(a.outputs[idx], astype(g, a.outputs[idx].dtype()));
    if (want_dw) r[1] = mul(a.outputs[idw], astype(g, a.outputs[idw].dtype()));
  }
  // dW is float32 for 16-bit weights: kept so where the weight is a cast of a float32 master
  // (Note [cached casts]), else rounded to the weight's dtype.
  if (r[1].defined()) r[1] = astype(r[1], weight_grad_dtype(a, 1, a.in_meta[1].dtype));
  return r;
}

}  // namespace bt
