// nn_fused.h: fused normalisation / loss primitives beyond primitives.h.
//
//   LayerNormBackward     dy, x, weight?, mean, rstd, extra? -> dx (+ extra), dweight?, dbias?,
//                         dsum? (the column sums of dx: a residual bias's gradient)
//                         (dweight/dbias reduced deterministically: per-block partials, then a
//                         second pass; no float atomics)
//   SoftmaxBackward       y, dy -> dx, for softmax and log_softmax over the last dim
//   CrossEntropyBackward  logits, target, lse, grad_loss -> dlogits (logits' dtype), one pass
//   AddLayerNorm          x, residual, weight?, bias?, residual_bias? -> sum = x + residual
//                         (+ residual_bias), y = layer_norm(sum), mean, rstd (one kernel reading
//                         x and residual once); y may be 16-bit over a float32 x (Note [float32
//                         residual stream])
// They are what the vjps of Softmax / LayerNorm / CrossEntropy / AddLayerNorm run on every
// backend.  Statistics (mean, rstd, lse) are float32 for 16-bit inputs, the input dtype otherwise.
//
// Note [float32 residual stream]
// Mixed precision as autocast runs a pre-LN transformer: the residual stream x (the embeddings'
// sum, every x + branch) stays float32 while the branches (GEMMs, attention) run in bf16.  Rounding
// x to bf16 at every add loses the branches' small increments to a stream 8 bits wide (issue 38:
// GPT-2 124M's bf16 run ended 0.27 below the float32 train loss and 0.41 above its val loss in
// 300 overfitting steps, autocast's 0.25 / 0.36; with a float32 stream 0.04 / 0.09).  The ops:
//   - layer_norm(x float32, ..., out_dtype=bf16): statistics and normalisation of the float32
//     row with float32 weight and bias, y rounded once to bf16 (the next GEMM's input);
//   - add_layer_norm(x float32, residual bf16, weight, bias, residual_bias float32,
//     out_dtype=bf16): sum = x + residual + residual_bias in float32, y as above; one kernel.
// Backward: LayerNormBackward reads dy (bf16) and x (float32) as they are.  By default the
// stream's gradient is carried in bf16: add_layer_norm's node takes the sum's cotangent in y's
// dtype (Primitive::cotangent_dtype) and writes one bf16 dx that is both the branch's gradient (a
// GEMM's input) and the stream's, as the bf16 stream did.  Bytes per (R, C) element and call:
// forward 12 (x 4, residual 2, sum 4, y 2) against the bf16 stream's 8, backward 10 (dy 2, sum 4,
// dsum 2, dx 2) against 8; activation memory: the saved sums are float32.
// stream_grad_dtype=float32 carries the stream's gradient in float32 as autocast does: the sum's
// cotangent comes float32, dx is float32 (the stream's) and the engine casts it to bf16 for the
// branch: backward 20 bytes (dy 2, sum 4, dsum 4, dx 4, the cast's 6).  Why it is offered: the
// bf16 gradient is rounded at every add on its way down, so its error grows with depth.  Gradient
// error against float64 per layer (CPU, trained-like weights, session 49), over autocast's:
//   - 12 layers of C=192: bf16 gradient 0.86x at the top, 1.23-1.34x at layer 0; float32
//     0.83-0.93x in every layer (test_bf16_gradients_per_layer_as_close_as_autocast);
//   - GPT-2 124M (C=768, B2 x T64): the other roundings dominate; bf16 gradient 0.88x at the
//     top, 0.93x at layer 0; float32 0.88x / 0.89x.
// So the default stays bf16; float32 is for narrow deep models.
#pragma once

#include <optional>

#include "primitives.h"

namespace bt {

// inputs: dy (R, C), x (R, C), weight (C) or undefined, mean (R), rstd (R), extra (R, C) or
// undefined (added to dx: the residual stream's gradient in add_layer_norm's backward).  dy and
// weight have x's dtype, except over a float32 x (Note [float32 residual stream]): dy 16-bit,
// weight float32, dx and extra either float32 or dy's dtype.
// outputs: dx (R, C) (x's dtype but as above), then dweight (C) if need_dweight, then dbias (C) if
// need_dbias, then dsum (C) if need_dsum: the column sums of dx as stored (rounded), the gradient
// of a bias added to the residual (Note [residual bias]) (all in x's dtype, or float32 with
// wide_grads for 16-bit x: the kernels' float32 column sums unrounded, for a weight that is a cast
// of a float32 master, Note [cached casts]).
class LayerNormBackward : public Primitive {
  BT_PRIM_BODY(LayerNormBackward, "layer_norm_backward")
  LayerNormBackward(bool w, bool e, bool ndw, bool ndb, bool wide = false, bool nds = false)
      : has_weight(w),
        has_extra(e),
        need_dweight(ndw),
        need_dbias(ndb),
        wide_grads(wide),
        need_dsum(nds) {}
  bool differentiable() const override { return false; }
  bool saves_inputs() const override { return false; }
  void attrs(Attrs& a) const override {
    a["has_weight"] = has_weight;
    a["has_extra"] = has_extra;
    a["need_dweight"] = need_dweight;
    a["need_dbias"] = need_dbias;
    a["wide_grads"] = wide_grads;
    a["need_dsum"] = need_dsum;
  }
  bool has_weight, has_extra, need_dweight, need_dbias, wide_grads, need_dsum;
};

// inputs: y (..., C) (the forward's output), dy (same shape).  output: dx (y's dtype).
class SoftmaxBackward : public Primitive {
  BT_PRIM_BODY(SoftmaxBackward, log ? "log_softmax_backward" : "softmax_backward")
  explicit SoftmaxBackward(bool lg) : log(lg) {}
  bool differentiable() const override { return false; }
  bool saves_inputs() const override { return false; }
  void attrs(Attrs& a) const override { a["log"] = log; }
  bool log;
};

// inputs: x, dy (same shape and dtype).  output: dx = dy * gelu_tanh'(x), bit for bit the
// composition gelu_tanh_grad runs elsewhere (Note [gelu backward], cpu/gelu_kernels.h).  CPU
// only: other devices run the composition.
class GeluTanhBackward : public Primitive {
  BT_PRIM_BODY(GeluTanhBackward, "gelu_tanh_backward")
  bool differentiable() const override { return false; }
  bool saves_inputs() const override { return false; }
};

// inputs: logits (N, Cx) (rows may be strided, unit column stride), target (N) int64, lse (N)
// (float32, float64 for float64 logits), grad_loss (() for mean / sum, (N) for none; any float
// dtype; read on the device only).  output: dlogits (N, Cx), contiguous, in logits' dtype.  Only
// the first num_classes columns (-1: all) are classes; padding columns get zeros.  Rows with
// target == ignore_index get zeros; an out-of-range target (the forward raises on the CPU, records
// an IndexError on CUDA) gives a NaN row on CUDA.
class CrossEntropyBackward : public Primitive {
  BT_PRIM_BODY(CrossEntropyBackward, "cross_entropy_backward")
  CrossEntropyBackward(int64_t ii, int r, double ls, int64_t nc = -1, bool over = false)
      : ignore_index(ii), reduction(r), label_smoothing(ls), num_classes(nc), in_place(over) {}
  bool differentiable() const override { return false; }
  bool saves_inputs() const override { return false; }
  int overwrites_input() const override { return in_place ? 0 : -1; }
  void attrs(Attrs& a) const override {
    a["ignore_index"] = ignore_index;
    a["reduction"] = std::string(reduction == 0 ? "none" : reduction == 1 ? "mean" : "sum");
    a["label_smoothing"] = label_smoothing;
    a["num_classes"] = num_classes;  // -1: every column is a class
    a["in_place"] = in_place;
  }
  int64_t classes(const Tensor& x) const { return num_classes < 0 ? x.shape()[1] : num_classes; }
  int64_t ignore_index;
  int reduction;  // 0 none, 1 mean, 2 sum
  double label_smoothing;
  int64_t num_classes;
  bool in_place;  // dlogits written over the logits (Note [donating a saved input])
};

// Note [residual bias]
// A transformer block's "x + linear(h, W, b); LayerNorm" can leave b out of the linear and give
// it to add_layer_norm as residual_bias: the sum x + r + b is rounded once, and b's gradient is
// the column sums of dsum, which the layer-norm backward already holds (no separate pass over
// the (R, C) gradient, as the linear's bias gradient needs).  GPT-2 has two such biases a block
// (attention's projection, the MLP's second linear).
//
// inputs: x (R, C), residual (R, C), weight (C) or undefined, bias (C) or undefined,
// residual_bias (C) or undefined, all of x's dtype, or (mixed) x float32, residual of y's
// 16-bit dtype, the parameters float32 (Note [float32 residual stream]).
// outputs: sum (R, C) (x's dtype), y (R, C) (x's dtype, or mixed 16-bit), mean (R), rstd (R).
// y normalises the stored (rounded) sum, so the backward is exactly LayerNorm's on `sum`.
class AddLayerNorm : public Primitive {
  BT_PRIM_BODY(AddLayerNorm, "add_layer_norm")
  AddLayerNorm(double e, bool w, bool b, bool rb = false, bool mx = false,
               DType yd = DType::Float32, bool wsg = false)
      : eps(e),
        has_weight(w),
        has_bias(b),
        has_residual_bias(rb),
        mixed(mx),
        y_dtype(yd),
        wide_stream_grad(wsg) {}
  bool saves_outputs() const override { return true; }
  bool saves_output(size_t i) const override { return i != 1; }  // sum, mean, rstd (not y)
  // sum: a sum nothing reads (the last layer's) costs no zero fill; mean, rstd
  bool takes_no_cotangent(size_t i) const override { return i != 1; }
  // mixed: the float32 sum's gradient is carried in y's dtype unless wide_stream_grad (Note
  // [float32 residual stream])
  DType cotangent_dtype(size_t i, DType own) const override {
    return mixed && i == 0 && !wide_stream_grad ? y_dtype : own;
  }
  // Only weight is needed by the backward (x and residual are not kept alive).
  bool saves_input(size_t i, const std::vector<bool>&) const override { return i == 2; }
  void attrs(Attrs& a) const override {
    a["eps"] = eps;
    a["has_weight"] = has_weight;
    a["has_bias"] = has_bias;
    a["has_residual_bias"] = has_residual_bias;
  }
  double eps;
  bool has_weight, has_bias, has_residual_bias;
  bool mixed;  // x float32, y 16-bit (Note [float32 residual stream])
  DType y_dtype;
  bool wide_stream_grad;  // mixed: the sum's gradient in float32 (stream_grad_dtype=float32)
};

// Fronts.
// (sum, y): sum = x + residual, y = layer_norm(sum, (C,), weight, bias, eps) over the last dim.
// recompute: y is rebuilt in backward (layer_norm of the kept sum) by whichever op saves it,
// instead of being kept (Note [recomputed activations], primitives.h).
// residual_bias (C): added to the sum (Note [residual bias]).
// out_dtype: y's dtype (default x's); a 16-bit y over a float32 x is one kernel (Note [float32
// residual stream]), other pairs normalise in x's dtype and cast.  sum always has x's dtype.
// stream_grad_dtype: the dtype the sum's gradient travels in, x's or y's (default y's; only a
// 16-bit y over a float32 x has two to choose from).
std::pair<Tensor, Tensor> add_layer_norm(const Tensor& x, const Tensor& residual,
                                         const Tensor& weight, const Tensor& bias, double eps,
                                         bool recompute = false,
                                         const Tensor& residual_bias = Tensor(),
                                         std::optional<DType> out_dtype = std::nullopt,
                                         std::optional<DType> stream_grad_dtype = std::nullopt);
// The backward ops as functions (used by the vjps in primitives.cpp).  wide_grads: dweight and
// dbias (and dsum) in float32 for 16-bit x (see LayerNormBackward; ignored otherwise).
// dx_dtype: dx's dtype (default x's; over a float32 x with a 16-bit dy it may be dy's dtype, read
// as is, Note [float32 residual stream]; otherwise dx is computed in x's dtype and cast).
// Returns {dx, dweight, dbias, dsum} (undefined where not asked for).
std::vector<Tensor> layer_norm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight,
                                        const Tensor& mean, const Tensor& rstd, const Tensor& extra,
                                        bool need_dweight, bool need_dbias, bool wide_grads = false,
                                        bool need_dsum = false,
                                        std::optional<DType> dx_dtype = std::nullopt);
// A layer norm vjp's wide_grads: true when each wanted affine gradient (weight at input iw, bias
// at ib) goes unnarrowed to a float32 master (weight_grad_dtype, autocast.h).
bool layer_norm_wide_grads(const VjpArgs& a, DType dt, bool need_dweight, size_t iw,
                           bool need_dbias, size_t ib);
Tensor softmax_backward(const Tensor& y, const Tensor& dy, bool log);
// dy * gelu_tanh'(x), each op rounded to x's dtype: GeluTanhBackward for same-shape, same-dtype
// concrete CPU tensors, else the composed ops (the same operations, op by op).
Tensor gelu_tanh_grad(const Tensor& x, const Tensor& dy);
Tensor cross_entropy_backward(const Tensor& logits, const Tensor& target, const Tensor& lse,
                              const Tensor& grad_loss, int64_t ignore_index, int reduction,
                              double label_smoothing, int64_t num_classes = -1,
                              bool in_place = false);

}  // namespace bt
