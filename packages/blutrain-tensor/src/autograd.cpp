// autograd.cpp: nodes, the leaf accumulator, hooks and the backward engine (see autograd.h).
#include "autograd.h"

#include <atomic>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "capture.h"
#include "ops.h"

namespace bt {

static std::atomic<uint64_t> g_seq{0};
Node::Node() : seq(g_seq.fetch_add(1)) {}

static thread_local bool g_grad_enabled = true;
bool grad_enabled() { return g_grad_enabled; }
void set_grad_enabled(bool on) { g_grad_enabled = on; }

// ---- the leaf accumulator ------------------------------------------------------------------
namespace {
std::atomic<uint64_t> g_hook_calls{0};
void count_hook_call() { g_hook_calls.fetch_add(1, std::memory_order_relaxed); }

struct AccumulateGrad : Node {
  explicit AccumulateGrad(std::shared_ptr<TensorImpl> l) : leaf(std::move(l)) {
    next = {};
    out_meta.push_back({leaf->shape, leaf->dtype, leaf->device});
    pre_hooks.resize(1);
  }
  std::string name() const override { return "AccumulateGrad"; }
  bool is_accumulator() const override { return true; }

  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    Tensor g = grads[0];
    Tensor leaf_t(leaf);
    leaf->hooks.for_each([&](const GradHook& h) {
      count_hook_call();
      Tensor r = h(g);
      if (r.defined()) g = r;
    });
    if (g.dtype() != leaf->dtype) g = astype(g, leaf->dtype);
    if (Graph* graph = active_graph()) {  // the .grad becomes the recorded value (capture.h)
      graph->accumulate_grad(leaf_t, g);
      return {};
    }
    if (!leaf->grad) {
      // Keep the gradient itself only when nothing else holds it (a user-given gradient or a
      // cotangent passed through unchanged must not be aliased by .grad).  A view of a tensor
      // that only the view still holds (a backward's output reshaped on its way to the leaf, as
      // the packed attention gradient is) counts as unshared: it is kept, detached from that
      // base, instead of copied.
      bool via_base = false;
      const bool sole = storage_only_via(g, &via_base);
      // kept through the base only when g is that whole base's memory and the base has no history
      const bool base_ok =
          !via_base || (!g.impl()->view_base->grad_fn && g.offset() == 0 &&
                        size_t(g.numel()) * itemsize(g.dtype()) == g.storage()->nbytes());
      const bool own = g.impl_ptr().use_count() <= 2 && g.is_contiguous() && !g.impl()->grad_fn &&
                       sole && base_ok;
      leaf->grad = !own ? clone(g).impl_ptr() : via_base ? detach(g).impl_ptr() : g.impl_ptr();
    } else if (leaf->grad_overwrite) {
      Tensor acc(leaf->grad);
      copy_(acc, g);  // the first gradient of a bucket's window: no zero fill, no add
    } else {
      Tensor acc(leaf->grad);
      inplace(acc, add(acc, g), "accumulate_grad");
    }
    leaf->grad_overwrite = false;
    leaf->post_acc_hooks.for_each([&](const PostAccHook& h) {
      count_hook_call();
      h(leaf_t);
    });
    return {};
  }
  std::shared_ptr<TensorImpl> leaf;
};

struct CustomNode : Node {
  std::string nm;
  BackwardFn fn;
  std::vector<TensorMeta> in_meta;
  std::string name() const override { return nm; }
  std::vector<Tensor> apply(std::vector<Tensor>& grads) override {
    if (released) {
      throw RuntimeError("[backward] trying to backward through " + nm +
                         " a second time; its saved state was freed after the first backward. "
                         "Pass retain_graph=True to the first backward to keep it.");
    }
    auto r = fn(grads);
    if (r.size() != next.size()) {
      throw RuntimeError("[" + nm + "] backward returned " + std::to_string(r.size()) +
                         " gradients, expected " + std::to_string(next.size()) +
                         " (one per forward input)");
    }
    return r;
  }
  void release() override {
    released = true;
    fn = nullptr;
  }
};
}  // namespace

std::shared_ptr<Node> grad_accumulator(const Tensor& leaf) {
  auto* impl = leaf.impl();
  if (auto acc = impl->grad_accumulator.lock()) return acc;
  auto acc = std::make_shared<AccumulateGrad>(leaf.impl_ptr());
  impl->grad_accumulator = acc;
  return acc;
}

Edge gradient_edge(const Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return {};
  if (t.grad_fn()) return {t.grad_fn(), t.impl()->output_nr};
  return {grad_accumulator(t), 0};
}

std::shared_ptr<Node> make_custom_node(const std::string& name, BackwardFn fn,
                                       const std::vector<Tensor>& inputs,
                                       const std::vector<Tensor>& outputs) {
  auto node = std::make_shared<CustomNode>();
  node->nm = name;
  node->fn = std::move(fn);
  for (auto& t : inputs) node->next.push_back(gradient_edge(t));
  node->pre_hooks.resize(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    auto* o = outputs[i].impl();
    node->out_meta.push_back({o->shape, o->dtype, o->device});
    if (is_floating(o->dtype)) {
      o->grad_fn = node;
      o->output_nr = static_cast<int>(i);
      o->requires_grad = true;
    }
  }
  return node;
}

// ---- hooks ---------------------------------------------------------------------------------
HookHandle register_hook(const Tensor& t, GradHook hook) {
  if (!t.requires_grad()) {
    throw RuntimeError(
        "[register_hook] cannot register a hook on a tensor that does not require "
        "grad");
  }
  if (t.grad_fn()) {
    const size_t k = static_cast<size_t>(t.impl()->output_nr);
    const uint64_t id = t.grad_fn()->pre_hooks[k].add(std::move(hook));
    std::weak_ptr<Node> node = t.grad_fn();
    return HookHandle([node, k, id] {
      auto n = node.lock();
      return n && n->pre_hooks[k].remove(id);
    });
  }
  const uint64_t id = t.impl()->hooks.add(std::move(hook));
  std::weak_ptr<TensorImpl> leaf = t.impl_ptr();
  return HookHandle([leaf, id] {
    auto l = leaf.lock();
    return l && l->hooks.remove(id);
  });
}

HookHandle register_post_accumulate_hook(const Tensor& leaf, PostAccHook hook) {
  if (!leaf.requires_grad() || leaf.grad_fn()) {
    throw RuntimeError(
        "[register_post_accumulate_grad_hook] only leaf tensors that require grad "
        "accumulate a gradient");
  }
  const uint64_t id = leaf.impl()->post_acc_hooks.add(std::move(hook));
  std::weak_ptr<TensorImpl> weak = leaf.impl_ptr();
  return HookHandle([weak, id] {
    auto l = weak.lock();
    return l && l->post_acc_hooks.remove(id);
  });
}

std::pair<size_t, size_t> hook_counts(const Tensor& t) {
  if (!t.defined()) return {0, 0};
  if (t.grad_fn()) return {t.grad_fn()->pre_hooks[t.impl()->output_nr].size(), 0};
  return {t.impl()->hooks.size(), t.impl()->post_acc_hooks.size()};
}

uint64_t hook_calls() { return g_hook_calls.load(std::memory_order_relaxed); }

void retain_grad(const Tensor& t) {
  if (!t.requires_grad()) {
    throw RuntimeError(
        "[retain_grad] cannot retain the gradient of a tensor that does not "
        "require grad");
  }
  if (!t.grad_fn() || t.impl()->retains_grad) return;  // leaves keep theirs anyway
  t.impl()->retains_grad = true;
  std::weak_ptr<TensorImpl> weak = t.impl_ptr();
  auto& slots = t.grad_fn()->retain_hooks;
  slots.resize(t.grad_fn()->out_meta.size());
  slots[t.impl()->output_nr].push_back([weak](const Tensor& g) {
    if (auto impl = weak.lock()) {
      if (!impl->grad) {
        impl->grad = clone(g).impl_ptr();
      } else {
        impl->grad = add(Tensor(impl->grad), g).impl_ptr();
      }
    }
    return Tensor();
  });
}

void set_requires_grad(const Tensor& t, bool value) {
  if (t.grad_fn()) {
    if (!value) {
      throw RuntimeError(
          "[requires_grad_] you can only change requires_grad of leaf tensors; "
          "use detach() to get a tensor without history");
    }
    return;
  }
  if (value && !is_floating(t.dtype())) {
    throw RuntimeError(
        std::string("[requires_grad_] only floating tensors can require grad, got ") +
        dtype_name(t.dtype()));
  }
  t.impl()->requires_grad = value;
}

// ---- the engine ----------------------------------------------------------------------------
void run_backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads_in,
                  bool retain_graph) {
  GradModeGuard no_grad(false);  // gradients are computed without building a graph
  OpScope scope("backward");     // (a vjp's error names the call: Note [the op the user called])
  std::vector<Edge> root_edges;
  std::vector<Tensor> root_grads;
  if (grads_in.size() > roots.size()) {
    throw ValueError("[backward] got " + std::to_string(grads_in.size()) + " gradients for " +
                     std::to_string(roots.size()) + " tensors");
  }
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    if (!r.defined()) {
      throw TypeError("[backward] tensors[" + std::to_string(i) + "] is None, not a Tensor");
    }
    if (!r.requires_grad()) {
      throw RuntimeError("[backward] element " + std::to_string(i) +
                         " of tensors does not require grad and has no grad_fn");
    }
    Tensor g = i < grads_in.size() ? grads_in[i] : Tensor();
    if (!g.defined()) {
      if (r.numel() != 1) {
        throw RuntimeError(
            "[backward] grad can be implicitly created only for one-element "
            "outputs, but the output has shape " +
            shape_str(r.shape()) + "; pass gradient= with that shape");
      }
      g = ones_like(r);
    } else if (g.shape() != r.shape()) {
      throw RuntimeError("[backward] gradient has shape " + shape_str(g.shape()) +
                         " but the output has shape " + shape_str(r.shape()));
    } else if (g.device() != r.device()) {
      throw ValueError("[backward] gradient is on " + g.device().str() + " but the output is on " +
                       r.device().str());
    } else if (!is_floating(g.dtype())) {
      throw TypeError(std::string("[backward] gradient must be floating, got ") +
                      dtype_name(g.dtype()));
    } else if (g.dtype() != r.dtype()) {
      g = astype(g, r.dtype());  // (as PyTorch: a root gradient takes its output's dtype)
    }
    root_edges.push_back(gradient_edge(r));
    root_grads.push_back(g);
  }

  // Dependencies: how many edges point at each node from the part of the graph we will run.
  std::unordered_map<Node*, int> deps;
  std::unordered_set<Node*> seen;
  std::vector<Node*> stack;
  for (auto& e : root_edges) {
    if (seen.insert(e.node.get()).second) stack.push_back(e.node.get());
  }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (auto& e : n->next) {
      if (!e.node) continue;
      deps[e.node.get()]++;
      if (seen.insert(e.node.get()).second) stack.push_back(e.node.get());
    }
  }

  std::unordered_map<Node*, std::vector<Tensor>> buffers;
  auto accumulate = [&](const Edge& e, const Tensor& g) {
    auto& buf = buffers[e.node.get()];
    if (buf.empty()) buf.resize(e.node->out_meta.size());
    Tensor& slot = buf[e.input_nr];
    slot = slot.defined() ? add(slot, g) : g;
  };
  // Note [taking over a pending gradient] (autograd.h): move a summed gradient out of the buffer
  // for a node that can take it over; afterwards put back what it did not take.
  auto offer_pending = [&](Node& node) {
    node.pending.clear();
    node.pending_taken.clear();
    for (size_t i = 0; i < node.next.size(); ++i) {
      const Edge& e = node.next[i];
      if (!e.node || !node.takes_pending_gradient(i)) continue;
      bool repeated = false;  // the same producer slot on two inputs: leave it to the plain sum
      for (size_t j = 0; j < node.next.size(); ++j) {
        repeated = repeated ||
                   (j != i && node.next[j].node == e.node && node.next[j].input_nr == e.input_nr);
      }
      auto it = buffers.find(e.node.get());
      if (repeated || it == buffers.end() || !it->second[e.input_nr].defined()) continue;
      if (node.pending.empty()) {
        node.pending.resize(node.next.size());
        node.pending_taken.assign(node.next.size(), 0);
      }
      node.pending[i] = std::move(it->second[e.input_nr]);
      it->second[e.input_nr] = Tensor();
    }
  };
  auto return_pending = [&](Node& node) {
    for (size_t i = 0; i < node.pending.size(); ++i) {
      if (node.pending[i].defined() && !node.pending_taken[i]) {
        const Edge& e = node.next[i];
        buffers[e.node.get()][e.input_nr] = std::move(node.pending[i]);
      }
    }
    node.pending.clear();
    node.pending_taken.clear();
  };
  auto cmp = [](const std::shared_ptr<Node>& a, const std::shared_ptr<Node>& b) {
    return a->seq < b->seq;
  };
  std::priority_queue<std::shared_ptr<Node>, std::vector<std::shared_ptr<Node>>, decltype(cmp)>
      ready(cmp);
  for (size_t i = 0; i < root_edges.size(); ++i) accumulate(root_edges[i], root_grads[i]);
  for (auto& e : root_edges) {
    if (deps[e.node.get()] == 0) {
      deps[e.node.get()] = -1;  // queued
      ready.push(e.node);
    }
  }

  while (!ready.empty()) {
    std::shared_ptr<Node> node = ready.top();
    ready.pop();
    std::vector<Tensor> grads = std::move(buffers[node.get()]);
    buffers.erase(node.get());
    grads.resize(node->out_meta.size());
    for (size_t i = 0; i < grads.size(); ++i) {
      const bool hooked = !node->pre_hooks[i].empty() ||
                          (i < node->retain_hooks.size() && !node->retain_hooks[i].empty());
      if (!grads[i].defined()) {
        // hooks see zeros
        if (!hooked && node->takes_no_gradient(i)) continue;
        const auto& m = node->out_meta[i];
        grads[i] = zeros(m.shape, m.dtype, m.device);
      }
      node->pre_hooks[i].for_each([&](const GradHook& h) {
        count_hook_call();
        Tensor r = h(grads[i]);
        if (r.defined()) grads[i] = r;
      });
      // retain_grad() sees the gradient after every user hook, as in PyTorch.
      if (i < node->retain_hooks.size()) {
        for (auto& h : node->retain_hooks[i]) h(grads[i]);
      }
    }
    node->last_run = !retain_graph;
    offer_pending(*node);
    std::vector<Tensor> in_grads = node->apply(grads);
    grads.clear();
    return_pending(*node);
    if (!retain_graph) node->release();  // saved tensors go now, not at the end of backward
    for (size_t i = 0; i < node->next.size(); ++i) {
      const Edge& e = node->next[i];
      if (!e.node) continue;
      if (i < in_grads.size() && in_grads[i].defined()) {
        Tensor g = in_grads[i];
        const auto& m = e.node->out_meta[e.input_nr];
        if (g.shape() != m.shape) {
          throw RuntimeError("[" + node->name() + "] backward produced a gradient of shape " +
                             shape_str(g.shape()) + " for an input of shape " + shape_str(m.shape));
        }
        if (g.dtype() != m.dtype && g.dtype() != e.node->grad_dtype_taken(e.input_nr)) {
          g = astype(g, m.dtype);
        }
        accumulate(e, g);
      }
      if (--deps[e.node.get()] == 0) {
        deps[e.node.get()] = -1;
        ready.push(e.node);
      }
    }
  }
}

}  // namespace bt
