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
         double eps, bool recompute, std::optional<Tensor> rb) {
        return add_layer_norm(x, residual, w ? *w : Tensor(), b ? *b : Tensor(), eps, recompute,
                              rb ? *rb : Tensor());
      },
      "x"_a, "residual"_a, "weight"_a = nb::none(), "bias"_a = nb::none(), "eps"_a = 1e-5,
      nb::kw_only(), "recompute"_a = false, "residual_bias"_a = nb::none(),
      "add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, *, recompute=False, "
      "residual_bias=None) -> (sum, y)\n\n"
      "Fused residual add + layer norm over the last dim: sum = x + residual (+ residual_bias,\n"
      "a (C,) vector: a linear layer's bias moved here, rounded once with the sum, its gradient\n"
      "the column sums of dsum) and y = layer_norm(sum, (C,), weight, bias, eps), in one kernel\n"
      "reading x and residual once.\n"
      "Differentiable in x, residual, weight, bias and residual_bias (through sum and y).\n"
      "recompute=True: y is not kept for backward by the ops that use it; each rebuilds it in\n"
      "backward from sum (kept anyway), bitwise the same values.");
}

}  // namespace bt::python
