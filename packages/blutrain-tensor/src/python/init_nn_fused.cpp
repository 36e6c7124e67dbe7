// python/init_nn_fused.cpp: bindings of src/nn_fused.h (see init.h).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>

#include <optional>

#include "../nn_fused.h"
#include "init.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace bt::python {

void init_nn_fused(nanobind::module_& m) {
  m.def(
      "add_layer_norm",
      [](const Tensor& x, const Tensor& residual, std::optional<Tensor> w, std::optional<Tensor> b,
         double eps, bool recompute, std::optional<Tensor> rb, nb::handle out_dtype,
         nb::handle stream_grad_dtype) {
        std::optional<DType> odt, gdt;
        if (out_dtype.is_valid() && !out_dtype.is_none()) {
          odt = parse_dtype(out_dtype, "add_layer_norm");
        }
        if (stream_grad_dtype.is_valid() && !stream_grad_dtype.is_none()) {
          gdt = parse_dtype(stream_grad_dtype, "add_layer_norm");
        }
        return add_layer_norm(x, residual, w ? *w : Tensor(), b ? *b : Tensor(), eps, recompute,
                              rb ? *rb : Tensor(), odt, gdt);
      },
      "x"_a, "residual"_a, "weight"_a = nb::none(), "bias"_a = nb::none(), "eps"_a = 1e-5,
      nb::kw_only(), "recompute"_a = false, "residual_bias"_a = nb::none(),
      "out_dtype"_a = nb::none(), "stream_grad_dtype"_a = nb::none(),
      "add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, *, recompute=False, "
      "residual_bias=None, out_dtype=None, stream_grad_dtype=None) -> (sum, y)\n\n"
      "Fused residual add + layer norm over the last dim: sum = x + residual (+ residual_bias,\n"
      "a (C,) vector: a linear layer's bias moved here, rounded once with the sum, its gradient\n"
      "the column sums of dsum) and y = layer_norm(sum, (C,), weight, bias, eps), in one kernel\n"
      "reading x and residual once.  sum has x's dtype; y has out_dtype (default x's).\n"
      "A float32 x with a bfloat16 (or float16) residual and out_dtype is autocast's residual\n"
      "stream in one kernel: the sum in float32 with float32 weight, bias and residual_bias, y\n"
      "rounded once to out_dtype; in backward the sum's gradient is carried in out_dtype (one\n"
      "gradient for the residual and the stream), or with stream_grad_dtype=float32 in float32\n"
      "as autocast's (the residual gets it cast; twice the backward's bytes, a gradient that\n"
      "keeps its precision through deep stacks).\n"
      "Differentiable in x, residual, weight, bias and residual_bias (through sum and y).\n"
      "recompute=True: y is not kept for backward by the ops that use it; each rebuilds it in\n"
      "backward from sum (kept anyway), bitwise the same values.");
}

}  // namespace bt::python
