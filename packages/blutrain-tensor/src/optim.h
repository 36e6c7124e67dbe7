// optim.h: multi-tensor optimizer primitives (AdamW, global gradient norm, clipping).
//
// All of them run over lists of tensors in one pass (on CUDA: one kernel launch for the whole
// list, the per-tensor pointer table passed by value as the kernel parameter), update in place
// and are not differentiable.  Scalars that change between steps (lr, step, grad scale) may be
// 0-d float32 tensors on the tensors' device, so a CUDA-graph-captured step can change them
// between replays without re-capture and clipping needs no host sync.
#pragma once

#include <optional>
#include <vector>

#include "primitives.h"
#include "tensor.h"

namespace bt {

// A scalar given either as a host value or as a 0-d float32 tensor on the device.
struct ScalarArg {
  double value = 0;
  Tensor tensor;  // defined: read from device memory at run time
};

// In-place AdamW (decoupled weight decay, PyTorch's arithmetic), per tensor i:
//   g = grads[i] * grad_scale
//   p *= 1 - lr * weight_decays[i]
//   m += (1 - beta1) * (g - m);  v = beta2 * v + (1 - beta2) * g * g
//   p -= lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
// params/grads: float32, float64, or bfloat16/float16 (with float32 states); states: float32
// (float64 for float64 params).  All contiguous, same device; grads' dtype == params'.
// A float32 param with a 16-bit cast kept by cached_astype gets that copy rewritten from its new
// value in the same kernel, and stays current (Note [cached casts], primitives.h).
void adamw_(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
            const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
            const ScalarArg& lr, double beta1, double beta2, double eps,
            const std::vector<double>& weight_decays, const ScalarArg& step,
            const Tensor& grad_scale = Tensor());

// The global L2 norm of every tensor in `grads` (a 0-d float32 tensor; float64 when every grad
// is float64) computed with float32 accumulation per chunk and a fixed-order (deterministic)
// second stage.
Tensor grad_norm(const std::vector<Tensor>& grads);
// min(1, max_norm / (norm + eps)) as a 0-d float32 tensor on norm's device (no host sync).
Tensor clip_coef(const Tensor& norm, double max_norm, double eps);
// grads[i] *= coef (a 0-d tensor on their device), in place.
void scale_(const std::vector<Tensor>& grads, const Tensor& coef);

// ---- primitives ------------------------------------------------------------------------------
// Inputs: params (n), grads (n), exp_avgs (n), exp_avg_sqs (n), then with has_copies the params'
// 16-bit copies (n, undefined where a param has none), then the optional device scalars lr, step,
// grad_scale (has_* say which are present).  No outputs: updates its inputs in place.
class AdamW : public Primitive {
  BT_PRIM_BODY(AdamW, "adamw_")
  bool differentiable() const override { return false; }
  bool saves_inputs() const override { return false; }
  void attrs(Attrs& a) const override {
    a["lr"] = lr;
    a["beta1"] = beta1;
    a["beta2"] = beta2;
    a["eps"] = eps;
    a["step"] = step;
    a["n"] = static_cast<int64_t>(n);
    a["weight_decays"] = weight_decays;
    a["has_lr"] = has_lr;
    a["has_step"] = has_step;
    a["has_scale"] = has_scale;
    a["has_copies"] = has_copies;
  }
  size_t n = 0;
  double lr = 0, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, step = 1;
  std::vector<double> weight_decays;
  bool has_lr = false, has_step = false, has_scale = false, has_copies = false;
};
// Inputs: grads (any float dtypes, contiguous).  Output: the norm (0-d).
class GradNorm : public Primitive {
  BT_PRIM_BODY(GradNorm, "grad_norm")
  bool differentiable() const override { return false; }
  bool saves_inputs() const override { return false; }
};
// Input: norm (0-d float).  Output: min(1, max_norm / (norm + eps)), 0-d float32.
class ClipCoef : public Primitive {
  BT_PRIM_BODY(ClipCoef, "clip_coef")
  ClipCoef(double m, double e) : max_norm(m), eps(e) {}
  bool differentiable() const override { return false; }
  bool saves_inputs() const override { return false; }
  void attrs(Attrs& a) const override {
    a["max_norm"] = max_norm;
    a["eps"] = eps;
  }
  double max_norm, eps;
};
// Inputs: tensors (n), then coef (0-d).  No outputs: scales the tensors in place.
class ScaleInplace : public Primitive {
  BT_PRIM_BODY(ScaleInplace, "scale_")
  bool differentiable() const override { return false; }
  bool saves_inputs() const override { return false; }
};

// CUDA AdamW kernel choice: 2 (default) the multi-tensor kernel, 1 the simple reference (one
// launch per tensor, scalar loads), kept to test the fast one against.
void set_optim_kernel_version(int v);
int optim_kernel_version();

// Chunking shared by both backends (per-chunk partial sums make the norm deterministic).
constexpr int64_t kOptimChunk = 4096;

}  // namespace bt
