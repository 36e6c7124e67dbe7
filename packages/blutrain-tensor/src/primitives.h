// primitives.h: one class per op (the MLX layout).
//
// A primitive knows how to run on each backend and how to differentiate itself:
//   eval_cpu  src/cpu/*.cpp          (outputs arrive allocated and contiguous)
//   eval_gpu  src/cuda/*.cu          (a CUDA-less build links src/cpu/no_cuda.cpp: every
//                                     eval_gpu raises "[op] has no CUDA implementation in this
//                                     build")
//   vjp       src/primitives.cpp     (written with ops, so it runs on any backend and is recorded
//                                     in capture mode like any other op)
//   attrs     what capture mode records besides op, dtypes, shapes and inputs.
// View primitives (reshape, permute, expand, slice, select) make no copy on any backend: they
// override is_view() and eval_view().
//
// Adding an op: declare it here (and add it to BT_PRIMITIVES so both backends get an entry), write
// its CPU kernel in src/cpu/, its vjp in primitives.cpp, its front function in ops.cpp.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <variant>
#include <vector>

#include "autograd.h"
#include "tensor.h"

namespace bt {

// Capture attributes (capture.h, schema.h): every value a primitive's constructor takes, so a
// recorded node rebuilds the same primitive (make_primitive) and replays it bit for bit.
using AttrValue =
    std::variant<int64_t, double, bool, std::string, std::vector<int64_t>, std::vector<double>>;
using Attrs = std::map<std::string, AttrValue>;

struct VjpArgs {
  const std::vector<Tensor>& inputs;   // saved inputs (undefined unless saves_inputs())
  const std::vector<Tensor>& outputs;  // saved outputs (undefined unless saves_outputs())
  const std::vector<TensorMeta>& in_meta;
  const std::vector<Tensor>& cotangents;  // one per output (zeros where none flowed, or undefined
                                          // where the primitive takes_no_cotangent)
  const std::vector<bool>& needs;         // which inputs need a gradient
  bool last_run = false;  // the node frees its saved tensors after this vjp (no retain_graph)
  // The dtype input i's gradient may be returned in: in_meta[i]'s, or a wider one when that input
  // is a cast of a wider tensor whose node takes its gradient unnarrowed (Note [cached casts]).
  // A vjp that writes a gradient anyway (a GEMM) writes it in this dtype; others may ignore it.
  const std::vector<DType>& grad_dtypes;
  // Note [taking over a pending gradient] (autograd.h): (*pending)[i], where defined, is the
  // gradient already summed for input i, held only here; a vjp whose result for input i includes
  // it (in place or not) sets (*pending_taken)[i].  Null when nothing is offered.
  std::vector<Tensor>* pending = nullptr;
  std::vector<char>* pending_taken = nullptr;
};

// Note [donating a saved input]
// A vjp may write its gradient over a saved input (the loss's dlogits over the logits: 1.5 GiB
// at GPT-2's bf16 shape) when that input can never be read again: this is the node's last run
// (VjpArgs::last_run) and donatable() says no one else holds the memory: the node's saved Tensor
// is the only handle to its TensorImpl, and every reference to the storage is that impl or the
// view base that only it keeps alive.  A user still holding the logits (or a view of them, a
// numpy / DLPack export, another node that saved them) shows up in those reference counts, and
// the vjp then allocates as usual.  The primitive names the input its output overwrites
// (Primitive::overwrites_input); apply() gives the output that memory, and bumps its version.
// The kernels read each element before the same thread writes it.
bool donatable(const Tensor& saved);

// Note [dense side inputs]
// A fused op's side tensors (a linear's bias in the GEMM epilogue, a qkv bias, a target vector)
// are read by the CPU and CUDA kernels alike as plain vectors: element j at ptr[j].  A strided or
// expanded one (bias[::2], ones(1).expand(C)) would be read wrong, or past its memory.  Rather
// than each kernel checking, the primitive says which inputs must be dense (contiguous_input) and
// apply() copies those, once for every backend, only when they are not contiguous: the common
// call pays one is_contiguous() per side input.  The copy is an op (recorded, differentiable), so
// gradients reach the caller's tensor.

// Note [recomputed activations]
// A cheap op's output that the next op saves for its backward (a layer norm's output, which the
// following linear keeps for its weight gradient: B*T*C elements per norm and layer) can instead
// be rebuilt in backward from tensors that are kept anyway (the norm's input, which the norm's
// own node saves).  The op's front marks such an output with a Recompute (mark_recompute); apply()
// then keeps, for an input that is that output or a view of it, the recipe and the view's
// geometry in place of the tensor, so the activation's memory goes as soon as the forward drops
// it.  Before the vjp, the node rebuilds it without grad: the same primitive on the same inputs,
// so the same bits as the forward's.  Cost: the op runs again in backward, once per node that
// saved the tensor (GPT-2: one linear per norm).
// In-place changes: the recipe records its inputs' versions, and a rebuild after one of them
// changed raises (as a changed saved tensor does).  A marked tensor changed in place is no longer
// replaced by its recipe (its version no longer matches the recipe's), so it is saved as usual.
// Symbolic (captured) tensors are always saved as usual.
struct Recompute {
  std::function<Tensor()> run;  // rebuilds the marked tensor (called with grad mode off)
  std::vector<Tensor> inputs;   // what run reads, checked for in-place changes
  std::vector<uint64_t> versions;
  uint64_t version = 0;  // the marked tensor's version when it was marked
  const char* op = "";
};
// Marks `out` (a fresh output of `op`) as rebuilt by `run` from `inputs` (see the Note); a no-op
// for symbolic tensors.
void mark_recompute(const Tensor& out, const char* op, std::vector<Tensor> inputs,
                    std::function<Tensor(const std::vector<Tensor>&)> run);

// Note [cached casts]
// Mixed precision casts each float32 master weight to bf16 in every forward: at GPT-2's size 148
// launches per step that rewrite the values the optimizer has just produced, and 148 more in
// backward that widen the weights' bf16 gradients to float32.
//   Forward: cached_astype(p, dt) keeps the cast with p's storage (Storage::cast_cache, one entry
// per geometry and dtype) and returns it while it is current: p's version and the copy's are
// those recorded when it was written.  An in-place change of either makes it stale, and the next
// call casts again, into the same memory.  adamw_ writes the copy of each float32 parameter that
// has one from the value it has just computed, in its own kernel, and records the new versions:
// a training loop casts each weight once.  The result is a CachedCast of the copy (a view of the
// copy's memory, no kernel); its node sends the gradient to p.  The copy lives as long as p's
// storage (drop_cast_cache frees it sooner).  Capture mode and symbolic tensors get a plain
// astype.  One process-wide mutex guards every cache (cast_cache_mutex()).  A CUDA graph captured
// while the copy was current reads the copy, not p: between its replays change p only through a
// captured (or eager) adamw_, which rewrites the copy, or re-capture.
//   Backward: a cast's node (AsType, CachedCast) widens its cotangent to its input's dtype.  The
// engine passes a cotangent already in that dtype through unnarrowed (Node::wide_grad_dtype), and
// a vjp that writes the gradient of such an input anyway writes it in that dtype
// (VjpArgs::grad_dtypes): float32 out of a bf16 GEMM (a linear layer's dW and db), out of the layer
// norm backward's column sums (dweight, dbias) and out of an embedding's index_add, one rounding
// fewer and no widening kernel.  Hooks on the cast's output see the narrow dtype as before (they
// turn this off).
struct CastCache {
  struct Entry {
    Shape shape;
    Strides strides;
    int64_t offset = 0;
    DType from = DType::Float32, to = DType::BFloat16;
    Tensor copy;  // contiguous, `to`
    uint64_t from_version = 0, copy_version = 0;
    bool current(const Tensor& x) const {
      return from_version == x.version() && copy_version == copy.version();
    }
  };
  std::vector<Entry> entries;
  Entry* find(const Tensor& x, DType to);  // the entry of x's geometry and dtype, or null
};
std::mutex& cast_cache_mutex();

class Primitive {
 public:
  virtual ~Primitive() = default;
  virtual const char* name() const = 0;
  virtual void eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) = 0;
  virtual void eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) = 0;
  virtual std::vector<Tensor> vjp(const VjpArgs& a);  // default: "[op] is not differentiable"
  virtual bool is_view() const { return false; }
  virtual Tensor eval_view(const std::vector<Tensor>& in) { return Tensor(); }
  virtual bool saves_inputs() const { return true; }
  // Finer grain, when saves_inputs(): whether input i is kept given which inputs need a
  // gradient (x * y keeps x only for y's gradient), so fewer in-place changes trip the check.
  virtual bool saves_input(size_t i, const std::vector<bool>& needs) const { return true; }
  virtual bool saves_outputs() const { return false; }
  // Finer grain, when saves_outputs(): whether output i is kept (an output the backward never
  // reads, such as a layer's result, is not held by this node).
  virtual bool saves_output(size_t i) const { return true; }
  virtual bool differentiable() const { return true; }
  // Elementwise ops: the output takes input 0's memory layout when that is dense (so a
  // transposed input gives a transposed output and the loop runs in memory order, as numpy's).
  virtual bool preserves_layout() const { return false; }
  // Whether vjp takes an undefined cotangent for output i when no gradient reached it (instead of
  // a zero-filled one): outputs such as a norm's statistics or attention's lse, which rarely get
  // a gradient, then cost no fill kernel in backward.
  virtual bool takes_no_cotangent(size_t i) const { return false; }
  // The input whose memory output 0 is written over, or -1 (see Note [donating a saved input]).
  virtual int overwrites_input() const { return -1; }
  // Whether vjp may take over the gradient already summed for input i (VjpArgs::pending; Note
  // [taking over a pending gradient], autograd.h).
  virtual bool takes_pending_gradient(size_t i) const { return false; }
  // A cast: its vjp only converts the cotangent to input 0's dtype, so it may be given one in that
  // dtype already (Note [cached casts]).
  virtual bool is_cast() const { return false; }
  // Whether every backend's kernel reads input i as a dense contiguous buffer (Note [dense side
  // inputs]): apply() then hands it a contiguous copy when it is not.
  virtual bool contiguous_input(size_t i) const { return false; }
  // The dtype output i (of dtype `own`) takes its cotangent in: `own`, or a narrower one its vjp
  // reads as is (add_layer_norm's float32 sum takes bf16, Note [float32 residual stream]); the
  // engine then passes such cotangents unwidened (cotangents of `own` still arrive too).
  virtual DType cotangent_dtype(size_t i, DType own) const { return own; }
  virtual void attrs(Attrs& a) const {}
};

#define BT_PRIM_BODY(Name, str)                                                    \
 public:                                                                           \
  const char* name() const override { return str; }                                \
  void eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) override; \
  void eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) override; \
  std::vector<Tensor> vjp(const VjpArgs& a) override;

// ---- creation ------------------------------------------------------------------------------
// A scalar attribute for capture: an int or bool keeps its exact int64, a float its double.
inline AttrValue scalar_attr(const Scalar& s) {
  return s.integral() ? AttrValue(s.i) : AttrValue(s.v);
}
class Full : public Primitive {
  BT_PRIM_BODY(Full, "full")
  explicit Full(double v) : value(Scalar::floating(v)) {}
  explicit Full(Scalar v) : value(v) {}
  bool differentiable() const override { return false; }
  void attrs(Attrs& a) const override { a["value"] = scalar_attr(value); }
  Scalar value;  // exact for integers (Scalar::as)
};
// out[i] = start + i * step.  Integral start and step (exact()) run in int64 (the front checked
// every value fits), else in double.
class Arange : public Primitive {
  BT_PRIM_BODY(Arange, "arange")
  Arange(double s, double st) : start(Scalar::floating(s)), step(Scalar::floating(st)) {}
  Arange(Scalar s, Scalar st) : start(s), step(st) {}
  bool differentiable() const override { return false; }
  void attrs(Attrs& a) const override {
    a["start"] = scalar_attr(start);
    a["step"] = scalar_attr(step);
  }
  bool exact() const { return start.integral() && step.integral(); }
  Scalar start, step;
};
// Random numbers: Philox4x32-10 keyed by `seed`; element i of the output uses counter
// (offset + i / 4, 0, 0, 0) and takes word i % 4 (see random.h), so any backend gives the same
// numbers for the same (seed, offset).
enum class RandKind { Uniform, Normal, Int };
class Random : public Primitive {
  BT_PRIM_BODY(Random, "random")
  Random(RandKind k, uint64_t s, uint64_t o, double a_, double b_)
      : kind(k), seed(s), offset(o), a(a_), b(b_) {}
  bool differentiable() const override { return false; }
  void attrs(Attrs& at) const override {
    at["kind"] = std::string(kind == RandKind::Uniform  ? "uniform"
                             : kind == RandKind::Normal ? "normal"
                                                        : "int");
    at["seed"] = static_cast<int64_t>(seed);
    at["offset"] = static_cast<int64_t>(offset);
    at["a"] = a;  // every kind records every attribute: one schema entry (schema.cpp)
    at["b"] = b;
    at["low"] = int_low;  // Int's exact bounds (a and b are their doubles)
    at["high"] = static_cast<int64_t>(static_cast<uint64_t>(int_low) + int_range);
  }
  RandKind kind;
  uint64_t seed, offset;
  double a, b;  // uniform [a, b); normal mean a, std b
  // Int: low + bits % range, in int64 (exact for any low: the front checked 1 <= range <= 2^32
  // and that every value fits the dtype).
  int64_t int_low = 0;
  uint64_t int_range = 1;
};

// ---- copies --------------------------------------------------------------------------------
// Copy to a contiguous tensor of the output's dtype (contiguous(), to(dtype), clone()).
class AsType : public Primitive {
  BT_PRIM_BODY(AsType, "astype")
  bool saves_inputs() const override { return false; }
  bool is_cast() const override { return true; }
};
// cached_astype's result (Note [cached casts]): inputs (x, copy), the output is the copy's
// memory (no kernel); the gradient goes to x, in x's dtype.
class CachedCast : public Primitive {
  BT_PRIM_BODY(CachedCast, "cached_astype")
  bool is_view() const override { return true; }
  Tensor eval_view(const std::vector<Tensor>& in) override;
  bool saves_inputs() const override { return false; }
  bool is_cast() const override { return true; }
};
class ToDevice : public Primitive {
  BT_PRIM_BODY(ToDevice, "to_device")
  bool saves_inputs() const override { return false; }
};

// ---- views ---------------------------------------------------------------------------------
#define BT_VIEW_BODY                                        \
  bool is_view() const override { return true; }            \
  Tensor eval_view(const std::vector<Tensor>& in) override; \
  bool saves_inputs() const override { return false; }
class Reshape : public Primitive {
  BT_PRIM_BODY(Reshape, "reshape")
  BT_VIEW_BODY
  explicit Reshape(Shape s) : shape(std::move(s)) {}
  void attrs(Attrs& a) const override { a["shape"] = shape; }
  Shape shape;
};
class Permute : public Primitive {
  BT_PRIM_BODY(Permute, "permute")
  BT_VIEW_BODY
  explicit Permute(std::vector<int64_t> p) : perm(std::move(p)) {}
  void attrs(Attrs& a) const override { a["perm"] = perm; }
  std::vector<int64_t> perm;
};
class Expand : public Primitive {
  BT_PRIM_BODY(Expand, "expand")
  BT_VIEW_BODY
  explicit Expand(Shape s) : shape(std::move(s)) {}
  void attrs(Attrs& a) const override { a["shape"] = shape; }
  Shape shape;
};
class Slice : public Primitive {
  BT_PRIM_BODY(Slice, "slice")
  BT_VIEW_BODY
  Slice(int64_t d, int64_t s, int64_t e, int64_t st) : dim(d), start(s), stop(e), step(st) {}
  void attrs(Attrs& a) const override {
    a["dim"] = dim;
    a["start"] = start;
    a["stop"] = stop;
    a["step"] = step;
  }
  int64_t dim, start, stop, step;  // normalised: 0 <= start <= stop <= size, step >= 1
};
class Select : public Primitive {
  BT_PRIM_BODY(Select, "select")
  BT_VIEW_BODY
  Select(int64_t d, int64_t i) : dim(d), index(i) {}
  void attrs(Attrs& a) const override {
    a["dim"] = dim;
    a["index"] = index;
  }
  int64_t dim, index;
};
// out = copy of base with base[slice] = src (the vjp of Slice/Select, and __setitem__'s op).
class SliceScatter : public Primitive {
  BT_PRIM_BODY(SliceScatter, "slice_scatter")
  SliceScatter(int64_t d, int64_t s, int64_t e, int64_t st) : dim(d), start(s), stop(e), step(st) {}
  bool saves_inputs() const override { return false; }
  void attrs(Attrs& a) const override {
    a["dim"] = dim;
    a["start"] = start;
    a["stop"] = stop;
    a["step"] = step;
  }
  int64_t dim, start, stop, step;
};

// ---- elementwise ---------------------------------------------------------------------------
enum class UnaryOp {
  Neg,
  Exp,
  Log,
  Sqrt,
  Rsqrt,
  Tanh,
  Abs,
  Sigmoid,
  Relu,
  Sin,
  Cos,
  GeluTanh,
  GeluErf,
  Erf,
  LogicalNot,
  Sign
};
const char* unary_name(UnaryOp op);
class Unary : public Primitive {
 public:
  explicit Unary(UnaryOp o) : op(o) {}
  const char* name() const override { return unary_name(op); }
  void eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) override;
  void eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) override;
  std::vector<Tensor> vjp(const VjpArgs& a) override;
  bool saves_inputs() const override;
  bool saves_outputs() const override;
  bool differentiable() const override { return op != UnaryOp::LogicalNot && op != UnaryOp::Sign; }
  bool preserves_layout() const override { return true; }
  UnaryOp op;
};

// FloorDiv / Mod: Python's // and % (pymath.h).  Eq and after give bool (kernels rely on the
// order).
enum class BinaryOp {
  Add,
  Sub,
  Mul,
  Div,
  Pow,
  Maximum,
  Minimum,
  FloorDiv,
  Mod,
  Eq,
  Ne,
  Lt,
  Le,
  Gt,
  Ge,
  And,
  Or
};
const char* binary_name(BinaryOp op);
// Inputs arrive broadcast to the output shape (expand views) and cast to the compute dtype.
class Binary : public Primitive {
 public:
  explicit Binary(BinaryOp o) : op(o) {}
  const char* name() const override { return binary_name(op); }
  void eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) override;
  void eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) override;
  std::vector<Tensor> vjp(const VjpArgs& a) override;
  bool saves_inputs() const override;
  bool saves_input(size_t i, const std::vector<bool>& needs) const override {
    if (op == BinaryOp::Mul) return needs[1 - i];
    if (op == BinaryOp::Div) return i == 1 || needs[1];
    if (op == BinaryOp::Mod) return needs[1];  // b's gradient reads a // b
    return true;
  }
  bool saves_outputs() const override { return op == BinaryOp::Pow; }
  bool differentiable() const override { return op <= BinaryOp::Mod; }
  bool preserves_layout() const override { return true; }
  BinaryOp op;
};

class Where : public Primitive {  // inputs: cond (bool), a, b, all broadcast
  BT_PRIM_BODY(Where, "where")
};
class MaskedFill : public Primitive {  // inputs: x, mask (bool, broadcast to x)
  BT_PRIM_BODY(MaskedFill, "masked_fill")
  explicit MaskedFill(Scalar v) : value(v) {}
  void attrs(Attrs& a) const override { a["value"] = scalar_attr(value); }
  Scalar value;  // the front checked it fits x's dtype
};

// ---- reductions ----------------------------------------------------------------------------
enum class ReduceOp { Sum, Mean, Max, Min, Var };
const char* reduce_name(ReduceOp op);
class Reduce : public Primitive {
 public:
  Reduce(ReduceOp o, std::vector<int64_t> d, bool k, double corr = 1)
      : op(o), dims(std::move(d)), keepdim(k), correction(corr) {}
  const char* name() const override { return reduce_name(op); }
  void eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) override;
  void eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) override;
  std::vector<Tensor> vjp(const VjpArgs& a) override;
  bool saves_inputs() const override { return op != ReduceOp::Sum && op != ReduceOp::Mean; }
  bool saves_outputs() const override { return op == ReduceOp::Max || op == ReduceOp::Min; }
  void attrs(Attrs& a) const override {
    a["dims"] = dims;
    a["keepdim"] = keepdim;
    if (op == ReduceOp::Var) a["correction"] = correction;
  }
  ReduceOp op;
  std::vector<int64_t> dims;  // sorted, non-negative
  bool keepdim;
  double correction;
};
class ArgReduce : public Primitive {  // argmax / argmin over one dim
  BT_PRIM_BODY(ArgReduce, is_max ? "argmax" : "argmin")
  ArgReduce(bool mx, int64_t d, bool k) : is_max(mx), dim(d), keepdim(k) {}
  bool differentiable() const override { return false; }
  void attrs(Attrs& a) const override {
    a["dim"] = dim;
    a["keepdim"] = keepdim;
  }
  bool is_max;
  int64_t dim;
  bool keepdim;
};

// ---- indexing, joining ---------------------------------------------------------------------
// embedding: the indices must be in [0, size) (negative ones are errors, as PyTorch's
// embedding; index_select counts them from the end), and errors name embedding.
class IndexSelect : public Primitive {  // inputs: x, index (int, 1-D)
  BT_PRIM_BODY(IndexSelect, "index_select")
  explicit IndexSelect(int64_t d, bool emb = false) : dim(d), embedding(emb) {}
  bool takes_pending_gradient(size_t i) const override { return i == 0; }
  void attrs(Attrs& a) const override {
    a["dim"] = dim;
    a["embedding"] = embedding;
  }
  int64_t dim;
  bool embedding;
};
// out = base; out.index_add_(dim, index, src).  over_base: out is written over base's memory
// (a fresh zero base no one else holds: IndexSelect's vjp; Note [donating a saved input]).
class IndexAdd : public Primitive {
  BT_PRIM_BODY(IndexAdd, "index_add")
  explicit IndexAdd(int64_t d, bool over = false) : dim(d), over_base(over) {}
  void attrs(Attrs& a) const override {
    a["dim"] = dim;
    a["over_base"] = over_base;
  }
  int overwrites_input() const override { return over_base ? 0 : -1; }
  int64_t dim;
  bool over_base;
};
class Gather : public Primitive {  // inputs: x, index (int, same ndim)
  BT_PRIM_BODY(Gather, "gather")
  explicit Gather(int64_t d) : dim(d) {}
  void attrs(Attrs& a) const override { a["dim"] = dim; }
  int64_t dim;
};
class ScatterAdd : public Primitive {  // out = base; out.scatter_add_(dim, index, src)
  BT_PRIM_BODY(ScatterAdd, "scatter_add")
  explicit ScatterAdd(int64_t d) : dim(d) {}
  void attrs(Attrs& a) const override { a["dim"] = dim; }
  int64_t dim;
};
class Concatenate : public Primitive {
  BT_PRIM_BODY(Concatenate, "cat")
  explicit Concatenate(int64_t d) : dim(d) {}
  bool saves_inputs() const override { return false; }
  void attrs(Attrs& a) const override { a["dim"] = dim; }
  int64_t dim;
};

// ---- neural-network ops --------------------------------------------------------------------
class Softmax : public Primitive {
  BT_PRIM_BODY(Softmax, log ? "log_softmax" : "softmax")
  Softmax(int64_t d, bool lg) : dim(d), log(lg) {}
  bool saves_inputs() const override { return false; }
  bool saves_outputs() const override { return true; }
  void attrs(Attrs& a) const override { a["dim"] = dim; }
  int64_t dim;  // the last dim after the front's permute
  bool log;
};
// inputs: x (..., C), weight (C) or none, bias (C) or none, all of x's dtype.  outputs: y (x's
// dtype, or 16-bit over a float32 x: Note [float32 residual stream], nn_fused.h), mean, rstd
// (float32 for 16-bit inputs, the input dtype otherwise), mean/rstd shaped (...).
class LayerNorm : public Primitive {
  BT_PRIM_BODY(LayerNorm, "layer_norm")
  LayerNorm(double e, bool w, bool b) : eps(e), has_weight(w), has_bias(b) {}
  bool saves_outputs() const override { return true; }
  bool saves_output(size_t i) const override { return i > 0; }        // mean, rstd (not y)
  bool takes_no_cotangent(size_t i) const override { return i > 0; }  // mean, rstd
  void attrs(Attrs& a) const override {
    a["eps"] = eps;
    a["has_weight"] = has_weight;
    a["has_bias"] = has_bias;
  }
  double eps;
  bool has_weight, has_bias;
};
// Whether (x, y) dtypes are a layer norm's mixed pair: float32 x, 16-bit y (Note [float32 residual
// stream], nn_fused.h).
inline bool is_mixed_norm(DType x, DType y) {
  return x == DType::Float32 && (y == DType::BFloat16 || y == DType::Float16);
}
// Fused log_softmax + nll: inputs logits (N, Cx), target (N) int64.  outputs: loss (() for mean /
// sum, (N) for none), lse (N) float32/64 (saved for backward).  Only the first num_classes
// columns are classes (-1: all Cx); the rest are padding (a padded vocabulary), ignored by the
// loss and given a zero gradient, so the backward writes the padded (N, Cx) layout in one pass.
// Logits rows may be strided (unit column stride): the kernels read them in place.
class CrossEntropy : public Primitive {
  BT_PRIM_BODY(CrossEntropy, "cross_entropy")
  CrossEntropy(int64_t ii, int r, double ls, int64_t nc = -1)
      : ignore_index(ii), reduction(r), label_smoothing(ls), num_classes(nc) {}
  bool saves_outputs() const override { return true; }
  bool takes_no_cotangent(size_t i) const override { return i == 1; }  // lse
  void attrs(Attrs& a) const override {
    a["ignore_index"] = ignore_index;
    a["reduction"] = std::string(reduction == 0 ? "none" : reduction == 1 ? "mean" : "sum");
    a["label_smoothing"] = label_smoothing;
    a["num_classes"] = num_classes;  // -1: every column is a class
  }
  // Classes of logits `x` (N, Cx): num_classes, or Cx when -1.
  int64_t classes(const Tensor& x) const { return num_classes < 0 ? x.shape()[1] : num_classes; }
  int64_t ignore_index;
  int reduction;  // 0 none, 1 mean, 2 sum
  double label_smoothing;
  int64_t num_classes;
};
// Whether the gradient of `view` reaches `base` only through view ops (no hooks on the way), so a
// gradient written for base's elements equals the one autograd would scatter from the view
// (cross_entropy's padded-vocabulary path).
bool grad_flows_through_views(const Tensor& view, const Tensor& base);
// out = x * keep / (1 - p), keep = uniform(seed, offset) >= p.  Its vjp is the same op on the
// cotangent (same seed and offset), so no mask is stored and any backend reproduces it.
class Dropout : public Primitive {
  BT_PRIM_BODY(Dropout, "dropout")
  Dropout(double p_, uint64_t s, uint64_t o) : p(p_), seed(s), offset(o) {}
  bool saves_inputs() const override { return false; }
  void attrs(Attrs& a) const override {
    a["p"] = p;
    a["seed"] = static_cast<int64_t>(seed);
    a["offset"] = static_cast<int64_t>(offset);
  }
  double p;
  uint64_t seed, offset;
};
// C = A @ B over broadcast batches, through blutrain-linalg.  Inputs (b, m, k) and (b, k, n) or
// 2-D (shared by every batch item); a bias (n) input when has_bias (linear's epilogue).
class Matmul : public Primitive {
  BT_PRIM_BODY(Matmul, has_bias ? "linear" : "matmul")
  explicit Matmul(bool tb = false, bool bias = false) : trans_b(tb), has_bias(bias) {}
  bool contiguous_input(size_t i) const override { return i == 2; }  // the bias
  void attrs(Attrs& a) const override {
    a["trans_b"] = trans_b;
    a["bias"] = has_bias;
  }
  bool trans_b;  // B given as (n, k): linear's weight
  bool has_bias;
};

// X-macro of every primitive class, for backend tables (no_cuda.cpp, future dispatch).
// clang-format off
#define BT_PRIMITIVES(X)                                                                     \
  X(Full) X(Arange) X(Random) X(AsType) X(CachedCast) X(ToDevice) X(Reshape) X(Permute)     \
  X(Expand) X(Slice) X(Select) X(SliceScatter) X(Unary) X(Binary) X(Where) X(MaskedFill)     \
  X(Reduce) X(ArgReduce) X(IndexSelect) X(IndexAdd) X(Gather) X(ScatterAdd) X(Concatenate)   \
  X(Softmax) X(LayerNorm) X(CrossEntropy) X(Dropout) X(Matmul)
// clang-format on

// ---- running a primitive -------------------------------------------------------------------
// The one entry point every op goes through: checks devices, runs (or records, in capture mode)
// and attaches autograd.  out_meta gives each output's shape and dtype.
std::vector<Tensor> apply(std::shared_ptr<Primitive> prim, const std::vector<Tensor>& inputs,
                          const std::vector<std::pair<Shape, DType>>& out_meta, Device device);
inline Tensor apply1(std::shared_ptr<Primitive> prim, const std::vector<Tensor>& inputs,
                     const Shape& shape, DType dtype, Device device) {
  return apply(std::move(prim), inputs, {{shape, dtype}}, device)[0];
}

// Matmul backend hook: installed by the Python module from blutrain-linalg's table.
struct LinalgHooks {
  const void* api = nullptr;  // const bt_linalg_api*
  std::string unavailable_reason;
};
void set_linalg_hooks(const LinalgHooks& h);
const LinalgHooks& linalg_hooks();

}  // namespace bt
