// tensor.cpp: Device, Storage, Tensor helpers and the PyTorch-like repr.
#include "tensor.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <type_traits>
#include <vector>

#include "autograd.h"
#include "backend.h"

namespace bt {

std::string shape_str(const Shape& s) {
  std::string r = "(";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) r += ", ";
    r += std::to_string(s[i]);
  }
  if (s.size() == 1) r += ",";
  return r + ")";
}

DType dtype_from_name(const std::string& n) {
  if (n == "bool") return DType::Bool;
  if (n == "uint8" || n == "u8") return DType::UInt8;
  if (n == "int32" || n == "i32") return DType::Int32;
  if (n == "int64" || n == "i64" || n == "int" || n == "long") return DType::Int64;
  if (n == "float16" || n == "f16" || n == "half") return DType::Float16;
  if (n == "bfloat16" || n == "bf16") return DType::BFloat16;
  if (n == "float32" || n == "f32" || n == "float") return DType::Float32;
  if (n == "float64" || n == "f64" || n == "double") return DType::Float64;
  throw TypeError("[dtype] unknown dtype '" + n +
                  "' (expected one of bool, uint8, int32, int64, float16, bfloat16, float32, "
                  "float64)");
}

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  const int ca = category(a), cb = category(b);
  if (ca != cb) return ca > cb ? a : b;
  if (ca == 2) {
    const bool half_mix = (a == DType::Float16 && b == DType::BFloat16) ||
                          (a == DType::BFloat16 && b == DType::Float16);
    if (half_mix) return DType::Float32;
  }
  // Enum order is width order within a category.
  return a > b ? a : b;
}

DType promote_with_scalar(DType t, int scalar_category) {
  const int ct = category(t);
  if (scalar_category <= ct) return t;
  return scalar_category == 2 ? kDefaultFloat : DType::Int64;
}

// ---- Note [the op the user called] ---------------------------------------------------------
namespace {
thread_local int g_scope_depth = 0;
thread_local const char* g_outer_op = nullptr;
}  // namespace

const char* detail::outer_op() { return g_outer_op; }
OpScope::OpScope(const char* op) {
  if (g_scope_depth++ == 0) g_outer_op = op;
}
OpScope::~OpScope() {
  if (--g_scope_depth == 0) g_outer_op = nullptr;
}
OpScopeReset::OpScopeReset() : depth_(g_scope_depth), op_(g_outer_op) {
  g_scope_depth = 0;
  g_outer_op = nullptr;
}
OpScopeReset::~OpScopeReset() {
  g_scope_depth = depth_;
  g_outer_op = op_;
}
std::string with_op_prefix(const std::string& msg, const char* op) {
  if (!op || msg.empty() || msg[0] != '[') return msg;
  const size_t close = msg.find(']');
  if (close == std::string::npos || msg.compare(1, close - 1, op) == 0) return msg;
  return std::string("[") + op + msg.substr(close);
}

// ---- device --------------------------------------------------------------------------------
Device Device::parse(const std::string& s, const char* op) {
  Device d;
  if (s == "cpu") return d;
  if (s.rfind("cuda", 0) == 0) {
    d.type = CUDA;
    if (s.size() == 4) return d;
    if (s[4] == ':' && s.size() > 5) {
      char* end = nullptr;
      long v = std::strtol(s.c_str() + 5, &end, 10);
      if (*end == '\0' && v >= 0) {
        d.index = static_cast<int>(v);
        return d;
      }
    }
  }
  throw ValueError(std::string("[") + op + "] unknown device '" + s +
                   "' (expected 'cpu', 'cuda' or 'cuda:N')");
}

std::string Device::str() const { return type == CPU ? "cpu" : "cuda:" + std::to_string(index); }

// ---- storage -------------------------------------------------------------------------------
static AllocHooks g_alloc;

void set_alloc_hooks(const AllocHooks& hooks) { g_alloc = hooks; }
bool have_alloc_hooks() { return g_alloc.malloc != nullptr; }

static constexpr int kHostPageable = -1;  // BT_ALLOC_HOST_PAGEABLE
static constexpr size_t kHostAlign = 64;  // bytes: one cache line, enough for AVX-512 loads

std::shared_ptr<Storage> Storage::allocate(size_t nbytes, Device device, const char* op) {
  if (device.is_cuda()) backend::check_cuda_device(device, op);
  std::shared_ptr<Storage> s(new Storage());
  s->nbytes_ = nbytes;
  s->device_ = device;
  const size_t request = nbytes == 0 ? 1 : nbytes;  // a valid pointer even for empty tensors
  if (g_alloc.malloc) {
    void* p = nullptr;
    const int rc = g_alloc.malloc(device.is_cuda() ? device.index : kHostPageable, request,
                                  backend::current_stream(device), &p);
    if (rc != 0) {
      throw RuntimeError(std::string("[") + op + "] cannot allocate " + std::to_string(nbytes) +
                         " bytes on " + device.str() + ": " +
                         (g_alloc.last_error ? g_alloc.last_error() : "allocator error"));
    }
    s->data_ = p;
    s->from_alloc_ = true;
  } else {
    if (device.is_cuda()) {
      throw RuntimeError(std::string("[") + op +
                         "] no allocator installed for CUDA memory (import blutrain.alloc)");
    }
    void* p = std::aligned_alloc(kHostAlign, (request + kHostAlign - 1) / kHostAlign * kHostAlign);
    if (!p) throw RuntimeError(std::string("[") + op + "] out of host memory");
    s->data_ = p;
  }
  return s;
}

std::shared_ptr<Storage> Storage::adopt(void* data, size_t nbytes, Device device,
                                        std::function<void()> deleter) {
  std::shared_ptr<Storage> s(new Storage());
  s->data_ = data;
  s->nbytes_ = nbytes;
  s->device_ = device;
  s->deleter_ = std::move(deleter);
  return s;
}

Storage::~Storage() {
  if (deleter_) {
    deleter_();
  } else if (from_alloc_) {
    if (g_alloc.free) g_alloc.free(data_);
  } else {
    std::free(data_);
  }
}

// ---- tensor --------------------------------------------------------------------------------
Strides contiguous_strides(const Shape& shape) {
  Strides st(shape.size());
  int64_t s = 1;
  for (int64_t i = static_cast<int64_t>(shape.size()) - 1; i >= 0; --i) {
    st[i] = s;
    s *= std::max<int64_t>(shape[i], 1);
  }
  return st;
}

int64_t shape_numel(const Shape& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op) {
  const int64_t lo = ndim == 0 ? -1 : -ndim, hi = ndim == 0 ? 0 : ndim - 1;
  if (dim < lo || dim > hi) {
    throw IndexError(std::string("[") + op + "] dim " + std::to_string(dim) +
                     " is out of range for a tensor of " + std::to_string(ndim) +
                     " dims (expected " + std::to_string(lo) + ".." + std::to_string(hi) + ")");
  }
  return dim < 0 ? dim + std::max<int64_t>(ndim, 1) : dim;
}

int64_t wrap_shape_dim(int64_t dim, int64_t ndim, const char* op) {
  if (ndim == 0) {
    throw IndexError(std::string("[") + op + "] dim " + std::to_string(dim) +
                     " does not exist: the tensor is 0-d (reshape it to (1,) first)");
  }
  return wrap_dim(dim, ndim, op);
}

int64_t Tensor::size(int64_t dim) const { return shape()[wrap_shape_dim(dim, ndim(), "size")]; }
int64_t Tensor::numel() const { return shape_numel(shape()); }

bool Tensor::is_contiguous() const {
  // An empty tensor has no elements to lay out (as PyTorch: its strides do not matter).
  for (int64_t n : shape()) {
    if (n == 0) return true;
  }
  int64_t expect = 1;
  for (int64_t i = ndim() - 1; i >= 0; --i) {
    if (shape()[i] == 1) continue;
    if (strides()[i] != expect) return false;
    expect *= shape()[i];
  }
  return true;
}

void* Tensor::data_ptr(const char* op) const {
  if (!impl_) throw RuntimeError(std::string("[") + op + "] tensor is undefined");
  if (!impl_->storage) {
    throw RuntimeError(std::string("[") + op +
                       "] tensor is symbolic (made in capture mode): it has no data");
  }
  return static_cast<char*>(impl_->storage->data()) + impl_->offset * itemsize(impl_->dtype);
}

int64_t checked_numel(const Shape& shape, const char* op, int64_t item_bytes) {
  int64_t n = 1;
  bool overflow = false;
  for (auto d : shape) {
    if (d < 0) {
      throw ValueError(std::string("[") + op + "] negative dimension in shape " + shape_str(shape));
    }
    overflow = overflow || __builtin_mul_overflow(n, d, &n);
  }
  int64_t bytes = 0;
  if (overflow || __builtin_mul_overflow(n, item_bytes, &bytes)) {
    throw ValueError(std::string("[") + op + "] shape " + shape_str(shape) +
                     " has more elements than int64 can count");
  }
  return n;
}

Tensor empty_tensor(const Shape& shape, DType dtype, Device device, const char* op) {
  const int64_t n = checked_numel(shape, op, itemsize(dtype));
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = Storage::allocate(n * itemsize(dtype), device, op);
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  impl->device = device;
  return Tensor(std::move(impl));
}

// Note [caller-given scratch] (tensor.h).
static thread_local Tensor g_scratch;            // the region: contiguous uint8, or undefined
static thread_local int64_t g_scratch_used = 0;  // bytes of it handed out in this scope
constexpr int64_t kScratchAlign = 256;           // bytes, as the compiler's arena buffers

ScratchScope::ScratchScope(const Tensor& region) : prev_(g_scratch), prev_used_(g_scratch_used) {
  if (region.defined() && (region.dtype() != DType::UInt8 || !region.is_contiguous())) {
    throw ValueError("[scratch] the region must be a contiguous uint8 tensor, got " +
                     std::string(dtype_name(region.dtype())));
  }
  g_scratch = region;
  g_scratch_used = 0;
}

ScratchScope::~ScratchScope() {
  g_scratch = prev_;
  g_scratch_used = prev_used_;
}

Tensor scratch_tensor(const Shape& shape, DType dtype, Device device, const char* op) {
  const Tensor& r = g_scratch;
  if (!r.defined() || !r.storage() || r.device() != device)
    return empty_tensor(shape, dtype, device, op);
  const int64_t item = itemsize(dtype);
  const int64_t bytes = checked_numel(shape, op, item) * item;
  const int64_t base = r.offset();  // bytes (uint8)
  int64_t start = (base + g_scratch_used + kScratchAlign - 1) / kScratchAlign * kScratchAlign;
  if ((start % item) != 0 || start + bytes > base + r.numel()) {
    return empty_tensor(shape, dtype, device, op);
  }
  g_scratch_used = start + bytes - base;
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = r.storage();
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->offset = start / item;
  impl->dtype = dtype;
  impl->device = device;
  return Tensor(std::move(impl));
}

Tensor empty_strided(const Shape& shape, const Strides& strides, DType dtype, Device device,
                     const char* op) {
  Tensor t = empty_tensor(shape, dtype, device, op);
  t.impl()->strides = strides;
  return t;
}

bool is_dense(const Tensor& t) {
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < t.ndim(); ++d) {
    if (t.shape()[d] != 1) dims.push_back(d);
  }
  std::sort(dims.begin(), dims.end(),
            [&](int64_t a, int64_t b) { return t.strides()[a] < t.strides()[b]; });
  int64_t expect = 1;
  for (auto d : dims) {
    if (t.strides()[d] != expect) return false;
    expect *= t.shape()[d];
  }
  return true;
}

Tensor symbolic_tensor(const Shape& shape, DType dtype, Device device) {
  auto impl = std::make_shared<TensorImpl>();
  impl->shape = shape;
  impl->strides = contiguous_strides(shape);
  impl->dtype = dtype;
  impl->device = device;
  return Tensor(std::move(impl));
}

Tensor make_view(const Tensor& base, const Shape& shape, const Strides& strides, int64_t offset) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = base.storage();
  impl->shape = shape;
  impl->strides = strides;
  impl->offset = offset;
  impl->dtype = base.dtype();
  impl->device = base.device();
  impl->version_counter = base.impl()->version_counter;  // views stay in their base's group
  return Tensor(std::move(impl));
}

static SymbolicAliasHook g_symbolic_alias_hook = nullptr;
void set_symbolic_alias_hook(SymbolicAliasHook hook) { g_symbolic_alias_hook = hook; }

Tensor detach(const Tensor& t) {
  Tensor r = make_view(t, t.shape(), t.strides(), t.offset());
  if (!t.storage() && g_symbolic_alias_hook) g_symbolic_alias_hook(t, r);  // capture only
  return r;
}

void record_stream(const Tensor& t, void* stream) {
  if (!t.defined() || t.is_symbolic())
    throw ValueError("[record_stream] the tensor is undefined or symbolic (no memory)");
  if (!t.device().is_cuda())
    throw ValueError("[record_stream] the tensor is on " + t.device().str() +
                     ": only CUDA memory is ordered by streams");
  // Memory adopted from elsewhere (DLPack) is its owner's to order; ours goes to the allocator.
  if (!t.storage()->from_alloc() || !g_alloc.record_stream || !t.storage()->data()) return;
  if (g_alloc.record_stream(t.storage()->data(), stream) != 0)
    throw RuntimeError(std::string("[record_stream] ") +
                       (g_alloc.last_error ? g_alloc.last_error() : "blutrain.alloc refused"));
}

void set_data(const Tensor& dst, const Tensor& src) {
  if (!dst.defined() || !src.defined() || dst.is_symbolic() || src.is_symbolic())
    throw ValueError("[set_data] both tensors need memory (not undefined or symbolic)");
  if (!dst.is_leaf())
    throw RuntimeError("[set_data] only a leaf tensor's memory can be replaced (it has a grad_fn)");
  if (dst.shape() != src.shape() || dst.dtype() != src.dtype() || dst.device() != src.device())
    throw ValueError("[set_data] the new memory is " + shape_str(src.shape()) + " " +
                     dtype_name(src.dtype()) + " on " + src.device().str() + "; the tensor is " +
                     shape_str(dst.shape()) + " " + dtype_name(dst.dtype()) + " on " +
                     dst.device().str());
  TensorImpl* d = dst.impl();
  d->storage = src.storage();
  d->strides = src.strides();
  d->offset = src.offset();
  d->version_counter = src.impl()->version_counter;
  d->view_base = nullptr;
  d->views.clear();
}

void share_version_counter(const std::vector<Tensor>& ts) {
  uint64_t start = 0;
  for (const auto& t : ts) {
    if (!t.defined() || t.is_symbolic())
      throw ValueError("[share_version_counter] every tensor needs memory");
    start = std::max(start, t.version() + 1);
  }
  auto counter = std::make_shared<std::atomic<uint64_t>>(start);
  for (const auto& t : ts) t.impl()->version_counter = counter;
}

bool storage_only_via(const Tensor& t, bool* via_base) {
  const auto& base = t.impl()->view_base;
  const bool vb = base && base.use_count() == 1 && base->storage == t.storage();
  if (via_base) *via_base = vb;
  return t.storage().use_count() == (vb ? 2 : 1);
}

void check_writable(const Tensor& t, const char* op) {
  if (t.defined() && t.storage() && t.storage()->read_only()) {
    throw ValueError(std::string("[") + op +
                     "] the tensor is read-only: it shares memory with a read-only buffer (a "
                     "read-only numpy array or memmap, bytes); clone() it before writing");
  }
}

// ---- repr ----------------------------------------------------------------------------------
static double read_double(const Tensor& t, int64_t off) {
  const char* base = static_cast<const char*>(t.storage()->data());
  return dispatch_all(t.dtype(), "repr", [&](auto tag) -> double {
    using T = typename decltype(tag)::type;
    return static_cast<double>(static_cast<compute_t<T>>(reinterpret_cast<const T*>(base)[off]));
  });
}

// Integer elements read exactly (an int64 above 2**53 printed through double would be rounded).
static int64_t read_int(const Tensor& t, int64_t off) {
  const char* base = static_cast<const char*>(t.storage()->data());
  return dispatch_all(t.dtype(), "repr", [&](auto tag) -> int64_t {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_integral<T>::value) {
      return static_cast<int64_t>(reinterpret_cast<const T*>(base)[off]);
    } else {
      return 0;
    }
  });
}

namespace {
constexpr int64_t kReprThreshold = 1000;  // elements: above this, print a summary (PyTorch's)
constexpr int64_t kReprEdge = 3;          // elements shown at each end of a summarised dim

struct ReprCtx {
  const Tensor& t;
  bool fl;
  bool int_valued;
  int width;
  int precision;
  bool sci;
  bool summarize;
};

// The indices of a dim of size n that are printed: all, or the first and last kReprEdge.
std::vector<int64_t> shown_indices(int64_t n, bool summarize) {
  std::vector<int64_t> r;
  if (summarize && n > 2 * kReprEdge) {
    for (int64_t i = 0; i < kReprEdge; ++i) r.push_back(i);
    for (int64_t i = n - kReprEdge; i < n; ++i) r.push_back(i);
  } else {
    for (int64_t i = 0; i < n; ++i) r.push_back(i);
  }
  return r;
}

// Storage offsets of the printed elements: never more than (2 kReprEdge)^ndim of a summary, so a
// huge (e.g. expanded) view is not walked element by element.
void shown_offsets(const Tensor& t, int64_t dim, int64_t off, bool summarize,
                   std::vector<int64_t>& out) {
  if (dim == t.ndim()) {
    out.push_back(off);
    return;
  }
  for (int64_t i : shown_indices(t.shape()[dim], summarize)) {
    shown_offsets(t, dim + 1, off + i * t.strides()[dim], summarize, out);
  }
}

std::string fmt_elem(const ReprCtx& c, int64_t off) {
  char buf[64];
  if (!c.fl) {
    const int64_t v = read_int(c.t, off);
    if (c.t.dtype() == DType::Bool) {
      std::snprintf(buf, sizeof(buf), "%s", v != 0 ? "True" : "False");
    } else {
      std::snprintf(buf, sizeof(buf), "%lld", static_cast<long long>(v));
    }
  } else {
    const double v = read_double(c.t, off);
    if (std::isnan(v)) {
      std::snprintf(buf, sizeof(buf), "nan");
    } else if (std::isinf(v)) {
      std::snprintf(buf, sizeof(buf), v > 0 ? "inf" : "-inf");
    } else if (c.sci) {
      std::snprintf(buf, sizeof(buf), "%.*e", c.precision, v);
    } else if (c.int_valued) {
      std::snprintf(buf, sizeof(buf), "%.0f.", v);
    } else {
      std::snprintf(buf, sizeof(buf), "%.*f", c.precision, v);
    }
  }
  std::string s(buf);
  if (static_cast<int>(s.size()) < c.width) s = std::string(c.width - s.size(), ' ') + s;
  return s;
}

// PyTorch's layout: elements joined by ", ", rows by ",\n" plus indentation; a summarised dim
// shows " ..." (innermost) or "..." (outer) in place of the skipped part.
std::string repr_rec(const ReprCtx& c, int64_t dim, int64_t off, int indent) {
  const Tensor& t = c.t;
  const int64_t n = t.shape()[dim];
  const bool cut = c.summarize && n > 2 * kReprEdge;
  std::vector<std::string> parts;
  for (int64_t i : shown_indices(n, c.summarize)) {
    if (cut && i == n - kReprEdge) parts.push_back(dim == t.ndim() - 1 ? " ..." : "...");
    const int64_t o = off + i * t.strides()[dim];
    parts.push_back(dim == t.ndim() - 1 ? fmt_elem(c, o) : repr_rec(c, dim + 1, o, indent + 1));
  }
  const std::string sep = dim == t.ndim() - 1 ? std::string(", ")
                                              : "," + std::string(t.ndim() - dim - 1, '\n') +
                                                    std::string(indent + 1, ' ');
  std::string r = "[";
  for (size_t k = 0; k < parts.size(); ++k) r += (k ? sep : "") + parts[k];
  return r + "]";
}
}  // namespace

std::string tensor_repr(const Tensor& t) {
  std::string suffix;
  const bool fl = is_floating(t.dtype());
  if (t.dtype() != DType::Float32 && t.dtype() != DType::Int64 && t.dtype() != DType::Bool) {
    suffix += ", dtype=bt." + std::string(dtype_name(t.dtype()));
  }
  if (t.device().is_cuda()) suffix = ", device='" + t.device().str() + "'" + suffix;
  if (t.grad_fn()) {
    suffix += ", grad_fn=<" + t.grad_fn()->name() + "Backward>";
  } else if (t.requires_grad()) {
    suffix += ", requires_grad=True";
  }
  if (t.is_symbolic()) {
    return "tensor(<symbolic>, shape=" + shape_str(t.shape()) + ", dtype=bt." +
           dtype_name(t.dtype()) + suffix + ")";
  }
  if (t.device().is_cuda()) {
    return "tensor(<on " + t.device().str() + ">, shape=" + shape_str(t.shape()) + suffix + ")";
  }
  const int64_t n = t.numel();
  if (n == 0) return "tensor([], size=" + shape_str(t.shape()) + suffix + ")";
  const bool summarize = n > kReprThreshold;
  // One format for every printed element, chosen from those elements (as PyTorch does):
  // integer-valued floats print as "1.", large or tiny magnitudes switch to scientific notation.
  std::vector<int64_t> offs;
  shown_offsets(t, 0, t.offset(), summarize, offs);
  bool int_valued = true;
  double amax = 0, amin = INFINITY;
  if (fl) {
    for (int64_t off : offs) {
      const double v = read_double(t, off);
      if (!std::isfinite(v)) continue;
      if (v != std::floor(v)) int_valued = false;
      amax = std::max(amax, std::fabs(v));
      if (v != 0) amin = std::min(amin, std::fabs(v));
    }
  }
  ReprCtx c{t, fl, int_valued, 0, 4, false, summarize};
  if (fl && !int_valued && (amax >= 1e8 || (amin < 1e-4 && amin > 0))) c.sci = true;
  if (fl && int_valued && amax >= 1e8) {
    c.sci = true;
    c.int_valued = false;
  }
  for (int64_t off : offs) {
    c.width = std::max<int>(c.width, static_cast<int>(fmt_elem(c, off).size()));
  }
  std::string body;
  if (t.ndim() == 0) {
    c.width = 0;
    body = fmt_elem(c, t.offset());
  } else {
    body = repr_rec(c, 0, t.offset(), 7);
  }
  return "tensor(" + body + suffix + ")";
}

static std::atomic<bool> g_deterministic{false};
bool deterministic_algorithms() { return g_deterministic.load(std::memory_order_relaxed); }
void set_deterministic_algorithms(bool on) { g_deterministic.store(on, std::memory_order_relaxed); }

}  // namespace bt
