// python/init_autocast.cpp: bindings of src/autocast.h (see init.h).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include "../autocast.h"
#include "init.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace bt::python {

void init_autocast(nanobind::module_& m) {
  m.def(
      "set_float32_matmul_precision",
      [](const std::string& p) { set_float32_matmul_precision(parse_matmul_precision(p)); },
      "precision"_a,
      "How float32 GEMMs (matmul, bmm, linear, linear_gelu and their backward) form products: "
      "'highest' = true fp32 (the default), 'high' = TF32 tensor cores (operands rounded to a "
      "10-bit mantissa, fp32 accumulation; the CPU emulates the rounding), 'medium' = operands "
      "rounded to bf16, fp32 accumulation. Process-wide; read when each GEMM runs. bf16/fp16 "
      "GEMMs always accumulate in fp32 and float64 ones stay float64.");
  m.def(
      "get_float32_matmul_precision",
      []() { return std::string(matmul_precision_name(float32_matmul_precision())); },
      "The current float32 matmul precision: 'highest', 'high' or 'medium'.");
  m.def(
      "set_float32_attention_precision",
      [](const std::string& p) { set_float32_attention_precision(parse_attention_precision(p)); },
      "precision"_a,
      "How the fused float32 attention kernels (CUDA, tensor cores) form their products: "
      "'matmul' (the default) follows the float32 matmul precision (TF32 unless it is "
      "'highest'), 'highest' is 3xTF32 (float32-accurate) whatever the matmul precision, as "
      "PyTorch's float32 scaled_dot_product_attention is under allow_tf32, and 'scores' is "
      "3xTF32 for the scores Q K^T only (where TF32's error matters most: softmax turns a "
      "score's absolute error into its probability's relative error), the other products as "
      "'matmul'. The CPU's attention is float32 either way. Process-wide; read when each "
      "attention kernel runs (forward and backward), so keep one setting from a forward to its "
      "backward.");
  m.def(
      "get_float32_attention_precision",
      []() { return std::string(attention_precision_name(float32_attention_precision())); },
      "The current float32 attention precision: 'matmul', 'scores' or 'highest'.");
  m.def(
      "linear_gelu",
      [](const Tensor& x, const Tensor& w, std::optional<Tensor> b) {
        return linear_gelu(x, w, b ? *b : Tensor());
      },
      "input"_a, "weight"_a, "bias"_a = nb::none(),
      "gelu_tanh(input @ weight.T + bias): one GEMM with blutrain-linalg's GELU epilogue, which "
      "also saves the pre-activation for backward (float32/float64: the GEMM, then the GELU "
      "kernel, unless BLUTRAIN_LGL_EPILOGUE=cublaslt). Backward: dpre = grad * gelu'(pre), "
      "d input = dpre @ weight, d weight = dpre^T @ input with d bias from the same GEMM.");
  m.def(
      "linear_gelu_linear",
      [](const Tensor& x, const Tensor& w1, std::optional<Tensor> b1, const Tensor& w2,
         std::optional<Tensor> b2, bool recompute) {
        return linear_gelu_linear(x, w1, b1 ? *b1 : Tensor(), w2, b2 ? *b2 : Tensor(), recompute);
      },
      "input"_a, "w1"_a, "b1"_a.none(), "w2"_a, "b2"_a = nb::none(), nb::kw_only(),
      "recompute"_a = false,
      "A GELU MLP, linear(linear_gelu(input, w1, b1), w2, b2), as one op: forward GEMM, GELU, "
      "GEMM (16-bit: the GELU in the first GEMM's epilogue); backward dh = dy @ w2, then "
      "d pre = dh * gelu'(pre) and d b1 in one fused kernel (CUDA; blutrain-linalg's DGELU "
      "epilogue on the CPU or with BLUTRAIN_LGL_EPILOGUE=cublaslt), weight gradients as GEMMs "
      "with a bias-grad epilogue. recompute=True saves only the pre-activation and recomputes "
      "the hidden activation gelu(pre) in backward (half the MLP's saved activations; the "
      "gradients are the same bits as recompute=False wherever the GELU runs as its own kernel: "
      "float32/float64; 16-bit forwards then run the GELU outside the GEMM too).");
  m.def("linear_cross_entropy", &linear_cross_entropy, "input"_a, "weight"_a, "target"_a,
        nb::kw_only(), "ignore_index"_a = -100, "reduction"_a = "mean",
        "num_classes"_a = nb::none(), "chunk_size"_a = nb::none(),
        "cross_entropy(linear(input, weight), target) without keeping the logits: a classifier "
        "head and its loss in one op. input (..., K), weight (V, K), target (...) integer class "
        "ids; only the first num_classes (default V) columns are classes (the rest, e.g. a "
        "padded vocabulary, get zero gradient); targets equal to ignore_index count for "
        "nothing; reduction 'mean' (over non-ignored targets) or 'sum'. The forward runs the rows "
        "in chunks of chunk_size rows (default: even chunks of at most 512 MiB of logits): the "
        "head GEMM, the loss and its gradient in one buffer, then the input and weight gradient "
        "GEMMs, so only a chunk of logits ever exists (GPT-2 124M at B=16, T=1024: 3.3 GB in "
        "float32). The backward scales the saved gradients. The loss is float32 for bf16/fp16 "
        "inputs, whose weight gradient is accumulated over chunks in float32. Not twice "
        "differentiable.");
  m.def(
      "_set_linear_gelu_linear_impl", [](const std::string& s) { set_lgl_impl(parse_lgl_impl(s)); },
      "impl"_a,
      "Tests/benchmarks: how linear_gelu_linear runs its GELU parts on CUDA: 'kernel' (our "
      "fused kernels, the default), 'cublaslt' (cuBLASLt's GELU_AUX/DGELU epilogues) or "
      "'kernel_v1' (the reference kernels). Overrides $BLUTRAIN_LGL_EPILOGUE.");
  m.def(
      "_get_linear_gelu_linear_impl", []() { return std::string(lgl_impl_name(lgl_impl())); },
      "The current linear_gelu_linear implementation ('kernel', 'cublaslt' or 'kernel_v1').");
  m.def("_get_rng_state", &get_rng_state,
        "The global generator's (seed, offset) (checkpoint saves it to replay random ops).");
  m.def("_set_rng_state", &set_rng_state, "seed"_a, "offset"_a,
        "Sets the global generator's (seed, offset) (initial_seed() is unchanged).");
}

}  // namespace bt::python
