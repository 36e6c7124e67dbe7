// capture.cpp: recording a graph (see capture.h); replay lives in replay.cpp.
#include "capture.h"

#include <atomic>
#include <charconv>
#include <mutex>
#include <sstream>
#include <utility>

#include "autocast.h"
#include "schema.h"

namespace bt {

static thread_local Graph* g_active = nullptr;
Graph* active_graph() { return g_active; }

// detach() of a symbolic tensor makes a new TensorImpl for the same value: the active graph
// learns the alias (tensor.cpp calls this hook only for symbolic tensors).
static void on_symbolic_detach(const Tensor& from, const Tensor& to) {
  if (g_active) g_active->alias(from, to);
}

static std::atomic<bool> g_op_log_on{false};
static std::mutex g_op_log_mu;
static std::vector<OpLogEntry> g_op_log;  // guarded by g_op_log_mu
bool op_log_on() { return g_op_log_on.load(std::memory_order_relaxed); }
void op_log_start() {
  std::lock_guard<std::mutex> lk(g_op_log_mu);
  g_op_log.clear();
  g_op_log_on.store(true);
}
std::vector<OpLogEntry> op_log_stop() {
  std::lock_guard<std::mutex> lk(g_op_log_mu);
  g_op_log_on.store(false);
  return std::exchange(g_op_log, {});
}
void op_log_note(const char* op, const std::vector<Tensor>& in, const std::vector<Tensor>& out) {
  OpLogEntry e{op, {}, {}};
  for (auto& t : in) {
    if (t.defined()) e.in.emplace_back(t.dtype(), t.shape());
  }
  for (auto& t : out) {
    if (t.defined()) e.out.emplace_back(t.dtype(), t.shape());
  }
  std::lock_guard<std::mutex> lk(g_op_log_mu);
  if (g_op_log_on.load()) g_op_log.push_back(std::move(e));
}

void set_active_graph(Graph* g) {
  set_symbolic_alias_hook(&on_symbolic_detach);
  g_active = g;
}

Graph::Graph() = default;
Graph::~Graph() = default;

Graph::GeomKey Graph::geom(const Tensor& t) {
  return {t.storage().get(), t.offset(), t.shape(), t.strides(), static_cast<int>(t.dtype())};
}

void Graph::begin() {
  numerics["matmul_precision"] = std::string(matmul_precision_name(float32_matmul_precision()));
  numerics["deterministic"] = deterministic_algorithms();
  const auto [seed, offset] = get_rng_state();
  rng_seed = static_cast<int64_t>(seed);
  rng_offset_begin = rng_offset_end = static_cast<int64_t>(offset);
}

void Graph::finish() {
  if (finished_) return;
  finished_ = true;
  rng_offset_end = static_cast<int64_t>(get_rng_state().second);
  for (auto& r : grad_records_) {
    int64_t gid = -1;
    if (r.leaf->grad) {
      auto it = by_impl_.find(r.leaf->grad.get());
      gid = it != by_impl_.end() ? it->second->id : value_of(Tensor(r.leaf->grad));
    }
    grads.emplace_back(r.leaf_value, gid);
    r.leaf->grad = r.before;  // nothing ran: the leaf keeps the gradient it had
  }
  grad_records_.clear();
}

int64_t Graph::new_value(const Tensor& t, int64_t root) {
  const int64_t id = static_cast<int64_t>(values.size());
  CaptureValue v;
  v.id = id;
  v.shape = t.shape();
  v.strides = t.strides();
  v.offset = t.offset();
  v.dtype = t.dtype();
  v.device = t.device();
  v.requires_grad = t.requires_grad();
  values.push_back(std::move(v));
  auto slot = std::make_shared<Slot>(Slot{id});
  by_impl_[t.impl()] = slot;
  if (!t.is_symbolic()) by_geom_.emplace(geom(t), slot);
  keep_.push_back(t.impl_ptr());
  root_.push_back(root == -1 ? id : root);  // -1: a root of its own
  epoch_of_value_.push_back(root_epoch_[root_.back()]);
  return id;
}

int64_t Graph::value_of(const Tensor& t) {
  auto it = by_impl_.find(t.impl());
  if (it != by_impl_.end()) return it->second->id;
  if (t.is_symbolic()) {
    throw RuntimeError(
        "[capture] a symbolic tensor that this capture did not make was used (it comes from "
        "another capture, or from one that has ended)");
  }
  auto g = by_geom_.find(geom(t));
  if (g != by_geom_.end()) {  // detach(), or the same view again: the same value
    by_impl_[t.impl()] = g->second;
    keep_.push_back(t.impl_ptr());
    return g->second->id;
  }
  const void* st = t.storage().get();
  auto si = storage_index_.emplace(st, static_cast<int64_t>(storage_index_.size())).first;
  // the root of a real tensor is its storage, as a number below -1 (value ids are >= 0)
  const int64_t root = -2 - si->second;
  if (root_epoch_[root] > 0) {
    throw RuntimeError(
        "[capture] a tensor read for the first time shares memory with a tensor this capture "
        "has already written in place: take it (the view) before the write, or clone() it");
  }
  const int64_t id = new_value(t, root);
  CaptureValue& v = values[id];
  v.is_input = true;
  v.name = t.impl()->name;
  v.storage = si->second;
  inputs.push_back(id);
  input_tensors_.push_back(t.impl_ptr());
  return id;
}

int64_t Graph::read(const Tensor& t, const std::string& op) {
  const int64_t id = value_of(t);
  if (epoch_of_value_[id] < root_epoch_[root_[id]]) {
    throw RuntimeError(
        "[capture] " + op + " reads value %" + std::to_string(id) +
        ", which shares memory with a tensor that was written in place after it was made (a "
        "view taken before an in-place op): eager would read the new data, the graph the old. "
        "Take the view after the write, or clone() it before.");
  }
  return id;
}

void Graph::rename(const Tensor& t, int64_t old_id, const std::string& op) {
  const int64_t id = static_cast<int64_t>(values.size());
  CaptureValue v = values[old_id];
  v.id = id;
  v.is_input = false;
  v.name.clear();
  v.storage = -1;
  v.requires_grad = t.requires_grad();
  values.push_back(std::move(v));
  const int64_t root = root_[old_id];
  root_.push_back(root);
  epoch_of_value_.push_back(++root_epoch_[root]);
  auto it = by_impl_.find(t.impl());
  if (it == by_impl_.end()) {
    throw RuntimeError("[capture] internal: " + op + " writes a tensor the graph has not seen");
  }
  it->second->id = id;  // every alias of t (detach, same geometry) follows
  auto o = origin_.find(old_id);
  const int64_t origin = o != origin_.end() ? o->second : values[old_id].is_input ? old_id : -1;
  if (origin >= 0) {
    origin_[id] = origin;
    bool found = false;
    for (auto& m : mutations) {
      if (m.first == origin) {
        m.second = id;
        found = true;
      }
    }
    if (!found) mutations.emplace_back(origin, id);
  }
}

void Graph::alias(const Tensor& from, const Tensor& to) {
  auto it = by_impl_.find(from.impl());
  if (it == by_impl_.end()) return;  // unknown here: reading it will raise
  by_impl_[to.impl()] = it->second;
  keep_.push_back(to.impl_ptr());
}

void Graph::record(const std::string& op, const Attrs& attrs, const std::vector<Tensor>& in,
                   const std::vector<Tensor>& out) {
  const OpSchema* s = find_schema(op);
  if (!s) {
    throw RuntimeError("[capture] op '" + op +
                       "' has no schema entry (src/schema.cpp): its node cannot be checked, "
                       "serialized or replayed");
  }
  check_attrs(*s, attrs);
  CaptureNode n{op, attrs, {}, {}, {}, {}};
  for (auto& t : in) n.inputs.push_back(t.defined() ? read(t, op) : -1);
  if (s->numerics & kMatmulPrecision) {
    n.numerics["matmul_precision"] = std::string(matmul_precision_name(float32_matmul_precision()));
  }
  if (s->numerics & kDeterministic) n.numerics["deterministic"] = deterministic_algorithms();
  if (s->numerics & kAttentionPrecision) {
    n.numerics["attention_precision"] =
        std::string(attention_precision_name(float32_attention_precision()));
  }
  for (auto& t : out) {
    const int64_t root = s->view && !n.inputs.empty() && n.inputs[0] >= 0 ? root_[n.inputs[0]] : -1;
    n.outputs.push_back(new_value(t, root));
  }
  for (int64_t pos : mutated_inputs(*s, attrs, in.size())) {
    if (pos < 0 || pos >= static_cast<int64_t>(in.size()) || !in[pos].defined()) continue;
    n.mutates.push_back(pos);
    rename(in[pos], n.inputs[pos], op);
    n.outputs.push_back(static_cast<int64_t>(values.size()) - 1);
  }
  nodes.push_back(std::move(n));
}

void Graph::note_grad_change(const Tensor& leaf) {
  for (const auto& r : grad_records_) {
    if (r.leaf.get() == leaf.impl()) return;
  }
  grad_records_.push_back({leaf.impl_ptr(), leaf.impl()->grad, value_of(leaf)});
}

void Graph::accumulate_grad(const Tensor& leaf, const Tensor& grad) {
  note_grad_change(leaf);
  TensorImpl* L = leaf.impl();
  if (!L->grad) {
    Tensor out = symbolic_tensor(leaf.shape(), leaf.dtype(), leaf.device());
    record("accumulate_grad", {}, {leaf, grad}, {out});
    L->grad = out.impl_ptr();
  } else {
    record("accumulate_grad", {}, {leaf, grad, Tensor(L->grad)}, {});  // renames the .grad
  }
}

void Graph::record_copy(const Tensor& dst, const Tensor& src) {
  record("copy_", {}, {dst, src}, {});
}

std::vector<Tensor> Graph::input_tensors() const {
  std::vector<Tensor> r;
  for (const auto& p : input_tensors_) r.emplace_back(p);
  return r;
}

// ---- printing --------------------------------------------------------------------------------
// Shortest decimal that reads back to the same double (C++17 to_chars).
static std::string exact(double d) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d);
  return std::string(buf, res.ptr);
}

static std::string attr_str(const AttrValue& v) {
  std::ostringstream os;
  if (auto p = std::get_if<int64_t>(&v)) {
    os << *p;
  } else if (auto p = std::get_if<double>(&v)) {
    os << exact(*p);
  } else if (auto p = std::get_if<bool>(&v)) {
    os << (*p ? "true" : "false");
  } else if (auto p = std::get_if<std::string>(&v)) {
    os << '"' << *p << '"';
  } else if (auto p = std::get_if<std::vector<int64_t>>(&v)) {
    os << shape_str(*p);
  } else if (auto p = std::get_if<std::vector<double>>(&v)) {
    os << "[";
    for (size_t i = 0; i < p->size(); ++i) os << (i ? ", " : "") << exact((*p)[i]);
    os << "]";
  }
  return os.str();
}

std::string Graph::str() const {
  std::ostringstream os;
  auto vstr = [&](int64_t id) {
    if (id < 0) return std::string("none");
    const auto& v = values[id];
    return "%" + std::to_string(id) + ":" + dtype_name(v.dtype) + shape_str(v.shape);
  };
  auto attrs_str = [](const Attrs& a) {
    std::string s;
    for (auto& [k, v] : a) s += (s.empty() ? "" : ", ") + k + "=" + attr_str(v);
    return s;
  };
  os << "graph(";
  for (size_t i = 0; i < inputs.size(); ++i) {
    os << (i ? ", " : "") << vstr(inputs[i]);
    if (!values[inputs[i]].name.empty()) os << " \"" << values[inputs[i]].name << "\"";
  }
  os << ") {\n";
  for (const auto& n : nodes) {
    os << "  ";
    for (size_t i = 0; i < n.outputs.size(); ++i) os << (i ? ", " : "") << vstr(n.outputs[i]);
    if (!n.outputs.empty()) os << " = ";
    os << n.op << "(";
    for (size_t i = 0; i < n.inputs.size(); ++i) {
      os << (i ? ", " : "") << (n.inputs[i] < 0 ? "none" : "%" + std::to_string(n.inputs[i]));
    }
    os << ")";
    if (!n.attrs.empty()) os << " {" << attrs_str(n.attrs) << "}";
    if (!n.mutates.empty()) {
      os << " writes";
      for (auto p : n.mutates) os << " %" << n.inputs[p];
    }
    if (!n.numerics.empty()) os << " [" << attrs_str(n.numerics) << "]";
    os << "\n";
  }
  os << "  return";
  for (size_t i = 0; i < outputs.size(); ++i) os << (i ? ", " : " ") << "%" << outputs[i];
  os << "\n}\n";
  return os.str();
}

// ---- loading -----------------------------------------------------------------------------------
void Graph::load_value(const CaptureValue& v) {
  if (v.id != static_cast<int64_t>(values.size())) {
    throw ValueError("[load_graph] value ids must be 0, 1, 2, ... in order; got " +
                     std::to_string(v.id) + " at position " + std::to_string(values.size()));
  }
  if (v.shape.size() != v.strides.size()) {
    throw ValueError("[load_graph] value %" + std::to_string(v.id) + " has " +
                     std::to_string(v.shape.size()) + " dims but " +
                     std::to_string(v.strides.size()) + " strides");
  }
  values.push_back(v);
  root_.push_back(v.id);
  epoch_of_value_.push_back(0);
}

void Graph::check_new_node(const CaptureNode& n, const char* who) const {
  const OpSchema* s = find_schema(n.op);
  const std::string pre =
      std::string("[") + who + "] node " + std::to_string(nodes.size()) + " (" + n.op + "): ";
  if (!s) throw ValueError(pre + "unknown op (no schema entry)");
  check_attrs(*s, n.attrs, who);
  std::vector<int64_t> expect;
  for (int64_t p : mutated_inputs(*s, n.attrs, n.inputs.size())) {
    if (p >= 0 && p < static_cast<int64_t>(n.inputs.size()) && n.inputs[p] >= 0) {
      expect.push_back(p);
    }
  }
  if (expect != n.mutates) throw ValueError(pre + "'mutates' does not match the op's schema");
  if (n.outputs.size() < n.mutates.size()) throw ValueError(pre + "fewer outputs than mutates");
  for (auto id : n.inputs) {
    if (id < -1 || id >= static_cast<int64_t>(values.size())) {
      throw ValueError(pre + "input id " + std::to_string(id) + " is out of range");
    }
  }
  for (auto id : n.outputs) {
    if (id < 0 || id >= static_cast<int64_t>(values.size())) {
      throw ValueError(pre + "output id " + std::to_string(id) + " is out of range");
    }
  }
  for (const auto& [k, v] : n.numerics) {
    if (k == "matmul_precision") {
      parse_matmul_precision(std::get<std::string>(v));
    } else if (k == "attention_precision") {
      parse_attention_precision(std::get<std::string>(v));
    } else if (k != "deterministic") {
      throw ValueError(pre + "unknown numerics setting '" + k + "'");
    }
  }
}

void Graph::load_node(const CaptureNode& n) {
  check_new_node(n, "load_graph");
  nodes.push_back(n);
}

void Graph::validate() const {
  const std::string pre = "[load_graph] ";
  std::vector<char> defined(values.size(), 0);
  for (auto id : inputs) {
    if (id < 0 || id >= static_cast<int64_t>(values.size()) || !values[id].is_input) {
      throw ValueError(pre + "input id " + std::to_string(id) + " is not an input value");
    }
    defined[id] = 1;
  }
  for (size_t k = 0; k < nodes.size(); ++k) {
    const auto& n = nodes[k];
    for (auto id : n.inputs) {
      if (id >= 0 && !defined[id]) {
        throw ValueError(pre + "node " + std::to_string(k) + " (" + n.op + ") reads %" +
                         std::to_string(id) + " before any node or input defines it");
      }
    }
    for (auto id : n.outputs) {
      if (defined[id]) {
        throw ValueError(pre + "node " + std::to_string(k) + " (" + n.op + ") redefines %" +
                         std::to_string(id));
      }
      defined[id] = 1;
    }
  }
  auto check_defined = [&](int64_t id, const char* what) {
    if (id < 0 || id >= static_cast<int64_t>(values.size()) || !defined[id]) {
      throw ValueError(pre + what + " %" + std::to_string(id) + " is never defined");
    }
  };
  for (auto id : outputs) check_defined(id, "output");
  for (auto& [a, b] : mutations) {
    check_defined(a, "mutated input");
    check_defined(b, "mutation result");
  }
  for (auto& [a, b] : grads) {
    check_defined(a, "leaf");
    if (b >= 0) check_defined(b, "gradient");
  }
}

}  // namespace bt
