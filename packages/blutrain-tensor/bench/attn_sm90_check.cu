// attn_sm90_check.cu: standalone check + timing of the Hopper wgmma attention forward
// (src/cuda/attention_sm90.cu) next to the mma.sync forward (attn_fwd_v2, attention.cu).
// Build and run: bash bench/attn_sm90_check.sh (needs an sm_90 GPU).  Exit status 1 on a FAIL.
//
// Check: every configuration, bf16, B2 H3, T in {1, 7, 64, 100, 200, 1024}, D 64 and 128, causal
// and not; q, k, v the strided slices of a packed (B, T, 3, H, D) buffer; o and lse poisoned with
// NaN; error = max |gpu - ref| / max |ref| against float64 math on the bf16 inputs (o; lse
// absolute).  Timing: B16 H12 T1024 D64 and B16 H6 T1024 D128, causal and not, cudaEvent median
// of 20 after 3 warm-ups; flops 4 B H T^2 D (half when causal).  Rows: the cp.async kernel, the
// warp-specialised one per tile ("ws") and persistent ("persistent": the library's default).
// BT_HARNESS_ONLY=name,... runs only the rows whose names contain one of those strings.
#define BT_ATTENTION_KERNELS_ONLY 1
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "../src/cuda/attention.cu"
#include "../src/cuda/attention_sm90.cu"
#define BT_HARNESS_THROW_STUB 1  // the launchers' BT_CUDA_CHECK reports, prints and exits
#include "harness_common.cuh"

using bt::cuda::AttnParams;
using bt::cuda::GradLayout;
using T16 = __nv_bfloat16;

static int g_fail = 0;

struct Problem {
  int B, H, T, D;
  bool causal;
  T16* x = nullptr;  // (B, T, 3, H, D)
  std::vector<float> hx;
  AttnParams p{};
  void make(int B_, int H_, int T_, int D_, bool causal_, unsigned seed) {
    B = B_, H = H_, T = T_, D = D_, causal = causal_;
    const size_t n = static_cast<size_t>(B) * T * 3 * H * D;
    std::vector<T16> h(n);
    hx.resize(n);
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (size_t i = 0; i < n; ++i) {
      h[i] = __float2bfloat16(nd(rng));
      hx[i] = __bfloat162float(h[i]);
    }
    x = dcopy(h, 0);
    p.B = B, p.H = H, p.L = T, p.S = T, p.D = D;
    const int64_t row = 3LL * H * D;
    p.q_b = p.k_b = p.v_b = T * row;
    p.q_h = p.k_h = p.v_h = D;
    p.q_l = p.k_l = p.v_l = row;
    p.dg = GradLayout::from_rows(p.L, p.S, p.D, static_cast<int64_t>(H) * D);
    p.scale = 1.0 / std::sqrt(static_cast<double>(D));
    p.causal = causal;
  }
  const T16* q() const { return x; }
  const T16* k() const { return x + static_cast<size_t>(H) * D; }
  const T16* v() const { return x + 2 * static_cast<size_t>(H) * D; }
  void free() { CK(cudaFree(x)); }
  // float64 reference: o (B, T, H, D), lse (B, H, T)
  void reference(std::vector<double>& o, std::vector<double>& lse) const {
    o.assign(static_cast<size_t>(B) * T * H * D, 0.0);
    lse.assign(static_cast<size_t>(B) * H * T, 0.0);
    auto at = [&](int b, int t, int w, int hh, int d) {
      return static_cast<double>(hx[(((static_cast<size_t>(b) * T + t) * 3 + w) * H + hh) * D + d]);
    };
    std::vector<double> s(T);
    for (int b = 0; b < B; ++b)
      for (int hh = 0; hh < H; ++hh)
        for (int i = 0; i < T; ++i) {
          const int n = causal ? i + 1 : T;
          double mx = -INFINITY;
          for (int j = 0; j < n; ++j) {
            double acc = 0;
            for (int d = 0; d < D; ++d) acc += at(b, i, 0, hh, d) * at(b, j, 1, hh, d);
            s[j] = acc * p.scale;
            mx = std::max(mx, s[j]);
          }
          double sum = 0;
          for (int j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - mx));
          for (int d = 0; d < D; ++d) {
            double acc = 0;
            for (int j = 0; j < n; ++j) acc += s[j] * at(b, j, 2, hh, d);
            o[((static_cast<size_t>(b) * T + i) * H + hh) * D + d] = acc / sum;
          }
          lse[(static_cast<size_t>(b) * H + hh) * T + i] = mx + std::log(sum);
        }
  }
};

template <int D, int WG, int Bc, int St>
static void run_sm90(const Problem& pr, T16* o, float* lse) {
  bt::cuda::launch_fwd_sm90_cfg<T16, D, WG, Bc, St>(pr.p, pr.q(), pr.k(), pr.v(), o, lse, 0,
                                                    "sm90");
}
template <int D, int WG, int Bc, int St, int MinB, bool PP, bool Pers = false>
static void run_ws(const Problem& pr, T16* o, float* lse) {
  if (!bt::cuda::launch_fwd_sm90_ws_cfg<T16, D, WG, Bc, St, MinB, PP, Pers>(
          pr.p, pr.q(), pr.k(), pr.v(), o, lse, 0, "sm90ws")) {
    std::printf("ws: tensor maps refused\n");
    std::exit(2);
  }
}
template <int D>
static void run_v2(const Problem& pr, T16* o, float* lse) {
  using C = bt::cuda::V2Config<D>;
  constexpr int W = C::kFwdWarps, Bc = C::kFwdBc, MT = C::kFwdMT, Br = 16 * MT * W;
  constexpr size_t smem = bt::cuda::fwd_smem<T16, D, W, Bc, MT>();
  auto kern = bt::cuda::attn_fwd_v2<T16, D, W, Bc, MT, C::kFwdMinBlocks>;
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  dim3 grid(pr.p.B * pr.p.H, (pr.p.L + Br - 1) / Br);
  kern<<<grid, W * 32, smem>>>(pr.p, pr.q(), pr.k(), pr.v(), o, lse);
}

using Runner = void (*)(const Problem&, T16*, float*);

struct Case {
  Problem pr;
  std::vector<double> ro, rl;
};
// Problems and their float64 references, built once per (D, T, causal).
static Case& get_case(int D, int T, int causal) {
  static std::map<std::tuple<int, int, int>, Case> cache;
  auto key = std::make_tuple(D, T, causal);
  auto it = cache.find(key);
  if (it == cache.end()) {
    Case& c = cache[key];
    c.pr.make(2, 3, T, D, causal, 1234u + T * 7 + causal + D);
    c.pr.reference(c.ro, c.rl);
    return c;
  }
  return it->second;
}

static void check(const char* name, int D, Runner fn) {
  const int Ts[] = {1, 7, 64, 100, 200, 1024};
  double worst_o = 0, worst_l = 0;
  for (int T : Ts) {
    for (int causal = 0; causal < 2; ++causal) {
      Case& c = get_case(D, T, causal);
      const Problem& pr = c.pr;
      const std::vector<double>&ro = c.ro, &rl = c.rl;
      const size_t no = ro.size(), nl = rl.size();
      T16* o = dmalloc<T16>(no, 0);
      float* lse = dmalloc<float>(nl, 0);
      poison(o, no * sizeof(T16));
      poison(lse, nl * sizeof(float));
      fn(pr, o, lse);
      CK(cudaGetLastError());
      CK(cudaDeviceSynchronize());
      const std::vector<T16> ho = hcopy(o, no);
      const std::vector<float> hl = hcopy(lse, nl);
      const double eo = rel_err(ro, [&](size_t i) { return double(__bfloat162float(ho[i])); });
      double ml = 0;
      for (size_t i = 0; i < nl; ++i) {
        ml = std::isfinite(hl[i]) ? std::max(ml, std::fabs(hl[i] - rl[i])) : INFINITY;
      }
      worst_o = std::max(worst_o, eo);
      worst_l = std::max(worst_l, ml);
      // bf16 output rounding (2^-8 relative) plus bf16 P in the P V product
      if (!(eo < 1.5e-2) || !(ml < 2e-3)) {
        std::printf("FAIL %-30s T=%4d causal=%d  o rel err %.3e  lse abs err %.3e\n", name, T,
                    causal, eo, ml);
        ++g_fail;
      }
      CK(cudaFree(o));
      CK(cudaFree(lse));
    }
  }
  std::printf("check %-30s D=%3d  worst o rel err %.3e  lse abs err %.3e\n", name, D, worst_o,
              worst_l);
}

static void bench(const char* name, int H, int D, Runner fn) {
  for (int causal = 1; causal >= 0; --causal) {
    Problem pr;
    pr.make(16, H, 1024, D, causal, 99u);
    T16* o = dmalloc<T16>(static_cast<size_t>(16) * 1024 * H * D, 0);
    float* lse = dmalloc<float>(static_cast<size_t>(16) * H * 1024, 0);
    const float ms = time_ms([&] { fn(pr, o, lse); }, 3, 20);
    const double fl = 4.0 * 16 * H * 1024.0 * 1024.0 * D * (causal ? 0.5 : 1.0);
    std::printf("bench %-30s B16 H%-2d T1024 D%-3d causal=%d  %.4f ms  %6.1f TFLOP/s\n", name, H, D,
                causal, ms, fl / ms / 1e9);
    CK(cudaFree(o));
    CK(cudaFree(lse));
    pr.free();
  }
}

#define CFG(D, WG, Bc, St) {"sm90 WG" #WG " Bc" #Bc " stages" #St, D, run_sm90<D, WG, Bc, St>}
#define WS(D, WG, Bc, St, MinB, PP) \
  {"ws WG" #WG " Bc" #Bc " st" #St " minB" #MinB " pp" #PP, D, run_ws<D, WG, Bc, St, MinB, PP>}
#define WSP(D, WG, Bc, St, PP) \
  {"persistent WG" #WG " Bc" #Bc " st" #St " pp" #PP, D, run_ws<D, WG, Bc, St, 1, PP, true>}

int main(int argc, char** argv) {
  const bool do_check = argc < 2 || std::string(argv[1]) != "--bench";
  const bool do_bench = argc < 2 || std::string(argv[1]) != "--check";
  struct Cfg {
    const char* name;
    int D;
    Runner fn;
  };
  const Cfg cfgs[] = {
      {"v2 (mma.sync)", 64, run_v2<64>},
      CFG(64, 2, 64, 5),
      WS(64, 2, 64, 4, 2, 0),
      WS(64, 2, 64, 4, 2, 1),
      WS(64, 2, 128, 3, 1, 0),
      WS(64, 2, 128, 3, 1, 1),
      WS(64, 2, 128, 4, 1, 1),
      WSP(64, 2, 128, 4, 1),
      WSP(64, 2, 128, 3, 1),
      WSP(64, 2, 128, 4, 0),
      WS(64, 3, 64, 5, 1, 1),
      WS(64, 3, 64, 4, 1, 0),
      {"v2 (mma.sync)", 128, run_v2<128>},
      CFG(128, 2, 64, 4),
      WS(128, 2, 64, 4, 1, 0),
      WS(128, 2, 64, 4, 1, 1),
      WSP(128, 2, 64, 4, 0),
      WSP(128, 2, 64, 4, 1),
      WS(128, 2, 64, 3, 1, 1),
  };
  for (const auto& c : cfgs) {
    if (do_check && harness_selected(c.name)) check(c.name, c.D, c.fn);
  }
  for (const auto& c : cfgs) {
    if (do_bench && harness_selected(c.name)) bench(c.name, c.D == 64 ? 12 : 6, c.D, c.fn);
  }
  std::printf(g_fail ? "attn_sm90_check: %d FAIL\n" : "attn_sm90_check: all PASS\n", g_fail);
  return g_fail ? 1 : 0;
}
