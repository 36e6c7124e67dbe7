// Randomised differential test of the CUDA backend's host logic (src/cuda/gemm_cuda.cpp) on a
// machine without a GPU: the backend runs over fake_cuda.cpp (runtime and kernels on the host)
// and fake_lt.cpp (a host cuBLASLt with its column-major semantics), and every result is
// compared with the CPU backend's for the same descriptor. It covers the row-major ->
// column-major mapping, fused and unfused epilogues, batches, dtypes, k = 0, in-place C,
// autotune and the persisted cache (a second pass reloads it). Built by test_cuda_host_logic.py.
// Usage: driver LIBSCIPY_OPENBLAS.so [iterations]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "blutrain/linalg.h"
#include "half.h"
using namespace blutrain::linalg;

static size_t esz(int dt) { return dt == BT_LINALG_F64 ? 8 : dt == BT_LINALG_F32 ? 4 : 2; }
static double ldv(const void* p, int dt, int64_t i) {
  switch (dt) {
    case 0:
      return ((const float*)p)[i];
    case 1:
      return ((const double*)p)[i];
    case 2:
      return f16_to_f32(((const uint16_t*)p)[i]);
    default:
      return bf16_to_f32(((const uint16_t*)p)[i]);
  }
}
static void stv(void* p, int dt, int64_t i, double v) {
  switch (dt) {
    case 0:
      ((float*)p)[i] = (float)v;
      break;
    case 1:
      ((double*)p)[i] = v;
      break;
    case 2:
      ((uint16_t*)p)[i] = f32_to_f16((float)v);
      break;
    default:
      ((uint16_t*)p)[i] = f32_to_bf16((float)v);
  }
}
struct Buf {
  std::vector<char> b;
  int dt;
  int64_t n;
  Buf(int dt_, int64_t n_) : b(esz(dt_) * (n_ ? n_ : 1)), dt(dt_), n(n_) {}
  void* p() { return b.data(); }
};
std::mt19937_64 rng(42);
static void fill(Buf& x) {
  std::normal_distribution<double> nd;
  for (int64_t i = 0; i < x.n; ++i) stv(x.p(), x.dt, i, nd(rng));
}
static double relerr(Buf& a, Buf& b) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.n; ++i) {
    double x = ldv(a.p(), a.dt, i), y = ldv(b.p(), b.dt, i);
    if (std::isnan(x) != std::isnan(y)) return 1e9;
    if (std::isnan(x)) continue;
    num += (x - y) * (x - y);
    den += y * y;
  }
  return std::sqrt(num / (den > 0 ? den : 1));
}

int main(int argc, char** argv) {
  const bt_linalg_api* api = bt_linalg_get_api();
  if (api->load_blas(argv[1])) {
    printf("blas: %s\n", api->last_error());
    return 1;
  }
  int iters = argc > 2 ? atoi(argv[2]) : 300, bad = 0;
  std::uniform_int_distribution<int> pick(0, 1000000);
  const int combos[][2] = {{0, 0}, {3, 3}, {3, 0}, {2, 2}, {2, 0}, {0, 3}, {1, 1}};
  for (int pass = 0; pass < 2; ++pass) {
    rng.seed(42);
    int64_t h0, m0;
    api->get_option("cache_hits", &h0);
    api->get_option("cache_misses", &m0);
    for (int it = 0; it < iters; ++it) {
      int ci = pick(rng) % 7;
      int din = combos[ci][0], dout = combos[ci][1];
      int64_t sizes[] = {0, 1, 2, 3, 7, 8, 13, 16, 31};
      int64_t m = sizes[1 + pick(rng) % 8], n = sizes[1 + pick(rng) % 8], k = sizes[pick(rng) % 9];
      int64_t batch = pick(rng) % 3 == 0 ? 3 : 1;
      int ta = pick(rng) % 2, tb = pick(rng) % 2, epi = pick(rng) % 10;
      double beta = pick(rng) % 3 == 0 ? 1.25 : 0.0;
      bool inplace = beta != 0 && pick(rng) % 2;
      int fused = pick(rng) % 2, noepi = pick(rng) % 3 == 0, tune = pick(rng) % 4 == 0;
      int x3 = pick(rng) % 2;  // float32 inputs: the 3xTF32 kernel or cuBLASLt
      int64_t pad = pick(rng) % 2 ? 3 : 0;
      int64_t ar = ta ? k : m, ac = ta ? m : k, br = tb ? n : k, bc = tb ? k : n;
      int64_t lda = (ac ? ac : 1) + pad, ldb = (bc ? bc : 1) + pad, ldd = n + pad;
      int64_t bsa = ar * lda, bsb = (batch > 1 && pick(rng) % 2) ? 0 : br * ldb, bsd = m * ldd;
      Buf A(din, bsa * batch), B(din, (bsb ? bsb : br * ldb) * batch);
      fill(A);
      fill(B);
      Buf C(dout, bsd * batch);
      fill(C);
      int auxdt = dout, bdt = pick(rng) % 2 ? dout : 0;
      if (din == 1) bdt = 1;
      int64_t blen = epi == BT_LINALG_EPI_BGRAD_A ? m : n;
      Buf bias(bdt, n * batch);
      fill(bias);
      Buf aux_in(auxdt, bsd * batch);
      fill(aux_in);
      bool aux_read = epi == 6 || epi == 7, aux_write = epi == 4 || epi == 5;
      Buf out[2] = {Buf(dout, bsd * batch), Buf(dout, bsd * batch)},
          auxo[2] = {Buf(auxdt, bsd * batch), Buf(auxdt, bsd * batch)},
          bg[2] = {Buf(bdt, blen * batch), Buf(bdt, blen * batch)};
      int rc[2];
      for (int dev = 0; dev < 2; ++dev) {
        setenv("FAKE_LT_NO_EPI", noepi ? "1" : "", 1);
        if (!noepi) unsetenv("FAKE_LT_NO_EPI");
        api->set_option("fused_epilogues", fused);
        api->set_option("autotune", tune);
        api->set_option("fp32_3xtf32", x3);
        bt_linalg_gemm_desc d;
        bt_linalg_gemm_desc_init(&d);
        d.device = dev == 0 ? -1 : 0;
        d.m = m;
        d.n = n;
        d.k = k;
        d.batch = batch;
        d.transa = ta;
        d.transb = tb;
        d.a = {A.p(), lda, batch > 1 ? bsa : 0, din, 0};
        d.b = {B.p(), ldb, batch > 1 ? bsb : 0, din, 0};
        memcpy(out[dev].p(), C.p(), C.b.size());
        d.d = {out[dev].p(), ldd, bsd, dout, 0};
        d.beta = beta;
        d.alpha = 0.75;
        if (beta != 0) d.c = inplace ? d.d : bt_linalg_matrix{C.p(), ldd, bsd, dout, 0};
        d.epilogue = epi;
        d.bias = {bias.p(), 0, batch > 1 ? n : 0, bdt, 0};
        if (aux_read) {
          memcpy(auxo[dev].p(), aux_in.p(), aux_in.b.size());
        }
        d.aux = {auxo[dev].p(), ldd, bsd, auxdt, 0};
        d.bgrad = {bg[dev].p(), 0, blen, bdt, 0};
        rc[dev] = api->gemm(&d);
        if (rc[dev]) printf("it %d dev %d rc %d: %s\n", it, dev, rc[dev], api->last_error());
      }
      double e1 = relerr(out[1], out[0]);
      double tol = (dout == 1 ? 1e-9 : dout == 0 && din == 0 ? 1e-5 : 2e-2);
      double e2 = aux_write ? relerr(auxo[1], auxo[0]) : 0,
             e3 = (epi == 7 || epi == 8 || epi == 9) ? relerr(bg[1], bg[0]) : 0;
      double btol = (bdt == 1                                          ? 1e-9
                     : (bdt == 0 && din != 2 && din != 3 && dout == 0) ? 1e-5
                                                                       : 3e-2);
      if (rc[0] != rc[1] || e1 > tol || e2 > tol || e3 > btol) {
        ++bad;
        printf(
            "MISMATCH it %d: din %d dout %d m %lld n %lld k %lld b %lld ta %d tb %d epi %d beta %g "
            "inplace %d fused %d noepi %d tune %d x3 %d pad %lld bsb %lld: rc %d/%d err D %.3g aux "
            "%.3g "
            "bgrad %.3g\n",
            it, din, dout, (long long)m, (long long)n, (long long)k, (long long)batch, ta, tb, epi,
            beta, (int)inplace, fused, noepi, tune, x3, (long long)pad, (long long)bsb, rc[0],
            rc[1], e1, e2, e3);
      }
    }
    int64_t h1, m1;
    api->get_option("cache_hits", &h1);
    api->get_option("cache_misses", &m1);
    printf("pass %d: hits %lld misses %lld\n", pass, (long long)(h1 - h0), (long long)(m1 - m0));
    api->clear_cache(0);
  }
  int64_t v;
  api->get_option("fallback_epilogues", &v);
  printf("fallbacks %lld\n", (long long)v);
  api->get_option("tf32x3_calls", &v);
  printf("tf32x3 calls %lld\n", (long long)v);
  api->get_option("cache_entries", &v);
  printf("cache entries %lld\n", (long long)v);
  printf("%d mismatches in %d\n", bad, iters);
  return bad != 0;
}
