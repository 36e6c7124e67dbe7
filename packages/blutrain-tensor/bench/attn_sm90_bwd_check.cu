// attn_sm90_bwd_check.cu: standalone check + timing of the Hopper wgmma attention backward
// (attn_bwd_sm90_ws, src/cuda/attention_sm90.cu) next to the mma.sync one-kernel backward
// (attn_bwd_dkdv_v2<kDq>, attention.cu).  Build and run: bash bench/attn_sm90_bwd_check.sh
// [--check | --check-small | --bench] (needs an sm_90 GPU).  Exit status 1 on a FAIL.
//
// Check: bf16, D 64, T in {1, 7, 64, 100, 200, 1024} (B2 H3; T 1024: B1 H2), causal and not; q, k,
// v the strided slices of a packed (B, T, 3, H, D) buffer; the kernels get the float64 reference
// lse and Dvec; dq, dk, dv go to a packed (B, T, 3, H, D) gradient poisoned with NaN (dq_acc
// poisoned before the memset).  Error: max |gpu - ref| / max |ref| per tensor against float64 math
// on the bf16 inputs; tolerance 3e-2 (P and dS are rounded to bf16 for the tensor cores); the
// persistent kinds run there on 3 blocks, and at the timing shape against kind 10 (dk, dv bitwise,
// dq_acc to 1e-5; compare_persistent).  Timing:
// B16 H12 T1024 D64, causal and not: memset + backward kernel + dq conversion (what the library
// runs after the Dvec preprocess), cudaEvent median of 20 after 3 warm-ups; FLOPs 5 B H T^2 D (half
// when causal).
#define BT_ATTENTION_KERNELS_ONLY 1
#include <cstring>

#include "../src/cuda/attention.cu"
#include "../src/cuda/attention_sm90.cu"
#define BT_HARNESS_THROW_STUB 1  // the launchers' BT_CUDA_CHECK reports, prints and exits
#include "attn_problem.cuh"

static int g_fail = 0;
static int g_blocks = 0;  // persistent kinds: blocks of the grid (0: one per SM, as the library)

template <int WG, int St, int Dq, bool PP = false, bool Def = false, bool Per = false>
struct Ws {
  static constexpr int kWG = WG, kStages = St, kDq = Dq;
  static constexpr bool kPP = PP, kDefer = Def, kPersist = Per;
};
// kind 0: the wgmma kernel as the library ran it until session 14 (dQ by TMA reduce, 3 stages,
// ping-pong); 1: the mma.sync one-kernel backward (V2Config<64>'s fused config); 2: 0 without
// ping-pong; 3: 0 with 2 stages; 4: dQ by red.v4 from registers; 5: no dQ adds (timing only: its
// dq is wrong, not checked); 6-9: kDefer (a producer warpgroup, 232 registers per consumer thread,
// each tile's dQ stored under the next tile's S^T, dP^T): 3 stages, 4 stages, 3 without ping-pong,
// red.v4; 10-12: kDq 3 (one warpgroup per tile computes the dQ part over the block's 128 keys and
// adds it: half the reduce traffic), 3, 4 and 2 stages; 13-14: kDq 3 persistent (one block per SM
// walking (head, key block) items, K / V double-buffered; Note [persistent backward]), 3 and 2
// stages.
static bool run_bwd(int kind, const Problem& pr, float* acc, T16* dq, T16* dk, T16* dv,
                    int64_t d_row) {
  using namespace bt::cuda;
  AttnParams p = pr.params();
  p.dg = GradLayout::from_rows(p.L, p.S, p.D, d_row);
  CK(cudaMemsetAsync(acc, 0, pr.no() * sizeof(float)));
  static int* bad_keys = [] {  // the kernel's flag (Note [no calls in wgmma kernels])
    int* b = nullptr;
    CK(cudaMalloc(&b, sizeof(int)));
    return b;
  }();
  CK(cudaMemsetAsync(bad_keys, 0, sizeof(int)));
  auto ws = [&](auto cfg) {
    using C = decltype(cfg);
    return launch_bwd_sm90_cfg<T16, C::kWG, C::kStages, C::kDq, C::kPP, C::kDefer, C::kPersist>(
        p, pr.q(), pr.k(), pr.v(), pr.dg, pr.dlse_ref, pr.ddvec_ref, acc, dk, dv, bad_keys, 0,
        "bwd_sm90", g_blocks);
  };
  if (kind == 0) {
    if (!ws(Ws<2, 3, 2, true>{})) return false;  // the library's configuration until session 14
  } else if (kind == 2) {
    if (!ws(Ws<2, 3, 2, false>{})) return false;
  } else if (kind == 3) {
    if (!ws(Ws<2, 2, 2, true>{})) return false;
  } else if (kind == 4) {
    if (!ws(Ws<2, 3, 1, true>{})) return false;
  } else if (kind == 5) {
    if (!ws(Ws<2, 3, 0, true>{})) return false;
  } else if (kind == 6) {
    if (!ws(Ws<2, 3, 2, true, true>{})) return false;
  } else if (kind == 7) {
    if (!ws(Ws<2, 4, 2, true, true>{})) return false;
  } else if (kind == 8) {
    if (!ws(Ws<2, 3, 2, false, true>{})) return false;
  } else if (kind == 9) {
    if (!ws(Ws<2, 3, 1, true, true>{})) return false;
  } else if (kind == 10) {
    if (!ws(Ws<2, 3, 3, true, true>{})) return false;
  } else if (kind == 11) {
    if (!ws(Ws<2, 4, 3, true, true>{})) return false;
  } else if (kind == 12) {
    if (!ws(Ws<2, 2, 3, true, true>{})) return false;
  } else if (kind == 13) {
    if (!ws(Ws<2, 3, 3, true, true, true>{})) return false;
  } else if (kind == 14) {
    if (!ws(Ws<2, 2, 3, true, true, true>{})) return false;
  } else {
    using C = V2Config<64>;
    constexpr int W = C::kFuWarps, Br = C::kFuBr, MT = C::kFuMT, Bc = 16 * MT * W;
    constexpr size_t smem = fused_smem<T16, 64, W, Br, MT>();
    auto kern = attn_bwd_dkdv_v2<T16, 64, W, Br, C::kFuFrag, C::kFuMinBlocks, MT, true, false>;
    CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    dim3 grid(p.B * p.H, unsigned(ceil_div(p.S, Bc)));
    kern<<<grid, W * 32, smem>>>(p, pr.q(), pr.k(), pr.v(), pr.dg, pr.dlse_ref, pr.ddvec_ref, dk,
                                 dv, acc);
    CK(cudaGetLastError());
  }
  const DqFixInputs<T16> fix{pr.q(), pr.k(), pr.v(), pr.dg, pr.dlse_ref, pr.ddvec_ref};
  attn_bwd_dq_convert<T16, 64>
      <<<unsigned(ceil_div(int64_t(pr.no() / 8), 256)), 256>>>(p, acc, dq, fix);
  CK(cudaGetLastError());
  return true;
}

static const char* kName[] = {"wgmma kDq 2",  "mma.sync fused", "wgmma no pp", "wgmma 2 st",
                              "wgmma red.v4", "wgmma no dQ",    "defer 3 st",  "defer 4 st",
                              "defer no pp",  "defer red.v4",   "dq128 3 st",  "dq128 4 st",
                              "dq128 2 st",   "persist 3 st",   "persist 2 st"};
static const int kKinds = 15;

static void check(int kind) {
  // persistent kinds: 3 blocks, so each walks several items (the library runs one per SM)
  g_blocks = kind >= 13 ? 3 : 0;
  const int Ts[] = {1, 7, 64, 100, 200, 1024};
  for (int T : Ts) {
    for (int causal = 0; causal < 2; ++causal) {
      Problem pr;
      const int B = T >= 1024 ? 1 : 2, H = T >= 1024 ? 2 : 3;
      pr.make(B, H, T, 64, causal, true, 4321u + T * 7 + causal);
      const size_t no = pr.no(), nx = pr.nx();
      const int HD = pr.H * 64;
      T16* packed = dmalloc<T16>(nx);
      float* acc = dmalloc<float>(no);
      poison(packed, nx * 2), poison(acc, no * 4);
      const bool ok = run_bwd(kind, pr, acc, packed, packed + HD, packed + 2 * HD, 3 * HD);
      CK(cudaDeviceSynchronize());
      double e[3] = {INFINITY, INFINITY, INFINITY};
      if (ok) {
        auto hp = hcopy(packed, nx);
        auto at = [&](int w, size_t i) {
          return double(bf2f(hp[((i / HD) * 3 + w) * HD + i % HD]));
        };
        e[0] = rel_err(pr.dq, [&](size_t i) { return at(0, i); });
        e[1] = rel_err(pr.dk, [&](size_t i) { return at(1, i); });
        e[2] = rel_err(pr.dv, [&](size_t i) { return at(2, i); });
      }
      const bool pass = e[0] <= 3e-2 && e[1] <= 3e-2 && e[2] <= 3e-2;
      g_fail += pass ? 0 : 1;
      std::printf("check %-16s T=%-5d %-6s dq %.2e dk %.2e dv %.2e  %s\n", kName[kind], T,
                  causal ? "causal" : "full", e[0], e[1], e[2], pass ? "PASS" : "FAIL");
      CK(cudaFree(packed));
      CK(cudaFree(acc));
      pr.release();
    }
  }
  g_blocks = 0;
}

// The persistent kernel at the timing shape (B16 H12 T1024, more items than SMs) against the
// one-item-per-block kernel (kind 10) on the same inputs: dk, dv bitwise equal (the same sums in
// the same order), dq_acc within 1e-5 of max |dq_acc| (its adds land in another order); with the
// library's grid and with 7 blocks.
static void compare_persistent() {
  const int B = 16, H = 12, T = 1024, HD = H * 64;
  for (int causal = 0; causal < 2; ++causal) {
    Problem big;
    big.make(B, H, T, 64, causal, false, 123u + causal);
    const size_t nx = big.nx(), no = big.no();
    T16* ref = dmalloc<T16>(nx);
    T16* got = dmalloc<T16>(nx);
    float* acc_ref = dmalloc<float>(no);
    float* acc_got = dmalloc<float>(no);
    poison(ref, nx * 2), poison(got, nx * 2);
    run_bwd(10, big, acc_ref, ref, ref + HD, ref + 2 * HD, 3 * HD);
    const auto href = hcopy(ref, nx);
    const auto aref = hcopy(acc_ref, no);
    for (int blocks : {0, 7}) {
      for (int kind : {13, 14}) {
        poison(got, nx * 2), poison(acc_got, no * 4);
        g_blocks = blocks;
        run_bwd(kind, big, acc_got, got, got + HD, got + 2 * HD, 3 * HD);
        g_blocks = 0;
        CK(cudaDeviceSynchronize());
        const auto hg = hcopy(got, nx);
        const auto ag = hcopy(acc_got, no);
        size_t kv_diff = 0;  // dk, dv elements (slots 1, 2 of each packed row) not bitwise equal
        for (size_t i = 0; i < nx; ++i) {
          const bool is_kv = (i / HD) % 3 != 0;
          if (is_kv && std::memcmp(&hg[i], &href[i], sizeof(T16)) != 0) ++kv_diff;
        }
        double amax = 0, dmax = 0;
        for (size_t i = 0; i < no; ++i) {
          amax = std::max(amax, std::fabs(double(aref[i])));
          const double d = std::fabs(double(ag[i]) - double(aref[i]));
          dmax = std::isnan(d) ? INFINITY : std::max(dmax, d);
        }
        const double e = dmax / amax;
        const bool pass = kv_diff == 0 && e <= 1e-5;
        g_fail += pass ? 0 : 1;
        std::printf(
            "compare %-12s blocks %-3d B%d H%d T%d %-6s dk/dv differing %zu, dq_acc %.2e  %s\n",
            kName[kind], blocks, B, H, T, causal ? "causal" : "full", kv_diff, e,
            pass ? "PASS" : "FAIL");
      }
    }
    CK(cudaFree(ref));
    CK(cudaFree(got));
    CK(cudaFree(acc_ref));
    CK(cudaFree(acc_got));
    big.release();
  }
}

static void bench() {
  const int B = 16, H = 12, T = 1024;
  for (int causal = 1; causal >= 0; --causal) {
    Problem big;
    big.make(B, H, T, 64, causal, false, 99u);
    T16* gbuf = dmalloc<T16>(big.nx());
    float* acc = dmalloc<float>(big.no());
    const int HD = H * 64;
    const double fl = 5.0 * B * H * double(T) * T * 64 * (causal ? 0.5 : 1.0);
    for (int kind = 0; kind < kKinds; ++kind) {
      if (!harness_selected(kName[kind])) continue;
      bool ok = true;
      auto run = [&] {
        ok = run_bwd(kind, big, acc, gbuf, gbuf + HD, gbuf + 2 * HD, 3 * HD) && ok;
      };
      const double ms = time_ms(run, 3, 20);
      std::printf("bench %-16s B%d H%d T%d D64 %-6s %8.3f ms %7.1f TFLOP/s%s\n", kName[kind], B, H,
                  T, causal ? "causal" : "full", ms, fl / (ms * 1e-3) / 1e12,
                  ok ? "" : "  (not launched)");
    }
    CK(cudaFree(gbuf));
    CK(cudaFree(acc));
    big.release();
  }
}

int main(int argc, char** argv) {
  auto attrs = [](const char* what, auto kern) {
    cudaFuncAttributes fa{};
    CK(cudaFuncGetAttributes(&fa, kern));
    std::printf("attn_bwd_sm90_ws %s: %d registers, max %d threads, %zu B local\n", what,
                fa.numRegs, fa.maxThreadsPerBlock, fa.localSizeBytes);
  };
  attrs("(kDq 2)", bt::cuda::attn_bwd_sm90_ws<T16, 64, 2, 3, 2, true, false, false>);
  attrs("(library: kDq 3, defer)", bt::cuda::attn_bwd_sm90_ws<T16, 64, 2, 3, 3, true, true, false>);
  attrs("(persistent)", bt::cuda::attn_bwd_sm90_ws<T16, 64, 2, 3, 3, true, true, true>);
  bool do_check = true, do_bench = true, do_compare = true;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--bench")) do_check = false;
    if (!std::strcmp(argv[i], "--check")) do_bench = false;
    if (!std::strcmp(argv[i], "--check-small")) do_bench = do_compare = false;  // (sanitizers)
  }
  if (do_check) {
    for (int kind = 0; kind < kKinds; ++kind) {
      if (kind != 5 && harness_selected(kName[kind])) check(kind);
    }
    if (do_compare && harness_selected("persist")) compare_persistent();
  }
  if (do_bench) bench();
  std::printf("%s: %d failing check(s)\n", g_fail ? "FAIL" : "PASS", g_fail);
  return g_fail ? 1 : 0;
}
