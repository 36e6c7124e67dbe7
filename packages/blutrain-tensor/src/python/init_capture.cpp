// python/init_capture.cpp: bindings of capture.h and schema.h (see init.h): the Graph class
// (wrapped by blutrain.tensor.graph, which adds JSON, the hash and replay's Python face),
// _op_schemas, _set_capture.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "../autocast.h"
#include "../capture.h"
#include "../schema.h"
#include "init.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace bt::python {

namespace {

nb::tuple ints_tuple(const std::vector<int64_t>& s) {
  nb::list l;
  for (auto v : s) l.append(v);
  return nb::tuple(l);
}

nb::object attr_to_py(const AttrValue& v) {
  if (auto p = std::get_if<int64_t>(&v)) return nb::int_(*p);
  if (auto p = std::get_if<double>(&v)) return nb::float_(*p);
  if (auto p = std::get_if<bool>(&v)) return nb::bool_(*p);
  if (auto p = std::get_if<std::string>(&v)) return nb::str(p->c_str());
  if (auto p = std::get_if<std::vector<int64_t>>(&v)) return ints_tuple(*p);
  nb::list l;
  for (auto x : std::get<std::vector<double>>(v)) l.append(x);
  return nb::tuple(l);
}

nb::dict attrs_to_py(const Attrs& a) {
  nb::dict d;
  for (auto& [k, v] : a) d[k.c_str()] = attr_to_py(v);
  return d;
}

// A Python value as the schema's type (a loaded graph's attributes).
AttrValue py_to_attr(nb::handle h, AttrType t, const std::string& where) {
  auto bad = [&]() -> AttrValue {
    throw TypeError("[load_graph] " + where + " must be " + attr_type_name(t) + ", got " +
                    nb::cast<std::string>(nb::repr(h)));
  };
  const bool is_bool = nb::isinstance<nb::bool_>(h);
  switch (t) {
    case AttrType::Int:
      if (is_bool || !nb::isinstance<nb::int_>(h)) return bad();
      return nb::cast<int64_t>(h);
    case AttrType::Float:
      if (is_bool || !(nb::isinstance<nb::float_>(h) || nb::isinstance<nb::int_>(h))) return bad();
      return nb::cast<double>(h);
    case AttrType::Bool:
      if (!is_bool) return bad();
      return nb::cast<bool>(h);
    case AttrType::String:
      if (!nb::isinstance<nb::str>(h)) return bad();
      return nb::cast<std::string>(h);
    case AttrType::Ints: {
      if (!(nb::isinstance<nb::list>(h) || nb::isinstance<nb::tuple>(h))) return bad();
      std::vector<int64_t> r;
      for (nb::handle x : h) {
        if (nb::isinstance<nb::bool_>(x) || !nb::isinstance<nb::int_>(x)) return bad();
        r.push_back(nb::cast<int64_t>(x));
      }
      return r;
    }
    case AttrType::Scalar:  // an int stays an exact int64, a float a double
      if (is_bool) return bad();
      if (nb::isinstance<nb::int_>(h)) return nb::cast<int64_t>(h);
      if (nb::isinstance<nb::float_>(h)) return nb::cast<double>(h);
      return bad();
    case AttrType::Floats: {
      if (!(nb::isinstance<nb::list>(h) || nb::isinstance<nb::tuple>(h))) return bad();
      std::vector<double> r;
      for (nb::handle x : h) {
        if (nb::isinstance<nb::bool_>(x) ||
            !(nb::isinstance<nb::float_>(x) || nb::isinstance<nb::int_>(x))) {
          return bad();
        }
        r.push_back(nb::cast<double>(x));
      }
      return r;
    }
  }
  return bad();
}

const char* numerics_name(unsigned bit) {
  if (bit == kMatmulPrecision) return "matmul_precision";
  return bit == kAttentionPrecision ? "attention_precision" : "deterministic";
}

}  // namespace

void init_capture(nb::module_& m) {
  m.attr("GRAPH_SCHEMA_VERSION") = kGraphSchemaVersion;
  nb::class_<Graph>(m, "Graph",
                    "A captured graph: nodes (op, attrs, inputs, outputs), values (shape, strides, "
                    "dtype, device), and what the program writes (docs/graph_format.md).")
      .def(nb::init<>())
      .def("__str__", &Graph::str)
      .def("mark_output", &Graph::mark_output, "tensor"_a, "Marks a value as a graph output.")
      .def_prop_ro(
          "inputs", [](const Graph& g) { return g.inputs; }, "Ids of input values.")
      .def_prop_ro(
          "outputs", [](const Graph& g) { return g.outputs; }, "Ids of output values.")
      .def_prop_ro(
          "values",
          [](const Graph& g) {
            nb::list l;
            for (auto& v : g.values) {
              nb::dict d;
              d["id"] = v.id;
              d["shape"] = ints_tuple(v.shape);
              d["strides"] = ints_tuple(v.strides);
              d["offset"] = v.offset;
              d["dtype"] = v.dtype;
              d["device"] = v.device.str();
              d["name"] = v.name;
              d["is_input"] = v.is_input;
              d["requires_grad"] = v.requires_grad;
              d["storage"] = v.storage;
              l.append(d);
            }
            return l;
          },
          "Every value: id, shape, strides, offset, dtype, device, name, is_input, "
          "requires_grad, storage (inputs: which inputs share memory; -1 otherwise).")
      .def_prop_ro(
          "nodes",
          [](const Graph& g) {
            nb::list l;
            for (auto& n : g.nodes) {
              nb::dict d;
              d["op"] = n.op;
              d["attrs"] = attrs_to_py(n.attrs);
              d["inputs"] = n.inputs;
              d["outputs"] = n.outputs;
              d["mutates"] = n.mutates;
              d["numerics"] = attrs_to_py(n.numerics);
              l.append(d);
            }
            return l;
          },
          "Every node: op, attrs, inputs (value ids, -1 for none), outputs (fresh values, then "
          "the new values of the inputs at positions `mutates`), numerics.")
      .def_prop_ro(
          "mutations", [](const Graph& g) { return g.mutations; },
          "(input value, its final value) for every input the program writes in place.")
      .def_prop_ro(
          "grads", [](const Graph& g) { return g.grads; },
          "(leaf input value, the value its .grad ends as, or -1 for None) for every leaf whose "
          ".grad the program changes.")
      .def_prop_ro(
          "numerics", [](const Graph& g) { return attrs_to_py(g.numerics); },
          "Settings at the capture's start: matmul_precision, deterministic.")
      .def_prop_ro(
          "rng",
          [](const Graph& g) {
            nb::dict d;
            d["seed"] = g.rng_seed;
            d["offset_begin"] = g.rng_offset_begin;
            d["offset_end"] = g.rng_offset_end;
            return d;
          },
          "The generator's seed and Philox offset before and after the capture.")
      .def_prop_ro("input_tensors", &Graph::input_tensors,
                   "The tensors the capture read as inputs, in `inputs` order (empty when loaded).")
      .def("_begin", &Graph::begin)
      .def("_finish", &Graph::finish)
      .def(
          "_load_value",
          [](Graph& g, int64_t id, std::vector<int64_t> shape, std::vector<int64_t> strides,
             int64_t offset, nb::handle dtype, const std::string& device, const std::string& name,
             bool is_input, bool requires_grad, int64_t storage) {
            CaptureValue v;
            v.id = id;
            v.shape = std::move(shape);
            v.strides = std::move(strides);
            v.offset = offset;
            v.dtype = parse_dtype(dtype, "load_graph");
            v.device = Device::parse(device, "load_graph");
            v.name = name;
            v.is_input = is_input;
            v.requires_grad = requires_grad;
            v.storage = storage;
            g.load_value(v);
          },
          "id"_a, "shape"_a, "strides"_a, "offset"_a, "dtype"_a, "device"_a, "name"_a, "is_input"_a,
          "requires_grad"_a, "storage"_a)
      .def(
          "_load_node",
          [](Graph& g, const std::string& op, nb::dict attrs, std::vector<int64_t> inputs,
             std::vector<int64_t> outputs, std::vector<int64_t> mutates, nb::dict numerics) {
            const OpSchema* s = find_schema(op);
            if (!s) {
              throw ValueError("[load_graph] node " + std::to_string(g.nodes.size()) +
                               ": unknown op '" + op + "' (no schema entry)");
            }
            CaptureNode n;
            n.op = op;
            for (auto [k, v] : attrs) {
              const std::string key = nb::cast<std::string>(k);
              const AttrType* t = nullptr;
              for (const auto& a : s->attrs) {
                if (a.first == key) t = &a.second;
              }
              if (!t) {
                throw ValueError("[load_graph] " + op + ": attribute '" + key +
                                 "' is not in the op's schema");
              }
              n.attrs[key] = py_to_attr(v, *t, op + "." + key);
            }
            for (auto [k, v] : numerics) {
              const std::string key = nb::cast<std::string>(k);
              n.numerics[key] = key == "deterministic"
                                    ? py_to_attr(v, AttrType::Bool, op + ".numerics." + key)
                                    : py_to_attr(v, AttrType::String, op + ".numerics." + key);
            }
            n.inputs = std::move(inputs);
            n.outputs = std::move(outputs);
            n.mutates = std::move(mutates);
            g.load_node(n);
          },
          "op"_a, "attrs"_a, "inputs"_a, "outputs"_a, "mutates"_a, "numerics"_a)
      .def(
          "_load_tables",
          [](Graph& g, std::vector<int64_t> inputs, std::vector<int64_t> outputs,
             std::vector<std::pair<int64_t, int64_t>> mutations,
             std::vector<std::pair<int64_t, int64_t>> grads, const std::string& precision,
             bool deterministic, int64_t seed, int64_t begin, int64_t end) {
            g.inputs = std::move(inputs);
            g.outputs = std::move(outputs);
            g.mutations = std::move(mutations);
            g.grads = std::move(grads);
            parse_matmul_precision(precision);
            g.numerics["matmul_precision"] = precision;
            g.numerics["deterministic"] = deterministic;
            g.rng_seed = seed;
            g.rng_offset_begin = begin;
            g.rng_offset_end = end;
            g.validate();
          },
          "inputs"_a, "outputs"_a, "mutations"_a, "grads"_a, "matmul_precision"_a,
          "deterministic"_a, "rng_seed"_a, "rng_offset_begin"_a, "rng_offset_end"_a)
      .def(
          "_replay",
          [](const Graph& g, nb::handle inputs, bool current_rng, bool check) {
            auto in = tensor_list(inputs, "replay", "inputs");
            ReplayOptions opt;
            opt.current_rng = current_rng;
            opt.check = check;
            std::vector<Tensor> grads;
            std::vector<Tensor> out;
            {
              nb::gil_scoped_release release;
              out = g.replay(in, opt, &grads);
            }
            nb::list gl;
            for (auto& t : grads) gl.append(t.defined() ? nb::cast(t) : nb::none());
            return nb::make_tuple(out, gl);
          },
          "inputs"_a, "current_rng"_a = true, "check"_a = true);

  m.def(
      "_op_schemas",
      []() {
        nb::list l;
        for (const auto& s : op_schemas()) {
          nb::dict d;
          d["op"] = s.op;
          d["primitive"] = s.primitive;
          nb::dict a;
          for (const auto& [k, t] : s.attrs) a[k.c_str()] = attr_type_name(t);
          d["attrs"] = a;
          nb::list num;
          for (unsigned bit : {unsigned(kMatmulPrecision), unsigned(kDeterministic),
                               unsigned(kAttentionPrecision)}) {
            if (s.numerics & bit) num.append(numerics_name(bit));
          }
          d["numerics"] = num;
          d["view"] = s.view;
          d["writes_inputs"] = static_cast<bool>(s.mutates);
          d["replayable"] = static_cast<bool>(s.make) || s.primitive.empty() || s.op == "to_device";
          l.append(d);
        }
        return l;
      },
      "Every op a capture can record: op, primitive (C++ class), attrs {name: type}, numerics "
      "(settings it reads), view, writes_inputs, replayable.");
  m.def("_enum_op_names", &enum_op_names,
        "Op names of every unary, binary and reduce kind (for schema coverage tests).");
  m.def(
      "_set_capture",
      [](Graph* g) {
        Graph* prev = active_graph();
        if (g) {
          g->begin();
          set_active_graph(g);
        } else {
          set_active_graph(nullptr);
          if (prev) prev->finish();
        }
      },
      "graph"_a.none(), "Starts (or with None ends) capture on this thread.");
  // The eager op log behind bt.op_log() (python/blutrain/tensor/__init__.py).
  m.def("_op_log_start", &op_log_start,
        "Start the eager op log (cleared): every primitive evaluated eagerly is noted.");
  m.def("_op_log_on", &op_log_on, "Whether the eager op log is recording.");
  m.def(
      "_op_log_stop",
      []() {
        nb::list l;
        for (auto& e : op_log_stop()) {
          auto metas = [](const std::vector<std::pair<DType, Shape>>& v) {
            nb::list r;
            for (auto& [d, s] : v) r.append(nb::make_tuple(dtype_name(d), ints_tuple(s)));
            return r;
          };
          l.append(nb::make_tuple(e.op, metas(e.in), metas(e.out)));
        }
        return l;
      },
      nb::sig("def _op_log_stop() -> list[tuple[str, list[tuple[str, tuple[int, ...]]], "
              "list[tuple[str, tuple[int, ...]]]]]"),
      "Stop the eager op log; its entries (op, [(dtype, shape) of inputs], [... of outputs]).");
  m.def("_capturing", []() { return active_graph() != nullptr; }, "Whether capture is active.");
}

}  // namespace bt::python
