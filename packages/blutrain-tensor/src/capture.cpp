// capture.cpp: the capture-mode graph (see capture.h).
#include "capture.h"

#include <sstream>

namespace bt {

static thread_local Graph* g_active = nullptr;
Graph* active_graph() { return g_active; }
void set_active_graph(Graph* g) { g_active = g; }

int64_t Graph::new_value(const Tensor& t) {
  const int64_t id = static_cast<int64_t>(values.size());
  values.push_back(
      {id, t.shape(), t.dtype(), t.device(), t.impl()->name, false, t.requires_grad()});
  ids_[t.impl()] = id;
  keep_.push_back(t.impl_ptr());
  return id;
}

int64_t Graph::value_of(const Tensor& t) {
  auto it = ids_.find(t.impl());
  if (it != ids_.end()) return it->second;
  const int64_t id = new_value(t);
  values[id].is_input = true;
  inputs.push_back(id);
  return id;
}

void Graph::record(const std::string& op, const Attrs& attrs, const std::vector<Tensor>& in,
                   const std::vector<Tensor>& out) {
  CaptureNode n{op, attrs, {}, {}};
  for (auto& t : in) n.inputs.push_back(t.defined() ? value_of(t) : -1);
  for (auto& t : out) n.outputs.push_back(new_value(t));
  nodes.push_back(std::move(n));
}

void Graph::record_grad(const Tensor& leaf, const Tensor& grad) {
  CaptureNode n{"accumulate_grad", {}, {value_of(leaf), value_of(grad)}, {}};
  nodes.push_back(std::move(n));
}

void Graph::record_copy(const Tensor& dst, const Tensor& src) {
  CaptureNode n{"copy_", {}, {value_of(dst), value_of(src)}, {}};
  // dst now names a new value (SSA): later reads see the copied data.
  n.outputs.push_back(new_value(dst));
  nodes.push_back(std::move(n));
}

static std::string attr_str(const AttrValue& v) {
  std::ostringstream os;
  if (auto p = std::get_if<int64_t>(&v)) {
    os << *p;
  } else if (auto p = std::get_if<double>(&v)) {
    os << *p;
  } else if (auto p = std::get_if<bool>(&v)) {
    os << (*p ? "true" : "false");
  } else if (auto p = std::get_if<std::string>(&v)) {
    os << '"' << *p << '"';
  } else if (auto p = std::get_if<std::vector<int64_t>>(&v)) {
    os << shape_str(*p);
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
    if (!n.attrs.empty()) {
      os << " {";
      bool first = true;
      for (auto& [k, v] : n.attrs) {
        os << (first ? "" : ", ") << k << "=" << attr_str(v);
        first = false;
      }
      os << "}";
    }
    os << "\n";
  }
  os << "  return";
  for (size_t i = 0; i < outputs.size(); ++i) os << (i ? ", " : " ") << "%" << outputs[i];
  os << "\n}\n";
  return os.str();
}

}  // namespace bt
