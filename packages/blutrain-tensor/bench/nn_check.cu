// nn_check.cu: standalone check + timing of the softmax / log_softmax and cross-entropy kernels,
// forward and backward: the library's (src/cuda/nn_kernels.cuh, nn_fused_kernels.cuh: v2 for
// every shape, v3 where the launchers take it) and the v1 references that left the library
// (bench/nn_v1_kernels.cuh).  Build and run: bash bench/nn_check.sh [--check | --bench] (needs an
// sm_80+ GPU; built for sm_90a).  Exit status 1 on any FAIL.
//
// Check: bf16 and fp32; R in {1, 7, 300}; C in {1000, 768, 50257} (50257: GPT-2's vocabulary,
// rows that are not whole 16-byte vectors); softmax and log_softmax; cross-entropy with some rows
// ignored (-100), label smoothing 0 and 0.1.  Outputs are poisoned (NaN) before each run; errors
// are max |gpu - ref| / max |ref| against float64 math on the rounded inputs (the backward's
// inputs y / lse are the float64 forward's, rounded as the kernels store them).  Tolerances: bf16
// 8e-3 (the output's rounding, 2^-9 relative, plus float math), fp32 2e-5.  Each variant runs
// twice and must give the same bits.
//
// Timing: (R, C) = (16384, 768) for softmax, (4096, 50257) for cross-entropy (GPT-2's attention
// rows and classifier); cudaEvent median of 15 samples, each the mean of 10 back-to-back calls,
// after 5 warm-ups.  Bytes: the rows read and written once; %copy = a D2D copy of those bytes / 2
// against ours.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "cuda/nn_fused_kernels.cuh"
#include "cuda/nn_kernels.cuh"
#include "nn_v1_kernels.cuh"
#define BT_HARNESS_THROW_STUB 1  // the library's BT_CUDA_CHECK reports, prints and exits
#include "harness_common.cuh"
#include "ln_harness.cuh"  // bf16 / float helpers, timing, summary and main (not layer-norm only)

using namespace bt::cuda;
using namespace bt::cuda::nn;

constexpr int64_t kIgnore = -100;

// One problem: rows x (R, C) in T and what both ops need, on the device and as rounded floats.
template <typename T>
struct Prob {
  int64_t R = 0, C = 0;
  bool lg = false;                                             // softmax: log_softmax
  double ls = 0;                                               // cross-entropy: label smoothing
  T *x = nullptr, *y = nullptr, *dy = nullptr, *dx = nullptr;  // softmax: y given for backward
  int64_t* t = nullptr;
  float *lse = nullptr, *loss = nullptr, *lse_in = nullptr, *scale = nullptr;
  std::vector<float> hx, hy, hdy, hlse_in, hscale;
  std::vector<int64_t> ht;

  void make(int64_t R_, int64_t C_, bool lg_, double ls_, unsigned seed) {
    R = R_, C = C_, lg = lg_, ls = ls_;
    const size_t n = static_cast<size_t>(R) * C;
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    auto fill = [&](std::vector<float>& h, float sc) {
      std::vector<T> v(n);
      h.resize(n);
      for (size_t i = 0; i < n; ++i) {
        v[i] = from_f<T>(nd(rng) * sc);
        h[i] = to_f(v[i]);
      }
      return dcopy(v, 0);
    };
    x = fill(hx, 3.f);
    dy = fill(hdy, 1.f);
    // softmax backward's y: the float64 forward of x, rounded to T
    std::vector<double> ry;
    softmax_ref(ry);
    std::vector<T> yv(n);
    hy.resize(n);
    for (size_t i = 0; i < n; ++i) {
      yv[i] = from_f<T>(static_cast<float>(ry[i]));
      hy[i] = to_f(yv[i]);
    }
    y = dcopy(yv, 0);
    dx = dmalloc<T>(n, 0);
    // cross-entropy: targets (every 5th row ignored), the forward's lse (float) and row scales
    ht.resize(R);
    hlse_in.resize(R);
    hscale.resize(R);
    std::uniform_int_distribution<int64_t> cls(0, C - 1);
    for (int64_t r = 0; r < R; ++r) {
      ht[r] = r % 5 == 3 ? kIgnore : cls(rng);
      double m = -INFINITY, s = 0;
      for (int64_t c = 0; c < C; ++c) m = std::max(m, double(hx[r * C + c]));
      for (int64_t c = 0; c < C; ++c) s += std::exp(double(hx[r * C + c]) - m);
      hlse_in[r] = static_cast<float>(m + std::log(s));
      hscale[r] = ht[r] == kIgnore ? 0.f : 1.f / static_cast<float>(R);
    }
    t = dcopy(ht, 0);
    lse_in = dcopy(hlse_in, 0);
    scale = dcopy(hscale, 0);
    lse = dmalloc<float>(R, 0);
    loss = dmalloc<float>(R, 0);
  }
  void free() {
    for (void* p :
         {static_cast<void*>(x), static_cast<void*>(y), static_cast<void*>(dy),
          static_cast<void*>(dx), static_cast<void*>(t), static_cast<void*>(lse),
          static_cast<void*>(loss), static_cast<void*>(lse_in), static_cast<void*>(scale)}) {
      if (p) CK(cudaFree(p));
    }
  }
  // float64 references
  void softmax_ref(std::vector<double>& ry) const {
    ry.resize(static_cast<size_t>(R) * C);
    for (int64_t r = 0; r < R; ++r) {
      double m = -INFINITY, s = 0;
      for (int64_t c = 0; c < C; ++c) m = std::max(m, double(hx[r * C + c]));
      for (int64_t c = 0; c < C; ++c) s += std::exp(double(hx[r * C + c]) - m);
      for (int64_t c = 0; c < C; ++c) {
        const double v = double(hx[r * C + c]) - m;
        ry[r * C + c] = lg ? v - std::log(s) : std::exp(v) / s;
      }
    }
  }
  void softmax_bwd_ref(std::vector<double>& rdx) const {
    rdx.resize(static_cast<size_t>(R) * C);
    for (int64_t r = 0; r < R; ++r) {
      double s = 0;
      for (int64_t c = 0; c < C; ++c) {
        s += lg ? double(hdy[r * C + c]) : double(hdy[r * C + c]) * hy[r * C + c];
      }
      for (int64_t c = 0; c < C; ++c) {
        const double yv = hy[r * C + c], g = hdy[r * C + c];
        rdx[r * C + c] = lg ? g - std::exp(yv) * s : yv * (g - s);
      }
    }
  }
  void ce_ref(std::vector<double>& rlse, std::vector<double>& rloss) const {
    rlse.resize(R);
    rloss.resize(R);
    for (int64_t r = 0; r < R; ++r) {
      double m = -INFINITY, s = 0, sx = 0;
      for (int64_t c = 0; c < C; ++c) m = std::max(m, double(hx[r * C + c]));
      for (int64_t c = 0; c < C; ++c) {
        s += std::exp(double(hx[r * C + c]) - m);
        sx += hx[r * C + c];
      }
      const double l = m + std::log(s);
      rlse[r] = l;
      const double nll = ht[r] == kIgnore ? 0 : l - hx[r * C + ht[r]];
      rloss[r] = ht[r] == kIgnore ? 0 : (1 - ls) * nll + ls * (l - sx / C);
    }
  }
  void ce_bwd_ref(std::vector<double>& rdx) const {
    rdx.assign(static_cast<size_t>(R) * C, 0.0);
    for (int64_t r = 0; r < R; ++r) {
      if (ht[r] == kIgnore) continue;
      for (int64_t c = 0; c < C; ++c) {
        double d = std::exp(double(hx[r * C + c]) - double(hlse_in[r])) - ls / C;
        if (c == ht[r]) d -= 1 - ls;
        rdx[r * C + c] = d * hscale[r];
      }
    }
  }
};

// A variant runs one op on a problem; false where it does not apply.
template <typename T>
using Runner = std::function<bool(const Prob<T>&)>;
template <typename T>
struct Variant {
  const char* name;
  Runner<T> fn;
};
enum Op { kSoftmaxFwd, kSoftmaxBwd, kCeFwd, kCeBwd };
static const char* op_name(Op op) {
  return op == kSoftmaxFwd   ? "softmax fwd"
         : op == kSoftmaxBwd ? "softmax bwd"
         : op == kCeFwd      ? "ce fwd"
                             : "ce bwd";
}

// ---- the variants: the v1 references and the library's launches (mirroring nn.cu / nn_fused.cu)
template <typename T>
static std::vector<Variant<T>> variants(Op op) {
  switch (op) {
    case kSoftmaxFwd:
      return {
          {"v1 (reference)",
           [](const Prob<T>& p) {
             softmax_forward_v1<T>
                 <<<unsigned(p.R), row_threads(p.C, 1, 256)>>>(p.x, p.dx, p.C, p.lg);
             return true;
           }},
          {"v2",
           [](const Prob<T>& p) {
             dispatch_vec(vec_width<T>({p.x, p.dx}), [&](auto vt) {
               constexpr int V = decltype(vt)::value;
               softmax_forward_v2<T, V>
                   <<<unsigned(p.R), row_threads(p.C, V)>>>(p.x, p.dx, p.C, p.lg);
             });
             return true;
           }},
          {"v3 (lib)",
           [](const Prob<T>& p) {
             return dispatch_v3<T>(p.C, {p.x, p.dx}, [&](auto vt, auto nvt) {
               constexpr int V = decltype(vt)::value, NV = decltype(nvt)::value;
               softmax_forward_v3<T, V, NV><<<unsigned(ceil_div(p.R, kV3Warps)), kV3Warps * 32>>>(
                   p.x, p.dx, p.R, p.C, p.lg);
             });
           }},
      };
    case kSoftmaxBwd:
      return {
          {"v1 (reference)",
           [](const Prob<T>& p) {
             softmax_backward_v1<T>
                 <<<unsigned(p.R), row_threads(p.C, 1, 256)>>>(p.y, p.dy, p.dx, p.C, p.lg);
             return true;
           }},
          {"v2 (lib)",
           [](const Prob<T>& p) {
             dispatch_vec(vec_width<T>({p.y, p.dy, p.dx}), [&](auto vt) {
               constexpr int V = decltype(vt)::value;
               softmax_backward_v2<T, V>
                   <<<unsigned(p.R), row_threads(p.C, V)>>>(p.y, p.dy, p.dx, p.C, p.lg);
             });
             return true;
           }},
      };
    case kCeFwd:
      return {
          {"v1 (reference)",
           [](const Prob<T>& p) {
             crossentropy_forward_v1<T, float, float><<<unsigned(p.R), row_threads(p.C, 1, 256)>>>(
                 p.x, p.C, p.t, p.lse, p.loss, nullptr, p.C, kIgnore, p.ls, nullptr);
             return true;
           }},
          {"v2",
           [](const Prob<T>& p) {
             dispatch_vec(vec_width<T>({p.x}), [&](auto vt) {
               constexpr int V = decltype(vt)::value;
               crossentropy_forward_v2<T, float, float, V>
                   <<<unsigned(p.R), row_threads(p.C, V, 512)>>>(
                       p.x, p.C, p.t, p.lse, p.loss, nullptr, p.C, kIgnore, p.ls, nullptr);
             });
             return true;
           }},
          {"v3 (lib)",
           [](const Prob<T>& p) {
             const int threads = ce_threads(p.C, 16 / sizeof(T));
             auto go = [&](auto kern) {
               kern<<<unsigned(p.R), threads>>>(p.x, p.C, p.t, p.lse, p.loss, nullptr,
                                                static_cast<int>(p.C), kIgnore, p.ls, nullptr);
             };
             if (p.ls != 0) {
               go(crossentropy_forward_v3<T, float, float, true>);
             } else {
               go(crossentropy_forward_v3<T, float, float, false>);
             }
             return true;
           }},
      };
    case kCeBwd:
      return {
          {"v1 (reference)",
           [](const Prob<T>& p) {
             crossentropy_backward_v1<T, float><<<unsigned(p.R), row_threads(p.C, 1, 256)>>>(
                 p.x, p.C, p.t, p.lse_in, p.scale, p.dx, p.C, p.C, kIgnore, p.ls);
             return true;
           }},
          {"v2",
           [](const Prob<T>& p) {
             dispatch_vec(vec_width<T>({p.x, p.dx}), [&](auto vt) {
               constexpr int V = decltype(vt)::value;
               crossentropy_backward_v2<T, float, V><<<unsigned(p.R), row_threads(p.C, V, 512)>>>(
                   p.x, p.C, p.t, p.lse_in, p.scale, p.dx, p.C, p.C, kIgnore, p.ls);
             });
             return true;
           }},
          {"v3 (lib)",
           [](const Prob<T>& p) {
             if (vec_width<T>({p.x, p.dx}) != static_cast<int>(16 / sizeof(T))) return false;
             crossentropy_backward_v3<T, float><<<unsigned(p.R), ce_threads(p.C, 16 / sizeof(T))>>>(
                 p.x, p.C, p.t, p.lse_in, p.scale, p.dx, static_cast<int>(p.C),
                 static_cast<int>(p.C), kIgnore, p.ls);
             return true;
           }},
      };
  }
  return {};
}

// Runs variant v and fetches its outputs (softmax: dx holds y or dx; ce fwd: lse, loss).
template <typename T>
static bool run(const Variant<T>& v, const Prob<T>& p, Op op, std::vector<float>& a,
                std::vector<float>& b) {
  const size_t n = static_cast<size_t>(p.R) * p.C;
  poison(p.dx, n * sizeof(T));
  poison(p.lse, p.R * sizeof(float));
  poison(p.loss, p.R * sizeof(float));
  if (!v.fn(p)) return false;
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  if (op == kCeFwd) {
    fetch(p.lse, p.R, a);
    fetch(p.loss, p.R, b);
  } else {
    fetch(p.dx, n, a);
    b.clear();
  }
  return true;
}

template <typename T>
static void check_all() {
  const double tol = sizeof(T) == 2 ? 8e-3 : 2e-5;
  unsigned seed = 1;
  for (Op op : {kSoftmaxFwd, kSoftmaxBwd, kCeFwd, kCeBwd}) {
    auto vs = variants<T>(op);
    std::vector<double> worst(vs.size(), 0.0);
    std::vector<int> ran(vs.size(), 0);
    for (int64_t C : {1000, 768, 50257}) {
      for (int64_t R : {1, 7, 300}) {
        for (int k = 0; k < 2; ++k) {  // softmax: log_softmax; cross-entropy: label smoothing
          const bool ce = op == kCeFwd || op == kCeBwd;
          Prob<T> p;
          p.make(R, C, !ce && k == 1, ce && k == 1 ? 0.1 : 0.0, seed++);
          std::vector<double> ra, rb;
          if (op == kSoftmaxFwd) p.softmax_ref(ra);
          if (op == kSoftmaxBwd) p.softmax_bwd_ref(ra);
          if (op == kCeFwd) p.ce_ref(ra, rb);
          if (op == kCeBwd) p.ce_bwd_ref(ra);
          for (size_t vi = 0; vi < vs.size(); ++vi) {
            if (!harness_selected(vs[vi].name)) continue;
            std::vector<float> a0, b0, a1, b1;
            if (!run(vs[vi], p, op, a0, b0)) continue;
            run(vs[vi], p, op, a1, b1);
            ++ran[vi];
            const double ea = rel_err_f(a0, ra), eb = rb.empty() ? 0.0 : rel_err_f(b0, rb);
            const bool det = same_bits(a0, a1) && same_bits(b0, b1);
            worst[vi] = std::max({worst[vi], ea, eb});
            // the forward's lse / loss are float for every T: the fp32 tolerance (scaled to the
            // sum of C terms)
            const double t_a = op == kCeFwd ? 2e-5 : tol, t_b = 2e-5;
            if (!(ea <= t_a) || !(eb <= t_b) || !det) {
              std::printf("FAIL %-11s %-15s %s R=%-4lld C=%-5lld %s  err %.3e %.3e%s\n",
                          op_name(op), vs[vi].name, tname<T>(), static_cast<long long>(R),
                          static_cast<long long>(C), k ? (ce ? "ls=0.1" : "log") : "", ea, eb,
                          det ? "" : "  NOT DETERMINISTIC");
              ++g_fail;
            }
          }
          p.free();
        }
      }
    }
    for (size_t vi = 0; vi < vs.size(); ++vi) {
      std::printf("check %-11s %-15s %s  %3d problems  worst rel err %.3e\n", op_name(op),
                  vs[vi].name, tname<T>(), ran[vi], worst[vi]);
    }
  }
}

template <typename T>
static void bench_all() {
  for (Op op : {kSoftmaxFwd, kSoftmaxBwd, kCeFwd, kCeBwd}) {
    const bool ce = op == kCeFwd || op == kCeBwd;
    const int64_t R = ce ? 4096 : 16384, C = ce ? 50257 : 768;
    Prob<T> p;
    p.make(R, C, false, 0.0, 77u);
    const size_t n = static_cast<size_t>(R) * C;
    // bytes moved: softmax fwd x + y, bwd y + dy + dx; ce fwd x, bwd x + dx
    const size_t bytes = n * sizeof(T) * (op == kSoftmaxBwd ? 3 : op == kCeFwd ? 1 : 2);
    void *ca, *cb;
    CK(cudaMalloc(&ca, bytes / 2 + 16));
    CK(cudaMalloc(&cb, bytes / 2 + 16));
    const float copy =
        median_ms([&] { CK(cudaMemcpyAsync(cb, ca, bytes / 2, cudaMemcpyDeviceToDevice)); });
    std::printf("\n%s %s R=%lld C=%lld: copy %.4f ms\n", op_name(op), tname<T>(),
                static_cast<long long>(R), static_cast<long long>(C), copy);
    CaseSummary sum;
    sum.name = std::string(op_name(op)) + " " + tname<T>();
    for (const auto& v : variants<T>(op)) {
      if (!harness_selected(v.name)) continue;
      bool applies = true;
      const float ms = median_ms([&] { applies = v.fn(p) && applies; });
      CK(cudaGetLastError());
      if (!applies) continue;
      const float pct = 100.f * copy / ms;
      std::printf("  %-15s %8.4f ms  %6.1f GB/s  %5.1f%% copy\n", v.name, ms, bytes / (ms * 1e6),
                  pct);
      if (std::string(v.name).find("(lib)") != std::string::npos)
        sum.def = v.name, sum.def_pct = pct;
      if (pct > sum.best_pct) sum.best = v.name, sum.best_pct = pct;
    }
    g_summary.push_back(sum);
    CK(cudaFree(ca));
    CK(cudaFree(cb));
    p.free();
  }
}

int main(int argc, char** argv) {
  return ln_harness_main(
      argc, argv, "nn_check", "",
      [] {
        check_all<bf16>();
        check_all<float>();
      },
      [] {
        bench_all<bf16>();
        bench_all<float>();
      });
}
