// python/init_optim.cpp: bindings of src/optim.h (see init.h): _adamw_, _grad_norm, _clip_coef,
// _scale_ (private names: python/blutrain/tensor/optim.py is the public, typed face).
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "../optim.h"
#include "init.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace bt::python {

namespace {

// A Python float/int, or a 0-d float32 tensor on the tensors' device (read at run time).
ScalarArg scalar_arg(nb::handle h, const char* op, const char* what) {
  ScalarArg s;
  if (nb::isinstance<Tensor>(h)) {
    s.tensor = nb::cast<Tensor>(h);
  } else {
    try {
      s.value = nb::cast<double>(h);
    } catch (const nb::cast_error&) {
      throw TypeError(std::string("[") + op + "] " + what +
                      " must be a float or a 0-d float32 tensor, got " +
                      nb::type_name(h.type()).c_str());
    }
  }
  return s;
}

}  // namespace

void init_optim(nb::module_& m) {
  m.def(
      "_adamw_",
      [](nb::handle params, nb::handle grads, nb::handle exp_avgs, nb::handle exp_avg_sqs,
         nb::handle lr, double beta1, double beta2, double eps, nb::handle weight_decays,
         nb::handle step, nb::handle grad_scale) {
        const char* op = "adamw_";
        auto p = tensor_list(params, op, "params");
        auto g = tensor_list(grads, op, "grads");
        auto ma = tensor_list(exp_avgs, op, "exp_avgs");
        auto va = tensor_list(exp_avg_sqs, op, "exp_avg_sqs");
        std::vector<double> wd;
        auto number = [&](nb::handle h) {
          double v = 0;
          if (!nb::try_cast<double>(h, v)) {
            throw TypeError(std::string("[") + op + "] weight_decay must be a float or a list " +
                            "of floats, got " + nb::cast<std::string>(nb::repr(h)));
          }
          return v;
        };
        if (nb::isinstance<nb::float_>(weight_decays) || nb::isinstance<nb::int_>(weight_decays)) {
          wd.assign(p.size(), number(weight_decays));
        } else {
          for (nb::handle h : weight_decays) wd.push_back(number(h));
        }
        Tensor gs;
        if (!grad_scale.is_none()) {
          if (!nb::isinstance<Tensor>(grad_scale)) {
            throw TypeError("[adamw_] grad_scale must be None or a 0-d float32 tensor");
          }
          gs = nb::cast<Tensor>(grad_scale);
        }
        adamw_(p, g, ma, va, scalar_arg(lr, op, "lr"), beta1, beta2, eps, wd,
               scalar_arg(step, op, "step"), gs);
      },
      "params"_a, "grads"_a, "exp_avgs"_a, "exp_avg_sqs"_a, "lr"_a, "beta1"_a, "beta2"_a, "eps"_a,
      "weight_decays"_a, "step"_a, "grad_scale"_a = nb::none(),
      "Multi-tensor AdamW, in place (no autograd; bumps versions).  lr and step: floats or 0-d "
      "float32 tensors on the params' device (read at run time: CUDA-graph friendly); "
      "weight_decays: one per tensor (or one float for all); grad_scale: optional 0-d float32 "
      "tensor multiplying every gradient (e.g. a clip coefficient).  On CUDA one kernel launch.");
  m.def(
      "_grad_norm",
      [](nb::handle grads) { return grad_norm(tensor_list(grads, "grad_norm", "grads")); },
      "grads"_a,
      "Global L2 norm of the tensors (None entries skipped) as a 0-d tensor on their device, "
      "float32 accumulation, deterministic reduction, no host sync.");
  m.def("_clip_coef", &clip_coef, "norm"_a, "max_norm"_a, "eps"_a = 1e-6,
        "min(1, max_norm / (norm + eps)) as a 0-d float32 tensor on norm's device (no host sync).");
  m.def(
      "_scale_",
      [](nb::handle tensors, const Tensor& coef) {
        scale_(tensor_list(tensors, "scale_", "tensors"), coef);
      },
      "tensors"_a, "coef"_a,
      "Multiplies every tensor in place by coef (a 0-d float32 tensor on their device).");
  m.def("_set_optim_kernel_version", &set_optim_kernel_version, "version"_a,
        "CUDA AdamW kernel: 2 multi-tensor (default), 1 the simple per-tensor reference.");
  m.def("_optim_kernel_version", &optim_kernel_version, "The CUDA AdamW kernel in use.");
}

}  // namespace bt::python
