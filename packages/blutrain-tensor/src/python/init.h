// python/init.h: one init_<area> per core header (the MLX layout); NB_MODULE in init_tensor.cpp
// calls each.  Shared parsing helpers live in init_tensor.cpp.
#pragma once

#include <nanobind/nanobind.h>

#include "../tensor.h"

namespace bt::python {

void init_capture(nanobind::module_& m);    // init_capture.cpp: Graph, op schemas, replay
void init_cuda(nanobind::module_& m);       // init_cuda.cpp: streams, sync, determinism, graphs
void init_nn_fused(nanobind::module_& m);   // init_nn_fused.cpp: fused norm / loss ops
void init_attention(nanobind::module_& m);  // init_attention.cpp: flash attention
void init_optim(nanobind::module_& m);      // init_optim.cpp: multi-tensor AdamW, grad norms
void init_autocast(nanobind::module_& m);   // init_autocast.cpp: precision policy, recompute

DType parse_dtype(nanobind::handle h, const char* op);
Device parse_device(nanobind::handle h, const char* op);
// The tensors of a Python iterable (None -> an undefined Tensor); anything else is a TypeError
// naming op and what[i].
std::vector<Tensor> tensor_list(nanobind::handle seq, const char* op, const char* what);

}  // namespace bt::python
