// pymath.h: Python's floor division and modulo on one element, shared by the CPU and CUDA
// kernels so both backends give the same values.
//   floor_divide(a, b) = floor(a / b); remainder(a, b) = a - b * floor_divide(a, b), which takes
//   the divisor's sign (Python's % and PyTorch's remainder, not C's fmod / %).
// Floats follow CPython's float divmod: the quotient from fmod, so it is exact where a / b then
// floor would round across an integer.  b == 0 gives inf / nan as division does.
// Integers: b == 0 is the caller's to catch (the CPU raises, CUDA records a device error);
// here it yields 0 instead of trapping.  The most negative value // -1 wraps (PyTorch, numpy).
#pragma once

#include <cmath>
#include <type_traits>

#if defined(__CUDACC__)
#define BT_PYMATH_FN __host__ __device__ __forceinline__
#else
#define BT_PYMATH_FN inline
#endif
// fmod / floor / copysign: CUDA's device overloads are global, the host's float ones in std
#if defined(__CUDA_ARCH__)
#define BT_PYMATH_STD ::
#else
#define BT_PYMATH_STD std::
#endif

namespace bt::pymath {

template <typename C>
BT_PYMATH_FN C floor_divide(C a, C b) {
  if constexpr (std::is_floating_point<C>::value) {
    if (b == C(0)) return a / b;
    const C m = BT_PYMATH_STD fmod(a, b);
    C d = (a - m) / b;  // an integer up to rounding
    if (m != C(0) && ((b < C(0)) != (m < C(0)))) d -= C(1);
    if (d == C(0)) return BT_PYMATH_STD copysign(C(0), a / b);  // the sign of the true quotient
    C f = BT_PYMATH_STD floor(d);
    if (d - f > C(0.5)) f += C(1);
    return f;
  } else if constexpr (std::is_same<C, bool>::value) {
    return b ? a : C(0);
  } else if constexpr (std::is_signed<C>::value) {
    if (b == C(0)) return C(0);
    if (b == C(-1)) {  // -min overflows: wrap through unsigned
      using U = std::make_unsigned_t<C>;
      return static_cast<C>(U(0) - static_cast<U>(a));
    }
    C q = static_cast<C>(a / b);
    if (static_cast<C>(a % b) != C(0) && ((a < C(0)) != (b < C(0)))) q = static_cast<C>(q - 1);
    return q;
  } else {
    return b == C(0) ? C(0) : static_cast<C>(a / b);
  }
}

template <typename C>
BT_PYMATH_FN C remainder(C a, C b) {
  if constexpr (std::is_floating_point<C>::value) {
    C r = BT_PYMATH_STD fmod(a, b);  // nan for b == 0
    if (r != C(0)) {
      if ((b < C(0)) != (r < C(0))) r += b;
    } else {
      r = BT_PYMATH_STD copysign(C(0), b);  // a zero takes the divisor's sign
    }
    return r;
  } else if constexpr (std::is_same<C, bool>::value) {
    return C(0);
  } else if constexpr (std::is_signed<C>::value) {
    if (b == C(0) || b == C(-1)) return C(0);
    C r = static_cast<C>(a % b);
    if (r != C(0) && ((r < C(0)) != (b < C(0)))) r = static_cast<C>(r + b);
    return r;
  } else {
    return b == C(0) ? C(0) : static_cast<C>(a % b);
  }
}

}  // namespace bt::pymath

#undef BT_PYMATH_STD
