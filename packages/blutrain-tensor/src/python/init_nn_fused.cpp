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
         double eps, bool recompute) {
        return add_layer_norm(x, residual, w ? *w : Tensor(), b ? *b : Tensor(), eps, recompute);
      },
      "x"_a, "residual"_a, "weight"_a = nb::none(), "bias"_a = nb::none(), "eps"_a = 1e-5,
      nb::kw_only(), "recompute"_a = false,
      "add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, *, recompute=False) -> "
      "(sum, y)\n\n"
      "Fused residual add + layer norm over the last dim: sum = x + residual and\n"
      "y = layer_norm(sum, (C,), weight, bias, eps), in one kernel reading x and residual once.\n"
      "Differentiable in x, residual, weight and bias (through sum and y).\n"
      "recompute=True: y is not kept for backward by the ops that use it; each rebuilds it in\n"
      "backward from sum (kept anyway), bitwise the same values.");
}

}  // namespace bt::python
