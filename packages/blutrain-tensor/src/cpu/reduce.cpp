// cpu/reduce.cpp: reductions (sum, mean, max, min, var, argmax, argmin) on the CPU.
// One output element per work item (ranges of outputs on the thread pool); the reduced dims are
// walked with their own strides, so no copy is made.  Floats accumulate in double, ints in int64,
// each output's elements added in index order. Over one reduced dim, float sums and max / min run
// the lane kernels of reduce_kernels.h (Note [row sums in lanes], Note [exact row sums]), which
// give the scalar loops' bits.
// Compiled with -ffp-contract=off (CMakeLists.txt): Var's (x - mean)^2 sums stay unfused in the
// AVX2 / AVX-512 clones of the kernels.
#include <cmath>
#include <limits>
#include <type_traits>

#include "../primitives.h"
#include "loops.h"
#include "reduce_kernels.h"

namespace bt {

namespace {
struct Geometry {
  Shape kshape;  // kept dims (input order)
  Strides kstride;
  Shape rshape;  // reduced dims
  Strides rstride;
  int64_t R = 1;
  int64_t nout = 1;
};

Geometry make_geometry(const Tensor& x, const std::vector<int64_t>& dims) {
  Geometry g;
  std::vector<bool> red(x.ndim(), false);
  for (auto d : dims) red[d] = true;
  for (int64_t d = 0; d < x.ndim(); ++d) {
    if (red[d]) {
      g.rshape.push_back(x.shape()[d]);
      g.rstride.push_back(x.strides()[d]);
      g.R *= x.shape()[d];
    } else {
      g.kshape.push_back(x.shape()[d]);
      g.kstride.push_back(x.strides()[d]);
      g.nout *= x.shape()[d];
    }
  }
  return g;
}

inline int64_t kept_offset(const Geometry& g, int64_t o) {
  int64_t off = 0;
  for (int64_t d = static_cast<int64_t>(g.kshape.size()) - 1; d >= 0; --d) {
    off += (o % g.kshape[d]) * g.kstride[d];
    o /= g.kshape[d];
  }
  return off;
}

// Calls f(value) for every reduced element of output o, in row-major order of the reduced dims.
template <typename T, typename F>
inline void visit(const Geometry& g, const T* base, F&& f) {
  const int64_t nd = static_cast<int64_t>(g.rshape.size());
  if (nd == 0) {
    f(base[0]);
    return;
  }
  const int64_t inner = g.rshape[nd - 1], is = g.rstride[nd - 1];
  const int64_t outer = g.R / std::max<int64_t>(inner, 1);
  for (int64_t r = 0; r < outer; ++r) {
    int64_t off = 0, rem = r;
    for (int64_t d = nd - 2; d >= 0; --d) {
      off += (rem % g.rshape[d]) * g.rstride[d];
      rem /= g.rshape[d];
    }
    const T* p = base + off;
    if (is == 1) {
      for (int64_t i = 0; i < inner; ++i) f(p[i]);
    } else {
      for (int64_t i = 0; i < inner; ++i) f(p[i * is]);
    }
  }
}
}  // namespace

#ifdef BT_REDUCE_LANES
// Sums of outputs [i0, i1) of a one-dim reduction of float elements by the lane kernels, store(i,
// sum) each; returns the first output left to the caller's scalar loop. Contiguous rows of 64
// elements or more: blocks of 8 rows, each row's sum proven exact in any order or else the block
// in lanes; the range's last rows one by one. Adjacent outputs (the reduced dim strided, the
// innermost kept one contiguous): 16 or 8 outputs' elements j at once.
template <typename T, typename Store>
int64_t lane_sums(const Geometry& g, const T* xb, int64_t i0, int64_t i1, Store&& store) {
  namespace rk = cpu::reduce;
  constexpr int kBlock = rk::kRowLanes * rk::kRowGroups;
  // The row length (elements) from which the lanes and the exact sums beat the caller's 8 chains
  // (2M float32 elements in short rows, one core: n = 4 1.07 ms there, 4.9 in the exact sums;
  // n = 32 0.60 vs 0.82; n = 64 0.55 vs 0.44).
  constexpr int64_t kMinRow = 64;
  const int64_t R = g.R, st = g.rstride[0];
  double s[16];
  int64_t i = i0;
  if (st == 1) {
    if (R < kMinRow) return i;  // short rows: the caller's 8 chains (per-row costs here)
    const T* p[kBlock];
    for (; i + kBlock <= i1; i += kBlock) {
      for (int k = 0; k < kBlock; ++k) p[k] = xb + kept_offset(g, i + k);
      bool exact = !std::is_same_v<T, double>;
      if constexpr (!std::is_same_v<T, double>) {
        for (int k = 0; k < kBlock && exact; ++k) exact = rk::sum_row_exact(p[k], R, s + k);
      }
      if (!exact) rk::sum_rows_block(p, R, s);
      for (int k = 0; k < kBlock; ++k) store(i + k, s[k]);
    }
    for (; i < i1; ++i) {  // the range's last rows: exact sums, else one chain each
      const T* q = xb + kept_offset(g, i);
      bool exact = false;
      if constexpr (!std::is_same_v<T, double>) exact = rk::sum_row_exact(q, R, s);
      store(i, exact ? s[0] : rk::sum_row(q, R, 1));
    }
    return i;
  }
  if (g.kshape.empty() || g.kstride.back() != 1) return i;
  const int64_t inner = g.kshape.back();
  while (i < i1) {
    const int64_t end = std::min(i1, i - i % inner + inner);  // this run of adjacent outputs
    for (; i + 16 <= end; i += 16) {
      rk::sum_cols_block(xb + kept_offset(g, i), R, st, s);
      for (int k = 0; k < 16; ++k) store(i + k, s[k]);
    }
    for (; i + 8 <= end; i += 8) {
      rk::sum_cols_group(xb + kept_offset(g, i), R, st, s);
      for (int k = 0; k < 8; ++k) store(i + k, s[k]);
    }
    for (; i < end; ++i) store(i, rk::sum_row(xb + kept_offset(g, i), R, st));
  }
  return i;
}
#endif

// Sum/mean over the leading dims of a contiguous tensor (a bias gradient: (N, C) -> (C)): walk
// rows in memory order, accumulating into a row of accumulators (vectorisable), columns split
// across threads.
template <typename T, typename O>
static void reduce_leading(const Tensor& x, const Tensor& out, int64_t R, int64_t N, bool mean,
                           const char* nm) {
  using C = compute_t<T>;
  using A = acc_t<T>;
  const T* xp = static_cast<const T*>(x.data_ptr(nm));
  O* o = static_cast<O*>(out.data_ptr(nm));
  constexpr int64_t kCols = 1024;
  cpu::parallel_for((N + kCols - 1) / kCols, R * kCols, [&](int64_t blk) {
    const int64_t j0 = blk * kCols, j1 = std::min(N, j0 + kCols);
    A acc[kCols] = {};
    for (int64_t r = 0; r < R; ++r) {
      const T* row = xp + r * N;
      for (int64_t j = j0; j < j1; ++j) acc[j - j0] += static_cast<A>(static_cast<C>(row[j]));
    }
    for (int64_t j = j0; j < j1; ++j) {
      if (mean) {
        o[j] = static_cast<O>(static_cast<double>(acc[j - j0]) / static_cast<double>(R));
      } else {
        o[j] = static_cast<O>(static_cast<compute_t<O>>(acc[j - j0]));
      }
    }
  });
}

void Reduce::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  const Tensor& x = in[0];
  const Geometry g = make_geometry(x, dims);
  bool leading = (op == ReduceOp::Sum || op == ReduceOp::Mean) && x.is_contiguous() &&
                 !dims.empty() && g.nout > 1;
  for (size_t i = 0; leading && i < dims.size(); ++i) leading = dims[i] == static_cast<int64_t>(i);
  if (leading) {
    dispatch_all(x.dtype(), name(), [&](auto tag) {
      using T = typename decltype(tag)::type;
      dispatch_all(out[0].dtype(), name(), [&](auto otag) {
        using O = typename decltype(otag)::type;
        reduce_leading<T, O>(x, out[0], g.R, g.nout, op == ReduceOp::Mean, name());
      });
    });
    return;
  }
  dispatch_all(x.dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = compute_t<T>;
    using A = acc_t<T>;
    const T* xb = static_cast<const T*>(x.data_ptr(name()));
    dispatch_all(out[0].dtype(), name(), [&](auto otag) {
      using O = typename decltype(otag)::type;
      O* o = static_cast<O*>(out[0].data_ptr(name()));
      const ReduceOp rop = op;
      const double corr = correction;
      auto store_sum = [&](int64_t i, A acc) {
        if (rop == ReduceOp::Mean) {
          o[i] = static_cast<O>(static_cast<double>(acc) / static_cast<double>(g.R));
        } else {
          o[i] = static_cast<O>(static_cast<compute_t<O>>(acc));
        }
      };
      if ((rop == ReduceOp::Sum || rop == ReduceOp::Mean) && g.rshape.size() == 1) {
        // One reduced dim (a row sum): kSums outputs' sums side by side, each in its own order
        // (a single running sum is a chain of dependent adds).
        constexpr int kSums = 8;
        const int64_t R = g.R, st = g.rstride[0];
        const int64_t grain = std::max<int64_t>(1, cpu::kChunk / std::max<int64_t>(R, 1));
        auto rows = [&](int64_t i0, int64_t i1) {
          int64_t i = i0;
#ifdef BT_REDUCE_LANES
          if constexpr (std::is_floating_point_v<C>) {
            if (cpu::reduce::lanes_enabled()) {
              // a NaN sum as the default quiet NaN, as Max / Min give: which NaN an add returns
              // when both operands are NaNs is the compiler's operand order (Note [row sums in
              // lanes]); the chains below keep theirs (a select there: short rows 1.4x slower)
              i = lane_sums(g, xb, i0, i1, [&](int64_t k, double v) {
                store_sum(k, v != v ? std::numeric_limits<double>::quiet_NaN() : v);
              });
            }
          }
#endif
          for (; i + kSums <= i1; i += kSums) {
            const T* p[kSums];
            A acc[kSums];
            for (int k = 0; k < kSums; ++k) {
              p[k] = xb + kept_offset(g, i + k);
              acc[k] = 0;
            }
            for (int64_t j = 0; j < R; ++j) {
              for (int k = 0; k < kSums; ++k)
                acc[k] += static_cast<A>(static_cast<C>(p[k][j * st]));
            }
            for (int k = 0; k < kSums; ++k) store_sum(i + k, acc[k]);
          }
          for (; i < i1; ++i) {  // the last < kSums outputs of the range
            const T* q = xb + kept_offset(g, i);
            A acc = 0;
            for (int64_t j = 0; j < R; ++j) acc += static_cast<A>(static_cast<C>(q[j * st]));
            store_sum(i, acc);
          }
        };
        cpu::parallel_ranges(g.nout, g.nout * R >= cpu::kParallelMin ? grain : g.nout, rows);
        return;
      }
#ifdef BT_REDUCE_LANES
      if constexpr (std::is_floating_point_v<C>) {
        // max / min of contiguous rows in lanes (reduce_kernels.h: extreme_row), the scalar
        // loop's bits
        if ((rop == ReduceOp::Max || rop == ReduceOp::Min) && g.rshape.size() == 1 &&
            g.rstride[0] == 1 && cpu::reduce::lanes_enabled()) {
          const bool is_max = rop == ReduceOp::Max;
          cpu::parallel_for(g.nout, g.R, [&](int64_t i) {
            const T* base = xb + kept_offset(g, i);
            C best;
            const bool done = is_max ? cpu::reduce::extreme_row<true>(base, g.R, &best)
                                     : cpu::reduce::extreme_row<false>(base, g.R, &best);
            if (!done) {
              best = is_max ? cpu::reduce::extreme_row_scalar<true>(base, g.R, 1)
                            : cpu::reduce::extreme_row_scalar<false>(base, g.R, 1);
            }
            o[i] = static_cast<O>(best);
          });
          return;
        }
      }
#endif
      cpu::parallel_for(g.nout, g.R, [&](int64_t i) {
        const T* base = xb + kept_offset(g, i);
        if (rop == ReduceOp::Sum || rop == ReduceOp::Mean) {
          A acc = 0;
          visit(g, base, [&](T v) { acc += static_cast<A>(static_cast<C>(v)); });
          if (rop == ReduceOp::Mean) {
            o[i] = static_cast<O>(static_cast<double>(acc) / static_cast<double>(g.R));
          } else {
            o[i] = static_cast<O>(static_cast<compute_t<O>>(acc));
          }
        } else if (rop == ReduceOp::Max || rop == ReduceOp::Min) {
          C best = static_cast<C>(base[0]);
          bool nan = false;
          visit(g, base, [&](T v) {
            const C c = static_cast<C>(v);
            if (c != c) nan = true;
            if (rop == ReduceOp::Max ? (c > best) : (c < best)) best = c;
          });
          if constexpr (std::is_floating_point<C>::value) {
            if (nan) best = std::numeric_limits<C>::quiet_NaN();
          }
          o[i] = static_cast<O>(best);
        } else {  // Var: two passes in double
          double s = 0;
          visit(g, base, [&](T v) { s += static_cast<double>(static_cast<C>(v)); });
          const double mean = s / static_cast<double>(g.R);
          double ss = 0;
          visit(g, base, [&](T v) {
            const double d = static_cast<double>(static_cast<C>(v)) - mean;
            ss += d * d;
          });
          // (PyTorch's: the degrees of freedom clamp at 0 (fmax: a NaN correction too), so inf
          // or 0 / 0; no elements: NaN)
          const double denom = std::fmax(static_cast<double>(g.R) - corr, 0.0);
          o[i] = static_cast<O>(g.R == 0 ? std::numeric_limits<double>::quiet_NaN() : ss / denom);
        }
      });
    });
  });
}

void ArgReduce::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  const Tensor& x = in[0];
  const Geometry g = make_geometry(x, {dim});
  dispatch_all(x.dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = compute_t<T>;
    const T* xb = static_cast<const T*>(x.data_ptr(name()));
    int64_t* o = static_cast<int64_t*>(out[0].data_ptr(name()));
    const int64_t n = g.R, st = g.rstride[0];
    cpu::parallel_for(g.nout, n, [&](int64_t i) {
      const T* p = xb + kept_offset(g, i);
      C best = static_cast<C>(p[0]);
      int64_t bi = 0;
      for (int64_t j = 1; j < n; ++j) {
        const C c = static_cast<C>(p[j * st]);
        if (best != best) break;  // NaN wins (first NaN), as in PyTorch
        if (c != c || (is_max ? c > best : c < best)) {
          best = c;
          bi = j;
        }
      }
      o[i] = bi;
    });
  });
}

}  // namespace bt
