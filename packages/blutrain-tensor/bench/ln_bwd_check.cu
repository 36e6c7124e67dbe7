// ln_bwd_check.cu: standalone check + timing of the layer-norm backward kernels of
// src/cuda/nn_fused_kernels.cuh (v2, v3 with either dweight / dbias reduce, v4, v5 and v6
// configurations), the v1 reference (bench/nn_v1_kernels.cuh) and the experiments that lost
// here (bench/ln_bwd_experiments.cuh: v5 with a prefetch, v6 with clusters).  Build and run: bash
// bench/ln_bwd_check.sh [--check | --bench] (needs an sm_90 GPU).  Exit status 1 on any FAIL.
//
// Check: bf16 and fp32; R in {1, 7, 300, 16384}; C in {768, 3072, 1000, 100} (each variant where
// it applies: v3-v6 need rows of whole 16-byte vectors, so C = 100 runs them in fp32 only; the v6
// sweep configurations build GPT-2's row shapes only); weight + dweight + dbias, weight + dweight,
// dbias only, neither (dx only; R = 16384: weight + dweight + dbias only); with and without
// `extra` (add_layer_norm's residual gradient).  dx, dw, db and the partials are poisoned (NaN)
// before each run; error = max |gpu - ref| / max |ref| per output against float64 math on the
// rounded inputs and the float mean / rstd the kernels read.  Tolerances: bf16 4e-3 (the output's
// rounding, 2^-9 relative, plus float math), fp32 2e-5 (float sums of up to 16384 rows).  Each
// variant runs twice: dx, dw, db must be bitwise equal (determinism for a fixed grid; for v6 also
// that its arrival counters were reset by the first run).
//
// Timing: R = 16384, C = 768 and 3072, weight + dweight + dbias, with and without extra;
// cudaEvent median of 15 samples, each the mean of 10 back-to-back calls (launch latency and the
// runners' host work hidden, as in a training step; session 11 timed single calls, which counted
// the host's launch time too), after 5 warm-ups; grids cached per (kernel, problem).  Bytes: dy, x
// (+ extra) read and dx written once (the tiny weight / stats / partials not counted).  "copy":
// cudaMemcpyAsync D2D of bytes / 2 (it reads and writes, so it moves the same bytes), "copyk": a
// plain uint4 copy kernel of the same size; %copy = copy ms / ours ms.  main / reduce: the row
// kernel and the dweight / dbias reduce kernel timed alone ("-": none; v6 with clusters reduces
// in the row kernel), main's %copy against the same copy.  regs / local (bytes of local memory
// per thread: spills) / smemKB (dynamic, per block) / blk/SM (occupancy) / grid / cl (cluster
// size) / parts (partial rows of 2C floats written): the row kernel's launch.  The summary at the
// end gives, per case, the library default's %copy and the best variant's.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cuda/nn_fused_kernels.cuh"
#include "ln_bwd_experiments.cuh"
#include "nn_v1_kernels.cuh"
#define BT_HARNESS_THROW_STUB 1  // the library's BT_CUDA_CHECK reports, prints and exits
#include "harness_common.cuh"
#include "ln_harness.cuh"

using namespace bt::cuda;
using namespace bt::cuda::nn;
// What the last runner launched (mode 0 / 1), for the bench's registers / occupancy columns.
struct LaunchNote {
  const void* kern = nullptr;                            // the row kernel
  int grid = 0, threads = 0, cluster = 1, partials = 0;  // partials: rows of 2C floats written
  size_t smem = 0;                                       // dynamic shared memory, bytes
};
static LaunchNote g_note;
// Grids by (kernel, R, C, extra, need_acc): the occupancy queries (and cudaFuncSetAttribute) run
// once, so the timed loops launch only (the host work per call stays under the GPU time).
static std::map<std::tuple<const void*, int64_t, int64_t, bool, bool>, int> g_grids;
template <typename F>
static int cached_grid(const void* kern, int64_t R, int64_t C, bool extra, bool need_acc, F&& f) {
  const auto key = std::make_tuple(kern, R, C, extra, need_acc);
  auto it = g_grids.find(key);
  if (it != g_grids.end()) return it->second;
  const int G = f();
  g_grids.emplace(key, G);
  return G;
}
static void note(const void* kern, int grid, int threads, size_t smem, int partials,
                 int cluster = 1) {
  g_note = LaunchNote{kern, grid, threads, cluster, partials, smem};
}
constexpr int64_t kMaxPartialBlocks = 2048;  // partial buffer rows (blocks); grids are checked

// One problem: device buffers and the host copies the reference reads.
template <typename T>
struct Prob {
  int64_t R = 0, C = 0;
  bool has_w = false, has_extra = false, need_dw = false, need_db = false;
  T *dy = nullptr, *x = nullptr, *w = nullptr, *extra = nullptr, *dx = nullptr, *dw = nullptr,
    *db = nullptr;
  float *mean = nullptr, *rstd = nullptr, *partial = nullptr;
  std::vector<float> hdy, hx, hw, hextra, hmean, hrstd;  // the rounded values, as float
  bool need_acc() const { return need_dw || need_db; }

  void make(int64_t R_, int64_t C_, bool w_, bool e_, bool dw_, bool db_, unsigned seed) {
    R = R_, C = C_, has_w = w_, has_extra = e_, need_dw = dw_, need_db = db_;
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
    fill(hdy, n, 1.f, 0.f, &dy);
    if (has_w) fill(hw, C, 1.f, 1.f, &w);
    if (has_extra) fill(hextra, n, 1.f, 0.f, &extra);
    hmean.resize(R);
    hrstd.resize(R);
    for (int64_t r = 0; r < R; ++r) {  // the forward's statistics, stored as float
      double s = 0, s2 = 0;
      for (int64_t c = 0; c < C; ++c) s += hx[r * C + c];
      const double m = s / C;
      for (int64_t c = 0; c < C; ++c) s2 += (hx[r * C + c] - m) * (hx[r * C + c] - m);
      hmean[r] = static_cast<float>(m);
      hrstd[r] = static_cast<float>(1.0 / std::sqrt(s2 / C + 1e-5));
    }
    mean = dcopy(hmean, 0);
    rstd = dcopy(hrstd, 0);
    dx = dmalloc<T>(n, 0);
    dw = dmalloc<T>(C, 0);
    db = dmalloc<T>(C, 0);
    partial = dmalloc<float>(kMaxPartialBlocks * 2 * C, 0);
  }
  void poison() const {  // 0xff bytes: NaN in bf16 and fp32
    ::poison(dx, static_cast<size_t>(R) * C * sizeof(T));
    ::poison(dw, C * sizeof(T));
    ::poison(db, C * sizeof(T));
    ::poison(partial, kMaxPartialBlocks * 2 * C * sizeof(float));
  }
  const T* wp() const { return has_w ? w : nullptr; }
  const T* ep() const { return has_extra ? extra : nullptr; }
  T* dwp() const { return need_dw ? dw : nullptr; }
  T* dbp() const { return need_db ? db : nullptr; }
  LnGrads<T> grads() const { return {dwp(), dbp(), false}; }
  void free() {
    for (void* p : {static_cast<void*>(dy), static_cast<void*>(x), static_cast<void*>(w),
                    static_cast<void*>(extra), static_cast<void*>(dx), static_cast<void*>(dw),
                    static_cast<void*>(db), static_cast<void*>(mean), static_cast<void*>(rstd),
                    static_cast<void*>(partial)}) {
      if (p) CK(cudaFree(p));
    }
  }
  // float64 reference: dx (R C), dw, db (C)
  void reference(std::vector<double>& rdx, std::vector<double>& rdw,
                 std::vector<double>& rdb) const {
    rdx.assign(static_cast<size_t>(R) * C, 0.0);
    rdw.assign(C, 0.0);
    rdb.assign(C, 0.0);
    std::vector<double> xh(C), g(C);
    for (int64_t r = 0; r < R; ++r) {
      const double m = hmean[r], rs = hrstd[r];
      double s1 = 0, s2 = 0;
      for (int64_t c = 0; c < C; ++c) {
        const double d = hdy[r * C + c];
        xh[c] = (hx[r * C + c] - m) * rs;
        g[c] = d * (has_w ? hw[c] : 1.0);
        s1 += g[c];
        s2 += g[c] * xh[c];
        rdw[c] += d * xh[c];
        rdb[c] += d;
      }
      s1 /= C;
      s2 /= C;
      for (int64_t c = 0; c < C; ++c) {
        rdx[r * C + c] = rs * (g[c] - s1 - xh[c] * s2) + (has_extra ? hextra[r * C + c] : 0.0);
      }
    }
  }
};

// mode: 0 the whole backward, 1 the row kernel only, 2 the dweight / dbias reduce only (after a
// whole run left the partials).  Returns false where the variant does not apply.
template <typename T>
using Runner = std::function<bool(const Prob<T>&, int)>;

template <typename T>
static bool run_v1(const Prob<T>& p, int mode) {
  if (mode != 2) {
    layernorm_backward_dx_v1<T, float><<<static_cast<unsigned>(p.R), row_threads(p.C, 1, 256)>>>(
        p.dy, p.x, p.wp(), p.mean, p.rstd, p.ep(), p.dx, p.C);
    CK(cudaGetLastError());
  }
  if (mode != 1 && p.need_acc()) {
    layernorm_backward_dwdb_v1<T, float><<<static_cast<unsigned>(ceil_div(p.C, 256)), 256>>>(
        p.dy, p.x, p.mean, p.rstd, p.grads(), p.R, p.C);
    CK(cudaGetLastError());
  }
  return true;
}

// mirrors LayerNormBackward::eval_gpu's v2 branch
template <typename T>
static bool run_v2(const Prob<T>& p, int mode) {
  const bool need_acc = p.need_acc();
  const bool rows_aligned = (p.C * sizeof(T)) % 16 == 0 || (!p.wp() && !need_acc);
  bool ok = true;
  dispatch_vec(rows_aligned ? vec_width<T>({p.dy, p.x, p.wp(), p.ep(), p.dx}) : 1, [&](auto vtag) {
    constexpr int V = decltype(vtag)::value;
    const int threads = row_threads(p.C, V);
    const int per_sm = std::max(1, std::min(8, 2048 / threads));
    const int G = static_cast<int>(std::min<int64_t>(p.R, int64_t(g_sms) * per_sm));
    if (G > kMaxPartialBlocks) {
      ok = false;
      return;
    }
    if (mode != 2) {
      const size_t smem = 2 * p.C * sizeof(float);
      const bool sm = need_acc && smem <= 40 * 1024;
      note(sm ? reinterpret_cast<const void*>(layernorm_backward_v2<T, float, V, true>)
              : reinterpret_cast<const void*>(layernorm_backward_v2<T, float, V, false>),
           G, threads, sm ? smem : 0, need_acc ? G : 0);
      if (sm) {
        layernorm_backward_v2<T, float, V, true><<<G, threads, smem>>>(
            p.dy, p.x, p.wp(), p.mean, p.rstd, p.ep(), p.dx, p.partial, p.R, p.C, true);
      } else {
        layernorm_backward_v2<T, float, V, false><<<G, threads, 0>>>(
            p.dy, p.x, p.wp(), p.mean, p.rstd, p.ep(), p.dx, p.partial, p.R, p.C, need_acc);
      }
      CK(cudaGetLastError());
    }
    if (mode != 1 && need_acc) {
      layernorm_backward_reduce<T>
          <<<static_cast<unsigned>(ceil_div(2 * p.C, 256)), 256>>>(p.partial, G, p.C, p.grads());
      CK(cudaGetLastError());
    }
  });
  return ok;
}

// mirrors eval_gpu's v3 branch; reduce_v4: the new default reduce, else the old serial one
template <typename T, bool kReduceV4>
static bool run_v3(const Prob<T>& p, int mode) {
  const bool need_acc = p.need_acc();
  return dispatch_v3<T, 32>(p.C, {p.dy, p.x, p.wp(), p.ep(), p.dx}, [&](auto vtag, auto nvtag) {
    constexpr int V = decltype(vtag)::value, NV = decltype(nvtag)::value;
    const int nw = 8;
    const size_t smem = need_acc ? size_t(nw) * 2 * p.C * sizeof(float) : 0;
    auto kern = layernorm_backward_v3<T, float, V, NV>;
    const int G =
        cached_grid(reinterpret_cast<const void*>(kern), p.R, p.C, p.has_extra, need_acc, [&] {
          if (smem > 48 * 1024) {
            CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
          }
          int per_sm = 0;
          CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, nw * 32, smem));
          per_sm = std::max(1, std::min(per_sm, 2));
          return static_cast<int>(std::min<int64_t>(ceil_div(p.R, nw), int64_t(g_sms) * per_sm));
        });
    if (mode != 2) {
      note(reinterpret_cast<const void*>(kern), G, nw * 32, smem, need_acc ? G : 0);
      kern<<<G, nw * 32, smem>>>(p.dy, p.x, p.wp(), p.mean, p.rstd, p.ep(), p.dx, p.partial, p.R,
                                 p.C, need_acc);
      CK(cudaGetLastError());
    }
    if (mode != 1 && need_acc) {
      if (kReduceV4) {
        layernorm_backward_reduce_v4<T>
            <<<static_cast<unsigned>(ceil_div(2 * p.C, 32)), dim3(32, kReduceRows)>>>(
                p.partial, G, p.C, p.grads());
      } else {
        layernorm_backward_reduce<T>
            <<<static_cast<unsigned>(ceil_div(2 * p.C, 256)), 256>>>(p.partial, G, p.C, p.grads());
      }
      CK(cudaGetLastError());
    }
  });
}

// mirrors eval_gpu's v4 branch (run wherever dispatch_v4 applies, not only for C > 1024)
template <typename T>
static bool run_v4(const Prob<T>& p, int mode) {
  const bool need_acc = p.need_acc();
  return dispatch_v4<T>(p.C, {p.dy, p.x, p.wp(), p.ep(), p.dx}, [&](auto vt, auto nvt, auto wt) {
    constexpr int V = decltype(vt)::value, NV = decltype(nvt)::value;
    constexpr int WPR = decltype(wt)::value, RG = kV4BwdWarps / WPR;
    const size_t smem = need_acc ? size_t(2) * p.C * sizeof(float) : 0;
    auto kern = layernorm_backward_v4<T, float, V, NV, WPR>;
    const int G =
        cached_grid(reinterpret_cast<const void*>(kern), p.R, p.C, p.has_extra, need_acc, [&] {
          if (smem > 48 * 1024) {
            CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
          }
          int per_sm = 0;
          CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, kV4BwdWarps * 32, smem));
          per_sm = std::max(1, std::min(per_sm, 2));
          return static_cast<int>(std::min<int64_t>(ceil_div(p.R, RG), int64_t(g_sms) * per_sm));
        });
    if (mode != 2) {
      note(reinterpret_cast<const void*>(kern), G, kV4BwdWarps * 32, smem, need_acc ? G : 0);
      kern<<<G, kV4BwdWarps * 32, smem>>>(p.dy, p.x, p.wp(), p.mean, p.rstd, p.ep(), p.dx,
                                          p.partial, p.R, p.C, need_acc);
      CK(cudaGetLastError());
    }
    if (mode != 1 && need_acc) {
      layernorm_backward_reduce_v4<T>
          <<<static_cast<unsigned>(ceil_div(2 * p.C, 32)), dim3(32, kReduceRows)>>>(p.partial, G,
                                                                                    p.C, p.grads());
      CK(cudaGetLastError());
    }
  });
}

// v5 with NW warps per block, prefetch and streaming as given (eval_gpu: kV5Warps, no pf, no cs:
// the library's kernel; with either, the experiment's)
template <typename T, int NW, bool kPf, bool kCs>
static bool run_v5(const Prob<T>& p, int mode) {
  const bool need_acc = p.need_acc();
  return dispatch_v5<T>(p.C, {p.dy, p.x, p.wp(), p.ep(), p.dx}, [&](auto nvt, auto wt) {
    constexpr int NV = decltype(nvt)::value, WPR = decltype(wt)::value;
    if constexpr (WPR > NW) {
      return false;
    } else {
      constexpr bool kLib = !kPf && !kCs;
      using K = std::conditional_t<kLib, LnBwdV5<T, float, NV, WPR, NW>,
                                   experiments::LnBwdV5<T, float, NV, WPR, NW, kPf, kCs>>;
      const void* kern = [] {
        if constexpr (kLib) {
          return reinterpret_cast<const void*>(layernorm_backward_v5<T, float, NV, WPR, NW>);
        } else {
          return reinterpret_cast<const void*>(
              experiments::layernorm_backward_v5<T, float, NV, WPR, NW, kPf, kCs>);
        }
      }();
      const int G = cached_grid(kern, p.R, p.C, p.has_extra, need_acc,
                                [&] { return K::grid(p.R, p.C, need_acc, g_sms, g_optin, "v5"); });
      if (G == 0 || G > kMaxPartialBlocks) return false;
      if (mode != 2) {
        note(kern, G, NW * 32, K::smem(p.C, need_acc), need_acc ? G : 0);
        K::launch(G, 0, p.dy, p.x, p.wp(), p.mean, p.rstd, p.ep(), p.dx, p.partial, p.R, p.C,
                  need_acc);
        CK(cudaGetLastError());
      }
      if (mode != 1 && need_acc) {
        layernorm_backward_reduce_v4<T>
            <<<static_cast<unsigned>(ceil_div(2 * p.C, 32)), dim3(32, kReduceRows)>>>(
                p.partial, G, p.C, p.grads());
        CK(cudaGetLastError());
      }
      return true;
    }
  });
}

// v6 with NW warps per block, K ring slots per row group, clusters of CL (1: no cluster, the
// library's kernel; else the experiment's) and the dw / db partials reduced in the kernel (kFinal,
// CL > 1) or by reduce_v6 / reduce_v4.  kAll: every row shape
// (the library's configurations); else GPT-2's (NV 3: bf16 WPR 1 / 4, fp32 WPR 2 / 8) only, to
// keep the sweep's compile time down.
template <typename T, int NW, int K, int CL, bool kFinal, bool kAll, int kRed = 6>
static bool run_v6(const Prob<T>& p, int mode) {
  const bool need_acc = p.need_acc();
  return dispatch_v5<T>(p.C, {p.dy, p.x, p.wp(), p.ep(), p.dx}, [&](auto nvt, auto wt) {
    constexpr int NV = decltype(nvt)::value, WPR = decltype(wt)::value;
    constexpr bool gpt2 =
        NV == 3 && (sizeof(T) == 2 ? (WPR == 1 || WPR == 4) : (WPR == 2 || WPR == 8));
    if constexpr (WPR > NW || (!kAll && !gpt2)) {
      return false;
    } else {
      using L = std::conditional_t<CL == 1, LnBwdV6<T, float, NV, WPR, NW, K>,
                                   experiments::LnBwdV6<T, float, NV, WPR, NW, K, CL>>;
      const int G = cached_grid(
          reinterpret_cast<const void*>(L::kernel()), p.R, p.C, p.has_extra, need_acc,
          [&] { return L::grid(p.R, p.C, p.has_extra, g_sms, g_optin, g_major, "v6"); });
      const bool fin = CL > 1 && kFinal;
      const int P = G / CL;  // partial rows written
      if (G == 0 || P > kMaxPartialBlocks) return false;
      if (mode == 2 && (fin || !need_acc)) return false;  // no separate reduce
      if (mode != 2) {
        note(reinterpret_cast<const void*>(L::kernel()), G, L::kThreads,
             L::smem(p.C, p.ep() != nullptr), need_acc ? P : 0, CL);
        if constexpr (CL == 1) {
          L::launch(G, 0, p.dy, p.x, p.wp(), p.mean, p.rstd, p.ep(), p.dx, p.partial, p.grads(),
                    p.R, p.C, need_acc, "v6");
        } else {
          L::launch(G, 0, p.dy, p.x, p.wp(), p.mean, p.rstd, p.ep(), p.dx, p.partial, p.grads(),
                    p.R, p.C, need_acc, fin, "v6");
        }
        CK(cudaGetLastError());
      }
      if (mode != 1 && need_acc && !fin) {
        if constexpr (kRed >= 6) {  // 6: the library's reduce (PDL as the library), 60: no PDL
          launch_ln_bwd_reduce_v6<T>(p.partial, P, p.C, p.grads(), 0,
                                     kRed == 6 && kV6ReducePdl && g_major >= 9, "reduce_v6");
        } else {
          layernorm_backward_reduce_v4<T>
              <<<static_cast<unsigned>(ceil_div(2 * p.C, 32)), dim3(32, kReduceRows)>>>(
                  p.partial, P, p.C, p.grads());
        }
        CK(cudaGetLastError());
      }
      return true;
    }
  });
}

static_assert(kV6Warps == 16 && kV6Stages == 2 && kV6ReducePdl, "v6 (lib) variant names");

template <typename T>
struct Variant {
  const char* name;
  Runner<T> fn;
};

template <typename T>
static std::vector<Variant<T>> variants() {
  // "lib": the configuration eval_gpu launches for that version
  return {
      {"v1 (reference)", run_v1<T>},
      {"v2", run_v2<T>},
      {"v3 + reduce (old)", run_v3<T, false>},
      {"v3 + reduce_v4 (lib)", run_v3<T, true>},
      {"v4 (lib)", run_v4<T>},
      {"v5 nw8 pf (old lib)", run_v5<T, 8, true, false>},
      {"v5 nw8 (lib)", run_v5<T, 8, false, false>},
      {"v5 nw16", run_v5<T, 16, false, false>},
      {"v6 nw8 k3 cl8", run_v6<T, 8, 3, 8, true, true>},
      {"v6 nw16 k2 cl1 + reduce6 (lib)", run_v6<T, kV6Warps, kV6Stages, 1, false, true>},
      {"v6 nw16 k2 cl1 + reduce4", run_v6<T, 16, 2, 1, false, false, 4>},
      {"v6 nw16 k2 cl1 + reduce6 no pdl", run_v6<T, 16, 2, 1, false, false, 60>},
      {"v6 nw8 k3 cl1 + reduce4 (old lib)", run_v6<T, 8, 3, 1, false, true, 4>},
      {"v6 nw8 k3 cl1 + reduce6", run_v6<T, 8, 3, 1, false, false>},
      {"v6 nw16 k3 cl1 + reduce6", run_v6<T, 16, 3, 1, false, false>},
      {"v6 nw8 k3 cl8 + reduce6", run_v6<T, 8, 3, 8, false, false>},
      {"v6 nw8 k2 cl8", run_v6<T, 8, 2, 8, true, false>},
      {"v6 nw8 k4 cl8", run_v6<T, 8, 4, 8, true, false>},
      {"v6 nw8 k3 cl2", run_v6<T, 8, 3, 2, true, false>},
      {"v6 nw8 k3 cl4", run_v6<T, 8, 3, 4, true, false>},
      {"v6 nw8 k3 cl16", run_v6<T, 8, 3, 16, true, false>},
      {"v6 nw4 k4 cl8", run_v6<T, 4, 4, 8, true, false>},
      {"v6 nw16 k2 cl8", run_v6<T, 16, 2, 8, true, false>},
      {"v6 nw16 k3 cl8", run_v6<T, 16, 3, 8, true, false>},
  };
}

template <typename T>
static void check_all() {
  const double tol = sizeof(T) == 2 ? 4e-3 : 2e-5;
  const int64_t Rs[] = {1, 7, 300, 16384};
  const int64_t Cs[] = {768, 3072, 1000, 100};
  struct Combo {
    const char* name;
    bool w, dw, db;
  };
  const Combo combos[] = {
      {"w+dw+db", true, true, true},
      {"w+dw", true, true, false},
      {"db", false, false, true},
      {"dx only", false, false, false},
  };
  auto vs = variants<T>();
  std::vector<double> worst(vs.size(), 0.0);
  std::vector<int> ran(vs.size(), 0);
  unsigned seed = 1;
  for (int64_t C : Cs) {
    for (int64_t R : Rs) {
      for (const Combo& cb : combos) {
        if (R > 300 && cb.name != combos[0].name) continue;      // many rows: GPT-2's case only
        if (R > 300 && std::getenv("BT_CHECK_SMALL")) continue;  // (under compute-sanitizer)
        for (int ex = 0; ex < 2; ++ex) {
          Prob<T> p;
          p.make(R, C, cb.w, ex != 0, cb.dw, cb.db, seed++);
          std::vector<double> rdx, rdw, rdb;
          p.reference(rdx, rdw, rdb);
          const size_t n = static_cast<size_t>(R) * C;
          for (size_t vi = 0; vi < vs.size(); ++vi) {
            if (!harness_selected(vs[vi].name)) continue;
            // v1's one-thread-per-column dweight / dbias over 16384 rows is slow but still checked
            std::vector<float> out[2][3];
            bool applies = true;
            for (int rep = 0; rep < 2 && applies; ++rep) {
              p.poison();
              applies = vs[vi].fn(p, 0);
              if (!applies) break;
              CK(cudaDeviceSynchronize());
              fetch(p.dx, n, out[rep][0]);
              if (p.need_dw) fetch(p.dw, C, out[rep][1]);
              if (p.need_db) fetch(p.db, C, out[rep][2]);
            }
            if (!applies) continue;
            ++ran[vi];
            const double edx = rel_err_f(out[0][0], rdx);
            const double edw = p.need_dw ? rel_err_f(out[0][1], rdw) : 0.0;
            const double edb = p.need_db ? rel_err_f(out[0][2], rdb) : 0.0;
            const bool det = same_bits(out[0][0], out[1][0]) && same_bits(out[0][1], out[1][1]) &&
                             same_bits(out[0][2], out[1][2]);
            worst[vi] = std::max({worst[vi], edx, edw, edb});
            if (!(edx <= tol) || !(edw <= tol) || !(edb <= tol) || !det) {
              std::printf(
                  "FAIL %-26s %s R=%-5lld C=%-4lld %-8s extra=%d  dx %.3e  dw %.3e  db %.3e%s\n",
                  vs[vi].name, tname<T>(), static_cast<long long>(R), static_cast<long long>(C),
                  cb.name, ex, edx, edw, edb, det ? "" : "  NOT DETERMINISTIC");
              ++g_fail;
            }
          }
          p.free();
        }
      }
    }
  }
  for (size_t vi = 0; vi < vs.size(); ++vi) {
    std::printf("check %-26s %s  %3d problems  worst rel err %.3e (tol %.0e)\n", vs[vi].name,
                tname<T>(), ran[vi], worst[vi], tol);
  }
}

// ---- timing
// --------------------------------------------------------------------------------------
__global__ void copy_kernel(const uint4* __restrict__ a, uint4* __restrict__ b, int64_t n) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i < n) b[i] = a[i];
}

// The variant eval_gpu runs by default for this case (ln_bwd_default; v2 never at these shapes).
static const char* default_variant(int ver) {
  switch (ver) {
    case 6:
      return "v6 nw16 k2 cl1 + reduce6 (lib)";
    case 5:
      return "v5 nw8 (lib)";
    case 4:
      return "v4 (lib)";
    default:
      return "v3 + reduce_v4 (lib)";
  }
}

template <typename T>
static void bench_all() {
  auto vs = variants<T>();
  for (int64_t C : {768, 3072}) {
    for (int ex = 0; ex < 2; ++ex) {
      const int64_t R = 16384;
      Prob<T> p;
      p.make(R, C, true, ex != 0, true, true, 77u);
      const size_t bytes = (3 + ex) * static_cast<size_t>(R) * C * sizeof(T);
      void *ca, *cb;
      CK(cudaMalloc(&ca, bytes / 2));
      CK(cudaMalloc(&cb, bytes / 2));
      const float copy_ms =
          median_ms([&] { CK(cudaMemcpyAsync(cb, ca, bytes / 2, cudaMemcpyDeviceToDevice)); });
      const int64_t nv = static_cast<int64_t>(bytes / 2 / 16);
      const float copyk_ms = median_ms([&] {
        copy_kernel<<<static_cast<unsigned>(ceil_div(nv, 256)), 256>>>(
            static_cast<const uint4*>(ca), static_cast<uint4*>(cb), nv);
      });
      CK(cudaFree(ca));
      CK(cudaFree(cb));
      const char* def = default_variant(ln_bwd_default<T>(C, ex != 0, g_major));
      std::printf(
          "\nbench %s R=%lld C=%lld %s: %.1f MB moved; memcpy D2D %.4f ms (%.0f GB/s), copy "
          "kernel %.4f ms (%.0f GB/s); library default: %s\n",
          tname<T>(), static_cast<long long>(R), static_cast<long long>(C),
          ex ? "layer_norm + extra (add_layer_norm)" : "layer_norm", bytes / 1e6, copy_ms,
          bytes / copy_ms / 1e6, copyk_ms, bytes / copyk_ms / 1e6, def);
      std::printf("  %-26s %8s %6s %6s %6s | %8s %6s %9s | %4s %5s %6s %6s %5s %2s %5s\n",
                  "variant", "ms", "GB/s", "%copy", "%copyk", "main ms", "%copy", "reduce ms",
                  "regs", "local", "smemKB", "blk/SM", "grid", "cl", "parts");
      CaseSummary sum;
      sum.name = std::string(tname<T>()) + " C=" + std::to_string(C) + (ex ? " + extra" : "");
      sum.def = def;
      for (const auto& v : vs) {
        if (std::string(v.name).rfind("v1", 0) == 0) continue;  // the reference: far too slow
        if (!v.fn(p, 0)) continue;
        CK(cudaDeviceSynchronize());
        const LaunchNote ln = g_note;
        const float ms = median_ms([&] { v.fn(p, 0); });
        const float main_ms = median_ms([&] { v.fn(p, 1); });
        const bool has_red = v.fn(p, 2);
        const float red_ms = has_red ? median_ms([&] { v.fn(p, 2); }) : 0.f;
        cudaFuncAttributes fa{};
        CK(cudaFuncGetAttributes(&fa, ln.kern));
        int per_sm = 0;
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, ln.kern, ln.threads, ln.smem));
        char red[16];
        if (has_red) {
          std::snprintf(red, sizeof red, "%9.4f", red_ms);
        } else {
          std::snprintf(red, sizeof red, "%9s", "-");
        }
        const double pct = 100.0 * copy_ms / ms;
        std::printf(
            "  %-26s %8.4f %6.0f %5.1f%% %5.1f%% | %8.4f %5.1f%% %s | %4d %5zu %6.1f %6d %5d %2d "
            "%5d\n",
            v.name, ms, bytes / ms / 1e6, pct, 100.0 * copyk_ms / ms, main_ms,
            100.0 * copy_ms / main_ms, red, fa.numRegs, static_cast<size_t>(fa.localSizeBytes),
            ln.smem / 1024.0, per_sm, ln.grid, ln.cluster, ln.partials);
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
      argc, argv, "ln_bwd_check", ", whole backward",
      [] {
        check_all<bf16>();
        check_all<float>();
      },
      [] {
        bench_all<bf16>();
        bench_all<float>();
      });
}
