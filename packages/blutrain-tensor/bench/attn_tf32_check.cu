// attn_tf32_check.cu: standalone check + bench of src/cuda/attention_tf32.cu (no framework).
// Build and run: bash bench/attn_tf32_check.sh.  Exit status 1 if any check FAILs.
//
// Checks fwd (o, lse) and bwd (dq, dk, dv) of 1xTF32 and 3xTF32 against a float64 CPU reference:
// B2 H3, T in {1, 7, 64, 200} (and a cross case L 33, S 100), D in {64, 128}, causal and not;
// q, k, v are the non-contiguous slices of (B, T, 3, H, D) buffers (a (B, T, 3C) linear split);
// outputs are poisoned with NaN; the backward runs with a random dlse, twice (bitwise equal) and
// into a packed (B, T, 3, H, D) dq/dk/dv buffer (d_row = 3 H D, bitwise equal to the separate one).
// Error: max |gpu - ref| / max(0.1, max |ref|) per tensor.  Then times fwd and bwd (both kernels;
// Dvec is precomputed) at B16 H12 T1024 D64 causal, cudaEvent, the mean of 20 back-to-back reps
// after 3 warm-ups.  Causal FLOPs: fwd 2 B H T^2 D (QK^T and PV, half the T x T), bwd 5 B H T^2 D
// (QK^T, dO V^T, P^T dO, dS^T Q, dS K; our kernels recompute QK^T and dO V^T in both kernels, not
// counted).
#define BT_ATTN_TF32_STANDALONE
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "../src/cuda/attention_tf32.cu"
#include "harness_common.cuh"

using bt::cuda::AttnTf32Args;
using bt::cuda::GradLayout;

static int g_fail = 0;

constexpr size_t kPad = 16;  // spare bytes after each device buffer (dcopy, dmalloc)
static float* dev_nan(size_t n) {
  float* d = dmalloc<float>(n, kPad);
  poison(d, n * sizeof(float));
  return d;
}

// rel_err's floor for max |ref|.  At T == 1 dq and dk are exactly zero and the kernels return the
// rounding of dP - Dvec, two terms that cancel: measured against the terms' scale, not zero.  For
// unit normal inputs dP's elements reach ~8 (D = 64 products), so 1xTF32's 2^-11 rounding of the
// products leaves ~1e-3 in dq and dk: their floor is 1 (the 0.1 of o and lse passed 3xTF32 only).
constexpr double kRefFloor = 1e-1;
constexpr double kGradFloor = 1.0;

static void report(const char* what, const char* name, double err, double tol) {
  const bool ok = err <= tol;
  if (!ok) ++g_fail;
  std::printf("  %-40s %-4s rel err %.3e (tol %.0e) %s\n", what, name, err, tol,
              ok ? "PASS" : "FAIL");
}

// One case: q from a (B, L, 3, H, D) buffer (slot 0), k, v from a (B, S, 3, H, D) buffer.
static void run_case(int B, int H, int L, int S, int D, bool causal, bool exact,
                     std::mt19937& rng) {
  const int C = H * D;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> qbuf(static_cast<size_t>(B) * L * 3 * C),
      kvbuf(static_cast<size_t>(B) * S * 3 * C);
  for (auto& x : qbuf) x = nd(rng);
  for (auto& x : kvbuf) x = nd(rng);
  std::vector<float> go(static_cast<size_t>(B) * L * C), dlse(static_cast<size_t>(B) * H * L);
  for (auto& x : go) x = nd(rng);
  for (auto& x : dlse) x = 0.3f * nd(rng);
  auto Q = [&](int b, int h, int i, int d) {
    return (double)qbuf[((size_t)(b * L + i) * 3 + 0) * C + h * D + d];
  };
  auto K = [&](int b, int h, int j, int d) {
    return (double)kvbuf[((size_t)(b * S + j) * 3 + 1) * C + h * D + d];
  };
  auto V = [&](int b, int h, int j, int d) {
    return (double)kvbuf[((size_t)(b * S + j) * 3 + 2) * C + h * D + d];
  };
  auto G = [&](int b, int h, int i, int d) {
    return (double)go[((size_t)(b * L + i) * H + h) * D + d];
  };

  // float64 reference: o, lse, dq (B, L, H, D), dk, dv (B, S, H, D)
  std::vector<double> ro((size_t)B * L * C), rl((size_t)B * H * L), rdq((size_t)B * L * C, 0),
      rdk((size_t)B * S * C, 0), rdv((size_t)B * S * C, 0);
  std::vector<double> P((size_t)L * S), dS((size_t)L * S);
  for (int b = 0; b < B; ++b) {
    for (int h = 0; h < H; ++h) {
      for (int i = 0; i < L; ++i) {
        double mx = -INFINITY;
        for (int j = 0; j < S; ++j) {
          double s = -INFINITY;
          if (!causal || j <= i) {
            s = 0;
            for (int d = 0; d < D; ++d) s += Q(b, h, i, d) * K(b, h, j, d);
            s *= scale;
          }
          P[(size_t)i * S + j] = s;
          mx = std::max(mx, s);
        }
        double sum = 0;
        for (int j = 0; j < S; ++j) sum += std::exp(P[(size_t)i * S + j] - mx);
        const double lse = mx + std::log(sum);
        rl[((size_t)b * H + h) * L + i] = lse;
        for (int j = 0; j < S; ++j) P[(size_t)i * S + j] = std::exp(P[(size_t)i * S + j] - lse);
        for (int d = 0; d < D; ++d) {
          double acc = 0;
          for (int j = 0; j < S; ++j) acc += P[(size_t)i * S + j] * V(b, h, j, d);
          ro[((size_t)(b * L + i) * H + h) * D + d] = acc;
        }
        double dvec = -dlse[((size_t)b * H + h) * L + i];
        for (int d = 0; d < D; ++d)
          dvec += G(b, h, i, d) * ro[((size_t)(b * L + i) * H + h) * D + d];
        for (int j = 0; j < S; ++j) {
          double dp = 0;
          for (int d = 0; d < D; ++d) dp += G(b, h, i, d) * V(b, h, j, d);
          dS[(size_t)i * S + j] = P[(size_t)i * S + j] * (dp - dvec);
        }
      }
      for (int i = 0; i < L; ++i) {
        for (int d = 0; d < D; ++d) {
          double a = 0;
          for (int j = 0; j < S; ++j) a += dS[(size_t)i * S + j] * K(b, h, j, d);
          rdq[((size_t)(b * L + i) * H + h) * D + d] = a * scale;
        }
      }
      for (int j = 0; j < S; ++j) {
        for (int d = 0; d < D; ++d) {
          double ak = 0, av = 0;
          for (int i = 0; i < L; ++i) {
            ak += dS[(size_t)i * S + j] * Q(b, h, i, d);
            av += P[(size_t)i * S + j] * G(b, h, i, d);
          }
          rdk[((size_t)(b * S + j) * H + h) * D + d] = ak * scale;
          rdv[((size_t)(b * S + j) * H + h) * D + d] = av;
        }
      }
    }
  }

  AttnTf32Args a{};
  a.B = B, a.H = H, a.L = L, a.S = S, a.D = D;
  a.q_b = (int64_t)L * 3 * C, a.q_h = D, a.q_l = 3 * C;
  a.k_b = (int64_t)S * 3 * C, a.k_h = D, a.k_l = 3 * C;
  a.v_b = a.k_b, a.v_h = D, a.v_l = 3 * C;
  a.g_b = (int64_t)L * C, a.g_l = C, a.g_h = D;
  a.dg = GradLayout::from_rows(a.L, a.S, a.D, C);
  a.scale = scale, a.causal = causal;
  a.prec = exact ? bt::cuda::kTf32All : bt::cuda::kTf32None;
  char what[128];
  std::snprintf(what, sizeof what, "%s B%d H%d L%d S%d D%d %s", exact ? "3xTF32" : "1xTF32", B, H,
                L, S, D, causal ? "causal" : "full");
  if (!bt::cuda::attn_tf32_supported(a)) {
    std::printf("  %-40s unsupported?! FAIL\n", what);
    ++g_fail;
    return;
  }
  const double tol = exact ? 2e-5 : 4e-3;
  float* qd = dcopy(qbuf, kPad);
  float* dkv = dcopy(kvbuf, kPad);
  const float *q = qd, *k = dkv + C, *v = dkv + 2 * C;
  float* o = dev_nan((size_t)B * L * C);
  float* lse = dev_nan((size_t)B * H * L);
  bt::cuda::attn_fwd_tf32(a, q, k, v, o, lse, 0, "attn_fwd_tf32");
  CK(cudaDeviceSynchronize());
  const auto ho = hcopy(o, ro.size()), hl = hcopy(lse, rl.size());
  report(what, "o", rel_err(ro, [&](size_t i) { return (double)ho[i]; }, kRefFloor), tol);
  report(what, "lse",
         rel_err(rl, [&](size_t i) { return (double)hl[i]; }, kRefFloor), exact ? 2e-6 : 1e-3);

  // Dvec from the GPU's o (as attn_bwd_preprocess does)
  std::vector<float> dvec((size_t)B * H * L);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h)
      for (int i = 0; i < L; ++i) {
        double s = 0;
        for (int d = 0; d < D; ++d) {
          const size_t idx = ((size_t)(b * L + i) * H + h) * D + d;
          s += (double)ho[idx] * go[idx];
        }
        dvec[((size_t)b * H + h) * L + i] = (float)(s - dlse[((size_t)b * H + h) * L + i]);
      }
  float* g = dcopy(go, kPad);
  float* dvd = dcopy(dvec, kPad);
  float* dq = dev_nan(rdq.size());
  float* dk = dev_nan(rdk.size());
  float* dv = dev_nan(rdv.size());
  bt::cuda::attn_bwd_tf32(a, q, k, v, g, lse, dvd, dq, dk, dv, 0, "attn_bwd_tf32");
  CK(cudaDeviceSynchronize());
  const auto hdq = hcopy(dq, rdq.size()), hdk = hcopy(dk, rdk.size()), hdv = hcopy(dv, rdv.size());
  report(what, "dq", rel_err(rdq, [&](size_t i) { return (double)hdq[i]; }, kGradFloor), tol);
  report(what, "dk", rel_err(rdk, [&](size_t i) { return (double)hdk[i]; }, kGradFloor), tol);
  report(what, "dv", rel_err(rdv, [&](size_t i) { return (double)hdv[i]; }, kRefFloor), tol);
  // repeat: bitwise equal
  poison(dq, rdq.size() * 4);
  poison(dk, rdk.size() * 4);
  bt::cuda::attn_bwd_tf32(a, q, k, v, g, lse, dvd, dq, dk, dv, 0, "attn_bwd_tf32");
  CK(cudaDeviceSynchronize());
  const bool same = hcopy(dq, rdq.size()) == hdq && hcopy(dk, rdk.size()) == hdk;
  report(what, "rep", same ? 0.0 : INFINITY, 0);
  if (L == S) {  // packed (B, T, 3, H, D) dq/dk/dv
    AttnTf32Args ap = a;
    ap.dg = GradLayout::from_rows(ap.L, ap.S, ap.D, 3 * C);
    float* pk = dev_nan((size_t)B * L * 3 * C);
    bt::cuda::attn_bwd_tf32(ap, q, k, v, g, lse, dvd, pk, pk + C, pk + 2 * C, 0, "attn_bwd_tf32");
    CK(cudaDeviceSynchronize());
    const auto hp = hcopy(pk, (size_t)B * L * 3 * C);
    bool eq = true;
    for (size_t r = 0; r < (size_t)B * L; ++r) {
      eq = eq && std::memcmp(&hp[(r * 3 + 0) * C], &hdq[r * C], C * 4) == 0;
      eq = eq && std::memcmp(&hp[(r * 3 + 1) * C], &hdk[r * C], C * 4) == 0;
      eq = eq && std::memcmp(&hp[(r * 3 + 2) * C], &hdv[r * C], C * 4) == 0;
    }
    report(what, "pack", eq ? 0.0 : INFINITY, 0);
    CK(cudaFree(pk));
  }
  // dQ by atomics from the dK / dV kernel (not bitwise repeatable): every gradient against the
  // float64 reference, in its own layout and in the packed one (dq's rows 3C apart)
  for (int packed = 0; packed < (L == S ? 2 : 1); ++packed) {
    AttnTf32Args af = a;
    af.fused_dq = true;
    const size_t row = packed ? 3 * (size_t)C : (size_t)C;
    if (packed) af.dg = GradLayout::from_rows(af.L, af.S, af.D, 3 * C);
    float* buf = dev_nan((size_t)B * std::max(L, S) * row * (packed ? 1 : 3));
    float *fq = buf, *fk = packed ? buf + C : buf + (size_t)B * L * C,
          *fv = packed ? buf + 2 * C : fk + (size_t)B * S * C;
    bt::cuda::attn_bwd_tf32(af, q, k, v, g, lse, dvd, fq, fk, fv, 0, "attn_bwd_tf32 fused");
    CK(cudaDeviceSynchronize());
    auto rows_of = [&](float* base, size_t n_rows) {
      std::vector<float> h(n_rows * C);
      CK(cudaMemcpy2D(h.data(), C * 4, base, row * 4, C * 4, n_rows, cudaMemcpyDeviceToHost));
      return h;
    };
    const auto fdq = rows_of(fq, (size_t)B * L), fdk = rows_of(fk, (size_t)B * S),
               fdv = rows_of(fv, (size_t)B * S);
    const char* tag[2] = {"dq-a", "dq-ap"};
    report(what, tag[packed],
           rel_err(rdq, [&](size_t i) { return (double)fdq[i]; }, kGradFloor), tol);
    report(what, packed ? "dk-ap" : "dk-a",
           rel_err(rdk, [&](size_t i) { return (double)fdk[i]; }, kGradFloor), tol);
    report(what, packed ? "dv-ap" : "dv-a",
           rel_err(rdv, [&](size_t i) { return (double)fdv[i]; }, kRefFloor), tol);
    CK(cudaFree(buf));
  }
  for (void* p : {(void*)qd, (void*)dkv, (void*)o, (void*)lse, (void*)g, (void*)dvd, (void*)dq,
                  (void*)dk, (void*)dv})
    CK(cudaFree(p));
}

static void bench(bool exact, int D) {
  const int B = 16, T = 1024, H = 768 / D, C = H * D;  // GPT-2 124M's width
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> qkv((size_t)B * T * 3 * C), go((size_t)B * T * C), dvec((size_t)B * H * T);
  for (auto& x : qkv) x = nd(rng);
  for (auto& x : go) x = nd(rng);
  for (auto& x : dvec) x = 0.1f * nd(rng);
  AttnTf32Args a{};
  a.B = B, a.H = H, a.L = T, a.S = T, a.D = D;
  a.q_b = a.k_b = a.v_b = (int64_t)T * 3 * C;
  a.q_h = a.k_h = a.v_h = D;
  a.q_l = a.k_l = a.v_l = 3 * C;
  a.g_b = (int64_t)T * C, a.g_l = C, a.g_h = D;
  a.dg = GradLayout::from_rows(a.L, a.S, a.D, C);
  a.scale = 0.125, a.causal = true;
  a.prec = exact ? bt::cuda::kTf32All : bt::cuda::kTf32None;
  float* x = dcopy(qkv, kPad);
  float* g = dcopy(go, kPad);
  float* dv_ = dcopy(dvec, kPad);
  float* o = dev_nan((size_t)B * T * C);
  float* lse = dev_nan((size_t)B * H * T);
  float *dq = dev_nan((size_t)B * T * C), *dk = dev_nan((size_t)B * T * C),
        *dv = dev_nan((size_t)B * T * C);
  const double flop = 2.0 * B * H * (double)T * T * D;
  float ms[3];
  AttnTf32Args af = a;
  af.fused_dq = true;
  for (int pass = 0; pass < 3; ++pass) {
    auto call = [&] {
      if (pass == 0) {
        bt::cuda::attn_fwd_tf32(a, x, x + C, x + 2 * C, o, lse, 0, "fwd");
      } else {
        bt::cuda::attn_bwd_tf32(pass == 1 ? a : af, x, x + C, x + 2 * C, g, lse, dv_, dq, dk, dv, 0,
                                "bwd");
      }
    };
    ms[pass] = time_ms(call, 3, 1, 20);  // one sample: the mean of 20 back-to-back calls
  }
  std::printf(
      "bench %s B16 H%d T1024 D%d causal: fwd %.3f ms (%.1f TFLOP/s)  bwd split %.3f ms (%.1f "
      "TFLOP/s)  bwd dQ-atomic %.3f ms (%.1f TFLOP/s)%s\n",
      exact ? "3xTF32" : "1xTF32", H, D, ms[0], flop / ms[0] * 1e-9, ms[1],
      2.5 * flop / ms[1] * 1e-9, ms[2], 2.5 * flop / ms[2] * 1e-9,
      D == 64 ? "   [PyTorch fp32 mem-eff: fwd 0.88, bwd 2.07 ms]" : "");
  for (void* p :
       {(void*)x, (void*)g, (void*)dv_, (void*)o, (void*)lse, (void*)dq, (void*)dk, (void*)dv})
    CK(cudaFree(p));
}

int main(int argc, char** argv) {
  const bool bench_only = argc > 1 && std::strcmp(argv[1], "--bench") == 0;
  std::mt19937 rng(1234);
  if (!bench_only) {
    for (int exact = 0; exact < 2; ++exact)
      for (int D : {64, 128})
        for (int T : {1, 7, 64, 200})
          for (int causal = 0; causal < 2; ++causal) run_case(2, 3, T, T, D, causal, exact, rng);
    for (int exact = 0; exact < 2; ++exact) run_case(2, 3, 33, 100, 64, false, exact, rng);
    std::printf("%s: %d check(s) failed\n", g_fail ? "FAIL" : "PASS", g_fail);
  }
  for (int D : {64, 128}) {
    bench(false, D);
    bench(true, D);
  }
  return g_fail ? 1 : 0;
}
