// schema.h: the per-op schema of captured graphs (docs/graph_format.md is the user's page).
//
// Every op a capture can record has one entry: its attributes with their types, which global
// numerics settings its results depend on, whether it is a view, which inputs it writes in
// place, the C++ primitive class behind it, and a factory that rebuilds that primitive from the
// recorded attributes.  Capture checks each recorded node against its entry (an op without one,
// a missing, extra or mistyped attribute raises), and the interpreter (Graph::replay) runs nodes
// through the factory: the same primitive with the same attributes, so the same bits as eager.
//
// Adding a primitive: give it an attrs() that records every constructor argument, and an entry
// in schema.cpp (tests/test_tensor_capture_schema.py fails for a primitive class without one).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "primitives.h"

namespace bt {

// Scalar: an int (exact int64) or a float, as the value was given (fill values, arange bounds).
enum class AttrType { Int, Float, Bool, String, Ints, Floats, Scalar };
const char* attr_type_name(AttrType t);
// The AttrType of a value's variant alternative.
AttrType attr_type_of(const AttrValue& v);

// Global settings a node's results depend on, recorded per node (CaptureNode::numerics).
enum NumericsFlags : unsigned {
  kNumericsNone = 0,
  kMatmulPrecision = 1,     // "matmul_precision": float32 GEMMs and float32 attention
  kDeterministic = 2,       // "deterministic": GEMM autotuning, atomics in scatter / attention
  kAttentionPrecision = 4,  // "attention_precision": float32 attention (autocast.h)
};

struct OpSchema {
  std::string op;         // the node's op name
  std::string primitive;  // the C++ class (or "" for graph-only ops: copy_, accumulate_grad)
  std::vector<std::pair<std::string, AttrType>> attrs;
  unsigned numerics = kNumericsNone;
  bool view = false;  // output 0 is a view of input 0 (no copy)
  // Input positions the op writes in place, given its attributes and input count.  Their new
  // values are the node's last outputs, in this order (SSA: the tensor is renamed).
  std::function<std::vector<int64_t>(const Attrs&, size_t)> mutates;
  // Rebuilds the primitive (null for graph-only ops, which Graph::replay runs itself).
  std::function<std::shared_ptr<Primitive>(const Attrs&)> make;
};

// Every entry, sorted by op name.
const std::vector<OpSchema>& op_schemas();
// The entry of `op`, or null.
const OpSchema* find_schema(const std::string& op);
// Raises RuntimeError "[capture] <op>: ..." when attrs do not match the entry exactly.
void check_attrs(const OpSchema& s, const Attrs& attrs, const char* who = "capture");
// The positions `s` writes in place for these attrs and input count (empty for most ops).
std::vector<int64_t> mutated_inputs(const OpSchema& s, const Attrs& attrs, size_t n_inputs);

// Names of every op the C++ enums can produce (unary, binary, reduce kinds) and of every
// primitive class the schema knows, for tests that enumerate coverage.
std::vector<std::string> enum_op_names();

}  // namespace bt
