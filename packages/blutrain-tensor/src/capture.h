// capture.h: capture mode, for blutrain-compiler.
//
// While a Graph is active on this thread, ops do not run: apply() records a node (op, attrs,
// input value ids, output values with dtype and shape) and returns symbolic tensors.  A tensor
// from outside the capture (a parameter, a batch) becomes an "input" value the first time an op
// reads it.  View ops are recorded like any other op.  backward() inside a capture records the
// backward ops too; a leaf's gradient is recorded as an "accumulate_grad" node (the leaf's .grad
// is not touched).  An in-place op records its out-of-place op and a "copy_" node, after which the
// tensor refers to the new value (SSA renaming).
#pragma once

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "primitives.h"

namespace bt {

struct CaptureValue {
  int64_t id;
  Shape shape;
  DType dtype;
  Device device;
  std::string name;  // inputs: the tensor's name if it has one
  bool is_input;
  bool requires_grad;
};

struct CaptureNode {
  std::string op;
  Attrs attrs;
  std::vector<int64_t> inputs;
  std::vector<int64_t> outputs;
};

class Graph {
 public:
  int64_t value_of(const Tensor& t);  // registers t as an input if unseen
  int64_t new_value(const Tensor& t);
  void record(const std::string& op, const Attrs& attrs, const std::vector<Tensor>& in,
              const std::vector<Tensor>& out);
  void record_grad(const Tensor& leaf, const Tensor& grad);
  void record_copy(const Tensor& dst, const Tensor& src);
  void mark_output(const Tensor& t) { outputs.push_back(value_of(t)); }
  std::string str() const;

  std::vector<CaptureValue> values;
  std::vector<CaptureNode> nodes;
  std::vector<int64_t> inputs, outputs;

 private:
  std::unordered_map<TensorImpl*, int64_t> ids_;
  std::vector<std::shared_ptr<TensorImpl>> keep_;  // keeps keys alive (no address reuse)
};

Graph* active_graph();
void set_active_graph(Graph* g);  // nullptr ends capture

}  // namespace bt
