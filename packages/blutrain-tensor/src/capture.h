// capture.h: capture mode, the graph contract blutrain-compiler builds on
// (docs/graph_format.md describes the format for users of the graph).
//
// While a Graph is active on this thread, ops do not run: apply() records a node (op, attrs,
// input value ids, output values with shape, strides, dtype and device) and returns symbolic
// tensors laid out as eager's results would be.  A tensor from outside the capture (a
// parameter, a batch) becomes an "input" value the first time an op reads it; tensors that
// share its storage, shape, strides and offset (detach(), the same view taken twice) are the
// same value.  View ops are recorded like any other op.  Every node is checked against its
// schema (schema.h): complete attributes, exact types.
//
// Mutation (SSA): an in-place op records its out-of-place op and a "copy_" node; ops that write
// inputs in place (adamw_, scale_, copy_, accumulate_grad onto an existing .grad) list those
// input positions in CaptureNode::mutates and get one new output value per written input, and
// the written tensor (with every alias of it) is renamed to that value.  A value that aliases a
// written one without being renamed with it (a view taken before the write) is stale: reading
// it raises, since eager would see the new data and the graph the old.
//
// backward() inside a capture records the backward ops too.  A leaf's gradient is recorded as
// an "accumulate_grad" node whose output is the leaf's new .grad; during the capture the leaf's
// .grad is that symbolic value (so a captured optimizer step reads it), and when the capture
// ends every .grad the capture changed is put back (Graph::finish) and the table Graph::grads
// says which value each leaf's .grad ended as.
//
// Numerics: nodes whose results depend on the float32 matmul precision or on deterministic mode
// carry those settings (CaptureNode::numerics); random ops carry their Philox (seed, offset);
// the graph keeps the generator's state before and after the capture (rng_*).
//
// Graph::replay runs a graph through the eager primitives (the schema's factories): on the
// same inputs it gives eager's results bit for bit.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "primitives.h"

namespace bt {

// Version of the serialized form (docs/graph_format.md); bump on any change to its meaning.
constexpr int kGraphSchemaVersion = 2;

struct CaptureValue {
  int64_t id;
  Shape shape;
  Strides strides;
  int64_t offset = 0;
  DType dtype;
  Device device;
  std::string name;  // inputs: the tensor's name if it has one
  bool is_input = false;
  bool requires_grad = false;
  int64_t storage = -1;  // inputs: index of their storage among the inputs' (aliases share one)
};

struct CaptureNode {
  std::string op;
  Attrs attrs;
  std::vector<int64_t> inputs;   // value ids, -1 for an absent optional input
  std::vector<int64_t> outputs;  // fresh values, then the new values of `mutates`
  std::vector<int64_t> mutates;  // input positions written in place
  Attrs numerics;                // "matmul_precision" / "deterministic" where the op reads them
};

struct ReplayOptions {
  // true: random ops draw from the generator's current state, which advances as eager's would
  // (each replay of a training step gets fresh dropout masks); false: the recorded offsets.
  bool current_rng = true;
  bool check = true;  // compare every result's shape, strides and dtype with the graph's
};

class Graph {
 public:
  Graph();
  ~Graph();

  // ---- recording (capture mode)
  void begin();                       // capture starts: numerics and generator state
  void finish();                      // capture ends: .grad put back, generator state after
  int64_t value_of(const Tensor& t);  // registers t as an input if unseen
  void record(const std::string& op, const Attrs& attrs, const std::vector<Tensor>& in,
              const std::vector<Tensor>& out);
  // A leaf's gradient arrives (already in the leaf's dtype): records accumulate_grad and makes
  // the result the leaf's .grad for the rest of the capture.
  void accumulate_grad(const Tensor& leaf, const Tensor& grad);
  // The leaf's .grad is being set from Python (zero_grad, p.grad = ...): put back at finish().
  void note_grad_change(const Tensor& leaf);
  void record_copy(const Tensor& dst, const Tensor& src);
  void alias(const Tensor& from, const Tensor& to);  // `to` is a detach() of symbolic `from`
  void mark_output(const Tensor& t) { outputs.push_back(value_of(t)); }
  std::string str() const;

  // ---- building a graph that was loaded (JSON): checked like a captured one
  void load_value(const CaptureValue& v);
  void load_node(const CaptureNode& n);
  void validate() const;  // ids in range, defined before use, inputs / outputs / tables

  // ---- running it
  // inputs: one tensor per `inputs` entry, in order.  Returns the value of each `outputs`
  // entry.  Mutated inputs are written in place (as eager writes them).  `grads_out` (when
  // given) receives, per `grads` entry, the tensor that leaf's .grad ends as (undefined: None).
  std::vector<Tensor> replay(const std::vector<Tensor>& inputs, const ReplayOptions& opt,
                             std::vector<Tensor>* grads_out = nullptr) const;
  // The tensors a capture read as inputs (empty for a loaded graph), in `inputs` order.
  std::vector<Tensor> input_tensors() const;

  std::vector<CaptureValue> values;
  std::vector<CaptureNode> nodes;
  std::vector<int64_t> inputs, outputs;
  std::vector<std::pair<int64_t, int64_t>> mutations;  // input value -> its final value
  std::vector<std::pair<int64_t, int64_t>> grads;      // leaf input value -> .grad value or -1
  Attrs numerics;  // at the capture's start: matmul_precision, deterministic
  int64_t rng_seed = 0, rng_offset_begin = 0, rng_offset_end = 0;

 private:
  struct Slot {
    int64_t id;
  };
  // Real tensors: the same memory seen through the same geometry is the same value.
  using GeomKey = std::tuple<const void*, int64_t, Shape, Strides, int>;
  static GeomKey geom(const Tensor& t);
  int64_t new_value(const Tensor& t, int64_t root);
  int64_t read(const Tensor& t, const std::string& op);  // value_of + the stale check
  void rename(const Tensor& t, int64_t old_id, const std::string& op);
  void check_new_node(const CaptureNode& n, const char* who) const;

  std::unordered_map<TensorImpl*, std::shared_ptr<Slot>> by_impl_;
  std::map<GeomKey, std::shared_ptr<Slot>> by_geom_;
  std::vector<std::shared_ptr<TensorImpl>> keep_;  // keeps keys alive (no address reuse)
  std::vector<std::shared_ptr<TensorImpl>> input_tensors_;
  std::map<const void*, int64_t> storage_index_;  // input storages, in order of first use
  // Staleness: every value has a root (its storage's, or for symbolic values the value its
  // view chain starts from); each write to a root starts a new epoch; values of an older epoch
  // than their root's were not renamed by the write and must not be read.
  std::vector<int64_t> root_, epoch_of_value_;
  std::map<int64_t, int64_t> root_epoch_;
  std::map<int64_t, int64_t> origin_;  // a renamed value -> the input value it started as
  // leaves whose .grad the capture changed: (leaf, .grad before, leaf's input value id)
  struct GradRecord {
    std::shared_ptr<TensorImpl> leaf, before;
    int64_t leaf_value;
  };
  std::vector<GradRecord> grad_records_;
  bool finished_ = false;
};

Graph* active_graph();
void set_active_graph(Graph* g);  // nullptr ends capture

// Eager op log (a profiling aid: bt.op_log(), used by blutrain-models' bench/op_trace.py and
// tests): while on, apply() notes
// every primitive it evaluates eagerly (not views, not inside a capture, which records a graph
// of its own and keeps one dtype per gradient edge, so its backward can differ from eager's) as
// the op's name and its inputs' and outputs' (dtype, shape).  One process-wide log under a
// mutex; off costs one relaxed atomic load per op.
struct OpLogEntry {
  std::string op;
  std::vector<std::pair<DType, Shape>> in, out;
};
bool op_log_on();
void op_log_start();
std::vector<OpLogEntry> op_log_stop();
void op_log_note(const char* op, const std::vector<Tensor>& in, const std::vector<Tensor>& out);

}  // namespace bt
