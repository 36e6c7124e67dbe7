// python/init.h: one init_<area> per core header (the MLX layout); NB_MODULE in init_tensor.cpp
// calls each.  Shared parsing helpers live in init_tensor.cpp.
#pragma once

#include <nanobind/nanobind.h>

#include "../tensor.h"

// Note [argument errors] (init_errors.cpp): a bool is not an int argument (PyTorch's rule:
// softmax(x, True) is a TypeError), which nanobind's converting pass would take as 1.  Every
// binding file includes this header before its bindings, so they all see this caster.
namespace nanobind::detail {
template <>
struct type_caster<int64_t> {
  NB_TYPE_CASTER(int64_t, const_name("int"))
  bool from_python(handle src, uint32_t flags, cleanup_list* cleanup) noexcept {
    if (PyBool_Check(src.ptr())) return false;
    return NB_CALL(load_i64)(NB_CTX_C(cleanup), src.ptr(), flags, &value);
  }
  static handle from_cpp(int64_t src, rv_policy, cleanup_list*) noexcept {
    return PyLong_FromLongLong(static_cast<long long>(src));
  }
};
}  // namespace nanobind::detail

namespace bt::python {

void init_capture(nanobind::module_& m);    // init_capture.cpp: Graph, op schemas, replay
void init_cuda(nanobind::module_& m);       // init_cuda.cpp: streams, sync, determinism, graphs
void init_nn_fused(nanobind::module_& m);   // init_nn_fused.cpp: fused norm / loss ops
void init_attention(nanobind::module_& m);  // init_attention.cpp: flash attention
void init_optim(nanobind::module_& m);      // init_optim.cpp: multi-tensor AdamW, grad norms
void init_autocast(nanobind::module_& m);   // init_autocast.cpp: precision policy, recompute
void init_errors(nanobind::module_& m);     // init_errors.cpp: Note [argument errors]

DType parse_dtype(nanobind::handle h, const char* op);
Device parse_device(nanobind::handle h, const char* op);
// The tensors of a Python iterable (None -> an undefined Tensor); anything else is a TypeError
// naming op and what[i].
std::vector<Tensor> tensor_list(nanobind::handle seq, const char* op, const char* what);

}  // namespace bt::python
