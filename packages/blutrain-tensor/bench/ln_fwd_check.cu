// ln_fwd_check.cu: standalone check + timing of the layer-norm forward kernels of
// src/cuda/nn_kernels.cuh (v2, v3, v4 and v6 configurations; with the residual add of
// add_layer_norm or without) and of the v1 reference (bench/nn_v1_kernels.cuh; no residual).  Build
// and run: bash bench/ln_fwd_check.sh [--check | --bench] (needs an sm_90 GPU).  Exit status 1 on
// any FAIL.
//
// Check: bf16 and fp32; R in {1, 7, 300, 4096}; C in {768, 3072, 1000, 96} (each variant where it
// applies: rows of whole 16-byte vectors); weight + bias, weight only, neither; with and without
// the residual.  y, the sum, mean and rstd are poisoned (NaN) before each run.  Errors against
// float64 math on the rounded inputs (the sum rounded to the dtype first, as the kernels do):
// y and the sum as max |gpu - ref| / max |ref|, mean and rstd relative per row.  Tolerances: y
// bf16 4e-3 (its rounding, 2^-9 relative, plus float math), fp32 2e-5; the sum bf16 4e-3, fp32 0;
// mean / rstd 2e-5.  Each variant runs twice and must give the same bits.
//
// Timing: bf16 and fp32, (R, C) = (16384, 768) and (4096, 3072) (the same bytes; bench_cuda_nn.py's
// rows), weight + bias, with and without the residual; cudaEvent median of 15 samples, each the
// mean of 10 back-to-back calls, after 5 warm-ups.  Bytes: x (+ residual) read, y (+ sum) written
// (weight, bias and the statistics not counted).  "copy": cudaMemcpyAsync D2D of bytes / 2 (it
// reads and writes, so it moves the same bytes); %copy = copy ms / ours ms.  The summary gives,
// per case, the library default's %copy and the best variant's.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/nn_kernels.cuh"
#include "nn_v1_kernels.cuh"
#define BT_HARNESS_THROW_STUB 1  // the library's BT_CUDA_CHECK reports, prints and exits
#include "harness_common.cuh"
#include "ln_harness.cuh"

using namespace bt::cuda;
using namespace bt::cuda::nn;
struct LaunchNote {  // what the last runner launched, for the bench's columns
  const void* kern = nullptr;
  int grid = 0, threads = 0;
  size_t smem = 0;
};
static LaunchNote g_note;

template <typename T>
struct Prob {
  int64_t R = 0, C = 0;
  bool has_w = false, has_b = false, add = false;
  T *x = nullptr, *res = nullptr, *w = nullptr, *b = nullptr, *y = nullptr, *sum = nullptr;
  float *mean = nullptr, *rstd = nullptr;
  std::vector<float> hx, hres, hw, hb;

  void make(int64_t R_, int64_t C_, bool w_, bool b_, bool add_, unsigned seed) {
    R = R_, C = C_, has_w = w_, has_b = b_, add = add_;
    const size_t n = static_cast<size_t>(R) * C;
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    auto fill = [&](std::vector<float>& h, size_t m, float sc, float sh, T** dev) {
      std::vector<T> t(m);
      h.resize(m);
      for (size_t i = 0; i < m; ++i) {
        t[i] = from_f<T>(nd(rng) * sc + sh);
        h[i] = to_f(t[i]);
      }
      *dev = dcopy(t, 0);
    };
    fill(hx, n, 2.f, 0.5f, &x);
    if (add) fill(hres, n, 1.f, -0.25f, &res);
    if (has_w) fill(hw, C, 0.5f, 1.f, &w);
    if (has_b) fill(hb, C, 0.5f, 0.f, &b);
    y = dmalloc<T>(n, 0);
    if (add) sum = dmalloc<T>(n, 0);
    mean = dmalloc<float>(R, 0);
    rstd = dmalloc<float>(R, 0);
  }
  void poison() const {
    ::poison(y, static_cast<size_t>(R) * C * sizeof(T));
    if (add) ::poison(sum, static_cast<size_t>(R) * C * sizeof(T));
    ::poison(mean, R * sizeof(float));
    ::poison(rstd, R * sizeof(float));
  }
  const T* resp() const { return add ? res : nullptr; }
  const T* wp() const { return has_w ? w : nullptr; }
  const T* bp() const { return has_b ? b : nullptr; }
  void free() {
    for (void* p : {static_cast<void*>(x), static_cast<void*>(res), static_cast<void*>(w),
                    static_cast<void*>(b), static_cast<void*>(y), static_cast<void*>(sum),
                    static_cast<void*>(mean), static_cast<void*>(rstd)}) {
      if (p) CK(cudaFree(p));
    }
  }
  // float64 reference: the sum (rounded to T, as the kernels round it), y, mean, rstd
  void reference(std::vector<double>& rs, std::vector<double>& ry, std::vector<double>& rm,
                 std::vector<double>& rr) const {
    const size_t n = static_cast<size_t>(R) * C;
    rs.resize(n);
    ry.resize(n);
    rm.resize(R);
    rr.resize(R);
    for (size_t i = 0; i < n; ++i) {
      rs[i] = add ? to_f(from_f<T>(hx[i] + hres[i])) : hx[i];
    }
    for (int64_t r = 0; r < R; ++r) {
      double s = 0, s2 = 0;
      for (int64_t c = 0; c < C; ++c) s += rs[r * C + c];
      const double m = s / C;
      for (int64_t c = 0; c < C; ++c) s2 += (rs[r * C + c] - m) * (rs[r * C + c] - m);
      const double ir = 1.0 / std::sqrt(s2 / C + 1e-5);
      rm[r] = m, rr[r] = ir;
      for (int64_t c = 0; c < C; ++c) {
        ry[r * C + c] = (rs[r * C + c] - m) * ir * (has_w ? hw[c] : 1.0) + (has_b ? hb[c] : 0.0);
      }
    }
  }
};

template <typename T>
using Runner = std::function<bool(const Prob<T>&)>;

// the v1 reference (no residual add: the library's v1 path took none)
template <typename T>
static bool run_v1(const Prob<T>& p) {
  if (p.add) return false;
  const unsigned grid = static_cast<unsigned>(p.R);
  const int threads = row_threads(p.C, 1, 256);
  auto kern = layernorm_forward_v1<T, float>;
  g_note = {reinterpret_cast<const void*>(kern), static_cast<int>(grid), threads, 0};
  kern<<<grid, threads>>>(p.x, p.wp(), p.bp(), p.y, p.mean, p.rstd, p.C, 1e-5);
  CK(cudaGetLastError());
  return true;
}

// mirrors layernorm_forward's v2 branch (every shape)
template <typename T>
static bool run_v2(const Prob<T>& p) {
  const bool rows_aligned = (p.C * sizeof(T)) % 16 == 0 || (!p.wp() && !p.bp());
  const int vw = !rows_aligned ? 1 : vec_width<T>({p.x, p.resp(), p.wp(), p.bp(), p.y, p.sum});
  dispatch_vec(vw, [&](auto vtag) {
    constexpr int V = decltype(vtag)::value;
    const int threads = row_threads(p.C, V);
    const unsigned grid = static_cast<unsigned>(p.R);
    auto kern =
        p.add ? layernorm_forward_v2<T, float, V, true> : layernorm_forward_v2<T, float, V, false>;
    g_note = {reinterpret_cast<const void*>(kern), static_cast<int>(grid), threads, 0};
    kern<<<grid, threads>>>(p.x, p.resp(), p.wp(), p.bp(), p.sum, p.y, p.mean, p.rstd, p.C, 1e-5);
    CK(cudaGetLastError());
  });
  return true;
}

// mirrors layernorm_forward's v3 branch
template <typename T>
static bool run_v3(const Prob<T>& p) {
  return dispatch_v3<T>(p.C, {p.x, p.resp(), p.wp(), p.bp(), p.y, p.sum}, [&](auto vt, auto nvt) {
    constexpr int V = decltype(vt)::value, NV = decltype(nvt)::value;
    const unsigned grid = static_cast<unsigned>(ceil_div(p.R, kV3Warps));
    auto kern = p.add ? layernorm_forward_v3<T, float, V, NV, true>
                      : layernorm_forward_v3<T, float, V, NV, false>;
    g_note = {reinterpret_cast<const void*>(kern), static_cast<int>(grid), kV3Warps * 32, 0};
    // (through a pointer the residual bias has no default: none, as layernorm_forward)
    kern<<<grid, kV3Warps * 32>>>(p.x, p.resp(), p.wp(), p.bp(), p.sum, p.y, p.mean, p.rstd, p.R,
                                  p.C, 1e-5, nullptr);
    CK(cudaGetLastError());
  });
}

// mirrors layernorm_forward's v4 branch (run wherever dispatch_v4 applies)
template <typename T>
static bool run_v4(const Prob<T>& p) {
  return dispatch_v4<T>(
      p.C, {p.x, p.resp(), p.wp(), p.bp(), p.y, p.sum}, [&](auto vt, auto nvt, auto wt) {
        constexpr int V = decltype(vt)::value, NV = decltype(nvt)::value;
        constexpr int WPR = decltype(wt)::value;
        const unsigned grid = static_cast<unsigned>(ceil_div(p.R, kV4Warps / WPR));
        auto kern = p.add ? layernorm_forward_v4<T, float, V, NV, WPR, true>
                          : layernorm_forward_v4<T, float, V, NV, WPR, false>;
        g_note = {reinterpret_cast<const void*>(kern), static_cast<int>(grid), kV4Warps * 32, 0};
        kern<<<grid, kV4Warps * 32>>>(p.x, p.resp(), p.wp(), p.bp(), p.sum, p.y, p.mean, p.rstd,
                                      p.R, p.C, 1e-5);
        CK(cudaGetLastError());
      });
}

// Resident blocks per SM by (kernel, C): the occupancy query runs once per configuration.
static std::map<std::tuple<const void*, int64_t>, int> g_per_sm;

// v6 with NW warps per block and K ring slots per row group
template <typename T, int NW, int K>
static bool run_v6(const Prob<T>& p) {
  return dispatch_v5<T>(p.C, {p.x, p.resp(), p.wp(), p.bp(), p.y, p.sum}, [&](auto nvt, auto wt) {
    constexpr int NV = decltype(nvt)::value, WPR = decltype(wt)::value;
    if constexpr (WPR > NW || (WPR > 1 && NW / WPR >= 16)) {  // group_sum2's named barriers
      return false;
    } else {
      auto go = [&](auto addt) {
        using L = LnFwdV6<T, float, NV, WPR, NW, K, decltype(addt)::value>;
        const auto key = std::make_tuple(reinterpret_cast<const void*>(L::kernel()), p.C);
        auto it = g_per_sm.find(key);
        if (it == g_per_sm.end()) {
          it = g_per_sm.emplace(key, L::per_sm(p.C, g_optin, g_major, "v6")).first;
        }
        if (it->second == 0) return false;
        const int G = L::grid(p.R, it->second, g_sms);
        g_note = {reinterpret_cast<const void*>(L::kernel()), G, L::kThreads, L::smem(p.C)};
        L::launch(G, 0, p.x, p.resp(), p.wp(), p.bp(), p.sum, p.y, p.mean, p.rstd, p.R, p.C, 1e-5);
        CK(cudaGetLastError());
        return true;
      };
      return p.add ? go(std::true_type{}) : go(std::false_type{});
    }
  });
}

static_assert(kLnFwdV6Warps == 16 && kLnFwdV6Stages == 3, "v6 (lib) variant name");

template <typename T>
struct Variant {
  const char* name;
  Runner<T> fn;
};

template <typename T>
static std::vector<Variant<T>> variants() {
  // session 15 also swept nw4 k2 / k4, nw8 k4, nw16 k4 (within 2% of these or slower) and nw32 k2
  // (64 registers: spills, 42-87% of copy)
  return {
      {"v1 (reference)", run_v1<T>},
      {"v2", run_v2<T>},
      {"v3", run_v3<T>},
      {"v4", run_v4<T>},
      {"v6 nw4 k3", run_v6<T, 4, 3>},
      {"v6 nw8 k2", run_v6<T, 8, 2>},
      {"v6 nw8 k3", run_v6<T, 8, 3>},
      {"v6 nw16 k2", run_v6<T, 16, 2>},
      {"v6 nw16 k3 (lib)", run_v6<T, 16, 3>},
  };
}

// The variant layernorm_forward runs by default for rows of C.
template <typename T>
static const char* default_variant(int64_t C) {
  if (ln_fwd_v6_default<T>(C)) return "v6 nw16 k3 (lib)";
  return C > kV4MinDefaultC ? "v4" : "v3";
}

// max over i of |g[i] - r[i]| / |r[i]| (per-row statistics)
static double rel_each(const std::vector<float>& g, const std::vector<double>& r) {
  double e = 0;
  for (size_t i = 0; i < r.size(); ++i) {
    if (!std::isfinite(g[i])) return INFINITY;
    e = std::max(e, std::fabs(g[i] - r[i]) / std::max(std::fabs(r[i]), 1e-30));
  }
  return e;
}

template <typename T>
static void check_all() {
  const double tol_y = sizeof(T) == 2 ? 4e-3 : 2e-5, tol_s = sizeof(T) == 2 ? 4e-3 : 0.0;
  const double tol_st = 2e-5;
  const int64_t Rs[] = {1, 7, 300, 4096};
  const int64_t Cs[] = {768, 3072, 1000, 96};
  struct Combo {
    const char* name;
    bool w, b;
  };
  const Combo combos[] = {{"w+b", true, true}, {"w", true, false}, {"none", false, false}};
  auto vs = variants<T>();
  std::vector<double> worst(vs.size(), 0.0);
  std::vector<int> ran(vs.size(), 0);
  unsigned seed = 1;
  for (int64_t C : Cs) {
    for (int64_t R : Rs) {
      if (R > 300 && std::getenv("BT_CHECK_SMALL")) continue;  // (under compute-sanitizer)
      for (const Combo& cb : combos) {
        for (int add = 0; add < 2; ++add) {
          Prob<T> p;
          p.make(R, C, cb.w, cb.b, add != 0, seed++);
          std::vector<double> rs, ry, rm, rr;
          p.reference(rs, ry, rm, rr);
          const size_t n = static_cast<size_t>(R) * C;
          for (size_t vi = 0; vi < vs.size(); ++vi) {
            if (!harness_selected(vs[vi].name)) continue;
            std::vector<float> out[2][4];
            bool applies = true;
            for (int rep = 0; rep < 2 && applies; ++rep) {
              p.poison();
              applies = vs[vi].fn(p);
              if (!applies) break;
              CK(cudaDeviceSynchronize());
              fetch(p.y, n, out[rep][0]);
              if (add) fetch(p.sum, n, out[rep][1]);
              fetch(p.mean, R, out[rep][2]);
              fetch(p.rstd, R, out[rep][3]);
            }
            if (!applies) continue;
            ++ran[vi];
            const double ey = rel_err_f(out[0][0], ry);
            const double es = add ? rel_err_f(out[0][1], rs) : 0.0;
            const double em = rel_err_f(out[0][2], rm);  // means near 0: relative to the largest
            const double er = rel_each(out[0][3], rr);
            bool det = true;
            for (int k = 0; k < 4; ++k) det = det && same_bits(out[0][k], out[1][k]);
            worst[vi] = std::max({worst[vi], ey, es, em, er});
            if (!(ey <= tol_y) || !(es <= tol_s) || !(em <= tol_st) || !(er <= tol_st) || !det) {
              std::printf(
                  "FAIL %-18s %s R=%-5lld C=%-4lld %-5s add=%d  y %.3e  sum %.3e  mean %.3e  "
                  "rstd %.3e%s\n",
                  vs[vi].name, tname<T>(), static_cast<long long>(R), static_cast<long long>(C),
                  cb.name, add, ey, es, em, er, det ? "" : "  NOT DETERMINISTIC");
              ++g_fail;
            }
          }
          p.free();
        }
      }
    }
  }
  for (size_t vi = 0; vi < vs.size(); ++vi) {
    std::printf("check %-18s %s  %3d problems  worst rel err %.3e\n", vs[vi].name, tname<T>(),
                ran[vi], worst[vi]);
  }
}

template <typename T>
static void bench_all() {
  auto vs = variants<T>();
  for (int64_t C : {768, 3072}) {
    for (int add = 0; add < 2; ++add) {
      const int64_t R = 16384 * 768 / C;
      Prob<T> p;
      p.make(R, C, true, true, add != 0, 77u);
      const size_t bytes = (add ? 4 : 2) * static_cast<size_t>(R) * C * sizeof(T);
      void *ca, *cb;
      CK(cudaMalloc(&ca, bytes / 2));
      CK(cudaMalloc(&cb, bytes / 2));
      const float copy_ms =
          median_ms([&] { CK(cudaMemcpyAsync(cb, ca, bytes / 2, cudaMemcpyDeviceToDevice)); });
      CK(cudaFree(ca));
      CK(cudaFree(cb));
      const char* def = default_variant<T>(C);
      std::printf(
          "\nbench %s R=%lld C=%lld %s: %.1f MB moved; memcpy D2D %.4f ms (%.0f GB/s); library "
          "default: %s\n",
          tname<T>(), static_cast<long long>(R), static_cast<long long>(C),
          add ? "add_layer_norm" : "layer_norm", bytes / 1e6, copy_ms, bytes / copy_ms / 1e6, def);
      std::printf("  %-18s %8s %6s %6s | %4s %5s %6s %6s %5s\n", "variant", "ms", "GB/s", "%copy",
                  "regs", "local", "smemKB", "blk/SM", "grid");
      CaseSummary sum;
      sum.name = std::string(tname<T>()) + " C=" + std::to_string(C) + (add ? " + add" : "");
      sum.def = def;
      for (const auto& v : vs) {
        if (!harness_selected(v.name) || !v.fn(p)) continue;
        CK(cudaDeviceSynchronize());
        const LaunchNote ln = g_note;
        const float ms = median_ms([&] { v.fn(p); });
        cudaFuncAttributes fa{};
        CK(cudaFuncGetAttributes(&fa, ln.kern));
        int per_sm = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, ln.kern, ln.threads, ln.smem));
        const double pct = 100.0 * copy_ms / ms;
        std::printf("  %-18s %8.4f %6.0f %5.1f%% | %4d %5zu %6.1f %6d %5d\n", v.name, ms,
                    bytes / ms / 1e6, pct, fa.numRegs, static_cast<size_t>(fa.localSizeBytes),
                    ln.smem / 1024.0, per_sm, ln.grid);
        if (pct > sum.best_pct) sum.best_pct = static_cast<float>(pct), sum.best = v.name;
        if (sum.def == v.name) sum.def_pct = static_cast<float>(pct);
      }
      g_summary.push_back(sum);
      p.free();
    }
  }
}

int main(int argc, char** argv) {
  return ln_harness_main(
      argc, argv, "ln_fwd_check", "",
      [] {
        check_all<bf16>();
        check_all<float>();
      },
      [] {
        bench_all<bf16>();
        bench_all<float>();
      });
}
