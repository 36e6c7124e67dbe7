// autograd.h: the reverse-mode engine.
//
// Every differentiable op run with grad mode on and at least one input that requires grad makes a
// Node.  Its `next` edges point at the nodes that produced its inputs (or at a leaf's
// AccumulateGrad node).  backward() counts dependencies from the roots, then runs nodes in
// dependency order, highest sequence number first (the reverse of creation order, which is what
// lets blutrain-dist start all-reducing the last layer's gradients while earlier layers are still
// in backward).  A leaf's AccumulateGrad node runs once all contributions to it are summed; it
// runs the leaf's tensor hooks, accumulates into .grad (in place when .grad exists, so gradient
// views into flat buffers stay valid) and then fires the "gradient final" (post-accumulate) hooks.
// Without retain_graph each node releases what it saved as soon as it has run (PyTorch's rule):
// activations are freed layer by layer as backward walks back, so its peak is its start.  Running
// a released node again raises.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "tensor.h"

namespace bt {

struct TensorMeta {
  Shape shape;
  DType dtype;
  Device device;
};

struct Edge {
  std::shared_ptr<Node> node;  // null: this input needs no gradient
  int input_nr = 0;            // which of node's forward outputs this edge feeds
};

struct Node : std::enable_shared_from_this<Node> {
  Node();
  virtual ~Node() = default;
  virtual std::string name() const = 0;
  // grads[i] is the gradient of forward output i (zeros where none flowed).  Returns one gradient
  // per forward input (undefined where next[i] is null).
  virtual std::vector<Tensor> apply(std::vector<Tensor>& grads) = 0;
  virtual void release() {}
  virtual bool is_accumulator() const { return false; }
  // Whether apply() takes an undefined gradient for forward output i when none reached it
  // (instead of zeros: no fill kernel for outputs such as a norm's statistics).
  virtual bool takes_no_gradient(size_t i) const { return false; }
  // The dtype this node takes forward output i's gradient in: out_meta[i]'s, or for a cast a
  // wider one that it would widen the gradient to anyway (Note [cached casts], primitives.h).
  virtual DType grad_dtype_taken(size_t i) const { return out_meta[i].dtype; }
  // Whether apply() may fold the gradient already summed for forward input i into its own
  // result (Note [taking over a pending gradient]).
  virtual bool takes_pending_gradient(size_t i) const { return false; }

  std::vector<Edge> next;
  std::vector<TensorMeta> out_meta;
  std::vector<HookList<GradHook>> pre_hooks;        // per forward output: hooks of non-leaf tensors
  std::vector<std::vector<GradHook>> retain_hooks;  // retain_grad(): run after pre_hooks
  uint64_t seq;
  bool released = false;
  // Set by the engine before apply(): this run is the node's last (no retain_graph), so its
  // vjp may write its result over a saved input that nothing else references (see donatable()).
  bool last_run = false;
  // Set by the engine around apply() (Note [taking over a pending gradient]): pending[i] is the
  // gradient already summed for input i at its producer, moved out of the engine's buffer (so
  // this is its only handle), or undefined; apply() sets pending_taken[i] when its result for
  // input i includes it.  Both empty when nothing is offered.
  std::vector<Tensor> pending;
  std::vector<char> pending_taken;
};

// Note [taking over a pending gradient]
// A tensor used twice gets two gradients, summed by the engine: add(first, second), a pass over
// both.  GPT-2's tied embedding gets the classifier's dW (50304 x 768 float32, 154 MB) and the
// embedding's sparse index_add; summing them costs a zero fill and an add of the whole table
// (0.15 ms a bf16 step).  A node whose vjp can add its contribution into an existing tensor says
// so (takes_pending_gradient; index_select's table input).  When the producer's buffer already
// holds a gradient for that input, the engine moves it out and offers it (Node::pending); the vjp
// adds into it (in place where donatable() allows, else out of place) and marks it taken, and the
// engine stores the result in place of the sum.  Not taken, it goes back to the buffer and the
// usual add follows.  Capture mode keeps the plain sum (captured graphs record one op per edge).

// The leaf's accumulator (created on first use, unique per leaf).
std::shared_ptr<Node> grad_accumulator(const Tensor& leaf);

// Where a gradient for `t` should go: its grad_fn, or its leaf accumulator; null if none.
Edge gradient_edge(const Tensor& t);

// A node for a Python (or C++) custom function: backward maps output grads to input grads.
using BackwardFn = std::function<std::vector<Tensor>(const std::vector<Tensor>&)>;
std::shared_ptr<Node> make_custom_node(const std::string& name, BackwardFn fn,
                                       const std::vector<Tensor>& inputs,
                                       const std::vector<Tensor>& outputs);

// Runs backward from `roots`; grads[i] may be undefined for a one-element root.
void run_backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& grads,
                  bool retain_graph);

// What registering a hook returns: remove() erases the hook from the list it went into (Note
// [removable hooks]); it returns false when it was removed already or its tensor / node is gone.
class HookHandle {
 public:
  explicit HookHandle(std::function<bool()> remover) : remover_(std::move(remover)) {}
  bool remove() {
    if (!remover_) return false;
    const bool r = remover_();
    remover_ = nullptr;
    return r;
  }

 private:
  std::function<bool()> remover_;  // holds only weak references: a handle keeps nothing alive
};

// Registers a hook on a tensor's gradient (leaf or not).
HookHandle register_hook(const Tensor& t, GradHook hook);
HookHandle register_post_accumulate_hook(const Tensor& leaf, PostAccHook hook);
// How many hooks the engine would call for t's gradient: (tensor hooks, post-accumulate hooks).
std::pair<size_t, size_t> hook_counts(const Tensor& t);
// Hook calls made by the engine in this process (a counter for tests: a removed hook adds none).
uint64_t hook_calls();
void retain_grad(const Tensor& t);
void set_requires_grad(const Tensor& t, bool value);

// Grad mode (thread local), with an RAII guard.
bool grad_enabled();
void set_grad_enabled(bool on);
struct GradModeGuard {
  explicit GradModeGuard(bool on) : prev_(grad_enabled()) { set_grad_enabled(on); }
  ~GradModeGuard() { set_grad_enabled(prev_); }
  bool prev_;
};

}  // namespace bt
