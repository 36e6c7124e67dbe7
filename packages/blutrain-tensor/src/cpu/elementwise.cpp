// cpu/elementwise.cpp: CPU kernels for creation, copies and elementwise primitives.
#include <cmath>
#include <cstring>

#include "../backend.h"
#include "../primitives.h"
#include "../pymath.h"
#include "../random.h"
#include "fastmath.h"
#include "loops.h"

namespace bt {

using cpu::for_each_strided;

template <typename T>
static inline T* base_ptr(const Tensor& t) {
  return static_cast<T*>(t.data_ptr("cpu"));
}

// ---- raw copies ----------------------------------------------------------------------------
void cpu::copy_raw(const Tensor& dst, const Tensor& src) {
  dispatch_all(dst.dtype(), "copy", [&](auto dtag) {
    using D = typename decltype(dtag)::type;
    dispatch_all(src.dtype(), "copy", [&](auto stag) {
      using S = typename decltype(stag)::type;
      D* o = base_ptr<D>(dst);
      const S* a = base_ptr<S>(src);
      for_each_strided<2>(
          dst.shape(), {dst.strides(), src.strides()},
          [&](const std::array<int64_t, 2>& off, int64_t n, const std::array<int64_t, 2>& s) {
            D* op = o + off[0];
            const S* ap = a + off[1];
            if (s[0] == 1 && s[1] == 1) {
              if (std::is_same<D, S>::value) {
                std::memcpy(static_cast<void*>(op), ap, n * sizeof(D));
              } else {
                for (int64_t i = 0; i < n; ++i)
                  op[i] = static_cast<D>(static_cast<compute_t<S>>(ap[i]));
              }
            } else {
              for (int64_t i = 0; i < n; ++i)
                op[i * s[0]] = static_cast<D>(static_cast<compute_t<S>>(ap[i * s[1]]));
            }
          });
    });
  });
}

Tensor cpu::contiguous_raw(const Tensor& t) {
  if (t.is_contiguous()) return t;
  Tensor out = empty_tensor(t.shape(), t.dtype(), t.device(), "contiguous");
  copy_raw(out, t);
  return out;
}

// ---- creation ------------------------------------------------------------------------------
void Full::eval_cpu(const std::vector<Tensor>&, std::vector<Tensor>& out) {
  dispatch_all(out[0].dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T v = value.as<T>();
    T* o = base_ptr<T>(out[0]);
    const int64_t n = out[0].numel();
    cpu::parallel_for((n + cpu::kChunk - 1) / cpu::kChunk, cpu::kChunk, [&](int64_t c) {
      const int64_t s = c * cpu::kChunk, e = std::min(n, s + cpu::kChunk);
      for (int64_t i = s; i < e; ++i) o[i] = v;
    });
  });
}

void Arange::eval_cpu(const std::vector<Tensor>&, std::vector<Tensor>& out) {
  dispatch_all(out[0].dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* o = base_ptr<T>(out[0]);
    const int64_t n = out[0].numel();
    if (exact()) {  // unsigned: wraps mod 2^64 to the exact value, which fits int64
      const uint64_t s0 = static_cast<uint64_t>(start.i), st = static_cast<uint64_t>(step.i);
      for (int64_t i = 0; i < n; ++i) {
        o[i] = Scalar::integer(static_cast<int64_t>(s0 + static_cast<uint64_t>(i) * st)).as<T>();
      }
      return;
    }
    for (int64_t i = 0; i < n; ++i) {
      o[i] = static_cast<T>(static_cast<compute_t<T>>(start.v + static_cast<double>(i) * step.v));
    }
  });
}

void Random::eval_cpu(const std::vector<Tensor>&, std::vector<Tensor>& out) {
  dispatch_all(out[0].dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = compute_t<T>;
    T* o = base_ptr<T>(out[0]);
    const int64_t n = out[0].numel();
    const bool f64 = out[0].dtype() == DType::Float64;
    cpu::parallel_for(n, 16, [&](int64_t i) {
      double v;
      if (kind == RandKind::Uniform) {
        const double u = f64 ? philox::uniform_f64(seed, offset, i)
                             : static_cast<double>(philox::uniform_f32(seed, offset, i));
        v = a + (b - a) * u;
      } else if (kind == RandKind::Normal) {
        v = a + b * philox::normal(seed, offset, i);
      } else {
        const uint64_t r = philox::bits(seed, offset, i) % int_range;
        o[i] = Scalar::integer(static_cast<int64_t>(static_cast<uint64_t>(int_low) + r)).as<T>();
        return;
      }
      o[i] = static_cast<T>(static_cast<C>(v));
    });
  });
}

// ---- copies --------------------------------------------------------------------------------
void AsType::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  cpu::copy_raw(out[0], in[0]);
}

void ToDevice::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  Tensor src = in[0];
  if (src.device().is_cuda()) {
    if (!src.is_contiguous()) {
      throw RuntimeError("[to_device] internal: the source must be contiguous");
    }
    backend::copy_bytes(out[0].data_ptr(name()), out[0].device(), src.data_ptr(name()),
                        src.device(), out[0].numel() * itemsize(out[0].dtype()), name());
  } else {
    cpu::copy_raw(out[0], src);
  }
}

void SliceScatter::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  cpu::copy_raw(out[0], in[0]);
  Slice sl(dim, start, stop, step);
  Tensor view = sl.eval_view({out[0]});
  cpu::copy_raw(view, in[1]);
}

// ---- unary ---------------------------------------------------------------------------------
// The op is a template parameter so each inner loop is branch-free (and vectorisable where the
// math allows).
template <UnaryOp OP, typename C>
static inline C unary_fn(C x) {
  if constexpr (!std::is_floating_point<C>::value) {
    // Integer/bool forms of the ops that allow them (the front casts the rest to float).
    if constexpr (OP == UnaryOp::Neg) return static_cast<C>(-x);
    if constexpr (OP == UnaryOp::Abs) return x < 0 ? static_cast<C>(-x) : x;
    if constexpr (OP == UnaryOp::Relu) return x > 0 ? x : C(0);
    if constexpr (OP == UnaryOp::Sign) return static_cast<C>((x > 0) - (x < 0));
    if constexpr (OP == UnaryOp::LogicalNot) return static_cast<C>(!x);
    return x;
  } else {
    constexpr bool f32 = std::is_same<C, float>::value;
    if constexpr (f32 && OP == UnaryOp::Exp) return cpu::fast_exp(x);
    if constexpr (f32 && OP == UnaryOp::Tanh) return cpu::fast_tanh(x);
    if constexpr (f32 && OP == UnaryOp::Sigmoid) return 1.0f / (1.0f + cpu::fast_exp(-x));
    if constexpr (f32 && OP == UnaryOp::GeluTanh) {
      return 0.5f * x * (1.0f + cpu::fast_tanh(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    }
    if constexpr (OP == UnaryOp::Neg) return -x;
    if constexpr (OP == UnaryOp::Exp) return std::exp(x);
    if constexpr (OP == UnaryOp::Log) return std::log(x);
    if constexpr (OP == UnaryOp::Sqrt) return std::sqrt(x);
    if constexpr (OP == UnaryOp::Rsqrt) return C(1) / std::sqrt(x);
    if constexpr (OP == UnaryOp::Tanh) return std::tanh(x);
    if constexpr (OP == UnaryOp::Abs) return x < C(0) ? -x : x;
    if constexpr (OP == UnaryOp::Sigmoid) return C(1) / (C(1) + std::exp(-x));
    if constexpr (OP == UnaryOp::Relu) return x < C(0) ? C(0) : x;  // NaN stays NaN (as numpy)
    if constexpr (OP == UnaryOp::Sin) return std::sin(x);
    if constexpr (OP == UnaryOp::Cos) return std::cos(x);
    if constexpr (OP == UnaryOp::Erf) return std::erf(x);
    if constexpr (OP == UnaryOp::GeluErf) return C(0.5) * x * (C(1) + std::erf(x * C(M_SQRT1_2)));
    if constexpr (OP == UnaryOp::GeluTanh) {
      const C k = C(0.7978845608028654);  // sqrt(2/pi)
      return C(0.5) * x * (C(1) + std::tanh(k * (x + C(0.044715) * x * x * x)));
    }
    if constexpr (OP == UnaryOp::Sign) return C((x > C(0)) - (x < C(0)));
    if constexpr (OP == UnaryOp::LogicalNot) return C(!x);
    return x;
  }
}

template <UnaryOp OP, typename T, typename O>
BT_CPU_CLONES void unary_contiguous(const T* a, O* o, int64_t n) {
  using C = compute_t<T>;
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<O>(unary_fn<OP, C>(C(a[i])));
}

template <typename T>
void cpu::tanh_raw(const T* a, T* o, int64_t n) {
  unary_contiguous<UnaryOp::Tanh, T, T>(a, o, n);
}
template void cpu::tanh_raw<float>(const float*, float*, int64_t);
template void cpu::tanh_raw<double>(const double*, double*, int64_t);
template void cpu::tanh_raw<bfloat16>(const bfloat16*, bfloat16*, int64_t);
template void cpu::tanh_raw<float16>(const float16*, float16*, int64_t);

template <UnaryOp OP, typename T, typename O>
static void unary_loop(const Tensor& x, const Tensor& out) {
  using C = compute_t<T>;
  const T* a = base_ptr<T>(x);
  O* o = base_ptr<O>(out);
  for_each_strided<2>(
      out.shape(), {out.strides(), x.strides()},
      [&](const std::array<int64_t, 2>& off, int64_t n, const std::array<int64_t, 2>& s) {
        O* op = o + off[0];
        const T* ap = a + off[1];
        if (s[0] == 1 && s[1] == 1) {
          unary_contiguous<OP, T, O>(ap, op, n);
        } else {
          for (int64_t i = 0; i < n; ++i)
            op[i * s[0]] = static_cast<O>(unary_fn<OP, C>(C(ap[i * s[1]])));
        }
      });
}

template <UnaryOp OP>
static void unary_dispatch(const Tensor& x, const Tensor& out, const char* nm) {
  dispatch_all(x.dtype(), nm, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (out.dtype() == DType::Bool) {
      unary_loop<OP, T, bool>(x, out);
    } else if (out.dtype() == x.dtype()) {
      unary_loop<OP, T, T>(x, out);
    } else {
      throw RuntimeError(std::string("[") + nm + "] internal: output dtype differs from input");
    }
  });
}

void Unary::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  switch (op) {
#define BT_CASE(N)                                     \
  case UnaryOp::N:                                     \
    unary_dispatch<UnaryOp::N>(in[0], out[0], name()); \
    break;
    // clang-format off
    BT_CASE(Neg) BT_CASE(Exp) BT_CASE(Log) BT_CASE(Sqrt) BT_CASE(Rsqrt) BT_CASE(Tanh)
    BT_CASE(Abs) BT_CASE(Sigmoid) BT_CASE(Relu) BT_CASE(Sin) BT_CASE(Cos) BT_CASE(GeluTanh)
    BT_CASE(GeluErf) BT_CASE(Erf) BT_CASE(LogicalNot) BT_CASE(Sign)
    // clang-format on
#undef BT_CASE
  }
}

// ---- binary --------------------------------------------------------------------------------
template <typename C>
static inline C ipow(C b, C e) {
  if (e < 0) return (b == 1) ? C(1) : (b == C(-1) ? ((e % 2) ? C(-1) : C(1)) : C(0));
  C r = 1;
  while (e) {
    if (e & 1) r = static_cast<C>(r * b);
    b = static_cast<C>(b * b);
    e = static_cast<C>(e >> 1);
  }
  return r;
}

template <BinaryOp OP, typename C>
static inline auto binary_fn(C a, C b) {
  if constexpr (OP == BinaryOp::Add) return static_cast<C>(a + b);
  if constexpr (OP == BinaryOp::Sub) return static_cast<C>(a - b);
  if constexpr (OP == BinaryOp::Mul) return static_cast<C>(a * b);
  if constexpr (OP == BinaryOp::Div) return static_cast<C>(a / b);
  if constexpr (OP == BinaryOp::Pow) {
    if constexpr (std::is_floating_point<C>::value) {
      return static_cast<C>(std::pow(a, b));
    } else if constexpr (std::is_same<C, bool>::value) {
      return static_cast<C>(a || !b);
    } else {
      return ipow<C>(a, b);
    }
  }
  if constexpr (OP == BinaryOp::Maximum) return (a != a) ? a : ((b != b) ? b : (a > b ? a : b));
  if constexpr (OP == BinaryOp::Minimum) return (a != a) ? a : ((b != b) ? b : (a < b ? a : b));
  if constexpr (OP == BinaryOp::FloorDiv) return pymath::floor_divide<C>(a, b);
  if constexpr (OP == BinaryOp::Mod) return pymath::remainder<C>(a, b);
  if constexpr (OP == BinaryOp::Eq) return a == b;
  if constexpr (OP == BinaryOp::Ne) return a != b;
  if constexpr (OP == BinaryOp::Lt) return a < b;
  if constexpr (OP == BinaryOp::Le) return a <= b;
  if constexpr (OP == BinaryOp::Gt) return a > b;
  if constexpr (OP == BinaryOp::Ge) return a >= b;
  if constexpr (OP == BinaryOp::And) return static_cast<bool>(a) && static_cast<bool>(b);
  if constexpr (OP == BinaryOp::Or) return static_cast<bool>(a) || static_cast<bool>(b);
}

template <BinaryOp OP, typename T, typename O>
static void binary_loop(const Tensor& x, const Tensor& y, const Tensor& out) {
  using C = compute_t<T>;
  const T* a = base_ptr<T>(x);
  const T* b = base_ptr<T>(y);
  O* o = base_ptr<O>(out);
  for_each_strided<3>(
      out.shape(), {out.strides(), x.strides(), y.strides()},
      [&](const std::array<int64_t, 3>& off, int64_t n, const std::array<int64_t, 3>& s) {
        O* op = o + off[0];
        const T* ap = a + off[1];
        const T* bp = b + off[2];
        // Specialised strides so the compiler vectorises the common cases.
        if (s[0] == 1 && s[1] == 1 && s[2] == 1) {
          for (int64_t i = 0; i < n; ++i)
            op[i] = static_cast<O>(binary_fn<OP, C>(C(ap[i]), C(bp[i])));
        } else if (s[0] == 1 && s[1] == 1 && s[2] == 0) {
          const C bv = C(bp[0]);
          for (int64_t i = 0; i < n; ++i) op[i] = static_cast<O>(binary_fn<OP, C>(C(ap[i]), bv));
        } else if (s[0] == 1 && s[1] == 0 && s[2] == 1) {
          const C av = C(ap[0]);
          for (int64_t i = 0; i < n; ++i) op[i] = static_cast<O>(binary_fn<OP, C>(av, C(bp[i])));
        } else {
          for (int64_t i = 0; i < n; ++i)
            op[i * s[0]] = static_cast<O>(binary_fn<OP, C>(C(ap[i * s[1]]), C(bp[i * s[2]])));
        }
      });
}

template <BinaryOp OP>
static void binary_dispatch(const Tensor& x, const Tensor& y, const Tensor& out, const char* nm) {
  dispatch_all(x.dtype(), nm, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (out.dtype() == DType::Bool) {
      binary_loop<OP, T, bool>(x, y, out);
    } else {
      binary_loop<OP, T, T>(x, y, out);
    }
  });
}

// Integer // and % by zero raise (as Python's do) before anything is written.
static void check_integer_divisor(const Tensor& y, const char* nm) {
  if (is_floating(y.dtype()) || y.numel() == 0) return;
  dispatch_all(y.dtype(), nm, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* b = base_ptr<T>(y);
    bool zero = false;
    for_each_strided<1>(
        y.shape(), {y.strides()},
        [&](const std::array<int64_t, 1>& off, int64_t n, const std::array<int64_t, 1>& s) {
          for (int64_t i = 0; i < n && !zero; ++i) zero = b[off[0] + i * s[0]] == T(0);
        });
    if (zero) {
      throw ZeroDivisionError(std::string("[") + nm + "] integer division by zero (" +
                              dtype_name(y.dtype()) + " divisor)");
    }
  });
}

void Binary::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  const Tensor &x = in[0], &y = in[1], &o = out[0];
  if (op == BinaryOp::FloorDiv || op == BinaryOp::Mod) check_integer_divisor(y, name());
  switch (op) {
#define BT_CASE(N)                                 \
  case BinaryOp::N:                                \
    binary_dispatch<BinaryOp::N>(x, y, o, name()); \
    break;
    // clang-format off
    BT_CASE(Add) BT_CASE(Sub) BT_CASE(Mul) BT_CASE(Div) BT_CASE(Pow) BT_CASE(Maximum)
    BT_CASE(Minimum) BT_CASE(FloorDiv) BT_CASE(Mod) BT_CASE(Eq) BT_CASE(Ne) BT_CASE(Lt) BT_CASE(Le)
    BT_CASE(Gt) BT_CASE(Ge) BT_CASE(And) BT_CASE(Or)
    // clang-format on
#undef BT_CASE
  }
}

void Where::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  dispatch_all(out[0].dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const bool* c = base_ptr<bool>(in[0]);
    const T* a = base_ptr<T>(in[1]);
    const T* b = base_ptr<T>(in[2]);
    T* o = base_ptr<T>(out[0]);
    for_each_strided<4>(
        out[0].shape(), {out[0].strides(), in[0].strides(), in[1].strides(), in[2].strides()},
        [&](const std::array<int64_t, 4>& off, int64_t n, const std::array<int64_t, 4>& s) {
          for (int64_t i = 0; i < n; ++i) {
            o[off[0] + i * s[0]] =
                c[off[1] + i * s[1]] ? a[off[2] + i * s[2]] : b[off[3] + i * s[3]];
          }
        });
  });
}

void MaskedFill::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  dispatch_all(out[0].dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T v = value.as<T>();
    const T* a = base_ptr<T>(in[0]);
    const bool* m = base_ptr<bool>(in[1]);
    T* o = base_ptr<T>(out[0]);
    for_each_strided<3>(
        out[0].shape(), {out[0].strides(), in[0].strides(), in[1].strides()},
        [&](const std::array<int64_t, 3>& off, int64_t n, const std::array<int64_t, 3>& s) {
          for (int64_t i = 0; i < n; ++i) {
            o[off[0] + i * s[0]] = m[off[2] + i * s[2]] ? v : a[off[1] + i * s[1]];
          }
        });
  });
}

void Dropout::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  Tensor x = cpu::contiguous_raw(in[0]);
  dispatch_float(out[0].dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = compute_t<T>;
    const T* a = base_ptr<T>(x);
    T* o = base_ptr<T>(out[0]);
    const C scale = C(1.0 / (1.0 - p));
    const float pf = static_cast<float>(p);
    const int64_t n = out[0].numel();
    cpu::parallel_for((n + 1023) / 1024, 1024, [&](int64_t c) {
      const int64_t s = c * 1024, e = std::min(n, s + 1024);
      for (int64_t i = s; i < e; ++i) {
        const bool keep = philox::uniform_f32(seed, offset, i) >= pf;
        o[i] = static_cast<T>(keep ? C(a[i]) * scale : C(0));
      }
    });
  });
}

}  // namespace bt
