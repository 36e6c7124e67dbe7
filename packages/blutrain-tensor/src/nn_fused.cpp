// nn_fused.cpp: fronts of the fused normalisation / loss ops and their vjps (see nn_fused.h).
#include "nn_fused.h"

#include <cmath>

#include "autocast.h"
#include "ops.h"

namespace bt {

namespace {
DType stat_dtype(DType d) { return d == DType::Float64 ? DType::Float64 : DType::Float32; }

void check_device_match(const Tensor& a, const Tensor& b, const char* op) {
  if (a.defined() && b.defined() && a.device() != b.device()) {
    throw ValueError(std::string("[") + op + "] expected all tensors on one device, got " +
                     a.device().str() + " and " + b.device().str());
  }
}
}  // namespace

std::pair<Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& residual,
                                         const Tensor& weight, const Tensor& bias, double eps,
                                         bool recompute, const Tensor& residual_bias,
                                         std::optional<DType> out_dtype,
                                         std::optional<DType> stream_grad_dtype) {
  OpScope scope("add_layer_norm");  // Note [the op the user called]
  const char* op = "add_layer_norm";
  if (!x.defined() || !residual.defined()) throw ValueError("[add_layer_norm] undefined input");
  if (!is_floating(x.dtype())) {
    throw TypeError(std::string("[add_layer_norm] expects a floating input, got ") +
                    dtype_name(x.dtype()));
  }
  if (out_dtype && !is_floating(*out_dtype)) {
    throw TypeError(std::string("[add_layer_norm] out_dtype must be a floating dtype, got ") +
                    dtype_name(*out_dtype));
  }
  if (x.ndim() < 1) throw ValueError("[add_layer_norm] input must have at least one dim");
  if (residual.shape() != x.shape()) {
    throw ValueError("[add_layer_norm] x " + shape_str(x.shape()) + " and residual " +
                     shape_str(residual.shape()) + " must have the same shape");
  }
  check_device_match(x, residual, op);
  const int64_t C = x.shape().back();
  for (const Tensor* p : {&weight, &bias, &residual_bias}) {
    if (p->defined() && p->shape() != Shape{C}) {
      throw ValueError("[add_layer_norm] weight, bias and residual_bias must have shape (" +
                       std::to_string(C) + ",), got " + shape_str(p->shape()));
    }
    check_device_match(x, *p, op);
  }
  const DType dt = x.dtype();
  const DType odt = out_dtype.value_or(dt);
  if (stream_grad_dtype && *stream_grad_dtype != dt && *stream_grad_dtype != odt) {
    throw ValueError(std::string("[add_layer_norm] stream_grad_dtype must be x's dtype (") +
                     dtype_name(dt) + ") or out_dtype's (" + dtype_name(odt) + "), got " +
                     dtype_name(*stream_grad_dtype));
  }
  // Note [float32 residual stream]: a float32 x with a 16-bit y is one kernel that reads the
  // residual in y's dtype; other pairs add and normalise in x's dtype, then cast y.
  const bool mixed = odt != dt && is_mixed_norm(dt, odt) && residual.dtype() == odt;
  if (odt != dt && !mixed) {
    auto r = add_layer_norm(x, residual, weight, bias, eps, recompute, residual_bias);
    return {r.first, astype(r.second, odt)};
  }
  const bool wide_grad = mixed && stream_grad_dtype == dt;
  Shape rows(x.shape().begin(), x.shape().end() - 1);
  auto cast = [dt](const Tensor& t) { return t.defined() ? astype(t, dt) : Tensor(); };
  std::vector<Tensor> in{x, mixed ? residual : astype(residual, dt), cast(weight), cast(bias),
                         cast(residual_bias)};
  auto outs =
      apply(std::make_shared<AddLayerNorm>(eps, weight.defined(), bias.defined(),
                                           residual_bias.defined(), mixed, odt, wide_grad),
            in, {{x.shape(), dt}, {x.shape(), odt}, {rows, stat_dtype(dt)}, {rows, stat_dtype(dt)}},
            x.device());
  if (recompute && grad_enabled() && outs[1].requires_grad()) {
    // y again: LayerNorm's kernels on the kept sum do y's very arithmetic (the add kernels
    // normalise the stored, rounded sum)
    const std::vector<std::pair<Shape, DType>> meta{
        {x.shape(), odt}, {rows, stat_dtype(dt)}, {rows, stat_dtype(dt)}};
    auto prim = std::make_shared<LayerNorm>(eps, weight.defined(), bias.defined());
    const Device dev = x.device();
    mark_recompute(outs[1], "add_layer_norm", {outs[0], in[2], in[3]},
                   [prim, meta, dev](const std::vector<Tensor>& ins) {
                     return apply(prim, ins, meta, dev)[0];
                   });
  }
  return {outs[0], outs[1]};
}

std::vector<Tensor> layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                        const Tensor& mean, const Tensor& rstd, const Tensor& extra,
                                        bool need_dweight, bool need_dbias, bool wide_grads,
                                        bool need_dsum, std::optional<DType> dx_dtype) {
  const int64_t C = x.shape().back();
  const int64_t R = C ? x.numel() / C : 0;
  const DType dt = x.dtype();
  // Note [float32 residual stream]: a 16-bit dy over a float32 x is read as is; dx (and extra)
  // float32 or dy's dtype.  Otherwise everything is in x's dtype and dx is cast if asked.
  const bool mixed = is_mixed_norm(dt, dy.dtype());
  const DType odt = dx_dtype.value_or(dt);
  if (odt != dt && !(mixed && odt == dy.dtype())) {
    auto r = layer_norm_backward(dy, x, weight, mean, rstd, extra, need_dweight, need_dbias,
                                 wide_grads, need_dsum);
    r[0] = astype(r[0], odt);
    return r;
  }
  std::vector<Tensor> in{reshape(mixed ? dy : astype(dy, dt), {R, C}),
                         reshape(x, {R, C}),
                         weight.defined() ? astype(weight, dt) : Tensor(),
                         reshape(mean, {R}),
                         reshape(rstd, {R}),
                         extra.defined() ? reshape(astype(extra, odt), {R, C}) : Tensor()};
  const bool hw = weight.defined();
  const bool wide = wide_grads && (dt == DType::BFloat16 || dt == DType::Float16);
  const DType gdt = wide ? DType::Float32 : dt;
  std::vector<std::pair<Shape, DType>> meta{{{R, C}, odt}};
  if (need_dweight) meta.push_back({{C}, gdt});
  if (need_dbias) meta.push_back({{C}, gdt});
  if (need_dsum) meta.push_back({{C}, gdt});
  auto outs = apply(std::make_shared<LayerNormBackward>(hw, extra.defined(), need_dweight,
                                                        need_dbias, wide, need_dsum),
                    in, meta, x.device());
  std::vector<Tensor> r(4);
  r[0] = reshape(outs[0], x.shape());
  size_t k = 1;
  if (need_dweight) r[1] = outs[k++];
  if (need_dbias) r[2] = outs[k++];
  if (need_dsum) r[3] = outs[k++];
  return r;
}

Tensor softmax_backward(const Tensor& y, const Tensor& dy, bool log) {
  return apply1(std::make_shared<SoftmaxBackward>(log), {y, astype(dy, y.dtype())}, y.shape(),
                y.dtype(), y.device());
}

Tensor gelu_tanh_grad(const Tensor& x, const Tensor& g) {
  if (!x.device().is_cuda() && !g.device().is_cuda() && !x.is_symbolic() && !g.is_symbolic() &&
      x.dtype() == g.dtype() && x.shape() == g.shape() && is_floating(x.dtype())) {
    return apply1(std::make_shared<GeluTanhBackward>(), {x, g}, x.shape(), x.dtype(), x.device());
  }
  const double k = std::sqrt(2.0 / M_PI), c = 0.044715;
  Tensor x2 = mul(x, x);
  Tensor t = unary(UnaryOp::Tanh, mul(mul(x, add(mul(x2, c), 1.0)), k));
  Tensor left = mul(add(t, 1.0), 0.5);
  Tensor one_minus_t2 = binary(BinaryOp::Sub, Scalar{1, 2}, mul(t, t));
  Tensor right = mul(mul(mul(x, one_minus_t2), add(mul(x2, 3 * c), 1.0)), 0.5 * k);
  return mul(g, add(left, right));
}

std::vector<Tensor> GeluTanhBackward::vjp(const VjpArgs&) {
  throw RuntimeError("[gelu_tanh_backward] is not differentiable");
}

Tensor cross_entropy_backward(const Tensor& logits, const Tensor& target, const Tensor& lse,
                              const Tensor& grad_loss, int64_t ignore_index, int reduction,
                              double label_smoothing, int64_t num_classes, bool in_place) {
  return apply1(std::make_shared<CrossEntropyBackward>(ignore_index, reduction, label_smoothing,
                                                       num_classes, in_place),
                {logits, target, lse, grad_loss}, logits.shape(), logits.dtype(), logits.device());
}

bool layer_norm_wide_grads(const VjpArgs& a, DType dt, bool need_dweight, size_t iw,
                           bool need_dbias, size_t ib) {
  auto wide = [&](size_t i) { return weight_grad_dtype(a, i, dt) == DType::Float32; };
  return (need_dweight || need_dbias) && (!need_dweight || wide(iw)) && (!need_dbias || wide(ib));
}

// ---- vjps --------------------------------------------------------------------------------------
std::vector<Tensor> LayerNormBackward::vjp(const VjpArgs&) {
  throw RuntimeError("[layer_norm_backward] is not differentiable (no double backward)");
}
std::vector<Tensor> SoftmaxBackward::vjp(const VjpArgs&) {
  throw RuntimeError(std::string("[") + name() + "] is not differentiable (no double backward)");
}
std::vector<Tensor> CrossEntropyBackward::vjp(const VjpArgs&) {
  throw RuntimeError("[cross_entropy_backward] is not differentiable (no double backward)");
}

std::vector<Tensor> AddLayerNorm::vjp(const VjpArgs& a) {
  // cotangents: sum (undefined when nothing reads it), y, mean, rstd (the last two carry
  // nothing: stats are not differentiable).
  const Tensor& gsum = a.cotangents[0];
  const Tensor& gy = a.cotangents[1];
  const bool ndw = has_weight && a.needs[2], ndb = has_bias && a.needs[3];
  const bool nds = has_residual_bias && a.needs[4];
  const DType dt = a.outputs[0].dtype();
  // float32 affine / residual-bias gradients only when every wanted one goes to a float32 master
  const bool wide = (ndw || ndb || nds) &&
                    (!(ndw || ndb) || layer_norm_wide_grads(a, dt, ndw, 2, ndb, 3)) &&
                    (!nds || weight_grad_dtype(a, 4, dt) == DType::Float32);
  // mixed: one dx in y's dtype serves the residual and (as the cotangent this node's sum takes)
  // the stream, unless the stream's gradient is float32 (wide_stream_grad) or the sum's came
  // float32 (it has another reader): then float32
  auto dxt = mixed && !wide_stream_grad && !(gsum.defined() && gsum.dtype() != y_dtype)
                 ? std::optional<DType>(y_dtype)
                 : std::nullopt;
  auto r = layer_norm_backward(gy, a.outputs[0], has_weight ? a.inputs[2] : Tensor(), a.outputs[2],
                               a.outputs[3], gsum, ndw, ndb, wide, nds, dxt);
  // (the engine casts dx to the inputs' dtypes where they differ)
  return {r[0], r[0], r[1], r[2], r[3]};
}

}  // namespace bt
