// tensor.h: Device, Storage and Tensor (a handle to a shared TensorImpl).
//
// A Tensor is a strided view (shape, strides in elements, offset in elements) of a Storage.
// Views share the Storage, and with it the version counter that autograd uses to detect an
// in-place change to a tensor saved for backward.  A Tensor without storage is "symbolic": it is
// what ops return in capture mode (shape and dtype only).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtype.h"

namespace bt {

using Shape = std::vector<int64_t>;
using Strides = std::vector<int64_t>;

// ---- errors ------------------------------------------------------------------------------
// Every error message starts with "[op] ".  The Python binding maps these to exceptions.
//
// Note [the op the user called]
// Ops are built from ops: embedding from index_select and reshape, linear from as_rows and a GEMM.
// An error raised inside names the inner op ("[index_select] index 5 ..."), which the user never
// called.  Each public front opens an OpScope with its own name; an error constructed while a
// scope is open records the outermost one (Error::op), and the Python binding's exception
// translator rewrites the message's "[inner]" prefix to it.  A call back into Python (a hook, a
// custom Function's backward) runs with no scope open (OpScopeReset): the ops it calls are the
// user's.  Cost on the normal path: a thread-local increment and decrement per op.
namespace detail {
const char* outer_op();  // the outermost open OpScope's op, or nullptr
}
struct ErrorOp {
  const char* op = detail::outer_op();
};
struct ValueError : std::invalid_argument, ErrorOp {
  using std::invalid_argument::invalid_argument;
};
struct TypeError : std::invalid_argument, ErrorOp {
  using std::invalid_argument::invalid_argument;
};
struct IndexError : std::out_of_range, ErrorOp {
  using std::out_of_range::out_of_range;
};
struct RuntimeError : std::runtime_error, ErrorOp {
  using std::runtime_error::runtime_error;
};
struct NotImplementedError : std::runtime_error, ErrorOp {
  using std::runtime_error::runtime_error;
};
struct ZeroDivisionError : std::domain_error, ErrorOp {  // integer // or % by zero
  using std::domain_error::domain_error;
};

class OpScope {
 public:
  explicit OpScope(const char* op);
  ~OpScope();
  OpScope(const OpScope&) = delete;
  OpScope& operator=(const OpScope&) = delete;
};
// No scope open while it lives (restored after): around calls back into Python.
class OpScopeReset {
 public:
  OpScopeReset();
  ~OpScopeReset();
  OpScopeReset(const OpScopeReset&) = delete;
  OpScopeReset& operator=(const OpScopeReset&) = delete;

 private:
  int depth_;
  const char* op_;
};
// msg with its leading "[name]" replaced by "[op]" (unchanged when op is null or msg has no
// bracketed prefix).
std::string with_op_prefix(const std::string& msg, const char* op);

std::string shape_str(const Shape& s);  // "(2, 3)"

// ---- device ------------------------------------------------------------------------------
struct Device {
  enum Type : uint8_t { CPU = 0, CUDA = 1 } type = CPU;
  int index = 0;  // CUDA ordinal; 0 for CPU
  static Device parse(const std::string& s, const char* op);
  std::string str() const;
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  bool is_cuda() const { return type == CUDA; }
};

// ---- storage -----------------------------------------------------------------------------
// Memory comes from blutrain-alloc's C ABI table when one has been installed (the Python module
// does this at init), else from aligned new (C++ unit use).  Foreign memory (numpy, DLPack) is
// adopted with a deleter that releases its owner.
struct AllocHooks {
  int (*malloc)(int device, size_t size, void* stream, void** out) = nullptr;
  int (*free)(void* ptr) = nullptr;
  const char* (*last_error)(void) = nullptr;
  // ptr (a block from malloc) is used on `stream` too: not reused before that work finishes
  int (*record_stream)(void* ptr, void* stream) = nullptr;
};
void set_alloc_hooks(const AllocHooks& hooks);
bool have_alloc_hooks();

struct CastCache;  // primitives.h, Note [cached casts]

class Storage {
 public:
  static std::shared_ptr<Storage> allocate(size_t nbytes, Device device, const char* op);
  static std::shared_ptr<Storage> adopt(void* data, size_t nbytes, Device device,
                                        std::function<void()> deleter);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  // Memory we may not write: a read-only numpy array, bytes, a read-only memmap (a write would
  // fault or change what the owner promised not to).  In-place ops check it (check_writable).
  bool read_only() const { return read_only_; }
  void set_read_only(bool ro) { read_only_ = ro; }
  // Adopted from a foreign owner (numpy, DLPack): never reused as a kernel's output memory.
  bool foreign() const { return static_cast<bool>(deleter_); }
  Device device() const { return device_; }
  bool from_alloc() const { return from_alloc_; }  // a block of blutrain-alloc's
  uint64_t version() const { return version_.load(std::memory_order_relaxed); }
  void bump_version() { version_.fetch_add(1, std::memory_order_relaxed); }

  // Casts of this storage's tensors kept by cached_astype; null until the first.  Read and
  // written under cast_cache_mutex() (Note [cached casts], primitives.h).
  std::shared_ptr<CastCache> cast_cache;

 private:
  Storage() = default;
  void* data_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  bool from_alloc_ = false;
  bool read_only_ = false;
  std::function<void()> deleter_;
  std::atomic<uint64_t> version_{0};
};

// ---- tensor ------------------------------------------------------------------------------
class Tensor;
struct Node;
struct Recompute;  // primitives.h, Note [recomputed activations]
using GradHook = std::function<Tensor(const Tensor&)>;   // returns an undefined Tensor to keep
using PostAccHook = std::function<void(const Tensor&)>;  // fired once a leaf's .grad is final

// Note [removable hooks]
// Each hook is kept with an id, and removing it erases it from its list: a removed hook costs
// nothing (the engine no longer calls it, i.e. no call into Python), and the fast paths that a
// hooked tensor turns off (a cast's gradient taken wide, packed attention sources, skipped zero
// gradients: they test empty()) are on again.  A hook may remove hooks, itself included, while
// it runs: for_each() walks a snapshot of the list and skips entries removed since it began.
template <class F>
class HookList {
 public:
  // Adds fn; returns its id (unique in the process).
  uint64_t add(F fn) {
    static std::atomic<uint64_t> next_id{1};
    const uint64_t id = next_id.fetch_add(1, std::memory_order_relaxed);
    entries_.push_back(std::make_shared<Entry>(Entry{id, std::move(fn), false}));
    return id;
  }
  // Erases the hook with this id; false when it is not (or no longer) here.
  bool remove(uint64_t id) {
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if ((*it)->id == id) {
        (*it)->removed = true;
        entries_.erase(it);
        return true;
      }
    }
    return false;
  }
  bool empty() const { return entries_.empty(); }
  size_t size() const { return entries_.size(); }
  template <class Fn>
  void for_each(Fn&& f) const {
    if (entries_.empty()) return;
    const auto snapshot = entries_;
    for (const auto& e : snapshot) {
      if (!e->removed) f(e->fn);
    }
  }

 private:
  struct Entry {
    uint64_t id;
    F fn;
    bool removed;
  };
  std::vector<std::shared_ptr<Entry>> entries_;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;  // null: symbolic (captured) tensor
  Shape shape;
  Strides strides;
  int64_t offset = 0;
  DType dtype = DType::Float32;
  Device device;

  // autograd
  bool requires_grad = false;
  bool retains_grad = false;
  std::shared_ptr<Node> grad_fn;  // null for leaves
  int output_nr = 0;
  std::shared_ptr<TensorImpl> grad;
  std::weak_ptr<Node> grad_accumulator;  // leaves only; created on first use
  HookList<GradHook> hooks;              // leaves (non-leaves keep theirs on the node)
  HookList<PostAccHook> post_acc_hooks;
  std::string name;           // optional, used by capture and repr of parameters
  bool view_of_grad = false;  // a view of a tensor that requires grad
  // The tensor a view was made from (the root of a chain of views, sharing its storage): an
  // in-place change of the view under autograd rebases this base's history (PyTorch semantics).
  std::shared_ptr<TensorImpl> view_base;
  std::vector<std::weak_ptr<TensorImpl>> views;  // on a base: its live views, refreshed on rebase
  // Set on an output its op can rebuild in backward (a layer norm's with recompute=True): nodes
  // that save it, or a view of it, keep this recipe instead (Note [recomputed activations]).
  std::shared_ptr<Recompute> recompute;
  // Note [version counter groups]: null means the storage's counter.  A group (set with
  // share_version_counter) gives some views of a storage a counter of their own, e.g. the
  // parameters of one bucket of a flat buffer: a write through a member bumps the group and the
  // storage, a write through any other view bumps the storage only, so saved copies of the
  // other buckets' parameters stay valid.  Views of a member join its group.  Whoever writes
  // the memory through a view outside the group (an all-gather into the flat buffer) bumps the
  // members it overwrote.
  std::shared_ptr<std::atomic<uint64_t>> version_counter;
  // The next gradient accumulated into this leaf's existing .grad replaces its values instead
  // of adding to them (then the flag clears): gradient buckets start an accumulation window
  // without a zero fill.  Set by blutrain-dist through _set_grad_overwrite.
  bool grad_overwrite = false;
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return static_cast<bool>(impl_); }
  TensorImpl* impl() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }

  const Shape& shape() const { return impl_->shape; }
  const Strides& strides() const { return impl_->strides; }
  int64_t offset() const { return impl_->offset; }
  int64_t ndim() const { return static_cast<int64_t>(impl_->shape.size()); }
  int64_t size(int64_t dim) const;  // negative dims wrap
  int64_t numel() const;
  DType dtype() const { return impl_->dtype; }
  Device device() const { return impl_->device; }
  bool is_symbolic() const { return !impl_->storage; }
  bool is_contiguous() const;
  const std::shared_ptr<Storage>& storage() const { return impl_->storage; }
  // The version autograd checks: the tensor's group counter, else its storage's (Note [version
  // counter groups]).  bump_version() marks a write through this tensor.
  uint64_t version() const {
    if (impl_->version_counter) return impl_->version_counter->load(std::memory_order_relaxed);
    return impl_->storage ? impl_->storage->version() : 0;
  }
  void bump_version() const {
    if (impl_->version_counter) impl_->version_counter->fetch_add(1, std::memory_order_relaxed);
    if (impl_->storage) impl_->storage->bump_version();
  }

  // Typed pointer to element [0] of the view (offset applied).  Throws for symbolic tensors.
  void* data_ptr(const char* op) const;
  template <typename T>
  T* data(const char* op) const {
    return static_cast<T*>(data_ptr(op));
  }

  // autograd accessors
  bool requires_grad() const { return impl_->requires_grad; }
  bool is_leaf() const { return !impl_->grad_fn; }
  const std::shared_ptr<Node>& grad_fn() const { return impl_->grad_fn; }
  Tensor grad() const { return Tensor(impl_->grad); }

  bool same(const Tensor& o) const { return impl_ == o.impl_; }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

Strides contiguous_strides(const Shape& shape);
int64_t shape_numel(const Shape& shape);
// shape_numel of a shape that came from a user: a negative size, or a count (or its size in
// bytes, at item_bytes each) past int64, is a ValueError naming op.  Overflow would otherwise
// size a tensor far smaller than its shape.
int64_t checked_numel(const Shape& shape, const char* op, int64_t item_bytes = 1);
// A dim in [-ndim, ndim) made non-negative; a 0-d tensor takes 0 or -1 (reductions over "all" of
// a scalar), so this is for ops that never index the shape.
int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op);
// As wrap_dim, for ops that index shape()[dim]: a 0-d tensor has no dims and raises IndexError.
int64_t wrap_shape_dim(int64_t dim, int64_t ndim, const char* op);

// A fresh contiguous tensor (memory uninitialised).
Tensor empty_tensor(const Shape& shape, DType dtype, Device device, const char* op);
// Note [caller-given scratch]: an op's internal temporaries (index_add's sort keys and partial
// sums on CUDA) come from scratch_tensor. Outside a ScratchScope that is empty_tensor; inside
// one, the temporaries are carved, 256-byte aligned and one after another, from the caller's
// contiguous uint8 tensor on this thread (a compiled program's arena: no allocator call), and
// from the allocator only for what does not fit or is on another device. The region is the
// caller's for the scope's duration; work queued on the region's stream reads it in order, so
// the caller may reuse it for later work on that stream. Not nested: a scope replaces the one
// before it until it ends.
Tensor scratch_tensor(const Shape& shape, DType dtype, Device device, const char* op);
class ScratchScope {
 public:
  explicit ScratchScope(const Tensor& region);
  ~ScratchScope();
  ScratchScope(const ScratchScope&) = delete;
  ScratchScope& operator=(const ScratchScope&) = delete;

 private:
  Tensor prev_;
  int64_t prev_used_;
};
// A fresh tensor with given strides (they must describe a dense, non-overlapping layout).
Tensor empty_strided(const Shape& shape, const Strides& strides, DType dtype, Device device,
                     const char* op);
// Whether t's elements exactly tile shape_numel elements of memory (any dim order), so a new
// tensor may take its strides: elementwise outputs then keep their input's layout.
bool is_dense(const Tensor& t);
// A symbolic tensor (capture mode).
Tensor symbolic_tensor(const Shape& shape, DType dtype, Device device);
// A new TensorImpl over the same storage with given geometry; no autograd state.
Tensor make_view(const Tensor& base, const Shape& shape, const Strides& strides, int64_t offset);
// The same data without autograd history (shares storage and version counter).
Tensor detach(const Tensor& t);
// Called by detach() of a symbolic tensor with (t, result): capture mode (capture.cpp) makes
// them one value.  Real tensors never reach it.
using SymbolicAliasHook = void (*)(const Tensor&, const Tensor&);
void set_symbolic_alias_hook(SymbolicAliasHook hook);
// Whether every reference to t's storage is t's impl, or t's view base that only t keeps alive
// (*via_base says which): nothing but t can reach the memory through another tensor handle.
bool storage_only_via(const Tensor& t, bool* via_base = nullptr);

// A ValueError naming op when t's memory is read-only (Storage::read_only).
void check_writable(const Tensor& t, const char* op);

std::string tensor_repr(const Tensor& t);

// ---- what blutrain-dist needs for flat buffers (Note [version counter groups]) --------------
// Marks t's memory as used by work on `stream` (a cudaStream_t) too: blutrain-alloc does not
// hand it out again, once t is freed, before that stream's work queued so far has finished.
void record_stream(const Tensor& t, void* stream);
// dst (a leaf) now views src's memory (same shape, dtype, device): PyTorch's `p.data = src`.
// Used to move parameters into a flat buffer; dst keeps its autograd identity (.grad, hooks).
void set_data(const Tensor& dst, const Tensor& src);
// Gives every tensor of `ts` one new shared version counter (starting above their current ones).
void share_version_counter(const std::vector<Tensor>& ts);

// Determinism mode: when on, every kernel gives bitwise-identical results run to run on the same
// device (no float atomics; fixed reduction orders; GEMM algorithms pinned).  Off by default.
bool deterministic_algorithms();
void set_deterministic_algorithms(bool on);

}  // namespace bt
