// ops.cpp: the backend-neutral front (promote, broadcast, check, build the node).
#include "ops.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <mutex>
#include <numeric>
#include <optional>
#include <unordered_map>

#include "attention.h"  // scaled_dot_product_attention fused path (attention helper)
#include "backend.h"
#ifdef BT_WITH_CUDA
#include "cuda/runtime.h"
#endif
#include "capture.h"
#include "optim.h"  // clip_grad_norm_ on CUDA
#include "random.h"

namespace bt {

std::optional<Strides> view_strides(const Shape& old_shape, const Strides& old_strides,
                                    const Shape& new_shape);  // views.cpp

template <typename P, typename... Args>
static std::shared_ptr<Primitive> mk(Args&&... args) {
  return std::make_shared<P>(std::forward<Args>(args)...);
}

static void check_device(Device d, const char* op) {
  if (d.is_cuda() && !active_graph()) backend::check_cuda_device(d, op);
}

static void check_same_device(const Tensor& a, const Tensor& b, const char* op) {
  if (a.device() != b.device()) {
    throw ValueError(std::string("[") + op + "] expected all tensors on the same device, got " +
                     a.device().str() + " and " + b.device().str());
  }
}

// Note [a 0-d CPU tensor meets a CUDA tensor]
// As PyTorch: an elementwise op (arithmetic, comparisons, logical and / or, where; fill_ and
// masked_fill take a 0-d value from either device already) accepts a 0-d CPU tensor next to CUDA
// tensors, as it accepts a Python number.  Its value is read on the host and becomes a 0-d tensor
// of its own dtype on their device: a fill kernel, no copy and no synchronisation; promotion is
// the usual one between tensor dtypes (a float64 0-d tensor makes float64, as on one device).
// One that needs a gradient, or a symbolic one under capture, moves by to() instead (tracked:
// its gradient comes back to the CPU).  Any other mix of devices is an error naming both, and
// an in-place op never writes a CUDA result into a CPU tensor (arith_inplace).
static Tensor cpu_scalar_on(const Tensor& t, Device dev, const char* op) {
  if (t.is_symbolic() || (grad_enabled() && t.requires_grad())) return to_device(t, dev);
  const Scalar v = dispatch_all(t.dtype(), op, [&](auto tag) -> Scalar {
    using T = typename decltype(tag)::type;
    const T x = *t.data<T>(op);
    if constexpr (std::is_same_v<T, bool>) {
      return Scalar::boolean(x);
    } else if constexpr (std::is_integral_v<T>) {
      return Scalar::integer(static_cast<int64_t>(x));
    } else {
      return Scalar::floating(static_cast<double>(static_cast<compute_t<T>>(x)));
    }
  });
  return full({}, v, t.dtype(), dev, op);
}

// Moves each 0-d CPU tensor of ts onto the CUDA device of the others, when there is one.
static void cpu_scalars_to_device(std::initializer_list<Tensor*> ts, const char* op) {
  const Tensor* cuda_t = nullptr;
  for (Tensor* t : ts) {
    if (t->defined() && t->device().is_cuda()) {
      cuda_t = t;
      break;
    }
  }
  if (!cuda_t) return;
  const Device dev = cuda_t->device();
  for (Tensor* t : ts) {
    if (t->defined() && t->ndim() == 0 && !t->device().is_cuda()) *t = cpu_scalar_on(*t, dev, op);
  }
}

static void check_defined(const Tensor& t, const char* op) {
  if (!t.defined()) throw ValueError(std::string("[") + op + "] got an undefined tensor");
}

// ---- creation ------------------------------------------------------------------------------
std::string scalar_str(const Scalar& s) {
  if (s.category == 0) return s.i ? "True" : "False";
  if (s.category == 1) return std::to_string(s.i);
  if (std::isnan(s.v)) return "nan";
  if (std::isinf(s.v)) return s.v > 0 ? "inf" : "-inf";
  char buf[40];
  for (int prec = 1; prec <= 17; ++prec) {  // the shortest text that reads back as v (Python's)
    std::snprintf(buf, sizeof buf, "%.*g", prec, s.v);
    if (std::strtod(buf, nullptr) == s.v) break;
  }
  std::string r(buf);
  if (r.find_first_of(".en") == std::string::npos) r += ".0";
  return r;
}

static bool int_fits(int64_t v, DType dt) {
  switch (dt) {
    case DType::UInt8:
      return v >= 0 && v <= 255;
    case DType::Int32:
      return v >= INT32_MIN && v <= INT32_MAX;
    default:
      return true;
  }
}

// A cast of NaN or of an out-of-range double to an integer type is undefined behaviour in C++;
// an integer scalar must fit exactly.  Floating and bool dtypes hold any value.
bool scalar_fits(const Scalar& s, DType dt) {
  if (is_floating(dt) || dt == DType::Bool) return true;
  if (s.integral()) return int_fits(s.i, dt);
  const double v = s.v;
  if (!std::isfinite(v)) return false;
  switch (dt) {
    case DType::UInt8:
      return v > -1.0 && v < 256.0;  // truncation toward zero lands in range
    case DType::Int32:
      return v > -2147483649.0 && v < 2147483648.0;
    default:  // Int64: 2^63 itself is out of range
      return v >= -9223372036854775808.0 && v < 9223372036854775808.0;
  }
}

static void check_scalar_fits(const Scalar& s, DType dt, const char* op, const char* what) {
  if (!scalar_fits(s, dt)) {
    throw ValueError(std::string("[") + op + "] " + what + " " + scalar_str(s) + " does not fit " +
                     dtype_name(dt) + (s.integral() ? "" : " (a finite value in range is needed)"));
  }
}

Tensor full(const Shape& shape, Scalar value, DType dtype, Device device, const char* op) {
  OpScope scope(op);  // Note [the op the user called]
  check_device(device, op);
  checked_numel(shape, op, itemsize(dtype));
  check_scalar_fits(value, dtype, op, "value");
  return apply1(mk<Full>(value), {}, shape, dtype, device);
}
Tensor full(const Shape& shape, double value, DType dtype, Device device, const char* op) {
  return full(shape, Scalar::floating(value), dtype, device, op);
}
Tensor zeros(const Shape& s, DType dt, Device dev) { return full(s, 0.0, dt, dev); }
Tensor ones(const Shape& s, DType dt, Device dev) { return full(s, 1.0, dt, dev); }
Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), t.dtype(), t.device()); }
Tensor ones_like(const Tensor& t) { return ones(t.shape(), t.dtype(), t.device()); }

Tensor empty(const Shape& shape, DType dtype, Device device) {
  check_device(device, "empty");
  if (active_graph()) return apply1(mk<Full>(0.0), {}, shape, dtype, device);
  return empty_tensor(shape, dtype, device, "empty");
}

// Integral start, stop and step count exactly in 128 bits and fill in int64 (an int above 2**53
// is not rounded through double); otherwise the values are start + i * step in double.  Every
// value must fit the dtype (no silent wrap-around into int32 / uint8).
Tensor arange(Scalar start, Scalar stop, Scalar step, DType dtype, Device device) {
  OpScope scope("arange");
  const char* op = "arange";
  check_device(device, op);
  if (dtype == DType::Bool) throw TypeError("[arange] dtype bool is not supported");
  for (const Scalar* s : {&start, &stop, &step}) {
    if (!s->integral() && !std::isfinite(s->v)) {
      throw ValueError("[arange] start, end and step must be finite, got start " +
                       scalar_str(start) + ", end " + scalar_str(stop) + ", step " +
                       scalar_str(step));
    }
  }
  if (step.integral() ? step.i == 0 : step.v == 0) {
    throw ValueError("[arange] step must be nonzero");
  }
  const bool exact = start.integral() && stop.integral() && step.integral();
  int64_t n = 0;
  Scalar last;
  if (exact) {
    const __int128 span = static_cast<__int128>(stop.i) - start.i, st = step.i;
    __int128 cnt = 0;
    if ((span > 0 && st > 0) || (span < 0 && st < 0)) {
      cnt = (span + st + (st > 0 ? -1 : 1)) / st;  // ceil(span / st), both of one sign
    }
    if (cnt > INT64_MAX) {
      throw ValueError("[arange] the range [" + scalar_str(start) + ", " + scalar_str(stop) +
                       ") in steps of " + scalar_str(step) +
                       " has more elements than int64 "
                       "can count");
    }
    n = static_cast<int64_t>(cnt);
    if (n > 0) last = Scalar::integer(static_cast<int64_t>(start.i + (cnt - 1) * st));
  } else {
    const double c = std::ceil((stop.v - start.v) / step.v);
    if (!std::isfinite(c)) throw ValueError("[arange] start, end and step must be finite");
    if (c >= 0x1p63) {  // (a cast of a larger double to int64 is undefined: it gave 0 elements)
      char msg[200];
      std::snprintf(msg, sizeof msg,
                    "[arange] the range [%.17g, %.17g) in steps of %.17g has %.17g elements, "
                    "more than int64 can count",
                    start.v, stop.v, step.v, c);
      throw ValueError(msg);
    }
    n = std::max<int64_t>(0, static_cast<int64_t>(c));
    if (n > 0) last = Scalar::floating(start.v + static_cast<double>(n - 1) * step.v);
  }
  if (n > 0) {
    const Scalar first = start.integral() ? Scalar::integer(start.i) : start;
    for (const Scalar* v : {&first, static_cast<const Scalar*>(&last)}) {
      if (!scalar_fits(*v, dtype)) {
        throw ValueError("[arange] the value " + scalar_str(*v) + " of the range [" +
                         scalar_str(start) + ", " + scalar_str(stop) + ") in steps of " +
                         scalar_str(step) + " does not fit " + dtype_name(dtype));
      }
    }
  }
  if (!exact) {  // the kernel's double path
    start = Scalar::floating(start.v);
    step = Scalar::floating(step.v);
  }
  return apply1(mk<Arange>(start, step), {}, {n}, dtype, device);
}

Tensor arange(double start, double stop, double step, DType dtype, Device device) {
  const auto sc = [dtype](double v) {
    // Internal callers pass whole numbers for integer dtypes: keep the exact path.
    return !is_floating(dtype) && v == std::floor(v) && std::fabs(v) < 0x1p62
               ? Scalar::integer(static_cast<int64_t>(v))
               : Scalar::floating(v);
  };
  return arange(sc(start), sc(stop), sc(step), dtype, device);
}

namespace {
struct GeneratorState {
  std::mutex mu;
  uint64_t seed = 0x2545F4914F6CDD1DULL;
  uint64_t initial = 0x2545F4914F6CDD1DULL;
  uint64_t offset = 0;
};
GeneratorState& gen() {
  static GeneratorState g;
  return g;
}
}  // namespace

void manual_seed(uint64_t seed) {
  auto& g = gen();
  std::lock_guard<std::mutex> lk(g.mu);
  g.seed = g.initial = seed;
  g.offset = 0;
}
uint64_t initial_seed() { return gen().initial; }
std::pair<uint64_t, uint64_t> next_philox(uint64_t n) {
  auto& g = gen();
  std::lock_guard<std::mutex> lk(g.mu);
  auto r = std::make_pair(g.seed, g.offset);
  g.offset += n;
  return r;
}
// Generator state for recomputation (checkpoint replays dropout); declared in autocast.h.
std::pair<uint64_t, uint64_t> get_rng_state() {
  auto& g = gen();
  std::lock_guard<std::mutex> lk(g.mu);
  return {g.seed, g.offset};
}
void set_rng_state(uint64_t seed, uint64_t offset) {
  auto& g = gen();
  std::lock_guard<std::mutex> lk(g.mu);
  g.seed = seed;
  g.offset = offset;
}

static Tensor random_op(RandKind k, const Shape& shape, DType dtype, Device device, double a,
                        double b, const char* op) {
  check_device(device, op);
  const uint64_t n = static_cast<uint64_t>(checked_numel(shape, op, itemsize(dtype)));
  auto [seed, off] =
      next_philox(philox::counters_needed(n, k == RandKind::Uniform && dtype == DType::Float64));
  return apply1(mk<Random>(k, seed, off, a, b), {}, shape, dtype, device);
}

Tensor rand(const Shape& shape, DType dtype, Device device) {
  OpScope scope("rand");
  if (!is_floating(dtype))
    throw TypeError("[rand] dtype must be floating, got " + std::string(dtype_name(dtype)));
  return random_op(RandKind::Uniform, shape, dtype, device, 0, 1, "rand");
}
Tensor randn(const Shape& shape, DType dtype, Device device) {
  OpScope scope("randn");
  if (!is_floating(dtype))
    throw TypeError("[randn] dtype must be floating, got " + std::string(dtype_name(dtype)));
  return random_op(RandKind::Normal, shape, dtype, device, 0, 1, "randn");
}
Tensor randint(int64_t low, int64_t high, const Shape& shape, DType dtype, Device device) {
  OpScope scope("randint");
  if (high <= low) {
    throw ValueError("[randint] high (" + std::to_string(high) + ") must be greater than low (" +
                     std::to_string(low) + ")");
  }
  // (high - low overflows int64 for a range wider than 2^63: compare in 128 bits)
  const __int128 range = static_cast<__int128>(high) - low;
  if (range > (__int128{1} << 32)) {
    throw ValueError("[randint] the range [" + std::to_string(low) + ", " + std::to_string(high) +
                     ") has more than 2^32 values; ranges up to 2^32 are supported");
  }
  if (dtype != DType::Bool) {
    for (int64_t v : {low, high - 1}) {
      if (!scalar_fits(Scalar::integer(v), dtype)) {
        throw ValueError("[randint] the range [" + std::to_string(low) + ", " +
                         std::to_string(high) + ") does not fit " + dtype_name(dtype));
      }
    }
  } else if (low < 0 || high > 2) {
    throw ValueError("[randint] the range [" + std::to_string(low) + ", " + std::to_string(high) +
                     ") does not fit bool (use [0, 2))");
  }
  check_device(device, "randint");
  const uint64_t n = static_cast<uint64_t>(checked_numel(shape, "randint", itemsize(dtype)));
  auto [seed, off] = next_philox(philox::counters_needed(n, false));
  auto prim = std::make_shared<Random>(RandKind::Int, seed, off, static_cast<double>(low),
                                       static_cast<double>(high));
  prim->int_low = low;
  prim->int_range = static_cast<uint64_t>(range);
  return apply1(prim, {}, shape, dtype, device);
}

// ---- copies --------------------------------------------------------------------------------
Tensor astype(const Tensor& x, DType dtype) {
  check_defined(x, "to");
  if (x.dtype() == dtype) return x;
  return apply1(mk<AsType>(), {x}, x.shape(), dtype, x.device());
}

Tensor contiguous(const Tensor& x) {
  if (x.is_contiguous()) return x;
  return apply1(mk<AsType>(), {x}, x.shape(), x.dtype(), x.device());
}

Tensor clone(const Tensor& x) {
  return apply1(mk<AsType>(), {x}, x.shape(), x.dtype(), x.device());
}

// ---- cached casts (Note [cached casts]) -----------------------------------------------------
static Tensor raw_copy_into(const Tensor& dst, const Tensor& src, const char* op);

std::mutex& cast_cache_mutex() {
  static std::mutex m;
  return m;
}

CastCache::Entry* CastCache::find(const Tensor& x, DType to) {
  for (auto& e : entries) {
    if (e.to == to && e.from == x.dtype() && e.offset == x.offset() && e.shape == x.shape() &&
        e.strides == x.strides()) {
      return &e;
    }
  }
  return nullptr;
}

static std::atomic<bool> g_cast_cache_enabled{true};
void set_cast_cache_enabled(bool enabled) { g_cast_cache_enabled.store(enabled); }
bool cast_cache_enabled() { return g_cast_cache_enabled.load(); }

Tensor cached_astype(const Tensor& x, DType dtype) {
  OpScope scope("cached_astype");
  check_defined(x, "cached_astype");
  if (x.dtype() == dtype) return x;
  if (!cast_cache_enabled() || !is_floating(x.dtype()) || !is_floating(dtype) || x.is_symbolic() ||
      !x.storage() || active_graph()) {
    return astype(x, dtype);
  }
  Tensor copy;
  {
    std::lock_guard<std::mutex> lock(cast_cache_mutex());
    auto& cache = x.storage()->cast_cache;
    if (!cache) cache = std::make_shared<CastCache>();
    CastCache::Entry* e = cache->find(x, dtype);
    if (!e) {
      GradModeGuard no_grad(false);
      cache->entries.push_back(
          {x.shape(), x.strides(), x.offset(), x.dtype(), dtype, astype(detach(x), dtype), 0, 0});
      e = &cache->entries.back();
    } else if (!e->current(x)) {
      raw_copy_into(e->copy, x, "cached_astype");
      e->copy.bump_version();  // a view of the old copy saved for backward is stale
    }
    e->from_version = x.version();
    e->copy_version = e->copy.version();
    copy = e->copy;
  }
  return apply1(mk<CachedCast>(), {x, copy}, x.shape(), dtype, x.device());
}

void drop_cast_cache(const Tensor& x) {
  check_defined(x, "drop_cast_cache");
  if (!x.storage()) return;
  std::lock_guard<std::mutex> lock(cast_cache_mutex());
  x.storage()->cast_cache.reset();
}

int64_t cast_cache_bytes(const Tensor& x) {
  check_defined(x, "cast_cache_bytes");
  if (!x.storage()) return 0;
  std::lock_guard<std::mutex> lock(cast_cache_mutex());
  int64_t n = 0;
  if (const auto& c = x.storage()->cast_cache) {
    for (const auto& e : c->entries) n += e.copy.numel() * static_cast<int64_t>(itemsize(e.to));
  }
  return n;
}

Tensor to_device(const Tensor& x, Device device) {
  OpScope scope("to");
  if (x.device() == device) return x;
  check_device(device, "to");
  check_device(x.device(), "to");
  Tensor src = contiguous(x);  // transfers are byte copies of a dense buffer
  // apply() checks that inputs live on the op's device; a transfer is the one exception.
  auto prim = mk<ToDevice>();
  Tensor out;
  {
    Graph* g = active_graph();
    out = g ? symbolic_tensor(x.shape(), x.dtype(), device)
            : empty_tensor(x.shape(), x.dtype(), device, "to");
    std::vector<Tensor> outs{out};
    if (g) {
      g->record("to_device", {{"device", device.str()}}, {src}, outs);
    } else if (device.is_cuda() || src.device().is_cuda()) {
      if (device.is_cuda()) {
        prim->eval_gpu({src}, outs);
      } else {
        prim->eval_cpu({src}, outs);
      }
    } else {
      prim->eval_cpu({src}, outs);
    }
  }
  if (src.requires_grad() && grad_enabled()) {
    const Device from = x.device();
    auto node = make_custom_node(
        "ToDevice",
        [from](const std::vector<Tensor>& g) { return std::vector<Tensor>{to_device(g[0], from)}; },
        {src}, {out});
    (void)node;
  }
  return out;
}

// ---- views ---------------------------------------------------------------------------------
static Shape infer_shape(Shape shape, int64_t numel, const Shape& from, const char* op) {
  int64_t infer = -1, prod = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      if (infer >= 0) throw ValueError(std::string("[") + op + "] only one dimension can be -1");
      infer = static_cast<int64_t>(i);
    } else if (shape[i] < 0) {
      throw ValueError(std::string("[") + op + "] invalid shape " + shape_str(shape));
    } else if (__builtin_mul_overflow(prod, shape[i], &prod)) {
      throw ValueError(std::string("[") + op + "] shape " + shape_str(shape) +
                       " has more elements than int64 can count");
    }
  }
  if (infer >= 0) {
    if (prod == 0 || numel % prod != 0) {
      throw ValueError(std::string("[") + op + "] shape " + shape_str(shape) +
                       " is invalid for input of shape " + shape_str(from));
    }
    shape[infer] = numel / prod;
  } else if (prod != numel) {
    throw ValueError(std::string("[") + op + "] shape " + shape_str(shape) +
                     " is invalid for input of shape " + shape_str(from) + " (" +
                     std::to_string(numel) + " elements)");
  }
  return shape;
}

Tensor as_rows(const Tensor& x) {
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < x.shape().size(); ++d) rows *= x.shape()[d];
  return reshape(x, {rows, x.shape().back()});
}

Tensor reshape(const Tensor& x, Shape shape) {
  OpScope scope("reshape");
  check_defined(x, "reshape");
  shape = infer_shape(std::move(shape), x.numel(), x.shape(), "reshape");
  if (shape == x.shape()) return x;
  Tensor src = view_strides(x.shape(), x.strides(), shape) ? x : contiguous(x);
  return apply1(mk<Reshape>(shape), {src}, shape, x.dtype(), x.device());
}

Tensor view(const Tensor& x, Shape shape) {
  OpScope scope("view");
  shape = infer_shape(std::move(shape), x.numel(), x.shape(), "view");
  if (!view_strides(x.shape(), x.strides(), shape)) {
    throw RuntimeError("[view] a tensor of shape " + shape_str(x.shape()) + " and strides " +
                       shape_str(x.strides()) + " cannot be viewed as " + shape_str(shape) +
                       " without a copy; use reshape()");
  }
  return apply1(mk<Reshape>(shape), {x}, shape, x.dtype(), x.device());
}

Tensor flatten(const Tensor& x, int64_t start, int64_t end) {
  OpScope scope("flatten");
  if (x.ndim() == 0) {  // dims -1 and 0 name a 0-d tensor's one "dim" (as PyTorch)
    wrap_dim(start, 0, "flatten");
    wrap_dim(end, 0, "flatten");
    return reshape(x, {1});
  }
  start = wrap_dim(start, x.ndim(), "flatten");
  end = wrap_dim(end, x.ndim(), "flatten");
  if (start > end) {
    throw ValueError("[flatten] start_dim " + std::to_string(start) + " is after end_dim " +
                     std::to_string(end) + " (of " + std::to_string(x.ndim()) + " dims)");
  }
  Shape s(x.shape().begin(), x.shape().begin() + start);
  int64_t m = 1;
  for (int64_t d = start; d <= end; ++d) m *= x.shape()[d];
  s.push_back(m);
  s.insert(s.end(), x.shape().begin() + end + 1, x.shape().end());
  return reshape(x, s);
}

Tensor permute(const Tensor& x, std::vector<int64_t> perm) {
  OpScope scope("permute");
  if (static_cast<int64_t>(perm.size()) != x.ndim()) {
    throw ValueError("[permute] got " + std::to_string(perm.size()) + " dims for a tensor of " +
                     std::to_string(x.ndim()) + " dims");
  }
  std::vector<bool> seen(perm.size(), false);
  Shape s;
  for (auto& p : perm) {
    p = wrap_dim(p, x.ndim(), "permute");
    if (seen[p]) throw ValueError("[permute] dim " + std::to_string(p) + " repeats");
    seen[p] = true;
    s.push_back(x.shape()[p]);
  }
  return apply1(mk<Permute>(perm), {x}, s, x.dtype(), x.device());
}

Tensor transpose(const Tensor& x, int64_t d0, int64_t d1) {
  OpScope scope("transpose");
  d0 = wrap_dim(d0, x.ndim(), "transpose");
  d1 = wrap_dim(d1, x.ndim(), "transpose");
  if (d0 == d1) return x;  // also a 0-d tensor's (0, -1)
  std::vector<int64_t> perm(x.ndim());
  std::iota(perm.begin(), perm.end(), 0);
  std::swap(perm[d0], perm[d1]);
  return permute(x, perm);
}

Tensor expand(const Tensor& x, const Shape& shape_in) {
  OpScope scope("expand");
  if (static_cast<int64_t>(shape_in.size()) < x.ndim()) {
    throw ValueError("[expand] cannot expand a tensor of shape " + shape_str(x.shape()) + " to " +
                     shape_str(shape_in) + " (fewer dims)");
  }
  Shape shape = shape_in;
  const int64_t lead = static_cast<int64_t>(shape.size()) - x.ndim();
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d) {
    const int64_t have = d >= lead ? x.shape()[d - lead] : 1;
    if (shape[d] == -1) {
      if (d < lead) throw ValueError("[expand] -1 is not allowed for a new leading dim");
      shape[d] = have;
    }
    if (have != shape[d] && have != 1) {
      throw ValueError("[expand] cannot expand a tensor of shape " + shape_str(x.shape()) + " to " +
                       shape_str(shape_in) + ": dim " + std::to_string(d) + " has size " +
                       std::to_string(have) + ", not 1");
    }
  }
  if (shape == x.shape()) return x;
  checked_numel(shape, "expand");
  return apply1(mk<Expand>(shape), {x}, shape, x.dtype(), x.device());
}
Tensor broadcast_to(const Tensor& x, const Shape& shape) { return expand(x, shape); }

Tensor slice(const Tensor& x, int64_t dim, std::optional<int64_t> start_o,
             std::optional<int64_t> stop_o, int64_t step) {
  if (x.ndim() == 0) throw IndexError("[slice] cannot slice a 0-d tensor");
  dim = wrap_dim(dim, x.ndim(), "slice");
  if (step <= 0) throw ValueError("[slice] step must be positive, got " + std::to_string(step));
  const int64_t n = x.shape()[dim];
  step = std::min(step, std::max<int64_t>(n, 1));  // same elements; no overflow in size, stride
  auto norm = [n](int64_t v) { return std::clamp<int64_t>(v < 0 ? v + n : v, 0, n); };
  const int64_t start = start_o ? norm(*start_o) : 0;
  const int64_t stop = std::max(start, stop_o ? norm(*stop_o) : n);
  if (start == 0 && stop == n && step == 1) return x;
  Shape s = x.shape();
  s[dim] = (stop - start + step - 1) / step;
  return apply1(mk<Slice>(dim, start, stop, step), {x}, s, x.dtype(), x.device());
}

Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length) {
  OpScope scope("narrow");
  dim = wrap_shape_dim(dim, x.ndim(), "narrow");
  const int64_t n = x.shape()[dim];
  const int64_t given = start;
  if (start < 0 && start >= -n) start += n;
  // (length > n - start rather than start + length > n, which overflows for huge values)
  if (start < 0 || start > n || length < 0 || length > n - start) {
    throw IndexError("[narrow] start " + std::to_string(given) + " and length " +
                     std::to_string(length) + " are out of range for dim " + std::to_string(dim) +
                     " of size " + std::to_string(n));
  }
  return slice(x, dim, start, start + length, 1);
}

Tensor select(const Tensor& x, int64_t dim, int64_t index) {
  OpScope scope("select");
  if (x.ndim() == 0) throw IndexError("[select] cannot index a 0-d tensor");
  dim = wrap_dim(dim, x.ndim(), "select");
  const int64_t n = x.shape()[dim];
  if (index < -n || index >= n) {
    throw IndexError("[select] index " + std::to_string(index) + " is out of range for dim " +
                     std::to_string(dim) + " of size " + std::to_string(n));
  }
  if (index < 0) index += n;
  Shape s = x.shape();
  s.erase(s.begin() + dim);
  return apply1(mk<Select>(dim, index), {x}, s, x.dtype(), x.device());
}

std::vector<Tensor> split_sizes(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) {
  OpScope scope("split");
  dim = wrap_shape_dim(dim, x.ndim(), "split");
  int64_t total = 0;
  bool over = false;
  for (auto s : sizes) {
    if (s < 0) throw ValueError("[split] sizes must be non-negative, got " + std::to_string(s));
    over = over || __builtin_add_overflow(total, s, &total);
  }
  if (over || total != x.shape()[dim]) {
    if (over) {
      throw ValueError("[split] sizes sum to more than int64 can count but dim " +
                       std::to_string(dim) + " has size " + std::to_string(x.shape()[dim]));
    }
    throw ValueError("[split] sizes sum to " + std::to_string(total) + " but dim " +
                     std::to_string(dim) + " has size " + std::to_string(x.shape()[dim]));
  }
  std::vector<Tensor> r;
  int64_t at = 0;
  for (auto s : sizes) {
    r.push_back(slice(x, dim, at, at + s, 1));
    at += s;
  }
  return r;
}

std::vector<Tensor> split(const Tensor& x, int64_t size, int64_t dim) {
  OpScope scope("split");
  if (size <= 0) {
    throw ValueError("[split] split_size must be positive, got " + std::to_string(size));
  }
  dim = wrap_shape_dim(dim, x.ndim(), "split");
  std::vector<int64_t> sizes;
  for (int64_t at = 0; at < x.shape()[dim]; at += size) {
    sizes.push_back(std::min(size, x.shape()[dim] - at));
  }
  if (sizes.empty()) sizes.push_back(0);
  return split_sizes(x, sizes, dim);
}

std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim) {
  OpScope scope("chunk");
  if (chunks <= 0) throw ValueError("[chunk] chunks must be positive");
  dim = wrap_shape_dim(dim, x.ndim(), "chunk");
  const int64_t n = x.shape()[dim];
  return split(x, std::max<int64_t>(1, (n + chunks - 1) / chunks), dim);
}

Tensor squeeze(const Tensor& x, std::optional<int64_t> dim) {
  OpScope scope("squeeze");
  Shape s;
  if (dim) {
    const int64_t d = wrap_dim(*dim, x.ndim(), "squeeze");
    if (x.ndim() == 0 || x.shape()[d] != 1) return x;
    s = x.shape();
    s.erase(s.begin() + d);
  } else {
    for (auto v : x.shape()) {
      if (v != 1) s.push_back(v);
    }
  }
  if (s == x.shape()) return x;
  return apply1(mk<Reshape>(s), {x}, s, x.dtype(), x.device());
}

Tensor unsqueeze(const Tensor& x, int64_t dim) {
  OpScope scope("unsqueeze");
  const int64_t d = wrap_dim(dim, x.ndim() + 1, "unsqueeze");
  Shape s = x.shape();
  s.insert(s.begin() + d, 1);
  return apply1(mk<Reshape>(s), {x}, s, x.dtype(), x.device());
}

Tensor slice_scatter(const Tensor& base, const Tensor& src_in, int64_t dim, int64_t start,
                     int64_t stop, int64_t step) {
  Shape ss = base.shape();
  ss[dim] = stop > start ? (stop - start + step - 1) / step : 0;
  check_same_device(base, src_in, "slice_scatter");
  Tensor src = astype(expand(src_in, ss), base.dtype());
  return apply1(mk<SliceScatter>(dim, start, stop, step), {base, src}, base.shape(), base.dtype(),
                base.device());
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const size_t n = std::max(a.size(), b.size());
  Shape r(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (da != db && da != 1 && db != 1) {
      throw ValueError(std::string("[") + op + "] shapes " + shape_str(a) + " and " + shape_str(b) +
                       " cannot be broadcast (dim " + std::to_string(i) + ": " +
                       std::to_string(da) + " vs " + std::to_string(db) + ")");
    }
    r[i] = da == 1 ? db : da;
  }
  return r;
}

Tensor sum_to(const Tensor& g, const Shape& shape) {
  if (g.shape() == shape) return g;
  const int64_t lead = g.ndim() - static_cast<int64_t>(shape.size());
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < g.ndim(); ++d) {
    if (d < lead || (shape[d - lead] == 1 && g.shape()[d] != 1)) dims.push_back(d);
  }
  Tensor r = dims.empty() ? g : reduce(ReduceOp::Sum, g, dims, true);
  return reshape(r, shape);
}

// ---- elementwise ---------------------------------------------------------------------------
const char* unary_name(UnaryOp op) {
  switch (op) {
    case UnaryOp::Neg:
      return "neg";
    case UnaryOp::Exp:
      return "exp";
    case UnaryOp::Log:
      return "log";
    case UnaryOp::Sqrt:
      return "sqrt";
    case UnaryOp::Rsqrt:
      return "rsqrt";
    case UnaryOp::Tanh:
      return "tanh";
    case UnaryOp::Abs:
      return "abs";
    case UnaryOp::Sigmoid:
      return "sigmoid";
    case UnaryOp::Relu:
      return "relu";
    case UnaryOp::Sin:
      return "sin";
    case UnaryOp::Cos:
      return "cos";
    case UnaryOp::GeluTanh:
      return "gelu_tanh";
    case UnaryOp::GeluErf:
      return "gelu";
    case UnaryOp::Erf:
      return "erf";
    case UnaryOp::LogicalNot:
      return "logical_not";
    case UnaryOp::Sign:
      return "sign";
  }
  return "?";
}

const char* binary_name(BinaryOp op) {
  switch (op) {
    case BinaryOp::Add:
      return "add";
    case BinaryOp::Sub:
      return "sub";
    case BinaryOp::Mul:
      return "mul";
    case BinaryOp::Div:
      return "div";
    case BinaryOp::Pow:
      return "pow";
    case BinaryOp::Maximum:
      return "maximum";
    case BinaryOp::Minimum:
      return "minimum";
    case BinaryOp::FloorDiv:
      return "floor_divide";
    case BinaryOp::Mod:
      return "remainder";
    case BinaryOp::Eq:
      return "eq";
    case BinaryOp::Ne:
      return "ne";
    case BinaryOp::Lt:
      return "lt";
    case BinaryOp::Le:
      return "le";
    case BinaryOp::Gt:
      return "gt";
    case BinaryOp::Ge:
      return "ge";
    case BinaryOp::And:
      return "logical_and";
    case BinaryOp::Or:
      return "logical_or";
  }
  return "?";
}

const char* reduce_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Mean:
      return "mean";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Min:
      return "min";
    case ReduceOp::Var:
      return "var";
  }
  return "?";
}

Tensor unary(UnaryOp op, const Tensor& x) {
  OpScope scope(unary_name(op));
  check_defined(x, unary_name(op));
  DType dt = x.dtype();
  switch (op) {
    case UnaryOp::Neg:
      if (dt == DType::Bool)
        throw TypeError("[neg] is not defined for bool tensors; use logical_not");
      break;
    case UnaryOp::Abs:
    case UnaryOp::Relu:
      if (dt == DType::Bool) {  // (as PyTorch)
        throw TypeError(std::string("[") + unary_name(op) + "] is not defined for bool tensors");
      }
      break;
    case UnaryOp::Sign:
      break;
    case UnaryOp::LogicalNot:
      dt = DType::Bool;
      break;
    default:
      dt = to_floating(dt);
      break;
  }
  Tensor in = op == UnaryOp::LogicalNot
                  ? x
                  : astype(x, op == UnaryOp::Neg || op == UnaryOp::Abs || op == UnaryOp::Relu ||
                                      op == UnaryOp::Sign
                                  ? x.dtype()
                                  : dt);
  return apply1(std::make_shared<Unary>(op), {in}, x.shape(), dt, x.device());
}

Tensor gelu(const Tensor& x, bool tanh_approx) {
  OpScope scope("gelu");
  return unary(tanh_approx ? UnaryOp::GeluTanh : UnaryOp::GeluErf, x);
}

static bool is_compare(BinaryOp op) { return op >= BinaryOp::Eq && op <= BinaryOp::Ge; }

Tensor binary(BinaryOp op, const Tensor& a_in, const Tensor& b_in) {
  OpScope scope(binary_name(op));
  const char* nm = binary_name(op);
  check_defined(a_in, nm);
  check_defined(b_in, nm);
  Tensor a = a_in, b = b_in;
  cpu_scalars_to_device({&a, &b}, nm);  // Note [a 0-d CPU tensor meets a CUDA tensor]
  check_same_device(a, b, nm);
  DType dt = promote_types(a.dtype(), b.dtype());
  if (op == BinaryOp::Div) dt = to_floating(dt);
  if (op == BinaryOp::And || op == BinaryOp::Or) dt = DType::Bool;
  if (op == BinaryOp::Sub && dt == DType::Bool) {
    throw TypeError("[sub] subtraction of bool tensors is not supported; use logical_xor or ^");
  }
  if ((op == BinaryOp::FloorDiv || op == BinaryOp::Mod) && dt == DType::Bool) {
    throw TypeError(std::string("[") + nm +
                    "] is not defined for bool tensors; cast to an integer " + "dtype first");
  }
  const Shape shape = broadcast_shapes(a.shape(), b.shape(), nm);
  const DType out_dt =
      (is_compare(op) || op == BinaryOp::And || op == BinaryOp::Or) ? DType::Bool : dt;
  Tensor a2 = expand(astype(a, dt), shape), b2 = expand(astype(b, dt), shape);
  return apply1(std::make_shared<Binary>(op), {a2, b2}, shape, out_dt, a.device());
}

static DType scalar_dtype(BinaryOp, DType t, int cat) {
  DType dt = promote_with_scalar(t, cat);
  return dt;
}

// The dtype a Python number becomes for op with a tensor: div computes in floating point; a
// comparison (or logical and / or) with an int the tensor's dtype cannot hold (int32 < 2**40,
// uint8 == -1) runs in int64: the true answer, not the wrapped value's.  Arithmetic with one
// raises (full's check).
static DType compare_dtype(BinaryOp op, DType dt, const Scalar& s) {
  if (op == BinaryOp::Div) return to_floating(dt);
  const bool logical = is_compare(op) || op == BinaryOp::And || op == BinaryOp::Or;
  return logical && s.integral() && !scalar_fits(s, dt) ? DType::Int64 : dt;
}

Tensor binary(BinaryOp op, const Tensor& a, Scalar b) {
  OpScope scope(binary_name(op));
  check_defined(a, binary_name(op));
  DType dt = compare_dtype(op, scalar_dtype(op, a.dtype(), b.category), b);
  return binary(op, a, full({}, b, dt, a.device(), binary_name(op)));
}
Tensor binary(BinaryOp op, Scalar a, const Tensor& b) {
  OpScope scope(binary_name(op));
  check_defined(b, binary_name(op));
  DType dt = compare_dtype(op, scalar_dtype(op, b.dtype(), a.category), a);
  return binary(op, full({}, a, dt, b.device(), binary_name(op)), b);
}

Tensor where(const Tensor& cond_in, const Tensor& a_in, const Tensor& b_in) {
  OpScope scope("where");
  if (cond_in.dtype() != DType::Bool) {
    throw TypeError(std::string("[where] condition must be bool, got ") +
                    dtype_name(cond_in.dtype()));
  }
  Tensor cond = cond_in, a = a_in, b = b_in;
  cpu_scalars_to_device({&cond, &a, &b}, "where");  // Note [a 0-d CPU tensor meets a CUDA tensor]
  check_same_device(cond, a, "where");
  check_same_device(a, b, "where");
  const DType dt = promote_types(a.dtype(), b.dtype());
  const Shape s =
      broadcast_shapes(broadcast_shapes(cond.shape(), a.shape(), "where"), b.shape(), "where");
  return apply1(mk<Where>(), {expand(cond, s), expand(astype(a, dt), s), expand(astype(b, dt), s)},
                s, dt, a.device());
}
Tensor where(const Tensor& cond, const Tensor& a, Scalar b) {
  OpScope scope("where");
  return where(cond, a,
               full({}, b, promote_with_scalar(a.dtype(), b.category), a.device(), "where"));
}

// The mask must live on the input's device, a 0-d one too: PyTorch refuses a CPU mask next to a
// CUDA input ("expected self and mask to be on the same device"), unlike a 0-d CPU *value*, which
// both take (Note [a 0-d CPU tensor meets a CUDA tensor]).  One check for both value paths (a
// number here, a 0-d tensor through where() in the bindings, which would otherwise take it).
void check_mask_device(const Tensor& x, const Tensor& mask, const char* op) {
  if (x.device() != mask.device()) {
    throw ValueError(std::string("[") + op + "] mask is on " + mask.device().str() +
                     " but the input is on " + x.device().str() + ": the mask must be on the " +
                     "input's device, a 0-d mask too (as in PyTorch); move it with mask.to(" +
                     "input.device)");
  }
}

Tensor masked_fill(const Tensor& x, const Tensor& mask, Scalar value) {
  OpScope scope("masked_fill");
  check_scalar_fits(value, x.dtype(), "masked_fill", "value");
  if (mask.dtype() != DType::Bool) {
    throw TypeError(std::string("[masked_fill] mask must be bool, got ") +
                    dtype_name(mask.dtype()));
  }
  check_mask_device(x, mask, "masked_fill");
  const Shape s = broadcast_shapes(x.shape(), mask.shape(), "masked_fill");
  if (s != x.shape()) {
    throw ValueError("[masked_fill] mask of shape " + shape_str(mask.shape()) +
                     " does not broadcast to the input's shape " + shape_str(x.shape()));
  }
  return apply1(mk<MaskedFill>(value), {x, expand(mask, s)}, x.shape(), x.dtype(), x.device());
}

static Tensor raw_copy_into(const Tensor& dst, const Tensor& src, const char* op);

// Flat (logical, row-major) positions in `base` of the elements of its view `v`, in v's order.
static Tensor view_positions(const Tensor& base, const Tensor& v, const char* op) {
  auto offsets = [](const Tensor& t) {
    std::vector<int64_t> out(static_cast<size_t>(t.numel()));
    std::vector<int64_t> idx(t.shape().size(), 0);
    for (size_t k = 0; k < out.size(); ++k) {
      int64_t off = t.offset();
      for (size_t d = 0; d < idx.size(); ++d) off += idx[d] * t.strides()[d];
      out[k] = off;
      for (size_t d = idx.size(); d-- > 0;) {
        if (++idx[d] < t.shape()[d]) break;
        idx[d] = 0;
      }
    }
    return out;
  };
  std::unordered_map<int64_t, int64_t> where_in_base;
  const std::vector<int64_t> bo = offsets(base);
  for (size_t k = 0; k < bo.size(); ++k) where_in_base.emplace(bo[k], static_cast<int64_t>(k));
  const std::vector<int64_t> vo = offsets(v);
  Tensor pos = empty({static_cast<int64_t>(vo.size())}, DType::Int64, Device{});
  int64_t* p = pos.data<int64_t>(op);
  for (size_t k = 0; k < vo.size(); ++k) {
    auto it = where_in_base.find(vo[k]);
    if (it == where_in_base.end()) {
      throw RuntimeError(std::string("[") + op + "] the view reaches outside its base tensor");
    }
    p[k] = it->second;
  }
  return base.device().is_cuda() ? to_device(pos, base.device()) : pos;
}

// After `base` took a new history (an in-place op on it or on one of its views), every live view
// of it reads the new values: each gets a gather from the new base as its history, so gradients
// through views made before the change follow the new value (PyTorch regenerates them too).
static void refresh_views(const Tensor& base, const Tensor& skip, const Tensor& skip_pos,
                          const char* op) {
  Tensor flat = reshape(base, {-1});
  std::vector<std::shared_ptr<TensorImpl>> live;
  for (const auto& w : base.impl()->views) {
    if (auto v = w.lock()) live.push_back(std::move(v));
  }
  for (auto& v : live) {
    Tensor vt(v);
    if (vt.same(flat)) continue;
    Tensor vp = skip.defined() && vt.same(skip) ? skip_pos : view_positions(base, vt, op);
    Tensor g = reshape(index_select(flat, 0, vp), vt.shape());
    v->grad_fn = g.grad_fn();
    v->output_nr = g.impl()->output_nr;
    v->requires_grad = true;
  }
}

// In-place change of a view under autograd (PyTorch's CopySlices): the base gets, as its new
// history, "old base with the view's positions replaced by the result" (index_add + where, as
// __setitem__), and the view's history becomes a gather from the new base.  Other views of the
// same base made earlier keep their old history.
static Tensor& inplace_view(Tensor& x, const Tensor& result, const char* op) {
  Tensor base(x.impl()->view_base);
  if (base.requires_grad() && base.is_leaf()) {
    throw RuntimeError(std::string("[") + op +
                       "] a view of a leaf tensor that requires grad is used in an in-place "
                       "operation; wrap it in no_grad() or use the out-of-place op");
  }
  if (base.is_symbolic()) {
    throw NotImplementedError(std::string("[") + op +
                              "] in-place change of a view under autograd inside capture is not "
                              "supported; use the out-of-place op");
  }
  Tensor pos = view_positions(base, x, op);
  Tensor r = astype(expand(result, x.shape()), x.dtype());
  Tensor rf = reshape(contiguous(r), {-1});
  const int64_t n = base.numel();
  Tensor placed = index_add(zeros({n}, base.dtype(), base.device()), 0, pos, rf);
  Tensor hits = index_add(zeros({n}, DType::Int64, base.device()), 0, pos, ones_like(pos));
  Tensor mask = reshape(binary(BinaryOp::Gt, hits, Scalar{0, 1}), base.shape());
  // where() saves its inputs; the write below must not change the old base it saved.
  Tensor nb = where(mask, reshape(placed, base.shape()), clone(base));
  inplace(base, nb, op);  // the base is no view: it takes nb's history
  if (grad_enabled() && base.requires_grad()) refresh_views(base, x, pos, op);
  return x;
}

// Note [fill_ without an allocation]: a compiled or CUDA-graph-replayed training step writes its
// scalars (learning rate, step count) with fill_ before each step and must make no allocator call
// in its steady state.  inplace() needs the value as a tensor (a 0-d full: one allocation each);
// for the common case (contiguous, no history to record, not captured) the Full kernel writes x
// directly: the same value.as<T>() rounding, so the same bits.  Anything else takes inplace().
Tensor& fill_(Tensor& x, Scalar v, const char* op) {
  OpScope scope(op);
  check_defined(x, op);
  const bool direct = !active_graph() && !x.is_symbolic() && x.numel() > 0 && x.is_contiguous() &&
                      !(grad_enabled() && x.requires_grad());
  if (!direct) return inplace(x, full({}, v, x.dtype(), x.device(), op), op);
  check_writable(x, op);
  check_scalar_fits(v, x.dtype(), op, "value");
  std::vector<Tensor> out{x};
  Full f(v);
  if (x.device().is_cuda()) {
#ifdef BT_WITH_CUDA
    f.eval_gpu({}, out);
#else
    backend::no_cuda_kernel(op);
#endif
  } else {
    f.eval_cpu({}, out);
  }
  x.bump_version();
  return x;
}

Tensor& inplace(Tensor& x, const Tensor& result, const char* op) {
  OpScope scope(op);
  check_defined(x, op);
  check_writable(x, op);
  for (int64_t d = 0; d < x.ndim() && x.numel() > 0; ++d) {  // an expand()ed view: one element
    if (x.strides()[d] == 0 && x.shape()[d] > 1) {           // per several places
      throw RuntimeError(std::string("[") + op + "] the tensor of shape " + shape_str(x.shape()) +
                         " has elements that share memory (dim " + std::to_string(d) +
                         " has stride 0, as after expand()); clone() it " +
                         "before changing it in place");
    }
  }
  if (broadcast_shapes(x.shape(), result.shape(), op) != x.shape()) {
    throw ValueError(std::string("[") + op + "] the result of shape " + shape_str(result.shape()) +
                     " does not fit the tensor of shape " + shape_str(x.shape()) +
                     " being modified in place");
  }
  const bool track = grad_enabled() && (result.requires_grad() || x.requires_grad());
  if (track && x.requires_grad() && x.is_leaf()) {
    throw RuntimeError(std::string("[") + op +
                       "] a leaf tensor that requires grad is used in an "
                       "in-place operation; wrap it in no_grad() or use the out-of-place op");
  }
  if (track && x.impl()->view_base) return inplace_view(x, result, op);
  if (track && x.impl()->view_of_grad) {
    throw NotImplementedError(std::string("[") + op +
                              "] in-place change of a view of a tensor that requires grad inside "
                              "capture is not supported; use the out-of-place op");
  }
  Tensor r = astype(expand(result, x.shape()), x.dtype());
  // A result that views x's memory in another layout (a.copy_(a.T), t[1:] = t[:-1]) is read whole
  // before the first write, as PyTorch's copy does; the same view is a plain copy onto itself.
  if (r.storage() && r.storage() == x.storage() &&
      (r.offset() != x.offset() || r.strides() != x.strides() || r.shape() != x.shape())) {
    r = clone(r);
  }
  if (Graph* g = active_graph()) {
    g->record_copy(x, r);
  } else {
    raw_copy_into(x, r, op);
  }
  x.bump_version();
  if (grad_enabled()) {
    if (r.requires_grad()) {
      // x now holds r's value: it takes over r's history (an alias node if r is a leaf).
      if (!r.grad_fn()) r = apply1(mk<Reshape>(r.shape()), {r}, r.shape(), r.dtype(), r.device());
      x.impl()->grad_fn = r.grad_fn();
      x.impl()->output_nr = r.impl()->output_nr;
      x.impl()->requires_grad = true;
    } else if (x.grad_fn()) {
      x.impl()->grad_fn = nullptr;  // the new value does not depend on anything that needs grad
      x.impl()->requires_grad = false;
    }
    // Views taken from x before this change now read the new value (x is a base here: views
    // of views are registered on their root, and an in-place change of a view went above).
    if (x.requires_grad() && !x.impl()->views.empty() && !x.is_symbolic()) {
      refresh_views(x, Tensor(), Tensor(), op);
    }
  }
  return x;
}

Tensor& copy_(Tensor& dst, const Tensor& src) {
  OpScope scope("copy_");
  // Across devices too (as PyTorch): the source moves first, then casts on the destination.
  Tensor s = src.device() == dst.device() ? src : to_device(src, dst.device());
  return inplace(dst, astype(s, dst.dtype()), "copy_");
}

// ---- reductions ----------------------------------------------------------------------------
Tensor reduce(ReduceOp op, const Tensor& x, std::vector<int64_t> dims, bool keepdim,
              double correction) {
  OpScope scope(reduce_name(op));
  const char* nm = reduce_name(op);
  check_defined(x, nm);
  if (dims.empty()) {
    dims.resize(x.ndim());
    std::iota(dims.begin(), dims.end(), 0);
  }
  for (auto& d : dims) d = wrap_dim(d, x.ndim(), nm);
  std::sort(dims.begin(), dims.end());
  if (std::adjacent_find(dims.begin(), dims.end()) != dims.end()) {
    throw ValueError(std::string("[") + nm + "] a dim appears more than once");
  }
  if (x.ndim() == 0) dims.clear();
  Shape out;
  for (int64_t d = 0, j = 0; d < x.ndim(); ++d) {
    const bool red = j < static_cast<int64_t>(dims.size()) && dims[j] == d;
    if (red) {
      ++j;
      if ((op == ReduceOp::Max || op == ReduceOp::Min) && x.shape()[d] == 0) {
        throw ValueError(std::string("[") + nm + "] cannot reduce over dim " + std::to_string(d) +
                         " of size 0 (shape " + shape_str(x.shape()) + ")");
      }
      if (keepdim) out.push_back(1);
    } else {
      out.push_back(x.shape()[d]);
    }
  }
  DType dt = x.dtype();
  Tensor in = x;
  if (op == ReduceOp::Sum && !is_floating(dt)) dt = DType::Int64;
  if (op == ReduceOp::Mean || op == ReduceOp::Var) {
    dt = to_floating(dt);
    in = astype(x, dt);
  }
  return apply1(std::make_shared<Reduce>(op, dims, keepdim, correction), {in}, out, dt, x.device());
}

Tensor argreduce(bool is_max, const Tensor& x, std::optional<int64_t> dim, bool keepdim) {
  OpScope scope(is_max ? "argmax" : "argmin");
  const char* nm = is_max ? "argmax" : "argmin";
  check_defined(x, nm);
  if (x.dtype() == DType::Bool) {  // (as PyTorch)
    throw TypeError(std::string("[") + nm + "] is not defined for bool tensors; cast it first");
  }
  if (!dim) {
    if (x.numel() == 0) {
      throw ValueError(std::string("[") + nm + "] got an empty tensor (shape " +
                       shape_str(x.shape()) + "): give a dim of nonzero size");
    }
    Tensor f = reshape(x, {-1});
    Tensor r = argreduce(is_max, f, 0, false);
    return keepdim ? reshape(r, Shape(x.ndim(), 1)) : r;
  }
  const int64_t d = wrap_dim(*dim, x.ndim(), nm);  // a 0-d tensor takes -1 or 0
  if (x.ndim() == 0) return zeros({}, DType::Int64, x.device());
  if (x.shape()[d] == 0) {
    throw ValueError(std::string("[") + nm + "] cannot reduce over dim " + std::to_string(d) +
                     " of size 0 (shape " + shape_str(x.shape()) + ")");
  }
  Shape s = x.shape();
  if (keepdim) {
    s[d] = 1;
  } else {
    s.erase(s.begin() + d);
  }
  return apply1(mk<ArgReduce>(is_max, d, keepdim), {x}, s, DType::Int64, x.device());
}

// ---- indexing, joining ---------------------------------------------------------------------
static void check_index_tensor(const Tensor& idx, const char* op) {
  if (idx.dtype() != DType::Int64 && idx.dtype() != DType::Int32) {
    throw TypeError(std::string("[") + op + "] index must be int32 or int64, got " +
                    dtype_name(idx.dtype()));
  }
}

static Tensor index_select_op(const Tensor& x, int64_t dim, const Tensor& index, bool embedding) {
  OpScope scope(embedding ? "embedding" : "index_select");
  const char* op = embedding ? "embedding" : "index_select";
  check_defined(x, op);
  check_defined(index, op);
  check_index_tensor(index, op);
  check_same_device(x, index, op);
  if (index.ndim() > 1)
    throw ValueError(std::string("[") + op + "] index must be 1-D, got shape " +
                     shape_str(index.shape()));
  dim = wrap_shape_dim(dim, x.ndim(), op);
  Shape s = x.shape();
  s[dim] = index.numel();
  return apply1(mk<IndexSelect>(dim, embedding), {x, reshape(index, {-1})}, s, x.dtype(),
                x.device());
}

Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  return index_select_op(x, dim, index, false);
}

// out= form: the same kernel writing given memory (a compiled program's planned buffer), so a
// steady-state step allocates nothing. No autograd and no capture: the result is plain data.
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& out,
                    bool embedding) {
  const char* op = embedding ? "embedding" : "index_select";
  OpScope scope(op);
  check_defined(x, op);
  check_defined(index, op);
  check_defined(out, op);
  check_index_tensor(index, op);
  check_same_device(x, index, op);
  check_same_device(x, out, op);
  if (index.ndim() > 1)
    throw ValueError(std::string("[") + op + "] index must be 1-D, got shape " +
                     shape_str(index.shape()));
  if (active_graph())
    throw RuntimeError(std::string("[") + op + "] out= is not recorded by a capture");
  if (grad_enabled() && x.requires_grad()) {
    throw RuntimeError(std::string("[") + op +
                       "] out= records no gradient but the input requires grad: call it under "
                       "bt.no_grad()");
  }
  dim = wrap_shape_dim(dim, x.ndim(), op);
  Shape s = x.shape();
  s[dim] = index.numel();
  if (out.shape() != s || out.dtype() != x.dtype() || !out.is_contiguous()) {
    throw ValueError(std::string("[") + op + "] out must be a contiguous " + dtype_name(x.dtype()) +
                     " tensor of shape " + shape_str(s) + ", got " + dtype_name(out.dtype()) + " " +
                     shape_str(out.shape()) +
                     (out.is_contiguous() ? std::string() : std::string(" (not contiguous)")));
  }
  if (out.storage() == x.storage() || out.storage() == index.storage()) {
    throw ValueError(std::string("[") + op + "] out shares memory with the input or the index");
  }
  check_writable(out, op);
  IndexSelect prim(dim, embedding);
  std::vector<Tensor> in{x, reshape(index, {-1})};
  std::vector<Tensor> res{out};
  if (out.device().is_cuda()) {  // the launch index_select makes, on the current stream
    prim.eval_gpu(in, res);
  } else {
    prim.eval_cpu(in, res);
  }
  res[0].bump_version();
  return out;
}

Tensor index_add(const Tensor& base, int64_t dim, const Tensor& index, const Tensor& src,
                 bool over_base) {
  OpScope scope("index_add");
  check_index_tensor(index, "index_add");
  dim = wrap_shape_dim(dim, base.ndim(), "index_add");
  Shape s = base.shape();
  s[dim] = index.numel();
  if (src.shape() != s) {
    throw ValueError("[index_add] source has shape " + shape_str(src.shape()) + ", expected " +
                     shape_str(s));
  }
  return apply1(mk<IndexAdd>(dim, over_base),
                {base, reshape(index, {-1}), astype(src, base.dtype())}, base.shape(), base.dtype(),
                base.device());
}

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) {
  OpScope scope("gather");
  check_index_tensor(index, "gather");
  check_same_device(x, index, "gather");
  dim = wrap_shape_dim(dim, x.ndim(), "gather");
  if (index.ndim() != x.ndim()) {
    throw ValueError("[gather] index has " + std::to_string(index.ndim()) + " dims but input has " +
                     std::to_string(x.ndim()));
  }
  for (int64_t d = 0; d < x.ndim(); ++d) {
    if (d != dim && index.shape()[d] > x.shape()[d]) {
      throw ValueError("[gather] index shape " + shape_str(index.shape()) +
                       " is larger than input shape " + shape_str(x.shape()) + " at dim " +
                       std::to_string(d));
    }
  }
  return apply1(mk<Gather>(dim), {x, index}, index.shape(), x.dtype(), x.device());
}

Tensor scatter_add(const Tensor& base, int64_t dim, const Tensor& index, const Tensor& src) {
  OpScope scope("scatter_add");
  check_index_tensor(index, "scatter_add");
  dim = wrap_shape_dim(dim, base.ndim(), "scatter_add");
  if (src.shape() != index.shape()) {
    throw ValueError("[scatter_add] src shape " + shape_str(src.shape()) +
                     " must equal index shape " + shape_str(index.shape()));
  }
  // index[i][j]... addresses base at the same position outside dim: it must fit there
  if (index.ndim() != base.ndim()) {
    throw ValueError("[scatter_add] index has " + std::to_string(index.ndim()) +
                     " dims but the input has " + std::to_string(base.ndim()));
  }
  for (int64_t d = 0; d < base.ndim(); ++d) {
    if (d != dim && index.shape()[d] > base.shape()[d]) {
      throw ValueError("[scatter_add] index shape " + shape_str(index.shape()) +
                       " is larger than input shape " + shape_str(base.shape()) + " at dim " +
                       std::to_string(d));
    }
  }
  // no position exists along an empty dim: any index is out of range (the kernels, which skip an
  // empty base, would never look at it)
  if (base.ndim() && base.shape()[dim] == 0 && index.numel() > 0) {
    throw IndexError("[scatter_add] index is out of range for a dim of size 0 (dim " +
                     std::to_string(dim) + ")");
  }
  return apply1(mk<ScatterAdd>(dim), {base, index, astype(src, base.dtype())}, base.shape(),
                base.dtype(), base.device());
}

Tensor cat(const std::vector<Tensor>& xs, int64_t dim) {
  OpScope scope("cat");
  if (xs.empty()) throw ValueError("[cat] expected a non-empty list of tensors");
  const Tensor& f = xs[0];
  if (f.ndim() == 0) throw ValueError("[cat] zero-dimensional tensors cannot be concatenated");
  dim = wrap_dim(dim, f.ndim(), "cat");
  DType dt = f.dtype();
  Shape s = f.shape();
  s[dim] = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const Tensor& t = xs[i];
    check_same_device(f, t, "cat");
    if (t.ndim() != f.ndim()) {
      throw ValueError("[cat] tensor " + std::to_string(i) + " has " + std::to_string(t.ndim()) +
                       " dims, expected " + std::to_string(f.ndim()));
    }
    for (int64_t d = 0; d < f.ndim(); ++d) {
      if (d != dim && t.shape()[d] != f.shape()[d]) {
        throw ValueError("[cat] tensor " + std::to_string(i) + " has shape " +
                         shape_str(t.shape()) + ", which differs from " + shape_str(f.shape()) +
                         " outside dim " + std::to_string(dim));
      }
    }
    dt = promote_types(dt, t.dtype());
    s[dim] += t.shape()[dim];
  }
  std::vector<Tensor> in;
  for (auto& t : xs) in.push_back(astype(t, dt));
  return apply1(mk<Concatenate>(dim), in, s, dt, f.device());
}

Tensor stack(const std::vector<Tensor>& xs, int64_t dim) {
  OpScope scope("stack");
  if (xs.empty()) throw ValueError("[stack] expected a non-empty list of tensors");
  dim = wrap_dim(dim, xs[0].ndim() + 1, "stack");
  std::vector<Tensor> u;
  for (size_t i = 0; i < xs.size(); ++i) {
    if (xs[i].shape() != xs[0].shape()) {
      throw ValueError("[stack] tensor " + std::to_string(i) + " has shape " +
                       shape_str(xs[i].shape()) + ", expected " + shape_str(xs[0].shape()));
    }
    u.push_back(unsqueeze(xs[i], dim));
  }
  return cat(u, dim);
}

Tensor embedding(const Tensor& weight, const Tensor& index) {
  OpScope scope("embedding");
  if (weight.ndim() != 2) {
    throw ValueError("[embedding] weight must be 2-D (num_embeddings, dim), got " +
                     shape_str(weight.shape()));
  }
  check_index_tensor(index, "embedding");
  check_same_device(weight, index, "embedding");
  Shape s = index.shape();
  s.push_back(weight.shape()[1]);
  return reshape(index_select_op(weight, 0, reshape(index, {-1}), true), s);
}

// x[mask] (PyTorch's rule): mask's shape must equal x's leading dims; the result holds the
// selected positions of those dims, in order, followed by x's remaining dims.  A 0-d mask adds a
// dim of size 1 (True) or 0 (False).  No broadcasting: a mismatched mask is an IndexError.
Tensor masked_select_bool(const Tensor& x_in, const Tensor& mask_in) {
  OpScope scope("getitem");
  if (mask_in.dtype() != DType::Bool) throw TypeError("[getitem] a mask index must be bool");
  if (active_graph()) {
    throw NotImplementedError(
        "[getitem] boolean-mask indexing has a data-dependent shape and "
        "cannot be captured");
  }
  check_same_device(x_in, mask_in, "getitem");
  const Tensor x = mask_in.ndim() == 0 ? unsqueeze(x_in, 0) : x_in;
  const Tensor mask = mask_in.ndim() == 0 ? reshape(mask_in, {1}) : mask_in;
  const int64_t k = mask.ndim();
  if (k > x.ndim()) {
    throw IndexError("[getitem] a mask of " + std::to_string(k) + " dims " +
                     shape_str(mask.shape()) + " indexes a tensor of only " +
                     std::to_string(x.ndim()) + " dims " + shape_str(x.shape()));
  }
  for (int64_t d = 0; d < k; ++d) {
    if (mask.shape()[d] != x.shape()[d]) {
      throw IndexError("[getitem] the mask of shape " + shape_str(mask.shape()) +
                       " does not match the indexed tensor's shape " + shape_str(x.shape()) +
                       " at dim " + std::to_string(d) + " (" + std::to_string(mask.shape()[d]) +
                       " vs " + std::to_string(x.shape()[d]) + ")");
    }
  }
  Tensor m = contiguous(mask);
  if (m.device().is_cuda()) m = to_device(m, Device());
  const bool* p = static_cast<const bool*>(m.data_ptr("getitem"));
  std::vector<int64_t> idx;
  for (int64_t i = 0; i < m.numel(); ++i) {
    if (p[i]) idx.push_back(i);
  }
  Tensor it = empty_tensor({static_cast<int64_t>(idx.size())}, DType::Int64, Device(), "getitem");
  std::copy(idx.begin(), idx.end(), static_cast<int64_t*>(it.data_ptr("getitem")));
  Shape rows{m.numel()};
  rows.insert(rows.end(), x.shape().begin() + k, x.shape().end());
  return index_select(reshape(x, rows), 0, to_device(it, x.device()));
}

// ---- neural-network ops --------------------------------------------------------------------
Tensor softmax(const Tensor& x_in, int64_t dim, bool log) {
  OpScope scope(log ? "log_softmax" : "softmax");
  const char* nm = log ? "log_softmax" : "softmax";
  if (!is_floating(x_in.dtype())) {  // (as PyTorch: no silent float32 for an integer input)
    throw TypeError(std::string("[") + nm + "] expects a floating input, got " +
                    dtype_name(x_in.dtype()) + "; cast it first (e.g. x.float())");
  }
  const Tensor& x = x_in;
  if (x.ndim() == 0) {
    wrap_dim(dim, 0, nm);  // -1 or 0
    return reshape(softmax(reshape(x, {1}), 0, log), {});
  }
  dim = wrap_dim(dim, x.ndim(), nm);
  const int64_t last = x.ndim() - 1;
  Tensor xt = dim == last ? x : transpose(x, dim, last);
  Tensor y = apply1(std::make_shared<Softmax>(-1, log), {xt}, xt.shape(), xt.dtype(), x.device());
  return dim == last ? y : transpose(y, dim, last);
}

Tensor layer_norm(const Tensor& x, const Shape& ns, const Tensor& weight, const Tensor& bias,
                  double eps, bool recompute, std::optional<DType> out_dtype) {
  OpScope scope("layer_norm");
  if (!is_floating(x.dtype()))
    throw TypeError(std::string("[layer_norm] expects a floating input, got ") +
                    dtype_name(x.dtype()));
  if (out_dtype && !is_floating(*out_dtype)) {
    throw TypeError(std::string("[layer_norm] out_dtype must be a floating dtype, got ") +
                    dtype_name(*out_dtype));
  }
  const DType odt = out_dtype.value_or(x.dtype());
  if (odt != x.dtype() && !is_mixed_norm(x.dtype(), odt)) {
    return astype(layer_norm(x, ns, weight, bias, eps, recompute), odt);
  }
  const int64_t k = static_cast<int64_t>(ns.size());
  if (k == 0 || k > x.ndim() || !std::equal(ns.begin(), ns.end(), x.shape().end() - k)) {
    throw ValueError("[layer_norm] normalized_shape " + shape_str(ns) +
                     " does not match the last dims of the input's shape " + shape_str(x.shape()));
  }
  const int64_t C = shape_numel(ns);
  for (const Tensor* p : {&weight, &bias}) {
    if (p->defined() && p->shape() != ns) {
      throw ValueError("[layer_norm] weight and bias must have shape " + shape_str(ns) + ", got " +
                       shape_str(p->shape()));
    }
    if (p->defined()) check_same_device(x, *p, "layer_norm");
  }
  Shape rows(x.shape().begin(), x.shape().end() - k);
  Shape x2s = rows;
  x2s.push_back(C);
  Tensor x2 = reshape(x, x2s);
  const DType sd = x.dtype() == DType::Float64 ? DType::Float64 : DType::Float32;
  std::vector<Tensor> in{x2, weight.defined() ? reshape(astype(weight, x.dtype()), {C}) : Tensor(),
                         bias.defined() ? reshape(astype(bias, x.dtype()), {C}) : Tensor()};
  // y in odt: x's dtype, or 16-bit over a float32 x (weight and bias float32, as x)
  const std::vector<std::pair<Shape, DType>> meta{{x2s, odt}, {rows, sd}, {rows, sd}};
  auto prim = std::make_shared<LayerNorm>(eps, weight.defined(), bias.defined());
  auto outs = apply(prim, in, meta, x.device());
  if (recompute && grad_enabled() && outs[0].requires_grad()) {
    const Device dev = x.device();
    mark_recompute(outs[0], "layer_norm", in, [prim, meta, dev](const std::vector<Tensor>& ins) {
      return apply(prim, ins, meta, dev)[0];
    });
  }
  return reshape(outs[0], x.shape());
}

// Padded classes: when `logits` (N, C) is X[:, :C] of a dense (N, Cx) tensor X (GPT-2's head,
// (B*T, 50304) with 50257 classes) whose gradient reaches X through views only, returns X viewed
// as (N, Cx), else an undefined tensor.  The loss then runs on X with num_classes = C, and its
// backward writes X's padded gradient in one pass instead of a dense (N, C) one that the narrow's
// backward scatters into a zero-filled (N, Cx) buffer.
static Tensor cross_entropy_padded_base(const Tensor& logits) {
  if (!grad_enabled() || !logits.requires_grad() || logits.is_symbolic()) return {};
  const auto& bimpl = logits.impl()->view_base;
  if (!bimpl) return {};
  Tensor base(bimpl);
  const int64_t N = logits.shape()[0], C = logits.shape()[1], ld = logits.strides()[0];
  if (N < 1 || C < 1 || logits.strides()[1] != 1 || ld <= C) return {};
  if (base.storage() != logits.storage() || base.dtype() != logits.dtype() ||
      base.offset() != logits.offset() || base.ndim() < 1 || !base.is_contiguous() ||
      base.shape().back() != ld || base.numel() != N * ld) {
    return {};
  }
  if (!grad_flows_through_views(logits, base)) return {};
  return reshape(base, {N, ld});
}

// loss_dtype: the loss's dtype (default: the logits'); e.g. float32 for bf16 logits, so the
// mean over 16K rows is not rounded to bf16 (the kernels accumulate in float/double either way).
Tensor cross_entropy(const Tensor& logits, const Tensor& target_in, int64_t ignore_index,
                     const std::string& reduction, double label_smoothing,
                     std::optional<DType> loss_dtype) {
  OpScope scope("cross_entropy");
  if (!is_floating(logits.dtype())) {
    throw TypeError(std::string("[cross_entropy] logits must be floating, got ") +
                    dtype_name(logits.dtype()));
  }
  if (logits.ndim() < 2) {
    throw ValueError("[cross_entropy] logits must be (N, C) or (N, C, d1, ...), got " +
                     shape_str(logits.shape()));
  }
  check_index_tensor(target_in, "cross_entropy");
  check_same_device(logits, target_in, "cross_entropy");
  if (logits.ndim() > 2) {
    // PyTorch layout: the class dim is dim 1. Move it last and flatten to (N*d1*..., C); the
    // permute and reshapes record their own vjps, and 'mean' over the flat rows equals PyTorch's
    // mean over all non-ignored positions.
    Shape tshape = logits.shape();
    tshape.erase(tshape.begin() + 1);
    if (target_in.shape() != tshape) {
      throw ValueError("[cross_entropy] target has shape " + shape_str(target_in.shape()) +
                       ", expected " + shape_str(tshape) + " for logits " +
                       shape_str(logits.shape()));
    }
    const int64_t nd = logits.ndim();
    std::vector<int64_t> perm{0};
    for (int64_t d = 2; d < nd; ++d) perm.push_back(d);
    perm.push_back(1);
    int64_t rows = 1;
    for (int64_t v : tshape) rows *= v;
    const int64_t C = logits.shape()[1];
    Tensor flat = reshape(permute(logits, perm), {rows, C});
    Tensor loss = cross_entropy(flat, reshape(target_in, {rows}), ignore_index, reduction,
                                label_smoothing, loss_dtype);
    return reduction == "none" ? reshape(loss, tshape) : loss;
  }
  const int64_t N = logits.shape()[0];
  if (target_in.shape() != Shape{N}) {
    throw ValueError("[cross_entropy] target has shape " + shape_str(target_in.shape()) +
                     ", expected (" + std::to_string(N) + ",) for logits " +
                     shape_str(logits.shape()));
  }
  int r;
  if (reduction == "none") {
    r = 0;
  } else if (reduction == "mean") {
    r = 1;
  } else if (reduction == "sum") {
    r = 2;
  } else {
    throw ValueError("[cross_entropy] reduction must be 'none', 'mean' or 'sum', got '" +
                     reduction + "'");
  }
  if (!(label_smoothing >= 0 && label_smoothing <= 1)) {  // NaN too
    throw ValueError("[cross_entropy] label_smoothing must be in [0, 1], got " +
                     scalar_str(Scalar::floating(label_smoothing)));
  }
  const DType sd = logits.dtype() == DType::Float64 ? DType::Float64 : DType::Float32;
  const DType ld = loss_dtype.value_or(logits.dtype());
  if (!is_floating(ld)) {
    throw TypeError(std::string("[cross_entropy] loss_dtype must be floating, got ") +
                    dtype_name(ld));
  }
  Tensor target = astype(target_in, DType::Int64);
  Tensor x = cross_entropy_padded_base(logits);
  const int64_t nc = x.defined() ? logits.shape()[1] : -1;
  if (!x.defined()) x = logits;  // strided rows are read in place (no copy)
  auto outs = apply(std::make_shared<CrossEntropy>(ignore_index, r, label_smoothing, nc),
                    {x, target}, {{r == 0 ? Shape{N} : Shape{}, ld}, {{N}, sd}}, logits.device());
  return outs[0];
}

Tensor dropout(const Tensor& x, double p, bool training) {
  OpScope scope("dropout");
  if (!(p >= 0 && p <= 1))  // NaN too
    throw ValueError("[dropout] p must be in [0, 1], got " + std::to_string(p));
  if (!is_floating(x.dtype()))
    throw TypeError(std::string("[dropout] expects a floating input, got ") +
                    dtype_name(x.dtype()));
  if (!training || p == 0) return x;
  if (p == 1) return mul(x, 0.0);
  auto [seed, off] = next_philox(philox::counters_needed(static_cast<uint64_t>(x.numel()), false));
  return apply1(std::make_shared<Dropout>(p, seed, off), {x}, x.shape(), x.dtype(), x.device());
}

// Operands the GEMM can read in place: unit stride along one of the last two dims.
static Tensor gemm_ready(const Tensor& t) {
  const int64_t nd = t.ndim();
  const int64_t r = t.shape()[nd - 2], c = t.shape()[nd - 1];
  const int64_t rs = t.strides()[nd - 2], cs = t.strides()[nd - 1];
  const bool n_ok = (c == 1 || cs == 1) && (r == 1 || rs >= c);
  const bool t_ok = (r == 1 || rs == 1) && (c == 1 || cs >= r);
  bool batch_ok = true;
  if (nd == 3 && t.shape()[0] > 1) {
    batch_ok = t.strides()[0] >= r * c || t.strides()[0] == 0;
  }
  return (n_ok || t_ok) && batch_ok ? t : contiguous(t);
}

static DType matmul_dtype(const Tensor& a, const Tensor& b, const char* op) {
  check_same_device(a, b, op);
  const DType dt = promote_types(a.dtype(), b.dtype());
  if (!is_floating(dt)) {
    throw TypeError(std::string("[") + op + "] expects floating tensors, got " +
                    dtype_name(a.dtype()) + " and " + dtype_name(b.dtype()));
  }
  return dt;
}

Tensor matmul(const Tensor& a_in, const Tensor& b_in) {
  OpScope scope("matmul");
  check_defined(a_in, "matmul");
  check_defined(b_in, "matmul");
  if (a_in.ndim() == 0 || b_in.ndim() == 0) {
    throw ValueError("[matmul] both arguments need at least 1 dim, got shapes " +
                     shape_str(a_in.shape()) + " and " + shape_str(b_in.shape()));
  }
  const DType dt = matmul_dtype(a_in, b_in, "matmul");
  Tensor a = astype(a_in, dt), b = astype(b_in, dt);
  const bool a1 = a.ndim() == 1, b1 = b.ndim() == 1;
  if (a1) a = unsqueeze(a, 0);
  if (b1) b = unsqueeze(b, -1);
  const int64_t m = a.shape()[a.ndim() - 2], k = a.shape().back();
  const int64_t k2 = b.shape()[b.ndim() - 2], n = b.shape().back();
  if (k != k2) {
    throw ValueError("[matmul] shapes " + shape_str(a_in.shape()) + " and " +
                     shape_str(b_in.shape()) + " do not align on k (" + std::to_string(k) + " vs " +
                     std::to_string(k2) + ")");
  }
  // An operand expanded along k (stride 0: constant over k) would be copied whole by the GEMM's
  // layout check (ones(1).expand(2**40) @ v): the product is its k-slice times the other's sum
  // over k instead (K times its slice when that one is expanded too).
  // (Not under autograd for an operand that needs a gradient: an expanded leaf's elements each
  // have their own, which the k-slice would give to the first alone.)
  const bool ak0 = a.strides().back() == 0, bk0 = b.strides()[b.ndim() - 2] == 0;
  const bool tracked = grad_enabled() && (a.requires_grad() || b.requires_grad());
  if (k > 1 && (ak0 || bk0) && !tracked) {
    Tensor r;
    if (ak0) {
      Tensor bs = bk0 ? mul(narrow(b, -2, 0, 1), static_cast<double>(k)) : sum(b, {-2}, true);
      r = matmul(narrow(a, -1, 0, 1), bs);
    } else {
      r = matmul(sum(a, {-1}, true), narrow(b, -2, 0, 1));
    }
    if (a1) r = squeeze(r, r.ndim() - 2);
    if (b1) r = squeeze(r, -1);
    return r;
  }
  Tensor out;
  if (a.ndim() == 2 && b.ndim() == 2) {
    out =
        apply1(std::make_shared<Matmul>(), {gemm_ready(a), gemm_ready(b)}, {m, n}, dt, a.device());
  } else if (b.ndim() == 2) {
    Shape lead(a.shape().begin(), a.shape().end() - 2);
    Tensor a2 = as_rows(a);
    Tensor o2 = apply1(std::make_shared<Matmul>(), {gemm_ready(a2), gemm_ready(b)},
                       {a2.shape()[0], n}, dt, a.device());
    lead.push_back(m);
    lead.push_back(n);
    out = reshape(o2, lead);
  } else {
    Shape ba(a.shape().begin(), a.shape().end() - 2), bb(b.shape().begin(), b.shape().end() - 2);
    Shape batch = broadcast_shapes(ba, bb, "matmul");
    const int64_t B = shape_numel(batch);
    auto as3 = [&](const Tensor& t, int64_t r, int64_t c) {
      if (t.ndim() == 2) return t;  // shared by every batch item (batch stride 0)
      Shape full_s = batch;
      full_s.push_back(r);
      full_s.push_back(c);
      return reshape(expand(t, full_s), {B, r, c});
    };
    Tensor a3 = as3(a, m, k), b3 = as3(b, k, n);
    Tensor o3 = apply1(std::make_shared<Matmul>(), {gemm_ready(a3), gemm_ready(b3)}, {B, m, n}, dt,
                       a.device());
    Shape os = batch;
    os.push_back(m);
    os.push_back(n);
    out = reshape(o3, os);
  }
  if (a1) out = squeeze(out, out.ndim() - 2);
  if (b1) out = squeeze(out, -1);
  return out;
}

Tensor bmm(const Tensor& a, const Tensor& b) {
  OpScope scope("bmm");
  if (a.ndim() != 3 || b.ndim() != 3) {
    throw ValueError("[bmm] expects 3-D tensors, got shapes " + shape_str(a.shape()) + " and " +
                     shape_str(b.shape()));
  }
  if (a.shape()[0] != b.shape()[0]) {
    throw ValueError("[bmm] batch sizes differ: " + shape_str(a.shape()) + " and " +
                     shape_str(b.shape()));
  }
  if (a.shape()[2] != b.shape()[1]) {
    throw ValueError("[bmm] shapes " + shape_str(a.shape()) + " and " + shape_str(b.shape()) +
                     " do not align on k (" + std::to_string(a.shape()[2]) + " vs " +
                     std::to_string(b.shape()[1]) + ")");
  }
  return matmul(a, b);
}

Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b) {
  OpScope scope("linear");
  check_defined(x, "linear");
  if (w.ndim() != 2)
    throw ValueError("[linear] weight must be 2-D (out, in), got " + shape_str(w.shape()));
  if (x.ndim() == 0 || x.shape().back() != w.shape()[1]) {
    throw ValueError("[linear] input of shape " + shape_str(x.shape()) + " has " +
                     (x.ndim() ? std::to_string(x.shape().back()) : std::string("no")) +
                     " features but weight " + shape_str(w.shape()) + " expects " +
                     std::to_string(w.shape()[1]));
  }
  if (b.defined() && b.shape() != Shape{w.shape()[0]}) {
    throw ValueError("[linear] bias has shape " + shape_str(b.shape()) + ", expected (" +
                     std::to_string(w.shape()[0]) + ",)");
  }
  DType dt = matmul_dtype(x, w, "linear");
  if (b.defined()) check_same_device(x, b, "linear");
  const int64_t in = w.shape()[1], outf = w.shape()[0];
  Tensor x2 = gemm_ready(as_rows(astype(x, dt)));
  std::vector<Tensor> ins{x2, gemm_ready(astype(w, dt))};
  if (b.defined()) ins.push_back(astype(b, dt));
  Tensor y = apply1(std::make_shared<Matmul>(true, b.defined()), ins, {x2.shape()[0], outf}, dt,
                    x.device());
  Shape os(x.shape().begin(), x.shape().end() - 1);
  os.push_back(outf);
  return reshape(y, os);
}

// Whether scaled_dot_product_attention's fused kernels take q's dtype, head dim and device, and
// the scale (they take the row max of S before scaling: a positive, finite scale only).
static bool fused_attention_applies(DType dt, int64_t hd, Device dev, double sc) {
  const bool cuda_ok = dt == DType::BFloat16 || dt == DType::Float16 ||
                       (dt == DType::Float32 && (hd == 64 || hd == 128));
  return std::isfinite(sc) && sc > 0 && (dev.is_cuda() ? cuda_ok : flash_attention_cpu());
}

// The fused CPU kernel on any q (..., L, D), k, v (..., S, D) of broadcastable batch dims, any
// finite scale (Note [causal masks skip]): the batch flattened to (N, 1, ., D) views, a
// non-positive scale folded into q (the kernel takes positive ones), and top-left causal rows
// with L != S split into a square causal part and full rows.  Undefined where it cannot run.
static Tensor fused_cpu_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                                  double sc) {
  if (sc > 0 && flash_attention_supported(q, k, v, causal)) {  // (GPT-2's layout as is)
    if (Tensor x = packed_qkv_source(q, k, v); x.defined()) {
      return flash_attention_packed(x, q.size(1), causal, sc).first;
    }
    return flash_attention(q, k, v, causal, sc).first;
  }
  const int64_t L = q.shape()[q.ndim() - 2], S = k.shape()[k.ndim() - 2], D = q.shape().back();
  if (v.shape()[v.ndim() - 2] != S || L < 1 || S < 1 || D < 1) return Tensor();
  Shape batch = broadcast_shapes(Shape(q.shape().begin(), q.shape().end() - 2),
                                 Shape(k.shape().begin(), k.shape().end() - 2),
                                 "scaled_dot_product_attention");
  batch = broadcast_shapes(batch, Shape(v.shape().begin(), v.shape().end() - 2),
                           "scaled_dot_product_attention");
  int64_t N = 1;
  for (int64_t d : batch) N *= d;
  if (N < 1) return Tensor();
  auto as4 = [&](const Tensor& t, int64_t rows) {
    Shape full = batch;
    full.push_back(rows);
    full.push_back(D);
    return reshape(expand(t, full), {N, 1, rows, D});
  };
  Tensor q4 = sc > 0 ? as4(q, L) : mul(as4(q, L), sc), k4 = as4(k, S), v4 = as4(v, S);
  const double s4 = sc > 0 ? sc : 1.0;
  Tensor o;
  if (!causal || L == S) {
    o = flash_attention(q4, k4, v4, causal, s4).first;
  } else if (L < S) {  // keys past L are seen by no row
    o = flash_attention(q4, slice(k4, 2, 0, L, 1), slice(v4, 2, 0, L, 1), true, s4).first;
  } else {  // rows S.. see every key
    o = cat({flash_attention(slice(q4, 2, 0, S, 1), k4, v4, true, s4).first,
             flash_attention(slice(q4, 2, S, L, 1), k4, v4, false, s4).first},
            2);
  }
  Shape out = batch;
  out.push_back(L);
  out.push_back(D);
  return reshape(o, out);
}

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& attn_mask, double dropout_p, bool is_causal,
                                    std::optional<double> scale) {
  OpScope scope("scaled_dot_product_attention");
  if (q.ndim() < 2 || k.ndim() < 2 || v.ndim() < 2) {
    throw ValueError("[scaled_dot_product_attention] q, k, v need at least 2 dims");
  }
  if (q.dtype() != k.dtype() || q.dtype() != v.dtype()) {  // (as PyTorch)
    throw TypeError(std::string("[scaled_dot_product_attention] query, key and value must have "
                                "one dtype, got ") +
                    dtype_name(q.dtype()) + ", " + dtype_name(k.dtype()) + " and " +
                    dtype_name(v.dtype()));
  }
  // before anything reads values: the CPU scan below would dereference a CUDA k or v
  check_same_device(q, k, "scaled_dot_product_attention");
  check_same_device(q, v, "scaled_dot_product_attention");
  if (attn_mask.defined()) check_same_device(q, attn_mask, "scaled_dot_product_attention");
  if (q.shape().back() != k.shape().back()) {
    throw ValueError("[scaled_dot_product_attention] q and k head dims differ: " +
                     shape_str(q.shape()) + " and " + shape_str(k.shape()));
  }
  const int64_t L = q.shape()[q.ndim() - 2], S = k.shape()[k.ndim() - 2];
  if (scale && !std::isfinite(*scale)) {  // (PyTorch returns NaN there)
    throw ValueError("[scaled_dot_product_attention] scale must be finite, got " +
                     scalar_str(Scalar::floating(*scale)));
  }
  const double sc = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.shape().back()));
  // The fused kernel (src/attention.h) when there is no mask and no dropout: on CUDA for 16-bit
  // inputs and for float32 with head dim 64 or 128 (tensor cores: TF32 when
  // float32_matmul_precision() is "high"/"medium", 3xTF32 (fp32-accurate) when "highest"), on the
  // CPU when flash_attention_cpu() (the composed path runs the CPU's GEMMs).  Other float32 head
  // dims compose GEMMs (the fused float32 kernel is SIMT there: GPT-2 124M measured 852 ms a step
  // with it against 408 ms composed).  The composed path holds two (B, H, T, T) float32 matrices
  // per layer (40.8 GiB peak at B=16, T=1024) and spent ~60 ms a step in softmax/masking; the
  // TF32 kernels need none of that (H200, B16 H12 T1024 D64 causal: 3xTF32 fwd 0.56 ms, bwd 2.49;
  // 1xTF32 0.24 / 0.99; GPT-2 124M fp32 peak 41.4 -> 16.9 GiB).
  // Note [causal masks skip], Note [empty rows] (attention.h): the CPU composition would multiply
  // a masked key's weight 0 by its value row (0 * inf = NaN) and make a row of -inf scores NaN,
  // so CPU inputs holding inf / NaN take the fused kernel, and scores that may overflow to -inf
  // from finite inputs (a huge scale) the composition that zeroes empty rows.  A scan of q, k, v
  // (O(T D) next to the O(T^2 D) GEMMs); not while capturing, where no values exist yet.
  const bool plain = !attn_mask.defined() && dropout_p == 0;
  const bool f64 = q.dtype() == DType::Float64;
  const double top = f64 ? std::numeric_limits<double>::max() : std::numeric_limits<float>::max();
  if (std::abs(sc) > top) {  // (applied in the scores' dtype, it would be inf)
    throw ValueError("[scaled_dot_product_attention] scale " + scalar_str(Scalar::floating(sc)) +
                     " overflows " + (f64 ? "float64" : "float32") + ", the scores' dtype");
  }
  const bool scan = !q.device().is_cuda() && active_graph() == nullptr;
  const double qm = scan ? abs_max_cpu(q) : 0, km = scan ? abs_max_cpu(k) : 0;
  const double vm = scan ? abs_max_cpu(v) : 0;
  const bool nonfinite = !(std::isfinite(qm) && std::isfinite(km) && std::isfinite(vm));
  const double stop = q.dtype() == DType::Float16 ? 65504.0 : top;  // (float16 scores)
  const bool overflow =
      scan && !(std::abs(sc) * qm * km * static_cast<double>(q.shape().back()) < 0.5 * stop);
  if (plain && nonfinite && q.shape().back() == v.shape().back()) {
    if (Tensor y = fused_cpu_attention(q, k, v, is_causal, sc); y.defined()) return y;
  }
  if (plain && fused_attention_applies(q.dtype(), q.shape().back(), q.device(), sc) &&
      flash_attention_supported(q, k, v, is_causal)) {
    // q, k, v sliced from one (B, T, 3C) tensor (GPT-2's qkv): one op on it, whose backward
    // writes the single (B, T, 3C) gradient directly (no scatter into zero-filled buffers).
    if (Tensor x = packed_qkv_source(q, k, v); x.defined()) {
      return flash_attention_packed(x, q.size(1), is_causal, sc).first;
    }
    return flash_attention(q, k, v, is_causal, sc).first;
  }
  Tensor s = mul(matmul(q, transpose(k, -2, -1)), sc);
  if (is_causal) {
    Tensor i = unsqueeze(arange(0, static_cast<double>(L), 1, DType::Int64, q.device()), 1);
    Tensor j = unsqueeze(arange(0, static_cast<double>(S), 1, DType::Int64, q.device()), 0);
    s = masked_fill(s, binary(BinaryOp::Gt, j, i), Scalar::floating(-INFINITY));
  }
  Tensor empty;  // Note [empty rows]: rows whose scores are all -inf (every key masked)
  if (!plain || nonfinite || overflow) {
    if (!attn_mask.defined()) {
    } else if (attn_mask.dtype() == DType::Bool) {
      s = masked_fill(s, unary(UnaryOp::LogicalNot, attn_mask), Scalar::floating(-INFINITY));
    } else {
      s = add(s, astype(attn_mask, s.dtype()));  // (the output keeps q's dtype)
    }
    // weigh nothing (as PyTorch): their softmax runs on zeros (a finite gradient, then cut)
    {
      GradModeGuard no_grad(false);
      empty =
          binary(BinaryOp::Eq, reduce(ReduceOp::Max, s, {-1}, true), Scalar::floating(-INFINITY));
    }
    s = masked_fill(s, empty, Scalar::floating(0));
  }
  Tensor p = softmax(s, -1, false);
  if (empty.defined()) p = masked_fill(p, empty, Scalar::floating(0));
  if (dropout_p > 0) p = dropout(p, dropout_p, true);
  return matmul(p, v);
}

Tensor qkv_attention(const Tensor& x, const Tensor& weight, const Tensor& bias, int64_t heads,
                     bool causal, std::optional<double> scale) {
  OpScope scope("qkv_attention");
  const char* op = "qkv_attention";
  check_defined(x, op);
  check_defined(weight, op);
  if (x.ndim() != 3) {
    throw ValueError("[qkv_attention] input must be (B, T, C), got " + shape_str(x.shape()));
  }
  if (heads < 1 || weight.ndim() != 2 || weight.shape()[0] % (3 * heads) != 0 ||
      weight.shape()[0] == 0) {
    throw ValueError("[qkv_attention] weight must be (3 * heads * D, C) with D >= 1, got " +
                     shape_str(weight.shape()) + " for " + std::to_string(heads) + " heads");
  }
  const int64_t B = x.size(0), T = x.size(1), N = weight.shape()[0], HD = N / 3, D = HD / heads;
  if (scale && !std::isfinite(*scale)) {
    throw ValueError("[qkv_attention] scale must be finite, got " +
                     scalar_str(Scalar::floating(*scale)));
  }
  if (scale && x.dtype() != DType::Float64 &&
      std::abs(*scale) > std::numeric_limits<float>::max()) {
    throw ValueError("[qkv_attention] scale " + scalar_str(Scalar::floating(*scale)) +
                     " overflows float32, the scores' dtype");
  }
  const double sc = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(D));
  const DType dt = matmul_dtype(x, weight, op);
  if (!fused_attention_applies(dt, D, x.device(), sc) || B == 0 || T == 0 ||
      (x.device().is_cuda() && D > 256) || x.shape().back() != weight.shape()[1] ||
      (bias.defined() && (bias.shape() != Shape{N} || bias.device() != x.device()))) {
    // the composition (and its errors for bad shapes)
    const Tensor qkv = linear(x, weight, bias);
    auto qkv_view = [&](int64_t j) {
      return transpose(view(slice(qkv, 2, j * HD, (j + 1) * HD, 1), {B, T, heads, D}), 1, 2);
    };
    const Tensor y = scaled_dot_product_attention(qkv_view(0), qkv_view(1), qkv_view(2), Tensor(),
                                                  0.0, causal, sc);
    return reshape(transpose(y, 1, 2), {B, T, HD});
  }
  Tensor x2 = gemm_ready(as_rows(astype(x, dt)));
  std::vector<Tensor> ins{x2, gemm_ready(astype(weight, dt))};
  if (bias.defined()) ins.push_back(astype(bias, dt));
  const DType ls = dt == DType::Float64 ? DType::Float64 : DType::Float32;
  auto outs = apply(std::make_shared<QkvAttention>(sc, causal, heads, T, bias.defined()), ins,
                    {{{B, T, heads, D}, dt}, {{B, heads, T}, ls}, {{B * T, N}, dt}}, x.device());
  return view(outs[0], {B, T, HD});
}

Tensor clip_grad_norm_(const std::vector<Tensor>& grads, double max_norm, double eps) {
  OpScope scope("clip_grad_norm_");
  GradModeGuard no_grad(false);
  // CUDA: multi-tensor kernels (deterministic norm, coefficient and scaling on the device, no
  // host sync; see optim.h).  The CPU keeps the composed reference below.
  for (auto& g : grads) {
    if (!g.defined()) continue;
    if (g.device().is_cuda()) {
      Tensor norm = grad_norm(grads);
      scale_(grads, clip_coef(norm, max_norm, eps));
      return norm;
    }
    break;
  }
  Tensor total;
  for (auto& g : grads) {
    if (!g.defined()) continue;
    const DType acc = g.dtype() == DType::Float64 ? DType::Float64 : DType::Float32;
    Tensor gf = astype(g, acc);
    Tensor s = sum(mul(gf, gf));
    total = total.defined() ? add(total, astype(s, promote_types(total.dtype(), s.dtype()))) : s;
  }
  if (!total.defined()) return zeros({}, DType::Float32, Device());
  Tensor norm = unary(UnaryOp::Sqrt, total);
  // coef = min(max_norm / (norm + eps), 1): no host sync, as in PyTorch.
  Tensor coef = binary(BinaryOp::Minimum,
                       binary(BinaryOp::Div, Scalar{max_norm, 2}, add(norm, eps)), Scalar{1.0, 2});
  for (auto g : grads) {
    if (!g.defined()) continue;
    inplace(g, mul(g, astype(coef, g.dtype())), "clip_grad_norm_");
  }
  return norm;
}

// The one raw copy the front needs (in-place ops): dispatched per device.
namespace cpu {
void copy_raw(const Tensor& dst, const Tensor& src);
}
static Tensor raw_copy_into(const Tensor& dst, const Tensor& src, const char* op) {
  if (dst.device().is_cuda()) {
#ifdef BT_WITH_CUDA
    cuda::copy_cast(dst, src, op);
    return dst;
#else
    backend::no_cuda_kernel(op);
#endif
  }
  cpu::copy_raw(dst, src);
  return dst;
}

}  // namespace bt
