// primitives.cpp: apply() (run or record an op, attach autograd) and every primitive's vjp.
// vjps are written with ops, so they run on any backend and are recorded in capture mode.
#include "primitives.h"

#include <algorithm>
#include <cmath>

#include "autocast.h"
#include "capture.h"
#include "nn_fused.h"
#include "ops.h"

namespace bt {

static LinalgHooks g_linalg;
void set_linalg_hooks(const LinalgHooks& h) { g_linalg = h; }
const LinalgHooks& linalg_hooks() { return g_linalg; }

std::vector<Tensor> Primitive::vjp(const VjpArgs&) {
  throw RuntimeError(std::string("[") + name() + "] is not differentiable");
}

// ---- the autograd node of a primitive ------------------------------------------------------
namespace {
// A saved input kept as its recipe (Note [recomputed activations]): the view's geometry over
// the rebuilt tensor.
struct RecomputedInput {
  std::shared_ptr<Recompute> recipe;
  Shape shape;
  Strides strides;
  int64_t offset = 0;
};

// The recipe of `t`'s values when t is a marked tensor, or a view of one, still unchanged.
std::shared_ptr<Recompute> recipe_of(const Tensor& t) {
  if (t.is_symbolic()) return nullptr;
  const auto& root = t.impl()->view_base ? t.impl()->view_base : t.impl_ptr();
  const auto& r = root->recompute;
  if (!r || root->storage != t.storage() || t.version() != r->version) return nullptr;
  return r;
}

Tensor rebuild(const RecomputedInput& s, const char* node_op) {
  const Recompute& r = *s.recipe;
  for (size_t i = 0; i < r.inputs.size(); ++i) {
    if (r.inputs[i].defined() && r.inputs[i].version() != r.versions[i]) {
      throw RuntimeError(std::string("[backward] input ") + std::to_string(i) + " of " + r.op +
                         ", kept to recompute its output for " + node_op +
                         "'s backward (recompute=True), was modified by an in-place operation. "
                         "Use an out-of-place op, or recompute=False.");
    }
  }
  GradModeGuard no_grad(false);
  Tensor base = r.run();
  if (base.shape() == s.shape && base.strides() == s.strides && base.offset() == s.offset) {
    return base;
  }
  return make_view(base, s.shape, s.strides, s.offset);
}

struct PrimNode : Node {
  std::shared_ptr<Primitive> prim;
  std::vector<Tensor> saved_in, saved_out;
  std::vector<RecomputedInput> recomputed_in;  // empty, or one per input (recipe or null)
  std::vector<uint64_t> ver_in, ver_out;
  std::vector<TensorMeta> in_meta;
  std::vector<bool> needs;

  std::string name() const override {
    std::string n = prim->name();
    // "log_softmax" -> "LogSoftmax", as PyTorch prints grad_fn names.
    std::string r;
    bool up = true;
    for (char c : n) {
      if (c == '_') {
        up = true;
        continue;
      }
      r += up ? static_cast<char>(std::toupper(c)) : c;
      up = false;
    }
    return r;
  }

  void check_saved(const std::vector<Tensor>& saved, const std::vector<uint64_t>& ver,
                   const char* what) const {
    for (size_t i = 0; i < saved.size(); ++i) {
      if (saved[i].defined() && saved[i].version() != ver[i]) {
        throw RuntimeError(
            std::string("[backward] ") + what + " " + std::to_string(i) + " of " + prim->name() +
            ", saved for backward, was modified by an in-place "
            "operation (it is at version " +
            std::to_string(saved[i].version()) + "; expected version " + std::to_string(ver[i]) +
            "). Use an out-of-place op, or clone() before changing it.");
      }
    }
  }

  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    if (released) {
      throw RuntimeError(std::string("[backward] trying to backward through the graph a second "
                                     "time (at ") +
                         prim->name() +
                         "): its saved tensors were freed after the first backward. Pass "
                         "retain_graph=True to the first backward if you need to call it twice.");
    }
    check_saved(saved_in, ver_in, "input");
    check_saved(saved_out, ver_out, "output");
    std::vector<Tensor> rebuilt;
    if (!recomputed_in.empty()) {
      rebuilt = saved_in;
      for (size_t i = 0; i < recomputed_in.size(); ++i) {
        if (recomputed_in[i].recipe) rebuilt[i] = rebuild(recomputed_in[i], prim->name());
      }
    }
    std::vector<DType> grad_dtypes(in_meta.size());
    for (size_t i = 0; i < in_meta.size(); ++i) {
      const Edge& e = next[i];
      grad_dtypes[i] = needs[i] && e.node ? e.node->grad_dtype_taken(e.input_nr) : in_meta[i].dtype;
    }
    VjpArgs args{recomputed_in.empty() ? saved_in : rebuilt,
                 saved_out,
                 in_meta,
                 grads,
                 needs,
                 last_run,
                 grad_dtypes,
                 pending.empty() ? nullptr : &pending,
                 pending.empty() ? nullptr : &pending_taken};
    auto r = prim->vjp(args);
    r.resize(next.size());
    for (size_t i = 0; i < r.size(); ++i) {
      if (!needs[i]) r[i] = Tensor();
    }
    return r;
  }
  void release() override {
    released = true;
    saved_in.clear();
    saved_out.clear();
    recomputed_in.clear();
  }
  bool takes_no_gradient(size_t i) const override { return prim->takes_no_cotangent(i); }
  bool takes_pending_gradient(size_t i) const override {
    return i < needs.size() && needs[i] && prim->takes_pending_gradient(i);
  }
  DType grad_dtype_taken(size_t i) const override {
    const DType own = out_meta[i].dtype;
    const bool hooked =
        !pre_hooks[i].empty() || (i < retain_hooks.size() && !retain_hooks[i].empty());
    if (hooked) return own;  // hooks see the output's own dtype
    // captured graphs keep one dtype per edge (as VjpArgs::grad_dtypes)
    if (!prim->is_cast()) return active_graph() ? own : prim->cotangent_dtype(i, own);
    if (in_meta.empty()) return own;
    const DType wide = in_meta[0].dtype;
    return is_floating(wide) && is_floating(own) && itemsize(wide) > itemsize(own) ? wide : own;
  }
};
}  // namespace

void mark_recompute(const Tensor& out, const char* op, std::vector<Tensor> inputs,
                    std::function<Tensor(const std::vector<Tensor>&)> run) {
  if (!out.defined() || out.is_symbolic()) return;
  auto r = std::make_shared<Recompute>();
  for (auto& t : inputs) {
    r->inputs.push_back(t.defined() ? detach(t) : Tensor());  // no grad_fn: the graph stays free
    r->versions.push_back(t.defined() ? t.version() : 0);
  }
  r->run = [run = std::move(run), ins = r->inputs] { return run(ins); };
  r->version = out.version();
  r->op = op;
  out.impl()->recompute = std::move(r);
}

bool donatable(const Tensor& saved) {
  // (never foreign memory: a numpy array or DLPack producer still owns and may read it)
  return saved.defined() && !saved.is_symbolic() && saved.impl_ptr().use_count() == 1 &&
         !saved.storage()->foreign() && storage_only_via(saved);
}

// Output 0 of a primitive that overwrites input k: input k's memory, as a fresh contiguous
// tensor without autograd state (the vjp checked donatable(); see the Note in primitives.h).
static Tensor donated_output(const Primitive& prim, const Tensor& in, const Shape& shape,
                             DType dtype) {
  if (!in.defined() || in.is_symbolic() || in.shape() != shape || in.dtype() != dtype ||
      !in.is_contiguous()) {
    throw RuntimeError(std::string("[") + prim.name() +
                       "] can write its result over its input only when that input is a "
                       "contiguous tensor of the result's shape " +
                       shape_str(shape) + " and dtype");
  }
  return make_view(in, shape, in.strides(), in.offset());
}

std::vector<Tensor> apply(std::shared_ptr<Primitive> prim, const std::vector<Tensor>& inputs_in,
                          const std::vector<std::pair<Shape, DType>>& out_meta, Device device) {
  // Note [dense side inputs]: a copy only for a declared input that is not contiguous.
  std::vector<Tensor> dense;
  for (size_t i = 0; i < inputs_in.size(); ++i) {
    const Tensor& t = inputs_in[i];
    if (t.defined() && prim->contiguous_input(i) && !t.is_contiguous()) {
      if (dense.empty()) dense = inputs_in;
      dense[i] = contiguous(t);
    }
  }
  const std::vector<Tensor>& inputs = dense.empty() ? inputs_in : dense;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& t = inputs[i];
    if (t.defined() && t.device() != device) {
      throw ValueError(std::string("[") + prim->name() + "] expected all tensors on " +
                       device.str() + ", but input " + std::to_string(i) + " is on " +
                       t.device().str());
    }
  }
  Graph* graph = active_graph();
  std::vector<Tensor> outs;
  // Elementwise results take a dense input 0's layout (so captured values carry eager's strides)
  const bool like0 = prim->preserves_layout() && out_meta.size() == 1 && !inputs.empty() &&
                     inputs[0].shape() == out_meta[0].first && !inputs[0].is_contiguous() &&
                     is_dense(inputs[0]);
  if (prim->is_view()) {
    outs.push_back(prim->eval_view(inputs));
  } else if (graph) {
    for (auto& m : out_meta) {
      outs.push_back(symbolic_tensor(m.first, m.second, device));
      if (like0) outs.back().impl()->strides = inputs[0].strides();
    }
  } else {
    const int over = prim->overwrites_input();
    for (auto& m : out_meta) {
      outs.push_back(
          over >= 0 && outs.empty()
              ? donated_output(*prim, inputs.at(static_cast<size_t>(over)), m.first, m.second)
          : like0 ? empty_strided(m.first, inputs[0].strides(), m.second, device, prim->name())
                  : empty_tensor(m.first, m.second, device, prim->name()));
    }
    for (auto& t : inputs) {
      if (t.defined() && t.is_symbolic()) {
        throw RuntimeError(std::string("[") + prim->name() +
                           "] got a symbolic tensor (from a capture) outside capture mode");
      }
    }
    if (device.is_cuda()) {
      prim->eval_gpu(inputs, outs);
    } else {
      prim->eval_cpu(inputs, outs);
    }
    if (over >= 0) outs[0].bump_version();  // the input's old values are gone
    if (op_log_on()) op_log_note(prim->name(), inputs, outs);
  }
  if (graph) {
    Attrs a;
    prim->attrs(a);
    graph->record(prim->name(), a, inputs, outs);
  }

  bool any = false;
  for (auto& t : inputs) any = any || (t.defined() && t.requires_grad());
  if (prim->is_view()) {
    outs[0].impl()->view_of_grad = any || inputs[0].impl()->view_of_grad;
    const auto& in = inputs[0].impl_ptr();
    if (outs[0].storage() && outs[0].storage() == in->storage) {
      const auto& base = in->view_base ? in->view_base : in;
      outs[0].impl()->view_base = base;
      auto& vs = base->views;
      if (vs.size() == vs.capacity()) {  // drop dead views before the vector grows
        vs.erase(std::remove_if(vs.begin(), vs.end(), [](const auto& w) { return w.expired(); }),
                 vs.end());
      }
      vs.push_back(outs[0].impl_ptr());
    }
  }
  if (!any || !grad_enabled() || !prim->differentiable()) return outs;

  auto node = std::make_shared<PrimNode>();
  node->prim = prim;
  for (auto& t : inputs) {
    node->next.push_back(gradient_edge(t));
    node->needs.push_back(t.defined() && t.requires_grad());
    node->in_meta.push_back(t.defined() ? TensorMeta{t.shape(), t.dtype(), t.device()}
                                        : TensorMeta{{}, DType::Float32, device});
  }
  if (prim->saves_inputs()) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      const bool keep = inputs[i].defined() && prim->saves_input(i, node->needs);
      auto recipe = keep ? recipe_of(inputs[i]) : nullptr;
      const bool rebuilt = recipe != nullptr;
      if (rebuilt) {  // Note [recomputed activations]: the recipe, not the tensor
        node->recomputed_in.resize(inputs.size());
        node->recomputed_in[i] = {std::move(recipe), inputs[i].shape(), inputs[i].strides(),
                                  inputs[i].offset()};
      }
      node->saved_in.push_back(keep && !rebuilt ? inputs[i] : Tensor());
      node->ver_in.push_back(keep ? inputs[i].version() : 0);
    }
  }
  if (prim->saves_outputs()) {
    for (size_t i = 0; i < outs.size(); ++i) {
      const bool keep = prim->saves_output(i);
      node->saved_out.push_back(keep ? detach(outs[i]) : Tensor());  // no grad_fn: no cycle
      node->ver_out.push_back(keep ? outs[i].version() : 0);
    }
  }
  node->pre_hooks.resize(outs.size());
  for (size_t i = 0; i < outs.size(); ++i) {
    auto* o = outs[i].impl();
    node->out_meta.push_back({o->shape, o->dtype, o->device});
    if (is_floating(o->dtype)) {
      o->grad_fn = node;
      o->output_nr = static_cast<int>(i);
      o->requires_grad = true;
    }
  }
  return outs;
}

// ---- vjps ----------------------------------------------------------------------------------

std::vector<Tensor> Full::vjp(const VjpArgs&) { return {}; }
std::vector<Tensor> Arange::vjp(const VjpArgs&) { return {}; }
std::vector<Tensor> Random::vjp(const VjpArgs&) { return {}; }
std::vector<Tensor> ArgReduce::vjp(const VjpArgs&) { return {}; }

std::vector<Tensor> AsType::vjp(const VjpArgs& a) {
  return {astype(a.cotangents[0], a.in_meta[0].dtype)};
}
std::vector<Tensor> CachedCast::vjp(const VjpArgs& a) {
  return {astype(a.cotangents[0], a.in_meta[0].dtype), Tensor()};
}
std::vector<Tensor> ToDevice::vjp(const VjpArgs& a) {
  return {to_device(a.cotangents[0], a.in_meta[0].device)};
}
std::vector<Tensor> Reshape::vjp(const VjpArgs& a) {
  return {reshape(a.cotangents[0], a.in_meta[0].shape)};
}
std::vector<Tensor> Permute::vjp(const VjpArgs& a) {
  std::vector<int64_t> inv(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) inv[perm[i]] = static_cast<int64_t>(i);
  return {permute(a.cotangents[0], inv)};
}
std::vector<Tensor> Expand::vjp(const VjpArgs& a) {
  return {sum_to(a.cotangents[0], a.in_meta[0].shape)};
}
std::vector<Tensor> Slice::vjp(const VjpArgs& a) {
  const auto& m = a.in_meta[0];
  return {slice_scatter(zeros(m.shape, a.cotangents[0].dtype(), m.device), a.cotangents[0], dim,
                        start, stop, step)};
}
std::vector<Tensor> Select::vjp(const VjpArgs& a) {
  const auto& m = a.in_meta[0];
  return {slice_scatter(zeros(m.shape, a.cotangents[0].dtype(), m.device),
                        unsqueeze(a.cotangents[0], dim), dim, index, index + 1, 1)};
}
std::vector<Tensor> SliceScatter::vjp(const VjpArgs& a) {
  const Tensor& g = a.cotangents[0];
  Tensor gsrc = slice(g, dim, start, stop, step);
  Tensor gbase = a.needs[0] ? slice_scatter(g, zeros_like(gsrc), dim, start, stop, step) : Tensor();
  return {gbase, gsrc};
}

// Unary ---------------------------------------------------------------------------------------
bool Unary::saves_inputs() const {
  switch (op) {
    case UnaryOp::Neg:
    case UnaryOp::Exp:
    case UnaryOp::Sqrt:
    case UnaryOp::Rsqrt:
    case UnaryOp::Tanh:
    case UnaryOp::Sigmoid:
    case UnaryOp::Relu:
      return false;
    default:
      return true;
  }
}
bool Unary::saves_outputs() const {
  switch (op) {
    case UnaryOp::Exp:
    case UnaryOp::Sqrt:
    case UnaryOp::Rsqrt:
    case UnaryOp::Tanh:
    case UnaryOp::Sigmoid:
    case UnaryOp::Relu:
      return true;
    default:
      return false;
  }
}

std::vector<Tensor> Unary::vjp(const VjpArgs& a) {
  const Tensor& g = a.cotangents[0];
  const Tensor x = a.inputs.empty() ? Tensor() : a.inputs[0];
  const Tensor y = a.outputs.empty() ? Tensor() : a.outputs[0];
  auto one_minus = [](const Tensor& t) { return binary(BinaryOp::Sub, Scalar{1, 2}, t); };
  switch (op) {
    case UnaryOp::Neg:
      return {neg(g)};
    case UnaryOp::Exp:
      return {mul(g, y)};
    case UnaryOp::Log:
      return {div(g, x)};
    case UnaryOp::Sqrt:
      return {div(mul(g, 0.5), y)};
    case UnaryOp::Rsqrt:
      return {mul(mul(g, -0.5), mul(y, mul(y, y)))};
    case UnaryOp::Tanh:
      return {mul(g, one_minus(mul(y, y)))};
    case UnaryOp::Abs:
      return {mul(g, unary(UnaryOp::Sign, x))};
    case UnaryOp::Sigmoid:
      return {mul(g, mul(y, one_minus(y)))};
    case UnaryOp::Relu:
      return {mul(g, astype(binary(BinaryOp::Gt, y, Scalar{0, 1}), g.dtype()))};
    case UnaryOp::Sin:
      return {mul(g, unary(UnaryOp::Cos, x))};
    case UnaryOp::Cos:
      return {neg(mul(g, unary(UnaryOp::Sin, x)))};
    case UnaryOp::Erf:
      return {mul(g, mul(unary(UnaryOp::Exp, neg(mul(x, x))), 2.0 / std::sqrt(M_PI)))};
    case UnaryOp::GeluErf: {
      // d/dx x Phi(x) = Phi(x) + x phi(x)
      Tensor cdf = mul(add(unary(UnaryOp::Erf, mul(x, M_SQRT1_2)), 1.0), 0.5);
      Tensor pdf = mul(unary(UnaryOp::Exp, mul(mul(x, x), -0.5)), 0.5 * M_2_SQRTPI * M_SQRT1_2);
      return {mul(g, add(cdf, mul(x, pdf)))};
    }
    case UnaryOp::GeluTanh:
      return {gelu_tanh_grad(x, g)};
    default:
      break;
  }
  return Primitive::vjp(a);
}

// Binary --------------------------------------------------------------------------------------
bool Binary::saves_inputs() const {
  return !(op == BinaryOp::Add || op == BinaryOp::Sub || op == BinaryOp::FloorDiv);
}

std::vector<Tensor> Binary::vjp(const VjpArgs& a) {
  const Tensor& g = a.cotangents[0];
  const Tensor x = a.inputs.empty() ? Tensor() : a.inputs[0];
  const Tensor y = a.inputs.empty() ? Tensor() : a.inputs[1];
  switch (op) {
    case BinaryOp::Add:
      return {g, g};
    case BinaryOp::Sub:
      return {g, a.needs[1] ? neg(g) : Tensor()};
    case BinaryOp::Mul:
      return {a.needs[0] ? mul(g, y) : Tensor(), a.needs[1] ? mul(g, x) : Tensor()};
    case BinaryOp::Div:
      return {a.needs[0] ? div(g, y) : Tensor(),
              a.needs[1] ? neg(div(mul(g, x), mul(y, y))) : Tensor()};
    case BinaryOp::Pow: {
      Tensor gx, gy;
      if (a.needs[0]) gx = mul(mul(g, y), binary(BinaryOp::Pow, x, sub(y, ones_like(y))));
      if (a.needs[1]) {
        // d/dy x^y = x^y log x; define it as 0 where x == 0 (PyTorch does the same).
        Tensor lg =
            unary(UnaryOp::Log, where(binary(BinaryOp::Eq, x, Scalar{0, 1}), ones_like(x), x));
        gy = mul(mul(g, a.outputs[0]), lg);
      }
      return {gx, gy};
    }
    case BinaryOp::FloorDiv:  // piecewise constant: zero almost everywhere (PyTorch's too)
      return {zeros_like(g), a.needs[1] ? zeros_like(g) : Tensor()};
    case BinaryOp::Mod:  // a - b * floor(a / b)
      return {g, a.needs[1] ? neg(mul(g, binary(BinaryOp::FloorDiv, x, y))) : Tensor()};
    case BinaryOp::Maximum:
    case BinaryOp::Minimum: {
      // Ties split the gradient evenly, as PyTorch does.
      const BinaryOp wins = op == BinaryOp::Maximum ? BinaryOp::Gt : BinaryOp::Lt;
      Tensor share = add(astype(binary(wins, x, y), g.dtype()),
                         mul(astype(binary(BinaryOp::Eq, x, y), g.dtype()), 0.5));
      Tensor gx = mul(g, share);
      return {gx, a.needs[1] ? sub(g, gx) : Tensor()};
    }
    default:
      break;
  }
  return Primitive::vjp(a);
}

std::vector<Tensor> Where::vjp(const VjpArgs& a) {
  const Tensor& g = a.cotangents[0];
  const Tensor& c = a.inputs[0];
  Tensor z = zeros({}, g.dtype(), g.device());
  return {Tensor(), a.needs[1] ? where(c, g, z) : Tensor(), a.needs[2] ? where(c, z, g) : Tensor()};
}
std::vector<Tensor> MaskedFill::vjp(const VjpArgs& a) {
  return {masked_fill(a.cotangents[0], a.inputs[1], Scalar::floating(0.0)), Tensor()};
}

// Reductions ----------------------------------------------------------------------------------
static Shape keepdim_shape(const Shape& in, const std::vector<int64_t>& dims) {
  Shape s = in;
  for (auto d : dims) s[d] = 1;
  return s;
}
static double reduced_count(const Shape& in, const std::vector<int64_t>& dims) {
  double n = 1;
  for (auto d : dims) n *= static_cast<double>(in[d]);
  return n;
}

std::vector<Tensor> Reduce::vjp(const VjpArgs& a) {
  const Shape& in_shape = a.in_meta[0].shape;
  const Shape ks = keepdim_shape(in_shape, dims);
  Tensor g = reshape(a.cotangents[0], ks);
  switch (op) {
    case ReduceOp::Sum:
      return {expand(g, in_shape)};
    case ReduceOp::Mean:
      return {expand(mul(g, 1.0 / reduced_count(in_shape, dims)), in_shape)};
    case ReduceOp::Max:
    case ReduceOp::Min: {
      const Tensor& x = a.inputs[0];
      Tensor mask = astype(binary(BinaryOp::Eq, x, reshape(a.outputs[0], ks)), g.dtype());
      Tensor count = reduce(ReduceOp::Sum, mask, dims, true);
      return {mul(mask, div(g, count))};
    }
    case ReduceOp::Var: {
      const Tensor& x = a.inputs[0];
      const double n = reduced_count(in_shape, dims);
      Tensor centered = sub(x, reduce(ReduceOp::Mean, x, dims, true));
      return {mul(mul(centered, g), 2.0 / std::max(n - correction, 0.0))};
    }
  }
  return Primitive::vjp(a);
}

// Indexing --------------------------------------------------------------------------------------
std::vector<Tensor> IndexSelect::vjp(const VjpArgs& a) {
  // An embedding's table gradient: float32 straight into a float32 master's cast (Note [cached
  // casts]), summed over the fresh zeros in place (no copy of a table-sized base) unless a
  // double backward could still need that base.
  const auto& m = a.in_meta[0];
  const Tensor& g = a.cotangents[0];
  const DType dt = weight_grad_dtype(a, 0, g.dtype());
  Tensor base;
  // The table's other gradient (a tied classifier's dW), when the engine offers it: add into it
  // instead of into zeros (Note [taking over a pending gradient], autograd.h).
  if (a.pending && a.needs[0] && (*a.pending)[0].defined()) {
    Tensor& p = (*a.pending)[0];
    if (p.dtype() == dt && p.shape() == m.shape && p.device() == m.device && p.is_contiguous()) {
      base = std::move(p);
      (*a.pending_taken)[0] = 1;
    }
  }
  if (!base.defined()) base = zeros(m.shape, dt, m.device);
  const bool over = !grad_enabled() && donatable(base);
  return {index_add(base, dim, a.inputs[1], g, over), Tensor()};
}
std::vector<Tensor> IndexAdd::vjp(const VjpArgs& a) {
  const Tensor& g = a.cotangents[0];
  return {g, Tensor(), a.needs[2] ? index_select(g, dim, a.inputs[1]) : Tensor()};
}
std::vector<Tensor> Gather::vjp(const VjpArgs& a) {
  const auto& m = a.in_meta[0];
  const Tensor& g = a.cotangents[0];
  return {scatter_add(zeros(m.shape, g.dtype(), m.device), dim, a.inputs[1], g), Tensor()};
}
std::vector<Tensor> ScatterAdd::vjp(const VjpArgs& a) {
  const Tensor& g = a.cotangents[0];
  return {g, Tensor(), a.needs[2] ? gather(g, dim, a.inputs[1]) : Tensor()};
}
std::vector<Tensor> Concatenate::vjp(const VjpArgs& a) {
  std::vector<int64_t> sizes;
  for (auto& m : a.in_meta) sizes.push_back(m.shape[dim]);
  return split_sizes(a.cotangents[0], sizes, dim);
}

// Neural-network ops ------------------------------------------------------------------------------
// Softmax / LayerNorm / CrossEntropy differentiate through the fused backward primitives of
// nn_fused.h (one kernel each, fp32 math, no fp32 copy of the logits).
std::vector<Tensor> Softmax::vjp(const VjpArgs& a) {
  return {softmax_backward(a.outputs[0], a.cotangents[0], log)};
}

std::vector<Tensor> LayerNorm::vjp(const VjpArgs& a) {
  const bool ndw = has_weight && a.needs[1], ndb = has_bias && a.needs[2];
  auto r = layer_norm_backward(a.cotangents[0], a.inputs[0], has_weight ? a.inputs[1] : Tensor(),
                               a.outputs[1], a.outputs[2], Tensor(), ndw, ndb,
                               layer_norm_wide_grads(a, a.inputs[0].dtype(), ndw, 1, ndb, 2));
  r.resize(3);  // (no dsum)
  return r;
}

std::vector<Tensor> CrossEntropy::vjp(const VjpArgs& a) {
  // dlogits over the logits when nothing can read them again (Note [donating a saved input])
  const bool over = a.last_run && donatable(a.inputs[0]) && a.inputs[0].is_contiguous();
  return {cross_entropy_backward(a.inputs[0], a.inputs[1], a.outputs[1], a.cotangents[0],
                                 ignore_index, reduction, label_smoothing, num_classes, over),
          Tensor()};
}

bool grad_flows_through_views(const Tensor& view, const Tensor& base) {
  if (!view.requires_grad() || !base.requires_grad() || !view.grad_fn()) return false;
  const Edge target = gradient_edge(base);
  Edge e = gradient_edge(view);
  for (int depth = 0; depth < 32 && e.node; ++depth) {
    if (e.node == target.node && e.input_nr == target.input_nr) return true;
    const auto* pn = dynamic_cast<const PrimNode*>(e.node.get());
    if (!pn || !pn->prim->is_view() || pn->next.size() != 1) return false;
    // a hook (or retain_grad) on an intermediate view must still see its gradient
    const size_t k = static_cast<size_t>(e.input_nr);
    if (k < pn->pre_hooks.size() && !pn->pre_hooks[k].empty()) return false;
    if (k < pn->retain_hooks.size() && !pn->retain_hooks[k].empty()) return false;
    e = pn->next[0];
  }
  return false;
}

std::vector<Tensor> Dropout::vjp(const VjpArgs& a) {
  const Tensor& g = a.cotangents[0];
  return {
      apply1(std::make_shared<Dropout>(p, seed, offset), {g}, g.shape(), g.dtype(), g.device())};
}

std::vector<Tensor> Matmul::vjp(const VjpArgs& a) {
  const Tensor& A = a.inputs[0];
  const Tensor& B = a.inputs[1];
  const Tensor& g = a.cotangents[0];
  std::vector<Tensor> r(a.inputs.size());
  auto mT = [](const Tensor& t) { return transpose(t, -1, -2); };
  if (a.needs[0]) {
    // C = A op(B): dA = g op(B)^T
    r[0] = sum_to(matmul(g, trans_b ? B : mT(B)), A.shape());
  }
  const bool linear2d = trans_b && A.ndim() == 2 && B.ndim() == 2 && g.ndim() == 2;
  if (linear2d && a.needs[1] && weight_grad_dtype(a, 1, g.dtype()) != g.dtype()) {
    // A 16-bit linear layer whose weight is a cast of a float32 master: dW and db written in
    // float32 (Note [cached casts]) by LinearWeightGrad.
    const bool want_db = has_bias && a.needs[2];
    auto [dw, db] = linear_weight_grads(a, g, A, B.shape(), 1, want_db);
    r[1] = dw;
    if (want_db) r[2] = db;
    return r;
  }
  if (a.needs[1]) {
    if (trans_b) {
      // B is (n, k): dB = g^T A, summed over batches.
      Tensor g2 = as_rows(g), A2 = as_rows(A);
      r[1] = matmul(mT(g2), A2);
    } else if (B.ndim() == 2 && A.ndim() > 2) {
      Tensor g2 = as_rows(g), A2 = as_rows(A);
      r[1] = matmul(mT(A2), g2);
    } else {
      r[1] = sum_to(matmul(mT(A), g), B.shape());
    }
  }
  if (has_bias && a.needs[2]) r[2] = sum(as_rows(g), {0});
  return r;
}

}  // namespace bt
