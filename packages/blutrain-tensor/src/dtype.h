// dtype.h: element types, their promotion rules, and the half-precision storage types.
//
// Promotion (the result dtype of a binary op; PyTorch's rules, restated):
//   1. Categories are ordered bool < integer < floating.  The result takes the highest category
//      among the operands.
//   2. Within one category the wider type wins: uint8 < int32 < int64 and
//      float16, bfloat16 < float32 < float64.  Mixed float16/bfloat16 gives float32 (neither holds
//      the other); mixed uint8/int32 gives int32.
//   3. A Python scalar is "weak": it only takes part through its category.  A float scalar with an
//      integer or bool tensor gives the default float dtype (float32); an int scalar with a bool
//      tensor gives int64; otherwise the tensor's dtype wins (bf16 tensor * 2.5 stays bf16).
//   4. True division (div) and the float-only unary ops (exp, log, sqrt, tanh, ...) promote
//      integer/bool inputs to float32.  Comparisons return bool.
// bfloat16 and float16 are stored as uint16 bit patterns; kernels compute in float32 and round
// to nearest even on store.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace bt {

enum class DType : uint8_t { Bool = 0, UInt8, Int32, Int64, Float16, BFloat16, Float32, Float64 };
constexpr int kNumDTypes = 8;

inline size_t itemsize(DType d) {
  switch (d) {
    case DType::Bool:
    case DType::UInt8:
      return 1;
    case DType::Float16:
    case DType::BFloat16:
      return 2;
    case DType::Int32:
    case DType::Float32:
      return 4;
    case DType::Int64:
    case DType::Float64:
      return 8;
  }
  return 0;
}

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::Bool:
      return "bool";
    case DType::UInt8:
      return "uint8";
    case DType::Int32:
      return "int32";
    case DType::Int64:
      return "int64";
    case DType::Float16:
      return "float16";
    case DType::BFloat16:
      return "bfloat16";
    case DType::Float32:
      return "float32";
    case DType::Float64:
      return "float64";
  }
  return "?";
}

DType dtype_from_name(const std::string& name);  // accepts "float32", "f32", "float", "int", ...

inline bool is_floating(DType d) { return d >= DType::Float16; }
inline bool is_integral(DType d, bool include_bool) {
  return (d == DType::Bool) ? include_bool : !is_floating(d);
}
inline int category(DType d) { return d == DType::Bool ? 0 : (is_floating(d) ? 2 : 1); }

constexpr DType kDefaultFloat = DType::Float32;

// Rule 1 and 2 above.
DType promote_types(DType a, DType b);
// Rule 3: a weak scalar of the given category (0 bool, 1 int, 2 float) meeting a tensor dtype.
DType promote_with_scalar(DType t, int scalar_category);
// Rule 4: the dtype float-only ops compute in.
inline DType to_floating(DType d) { return is_floating(d) ? d : kDefaultFloat; }

// ---- half-precision storage types --------------------------------------------------------
// Plain 16-bit structs (trivially copyable, so they live in arrays and in DLPack buffers as is).

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

struct bfloat16 {
  uint16_t x = 0;
  bfloat16() = default;
  explicit bfloat16(float f) {
    uint32_t u = float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      x = static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN, keep sign
    } else {
      u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
      x = static_cast<uint16_t>(u >> 16);
    }
  }
  explicit bfloat16(double d) : bfloat16(static_cast<float>(d)) {}
  template <typename I, typename = std::enable_if_t<std::is_integral<I>::value>>
  explicit bfloat16(I i) : bfloat16(static_cast<float>(i)) {}
  operator float() const { return bits_to_float(static_cast<uint32_t>(x) << 16); }
};

struct float16 {
  uint16_t x = 0;
  float16() = default;
  explicit float16(float f) { x = from_float(f); }
  explicit float16(double d) : float16(static_cast<float>(d)) {}
  template <typename I, typename = std::enable_if_t<std::is_integral<I>::value>>
  explicit float16(I i) : float16(static_cast<float>(i)) {}
  operator float() const { return to_float(x); }

  static float to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (mant << 13));  // inf / nan
    if (exp == 0) {
      if (mant == 0) return bits_to_float(sign);
      // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      mant &= 0x3ffu;
      return bits_to_float(sign | (static_cast<uint32_t>(112 - e) << 23) | (mant << 13));
    }
    return bits_to_float(sign | ((exp + 112) << 23) | (mant << 13));
  }
  static uint16_t from_float(float f) {
    uint32_t u = float_to_bits(f);
    const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | 0x7e00u;   // nan
    if (u >= 0x477ff000u) return sign | 0x7c00u;  // overflow (incl. rounding up) -> inf
    if (u < 0x38800000u) {                        // subnormal or zero in half
      if (u < 0x33000000u) return sign;           // below half the smallest subnormal
      const uint32_t e = u >> 23, mant = (u & 0x7fffffu) | 0x800000u;
      const uint32_t shift = 126 - e;  // 14..24
      uint32_t r = mant >> shift;
      const uint32_t rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
      if (rem > half || (rem == half && (r & 1u))) ++r;
      return sign | static_cast<uint16_t>(r);
    }
    uint32_t r = u + 0xfffu + ((u >> 13) & 1u);  // round to nearest even at bit 13
    return sign | static_cast<uint16_t>(((r >> 13) - (112u << 10)) & 0xffffu);
  }
};

// The type kernels compute in: float for the 16-bit floats, the type itself otherwise.
template <typename T>
struct compute_type {
  using type = T;
};
template <>
struct compute_type<bfloat16> {
  using type = float;
};
template <>
struct compute_type<float16> {
  using type = float;
};
template <typename T>
using compute_t = typename compute_type<T>::type;

// A Python number as an op argument.  An int or bool keeps its exact value in `i` (an int above
// 2**53 reaches an int64 tensor unrounded: full, fill_, comparisons, arithmetic, where, arange);
// `v` is the value as a double (exact for floats).  category (for weak promotion, rule 3): 0 bool,
// 1 int, 2 float.
struct Scalar {
  double v = 0;
  int category = 2;
  int64_t i = 0;
  Scalar() = default;
  // An int or bool category from a double is for small internal constants (Scalar{0, 1}).
  Scalar(double value, int cat)
      : v(value),
        category(cat),
        i(cat < 2 && value >= -0x1p63 && value < 0x1p63 ? static_cast<int64_t>(value) : 0) {}
  static Scalar integer(int64_t x) {
    Scalar s(static_cast<double>(x), 1);
    s.i = x;
    return s;
  }
  static Scalar boolean(bool b) { return Scalar(b ? 1.0 : 0.0, 0); }
  static Scalar floating(double x) { return Scalar(x, 2); }
  bool integral() const { return category < 2; }
  // The value stored as T (a dtype's storage type): integral scalars convert from the exact
  // int64, floats through compute_t<T> as the kernels always have.
  template <typename T>
  T as() const {
    if constexpr (std::is_same<T, bool>::value) {
      return category < 2 ? i != 0 : v != 0;
    } else if constexpr (std::is_integral<T>::value) {
      return category < 2 ? static_cast<T>(i) : static_cast<T>(v);
    } else {
      return static_cast<T>(category < 2 ? static_cast<compute_t<T>>(i)
                                         : static_cast<compute_t<T>>(v));
    }
  }
};
// "3", "True", "2.5", "nan" (for messages).
std::string scalar_str(const Scalar& s);
// Whether a tensor of dtype d holds s (ints: exactly in range; floats into an integer dtype:
// finite and in range, then truncated as a cast); floating and bool dtypes hold any value.
bool scalar_fits(const Scalar& s, DType d);

// Accumulator for reductions: float32 inputs accumulate in double only where the issue asks for
// "float32/float64 accumulators": 16-bit floats accumulate in float, float in double (cheap on CPU
// and makes sums of 1e6 elements exact enough to compare against numpy float64).
template <typename T>
struct acc_type {
  using type = double;
};
template <>
struct acc_type<int32_t> {
  using type = int64_t;
};
template <>
struct acc_type<int64_t> {
  using type = int64_t;
};
template <>
struct acc_type<uint8_t> {
  using type = int64_t;
};
template <>
struct acc_type<bool> {
  using type = int64_t;
};
template <typename T>
using acc_t = typename acc_type<T>::type;

template <typename T>
struct dtype_of;
template <>
struct dtype_of<bool> {
  static constexpr DType value = DType::Bool;
};
template <>
struct dtype_of<uint8_t> {
  static constexpr DType value = DType::UInt8;
};
template <>
struct dtype_of<int32_t> {
  static constexpr DType value = DType::Int32;
};
template <>
struct dtype_of<int64_t> {
  static constexpr DType value = DType::Int64;
};
template <>
struct dtype_of<float16> {
  static constexpr DType value = DType::Float16;
};
template <>
struct dtype_of<bfloat16> {
  static constexpr DType value = DType::BFloat16;
};
template <>
struct dtype_of<float> {
  static constexpr DType value = DType::Float32;
};
template <>
struct dtype_of<double> {
  static constexpr DType value = DType::Float64;
};

template <typename T>
struct type_tag {
  using type = T;
};

// dispatch(dtype, "op", [&](auto tag) { using T = typename decltype(tag)::type; ... });
template <typename F>
decltype(auto) dispatch_all(DType d, const char* op, F&& f) {
  switch (d) {
    case DType::Bool:
      return f(type_tag<bool>{});
    case DType::UInt8:
      return f(type_tag<uint8_t>{});
    case DType::Int32:
      return f(type_tag<int32_t>{});
    case DType::Int64:
      return f(type_tag<int64_t>{});
    case DType::Float16:
      return f(type_tag<float16>{});
    case DType::BFloat16:
      return f(type_tag<bfloat16>{});
    case DType::Float32:
      return f(type_tag<float>{});
    case DType::Float64:
      return f(type_tag<double>{});
  }
  throw std::invalid_argument(std::string("[") + op + "] unknown dtype");
}

template <typename F>
decltype(auto) dispatch_float(DType d, const char* op, F&& f) {
  switch (d) {
    case DType::Float16:
      return f(type_tag<float16>{});
    case DType::BFloat16:
      return f(type_tag<bfloat16>{});
    case DType::Float32:
      return f(type_tag<float>{});
    case DType::Float64:
      return f(type_tag<double>{});
    default:
      break;
  }
  throw std::invalid_argument(std::string("[") + op + "] expects a floating dtype, got " +
                              dtype_name(d));
}

// f(type_tag<O>) for a dtype d paired with an element type T: O = T when d is T's dtype, or for a
// float32 T also the 16-bit floats (the mixed layer norms, Note [float32 residual stream] in
// nn_fused.h).  Other pairs throw.
template <typename T, typename F>
decltype(auto) dispatch_same_or_half(DType d, const char* op, F&& f) {
  if constexpr (std::is_same_v<T, float>) {
    if (d == DType::BFloat16) return f(type_tag<bfloat16>{});
    if (d == DType::Float16) return f(type_tag<float16>{});
  }
  if (d != dtype_of<T>::value) {
    throw std::invalid_argument(std::string("[") + op + "] unsupported dtype pair " +
                                dtype_name(dtype_of<T>::value) + " / " + dtype_name(d));
  }
  return f(type_tag<T>{});
}

}  // namespace bt
