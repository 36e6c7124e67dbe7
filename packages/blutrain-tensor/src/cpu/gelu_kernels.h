// cpu/gelu_kernels.h: the tanh-GELU backward's element-wise passes around the tanh, for
// GeluTanhBackward (cpu/gelu.cpp) and bench/cpu_kernels_check.cpp.
//
// Note [gelu backward]
// dx = dy * gelu_tanh'(x) was a composition of 16 element-wise ops (Unary::vjp), 16 passes over
// memory. GeluTanhBackward computes it in one pass over blocks that stay in L1, with the very
// same operations: each op's result rounded to x's dtype (R below), a Python scalar taken as
// that dtype's value of it (K below, what `full` stores), and the tanh computed by the Tanh op's
// own loop (cpu::tanh_raw) between the two passes here. Compiled with -ffp-contract=off: the
// composition's ops each rounded (no fused multiply-add across them).
#pragma once

#include <cmath>
#include <cstdint>

#include "../dtype.h"
#include "fastmath.h"  // BT_CPU_CLONES

namespace bt::cpu::gelu {

template <typename T>
struct Consts {
  using C = compute_t<T>;
  static C K(double v) { return static_cast<C>(static_cast<T>(static_cast<C>(v))); }
  C c = K(0.044715), one = K(1.0), k = K(std::sqrt(2.0 / M_PI)), half = K(0.5),
    c3 = K(3 * 0.044715), halfk = K(0.5 * std::sqrt(2.0 / M_PI));
};

template <typename T>
inline compute_t<T> R(compute_t<T> v) {  // an op's result, stored as T
  return static_cast<compute_t<T>>(static_cast<T>(v));
}

// u = ((x * (x^2 * c + 1)) * k), the tanh's argument.
template <typename T>
BT_CPU_CLONES void backward_pre(const T* x, T* u, int64_t n, const Consts<T> q) {
  using C = compute_t<T>;
  for (int64_t i = 0; i < n; ++i) {
    const C xv = static_cast<C>(x[i]);
    const C x2 = R<T>(xv * xv);
    const C b = R<T>(R<T>(x2 * q.c) + q.one);
    u[i] = static_cast<T>(R<T>(xv * b) * q.k);
  }
}

// dx = dy * ((t + 1) * 0.5 + ((x * (1 - t^2)) * (x^2 * 3c + 1)) * 0.5k), t = tanh(u).
template <typename T>
BT_CPU_CLONES void backward_post(const T* x, const T* t, const T* dy, T* dx, int64_t n,
                                 const Consts<T> q) {
  using C = compute_t<T>;
  for (int64_t i = 0; i < n; ++i) {
    const C xv = static_cast<C>(x[i]), tv = static_cast<C>(t[i]);
    const C x2 = R<T>(xv * xv);
    const C left = R<T>(R<T>(tv + q.one) * q.half);
    const C p1 = R<T>(xv * R<T>(q.one - R<T>(tv * tv)));
    const C e1 = R<T>(R<T>(x2 * q.c3) + q.one);
    const C right = R<T>(R<T>(p1 * e1) * q.halfk);
    dx[i] = static_cast<T>(static_cast<C>(dy[i]) * R<T>(left + right));
  }
}

}  // namespace bt::cpu::gelu
