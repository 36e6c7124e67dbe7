// attn_problem.cuh: what the bf16 attention harnesses share beyond harness_common.cuh (CK, device
// buffers, NaN poisoning, rel_err, time_ms; included here): Problem (bf16 inputs as slices of a
// packed (B, T, 3, H, D) buffer, dO, and float64 reference o, lse, Dvec, dq, dk, dv).
// Included by attn_tune.cu and attn_sm90_bwd_check.cu after the kernel sources.
#pragma once
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "harness_common.cuh"

using bt::cuda::AttnParams;
using bt::cuda::GradLayout;
using T16 = __nv_bfloat16;

// ---- host helpers ------------------------------------------------------------------------------
static float bf2f(T16 x) { return __bfloat162float(x); }

// ---- problem: inputs, float64 reference ------------------------------------------------------
struct Problem {
  int B, H, T, D;
  bool causal;
  double scale;
  // host (double, on bf16-rounded values): x (B, T, 3, H, D), g = dO and o (B, T, H, D),
  // lse, dlse, dvec (B, H, T), dq, dk, dv (B, T, H, D)
  std::vector<double> x, g, o, lse, dlse, dvec, dq, dk, dv;
  // device
  T16 *dx = nullptr, *dg = nullptr, *dor = nullptr;
  float *dlse_ref = nullptr, *ddvec_ref = nullptr, *ddlse = nullptr;
  size_t nx() const { return size_t(B) * T * 3 * H * D; }
  size_t no() const { return size_t(B) * T * H * D; }
  size_t nr() const { return size_t(B) * H * T; }
  size_t xi(int b, int t, int w, int h, int d) const {
    return ((((size_t(b) * T + t) * 3 + w) * H + h) * D + d);
  }
  size_t oi(int b, int t, int h, int d) const { return ((size_t(b) * T + t) * H + h) * D + d; }
  size_t ri(int b, int h, int t) const { return (size_t(b) * H + h) * T + t; }

  AttnParams params() const {
    AttnParams p{};
    p.B = B, p.H = H, p.L = T, p.S = T, p.D = D;
    const int64_t row = int64_t(3) * H * D, bat = row * T;
    p.q_b = p.k_b = p.v_b = bat;
    p.q_h = p.k_h = p.v_h = D;
    p.q_l = p.k_l = p.v_l = row;
    p.o_b = p.g_b = int64_t(T) * H * D;
    p.o_l = p.g_l = int64_t(H) * D;
    p.o_h = p.g_h = D;
    p.dl_b = int64_t(H) * T, p.dl_h = T, p.dl_l = 1;
    p.dg = GradLayout::from_rows(p.L, p.S, p.D, int64_t(H) * D);
    p.scale = scale;
    p.causal = causal;
    return p;
  }
  const T16* q() const { return dx; }
  const T16* k() const { return dx + size_t(H) * D; }
  const T16* v() const { return dx + 2 * size_t(H) * D; }

  void make(int B_, int H_, int T_, int D_, bool causal_, bool reference, unsigned seed) {
    B = B_, H = H_, T = T_, D = D_, causal = causal_, scale = 1.0 / std::sqrt(double(D));
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    std::vector<T16> hx(nx()), hg(no());
    x.resize(nx()), g.resize(no());
    for (size_t i = 0; i < nx(); ++i) {
      hx[i] = __float2bfloat16(nd(rng));
      x[i] = bf2f(hx[i]);
    }
    for (size_t i = 0; i < no(); ++i) {
      hg[i] = __float2bfloat16(nd(rng));
      g[i] = bf2f(hg[i]);
    }
    dlse.resize(nr());
    for (auto& e : dlse) e = 0.5 * nd(rng);
    dx = dcopy(hx);
    dg = dcopy(hg);
    std::vector<float> fdl(dlse.begin(), dlse.end());
    ddlse = dcopy(fdl);
    o.assign(no(), 0.0);
    lse.assign(nr(), 0.0);
    dvec.assign(nr(), 0.0);
    std::vector<T16> ho(no());
    if (reference) {
      dq.assign(no(), 0.0), dk.assign(no(), 0.0), dv.assign(no(), 0.0);
      std::vector<double> s(T), p(T), dp(T);
      for (int b = 0; b < B; ++b) {
        for (int h = 0; h < H; ++h) {
          for (int i = 0; i < T; ++i) {
            const int n = causal ? i + 1 : T;
            double m = -INFINITY;
            for (int j = 0; j < n; ++j) {
              double acc = 0;
              for (int d = 0; d < D; ++d) acc += x[xi(b, i, 0, h, d)] * x[xi(b, j, 1, h, d)];
              s[j] = acc * scale;
              m = std::max(m, s[j]);
            }
            double l = 0;
            for (int j = 0; j < n; ++j) l += (p[j] = std::exp(s[j] - m));
            for (int j = 0; j < n; ++j) p[j] /= l;
            lse[ri(b, h, i)] = m + std::log(l);
            double dv_i = 0;
            for (int j = 0; j < n; ++j) {
              double acc = 0;
              for (int d = 0; d < D; ++d) acc += g[oi(b, i, h, d)] * x[xi(b, j, 2, h, d)];
              dp[j] = acc;
              dv_i += p[j] * dp[j];
            }
            for (int d = 0; d < D; ++d) {
              double acc = 0;
              for (int j = 0; j < n; ++j) acc += p[j] * x[xi(b, j, 2, h, d)];
              o[oi(b, i, h, d)] = acc;
            }
            // Dvec = rowsum(dO * O) - dlse (exact O), then dS = P (dP - Dvec)
            dvec[ri(b, h, i)] = dv_i - dlse[ri(b, h, i)];
            for (int j = 0; j < n; ++j) {
              const double ds = p[j] * (dp[j] - dvec[ri(b, h, i)]) * scale;
              for (int d = 0; d < D; ++d) {
                dq[oi(b, i, h, d)] += ds * x[xi(b, j, 1, h, d)];
                dk[oi(b, j, h, d)] += ds * x[xi(b, i, 0, h, d)];
                dv[oi(b, j, h, d)] += p[j] * g[oi(b, i, h, d)];
              }
            }
          }
        }
      }
      for (size_t i = 0; i < no(); ++i) ho[i] = __float2bfloat16(float(o[i]));
    } else {
      for (size_t i = 0; i < no(); ++i) ho[i] = __float2bfloat16(nd(rng));  // timing only
      for (auto& e : lse) e = 5.0;
    }
    dor = dcopy(ho);
    std::vector<float> fl(lse.begin(), lse.end()), fd(dvec.begin(), dvec.end());
    dlse_ref = dcopy(fl);
    ddvec_ref = dcopy(fd);
  }
  void release() {
    for (void* ptr :
         {(void*)dx, (void*)dg, (void*)dor, (void*)dlse_ref, (void*)ddvec_ref, (void*)ddlse}) {
      CK(cudaFree(ptr));
    }
  }
};
