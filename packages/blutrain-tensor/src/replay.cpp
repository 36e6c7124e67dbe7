// replay.cpp: the reference interpreter of captured graphs (Graph::replay, capture.h).
//
// Each node rebuilds its primitive from the recorded attributes (the schema's factory) and runs
// it through apply(), the entry point eager ops use, with the node's recorded numerics settings
// in force: the same kernels on the same inputs, so the results are eager's bit for bit.  Values
// are dropped after their last reader, so a replayed training step holds about what eager holds.
#include <algorithm>
#include <optional>

#include "autocast.h"
#include "capture.h"
#include "ops.h"
#include "schema.h"

namespace bt {

namespace {

// Sets a node's recorded numerics settings and puts the previous ones back.
struct NumericsGuard {
  std::optional<MatmulPrecision> precision;
  std::optional<bool> deterministic;
  std::optional<AttentionPrecision> attention;  // absent in graphs saved before it existed
  explicit NumericsGuard(const Attrs& n) {
    if (auto it = n.find("matmul_precision"); it != n.end()) {
      const MatmulPrecision p = parse_matmul_precision(std::get<std::string>(it->second));
      precision = float32_matmul_precision();
      set_float32_matmul_precision(p);
    }
    if (auto it = n.find("deterministic"); it != n.end()) {
      deterministic = deterministic_algorithms();
      set_deterministic_algorithms(std::get<bool>(it->second));
    }
    if (auto it = n.find("attention_precision"); it != n.end()) {
      const AttentionPrecision p = parse_attention_precision(std::get<std::string>(it->second));
      attention = float32_attention_precision();
      set_float32_attention_precision(p);
    }
  }
  ~NumericsGuard() {
    if (precision) set_float32_matmul_precision(*precision);
    if (deterministic) set_deterministic_algorithms(*deterministic);
    if (attention) set_float32_attention_precision(*attention);
  }
};

std::string where(size_t k, const CaptureNode& n) {
  return "[replay] node " + std::to_string(k) + " (" + n.op + ")";
}

void check_value(const Tensor& t, const CaptureValue& v, const std::string& who) {
  if (!t.defined()) throw RuntimeError(who + ": value %" + std::to_string(v.id) + " is None");
  auto fail = [&](const std::string& what, const std::string& got, const std::string& want) {
    throw RuntimeError(who + ": value %" + std::to_string(v.id) + " has " + what + " " + got +
                       ", the graph says " + want);
  };
  if (t.shape() != v.shape) fail("shape", shape_str(t.shape()), shape_str(v.shape));
  if (t.dtype() != v.dtype) fail("dtype", dtype_name(t.dtype()), dtype_name(v.dtype));
  if (t.device().type != v.device.type) fail("device", t.device().str(), v.device.str());
  // strides of size-1 dims carry no meaning (and differ between equal layouts)
  for (size_t d = 0; d < v.shape.size(); ++d) {
    if (v.shape[d] > 1 && t.strides()[d] != v.strides[d]) {
      fail("strides", shape_str(t.strides()), shape_str(v.strides));
    }
  }
}

}  // namespace

std::vector<Tensor> Graph::replay(const std::vector<Tensor>& in_tensors, const ReplayOptions& opt,
                                  std::vector<Tensor>* grads_out) const {
  if (active_graph()) throw RuntimeError("[replay] cannot replay a graph inside a capture");
  if (in_tensors.size() != inputs.size()) {
    throw ValueError("[replay] the graph has " + std::to_string(inputs.size()) + " inputs, got " +
                     std::to_string(in_tensors.size()));
  }
  std::vector<Tensor> env(values.size());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const CaptureValue& v = values[inputs[i]];
    const std::string who = "[replay] input " + std::to_string(i) +
                            (v.name.empty() ? std::string() : " (" + v.name + ")");
    check_value(in_tensors[i], v, who);
    if (in_tensors[i].is_symbolic()) throw ValueError(who + " is a symbolic tensor");
    env[inputs[i]] = in_tensors[i];
  }
  // the last node reading each value; graph outputs and final gradients live to the end
  std::vector<int64_t> last(values.size(), -1);
  for (size_t k = 0; k < nodes.size(); ++k) {
    for (auto id : nodes[k].inputs) {
      if (id >= 0) last[id] = static_cast<int64_t>(k);
    }
  }
  const int64_t end = static_cast<int64_t>(nodes.size());
  for (auto id : outputs) last[id] = end;
  for (auto& [leaf, g] : grads) {
    last[leaf] = end;
    if (g >= 0) last[g] = end;
  }

  GradModeGuard no_grad(false);
  const auto [seed, offset] = get_rng_state();
  const uint64_t shift = opt.current_rng ? offset - static_cast<uint64_t>(rng_offset_begin) : 0;

  for (size_t k = 0; k < nodes.size(); ++k) {
    const CaptureNode& n = nodes[k];
    std::vector<Tensor> in;
    in.reserve(n.inputs.size());
    for (auto id : n.inputs) {
      if (id >= 0 && !env[id].defined()) {
        throw RuntimeError(where(k, n) + ": input %" + std::to_string(id) + " has no value");
      }
      in.push_back(id >= 0 ? env[id] : Tensor());
    }
    std::vector<Tensor> res;
    if (n.op == "copy_") {
      Tensor dst = in[0];
      copy_(dst, in[1]);
      res = {dst};
    } else if (n.op == "accumulate_grad") {
      if (in.size() == 3) {  // eager: .grad += grad, in place
        Tensor prev = in[2];
        inplace(prev, add(prev, in[1]), "accumulate_grad");
        res = {prev};
      } else {
        res = {clone(in[1])};
      }
    } else if (n.op == "to_device") {
      res = {to_device(in[0], Device::parse(std::get<std::string>(n.attrs.at("device")), "to"))};
    } else {
      const OpSchema* s = find_schema(n.op);
      if (!s || !s->make) throw RuntimeError(where(k, n) + ": the op cannot be replayed");
      Attrs a = n.attrs;
      if (opt.current_rng && (n.op == "random" || n.op == "dropout")) {
        if (std::get<int64_t>(a.at("seed")) != rng_seed) {
          throw RuntimeError(where(k, n) +
                             ": its seed differs from the generator's at the capture's start "
                             "(manual_seed inside the capture); replay with current_rng=False");
        }
        a["offset"] =
            static_cast<int64_t>(static_cast<uint64_t>(std::get<int64_t>(a["offset"])) + shift);
      }
      std::shared_ptr<Primitive> prim = s->make(a);
      if (prim->name() != n.op) {
        throw RuntimeError(where(k, n) + ": the schema's factory made a '" + prim->name() +
                           "' primitive");
      }
      const size_t fresh = n.outputs.size() - n.mutates.size();
      std::vector<std::pair<Shape, DType>> meta;
      Device dev;
      bool have_dev = false;
      for (size_t j = 0; j < fresh; ++j) {
        const CaptureValue& v = values[n.outputs[j]];
        meta.emplace_back(v.shape, v.dtype);
        if (!have_dev) dev = v.device;
        have_dev = true;
      }
      for (auto& t : in) {
        if (!have_dev && t.defined()) {
          dev = t.device();
          have_dev = true;
        }
      }
      {
        NumericsGuard guard(n.numerics);
        res = apply(prim, in, meta, dev);
      }
      for (auto p : n.mutates) {
        res.push_back(in[p]);
        if (in[p].storage()) in[p].storage()->bump_version();
      }
    }
    if (res.size() != n.outputs.size()) {
      throw RuntimeError(where(k, n) + " made " + std::to_string(res.size()) +
                         " results, the graph has " + std::to_string(n.outputs.size()));
    }
    for (size_t j = 0; j < res.size(); ++j) {
      if (opt.check) check_value(res[j], values[n.outputs[j]], where(k, n));
      env[n.outputs[j]] = res[j];
    }
    for (auto id : n.inputs) {  // drop values nothing reads any more
      if (id >= 0 && last[id] == static_cast<int64_t>(k)) env[id] = Tensor();
    }
    for (auto id : n.outputs) {
      if (last[id] < 0) env[id] = Tensor();
    }
  }
  if (opt.current_rng) {  // the generator advances as the eager step's draws did
    set_rng_state(seed, offset + static_cast<uint64_t>(rng_offset_end - rng_offset_begin));
  }
  std::vector<Tensor> out;
  for (auto id : outputs) out.push_back(env[id]);
  if (grads_out) {
    grads_out->clear();
    for (auto& [leaf, g] : grads) grads_out->push_back(g >= 0 ? env[g] : Tensor());
  }
  return out;
}

}  // namespace bt
