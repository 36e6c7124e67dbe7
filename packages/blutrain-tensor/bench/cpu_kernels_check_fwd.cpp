// bench/cpu_kernels_check_fwd.cpp: the kernels compiled as nn.cpp and elementwise.cpp compile
// them, FMA contraction on (see cpu_kernels_check.cpp): the softmax forward rows against v1,
// and the Tanh op's loop for the GELU backward check.
#include <cstdio>

#include "../src/cpu/softmax_kernels.h"
#include "../src/dtype.h"
#include "cpu_kernels_check.h"

using bt::bfloat16;
using bt::float16;

template <typename T>
void tanh_loop(const T* a, T* o, int64_t n) {
  using C = bt::compute_t<T>;
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<C, float>) {
      o[i] = static_cast<T>(bt::cpu::fast_tanh(static_cast<C>(a[i])));
    } else {
      o[i] = static_cast<T>(std::tanh(static_cast<C>(a[i])));
    }
  }
}
template void tanh_loop<float>(const float*, float*, int64_t);
template void tanh_loop<double>(const double*, double*, int64_t);
template void tanh_loop<bfloat16>(const bfloat16*, bfloat16*, int64_t);
template void tanh_loop<float16>(const float16*, float16*, int64_t);

namespace {
using namespace bt::cpu::softmax;

// v1: max, exp-sum, then the output pass with its own exp (softmax) or (p - m) - log(s) (log_softmax).
template <typename T>
void softmax_v1(const T* xp, T* o, int64_t rows, int64_t C, bool lg) {
  using A = bt::compute_t<T>;
  for (int64_t r = 0; r < rows; ++r) {
    const T* p = xp + r * C;
    T* q = o + r * C;
    A m = row_max<A>(p, C);
    if (std::isinf(m) && m < 0) m = 0;
    const double s = row_exp_sum<A>(p, C, m);
    softmax_row_out<A>(p, q, C, m, static_cast<A>(1.0 / s), static_cast<A>(std::log(s)), lg);
  }
}

void softmax_now(const float* xp, float* o, int64_t rows, int64_t C) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* p = xp + r * C;
    float* q = o + r * C;
    float m = row_max<float>(p, C);
    if (std::isinf(m) && m < 0) m = 0;
    const double s = row_exp_sum_store(p, q, C, m);
    scale_row(q, C, static_cast<float>(1.0 / s));
  }
}
}  // namespace

void check_softmax_forward(int reps) {
  std::mt19937_64 g(99);
  const int64_t shapes[][2] = {{1, 1}, {3, 5}, {7, 127}, {4096, 128}, {2048, 1024}, {16, 50304}};
  for (const auto& sh : shapes) {
    const int64_t R = sh[0], C = sh[1];
    auto x = random_rows<float>(R, C, g, true);
    if (R > 6) {  // a masked row (causal attention): -inf but for the first column; all -inf
      for (int64_t i = 1; i < C; ++i) x[6 * C + i] = -std::numeric_limits<float>::infinity();
    }
    std::vector<float> a(x.size()), b(x.size());
    const double ta = best_ms(reps, [&] { softmax_v1<float>(x.data(), a.data(), R, C, false); });
    const double tb = best_ms(reps, [&] { softmax_now(x.data(), b.data(), R, C); });
    report("softmax", "float32", R, C, same_bits(a, b), ta, tb);
  }
}
