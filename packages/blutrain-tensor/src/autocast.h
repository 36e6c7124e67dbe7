// autocast.h: precision controls and the fused linear + GELU layer.
//
//   - float32 matmul precision (PyTorch's names): "highest" = true fp32 products (the default),
//     "high" = TF32 tensor cores (operands rounded to a 10-bit mantissa, fp32 accumulation),
//     "medium" = operands rounded to bf16, fp32 accumulation. Read by every GEMM (src/cpu/
//     matmul.cpp) when it builds the blutrain-linalg descriptor; it only affects float32 GEMMs
//     (bf16/fp16 GEMMs always accumulate in fp32, float64 stays float64).
//   - the global generator's (seed, offset), so recomputation (checkpoint) replays dropout.
//   - linear_gelu(x, W, b) = gelu_tanh(x W^T + b): one GEMM whose epilogue adds the bias, applies
//     the GELU and also writes the pre-activation (saved for backward).
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "primitives.h"

namespace bt {

// ---- float32 matmul precision ------------------------------------------------------------------
enum class MatmulPrecision : int { Highest = 0, High = 1, Medium = 2 };
void set_float32_matmul_precision(MatmulPrecision p);  // process-wide, thread-safe (atomic)
MatmulPrecision float32_matmul_precision();
MatmulPrecision parse_matmul_precision(const std::string& s);  // ValueError on unknown names
const char* matmul_precision_name(MatmulPrecision p);

// ---- generator state (defined in ops.cpp, next to the generator) ------------------------------
std::pair<uint64_t, uint64_t> get_rng_state();  // (seed, offset)
void set_rng_state(uint64_t seed, uint64_t offset);

// ---- fused linear + bias + tanh-GELU ---------------------------------------------------------
// Inputs: x (M, K), W (N, K)[, b (N)]; outputs: y = gelu_tanh(pre) (M, N) and pre = x W^T + b
// (M, N). eval_cpu and eval_gpu are the same blutrain-linalg call (src/cpu/matmul.cpp).
class LinearGelu : public Primitive {
  BT_PRIM_BODY(LinearGelu, "linear_gelu")
  explicit LinearGelu(bool bias) : has_bias(bias) {}
  bool saves_input(size_t i, const std::vector<bool>& needs) const override { return i < 2; }
  bool saves_outputs() const override { return true; }  // pre (y is the next layer's input)
  void attrs(Attrs& a) const override { a["bias"] = has_bias; }
  bool has_bias;
};

// Backward of a linear layer's weight: dW = g^T x (N, K) and, with bias, db = column sums of g
// (N) in the same GEMM (linalg's BGRAD_A epilogue). Inputs g (M, N), x (M, K).
class LinearWeightGrad : public Primitive {
  BT_PRIM_BODY(LinearWeightGrad, "linear_weight_grad")
  explicit LinearWeightGrad(bool bias) : has_bias(bias) {}
  bool differentiable() const override { return false; }
  bool saves_inputs() const override { return false; }
  void attrs(Attrs& a) const override { a["bias"] = has_bias; }
  bool has_bias;
};

// dpre = (g W) * gelu_tanh'(pre) in one GEMM (linalg's DGELU epilogue), with bgrad: also
// db = column sums of dpre (DGELU_BGRAD). Inputs g (M, N2), W (N2, N1), pre (M, N1).
class LinearDgelu : public Primitive {
  BT_PRIM_BODY(LinearDgelu, "linear_dgelu")
  explicit LinearDgelu(bool bg) : bgrad(bg) {}
  bool differentiable() const override { return false; }
  bool saves_inputs() const override { return false; }
  void attrs(Attrs& a) const override { a["bgrad"] = bgrad; }
  bool bgrad;
};

// A GELU MLP: y = gelu_tanh(x W1^T + b1) W2^T + b2 in two GEMMs, whose backward needs no
// elementwise kernel: dh * gelu'(pre) is the DGELU epilogue of the dh = dy W2 GEMM (and db1
// comes out of it), dW2/db2 and dW1 are BGRAD GEMMs. Inputs x (M, K), W1 (N1, K), W2 (N2, N1),
// then b1 (N1) if has_b1, then b2 (N2) if has_b2; outputs y (M, N2), h (M, N1), pre (M, N1).
class LinearGeluLinear : public Primitive {
  BT_PRIM_BODY(LinearGeluLinear, "linear_gelu_linear")
  LinearGeluLinear(bool b1, bool b2) : has_b1(b1), has_b2(b2) {}
  bool saves_input(size_t i, const std::vector<bool>& needs) const override { return i < 3; }
  bool saves_outputs() const override { return true; }  // h and pre
  void attrs(Attrs& a) const override {
    a["bias1"] = has_b1;
    a["bias2"] = has_b2;
  }
  bool has_b1, has_b2;
};

// dy * gelu_tanh'(pre), computed in float32 for 16-bit inputs (composed ops: any backend).
Tensor gelu_tanh_backward(const Tensor& dy, const Tensor& pre);

// gelu_tanh(x W^T + b) over x's last dim (x (..., K), W (N, K), b (N) or undefined).
Tensor linear_gelu(const Tensor& x, const Tensor& weight, const Tensor& bias);

// linear(linear_gelu(x, w1, b1), w2, b2) fused as above (biases may be undefined).
Tensor linear_gelu_linear(const Tensor& x, const Tensor& w1, const Tensor& b1, const Tensor& w2,
                          const Tensor& b2);

}  // namespace bt
