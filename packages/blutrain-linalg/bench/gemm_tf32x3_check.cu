// gemm_tf32x3_check.cu: standalone check + bench of src/cuda/gemm_tf32x3.cu (no framework).
// Build and run: bash bench/gemm_tf32x3_check.sh [--bench].  Exit status 1 if any check FAILs.
//
// Checks. Every transa / transb combination, odd sizes (partial tiles, k not a multiple of 4),
// padded leading dimensions, batches, alpha / beta with C (also C == D), and split-K shapes, on
// fresh random inputs, against a float64 CPU reference: all of D for small problems, 4096 random
// elements for GPT-2's. The error of an element is |got - ref| / sum_k |a_ik b_kj| (the scale
// of fp32's own rounding of that dot product). The same problem also runs through cuBLAS's
// fp32 SGEMM (true fp32, SIMT) and its TF32 mode, whose errors print alongside. A check FAILs
// when ours is above max(4 x SGEMM's, 2e-6), or any output is not finite (D is poisoned with
// NaN first), or elements outside D's m x n (the ld padding) change.
// Bench: GPT-2 124M's GEMM shapes (B16 T1024), ours vs SGEMM vs cuBLAS TF32, cudaEvent, the
// median of 15 runs after 3 warm-ups.
#include <cublas_v2.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#define BT_TF32X3_VARIANTS
#include "../src/cuda/gemm_tf32x3.cu"

#define CK(x)                                                                                      \
  do {                                                                                             \
    cudaError_t e_ = (x);                                                                          \
    if (e_ != cudaSuccess) {                                                                       \
      std::printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e_), __FILE__, __LINE__, #x); \
      std::exit(2);                                                                                \
    }                                                                                              \
  } while (0)
#define CB(x)                                                                         \
  do {                                                                                \
    cublasStatus_t s_ = (x);                                                          \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                \
      std::printf("cuBLAS error %d at %s:%d: %s\n", int(s_), __FILE__, __LINE__, #x); \
      std::exit(2);                                                                   \
    }                                                                                 \
  } while (0)

using blutrain::linalg::kern::Tf32x3Problem;

static int g_fail = 0;
static cublasHandle_t g_h;
static std::mt19937_64 g_rng(std::random_device{}());

struct Case {
  const char* name;
  int64_t m, n, k, batch;
  int ta, tb;
  int pad;  // extra elements per row of every matrix
  double alpha, beta;
  bool in_place;  // C is D
  int samples;    // 0: check all of D
};

struct Buffers {
  std::vector<float> a, b, c;
  int64_t lda, ldb, ldd, bsa, bsb, bsd;
  float *da, *db, *dc, *dd;
};

static void fill(std::vector<float>& v) {
  std::normal_distribution<float> nd(0.f, 1.f);
  for (float& x : v) x = nd(g_rng);
}

// cuBLAS, row-major through the column-major swap (D^T = op(B)^T op(A)^T).
static void run_cublas(const Case& cs, const Buffers& bf, float* d, bool tf32) {
  CB(cublasSetMathMode(g_h, tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_PEDANTIC_MATH));
  const float al = float(cs.alpha), be = float(cs.beta);
  if (cs.beta != 0) CK(cudaMemcpyAsync(d, bf.dc, bf.c.size() * 4, cudaMemcpyDeviceToDevice));
  CB(cublasSgemmStridedBatched(g_h, cs.tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                               cs.ta ? CUBLAS_OP_T : CUBLAS_OP_N, int(cs.n), int(cs.m), int(cs.k),
                               &al, bf.db, int(bf.ldb), bf.bsb, bf.da, int(bf.lda), bf.bsa, &be, d,
                               int(bf.ldd), bf.bsd, int(cs.batch)));
}

static Tf32x3Problem problem(const Case& cs, const Buffers& bf, float* d) {
  Tf32x3Problem p{};
  p.m = cs.m, p.n = cs.n, p.k = cs.k, p.batch = cs.batch;
  p.transa = cs.ta, p.transb = cs.tb;
  p.a = bf.da, p.lda = bf.lda, p.bsa = bf.bsa;
  p.b = bf.db, p.ldb = bf.ldb, p.bsb = bf.bsb;
  p.d = d, p.ldd = bf.ldd, p.bsd = bf.bsd;
  p.c = cs.in_place ? d : bf.dc, p.ldc = bf.ldd, p.bsc = bf.bsd;
  p.alpha = cs.alpha, p.beta = cs.beta;
  return p;
}

static void run_ours(const Case& cs, const Buffers& bf, float* d, void* ws) {
  if (cs.beta != 0 && cs.in_place)
    CK(cudaMemcpyAsync(d, bf.dc, bf.c.size() * 4, cudaMemcpyDeviceToDevice));
  const Tf32x3Problem p = problem(cs, bf, d);
  CK(cudaError_t(blutrain::linalg::kern::gemm_tf32x3(p, 0, ws, nullptr)));
}

static Buffers make(const Case& cs) {
  Buffers bf{};
  const int64_t ar = cs.ta ? cs.k : cs.m, ac = cs.ta ? cs.m : cs.k;
  const int64_t br = cs.tb ? cs.n : cs.k, bc = cs.tb ? cs.k : cs.n;
  auto up4 = [](int64_t x) { return (x + 3) / 4 * 4; };
  bf.lda = up4(ac + cs.pad), bf.ldb = up4(bc + cs.pad), bf.ldd = cs.n + cs.pad;
  bf.bsa = ar * bf.lda, bf.bsb = br * bf.ldb, bf.bsd = cs.m * bf.ldd;
  bf.a.resize(size_t(cs.batch * bf.bsa));
  bf.b.resize(size_t(cs.batch * bf.bsb));
  bf.c.resize(size_t(cs.batch * bf.bsd));
  fill(bf.a), fill(bf.b), fill(bf.c);
  CK(cudaMalloc(&bf.da, bf.a.size() * 4));
  CK(cudaMalloc(&bf.db, bf.b.size() * 4));
  CK(cudaMalloc(&bf.dc, bf.c.size() * 4));
  CK(cudaMalloc(&bf.dd, bf.c.size() * 4));
  CK(cudaMemcpy(bf.da, bf.a.data(), bf.a.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(bf.db, bf.b.data(), bf.b.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(bf.dc, bf.c.data(), bf.c.size() * 4, cudaMemcpyHostToDevice));
  return bf;
}

static void release(Buffers& bf) {
  cudaFree(bf.da), cudaFree(bf.db), cudaFree(bf.dc), cudaFree(bf.dd);
}

// max and mean of |got - ref| / sum |a b| over the checked elements, plus non-finite count.
struct Err {
  double max = 0, mean = 0;
  int bad = 0;
};

static Err compare(const Case& cs, const Buffers& bf, const std::vector<float>& got,
                   const std::vector<std::array<int64_t, 3>>& at) {
  Err e;
  for (const auto& ix : at) {
    const int64_t b = ix[0], i = ix[1], j = ix[2];
    double ref = 0, scale = 0;
    for (int64_t kk = 0; kk < cs.k; ++kk) {
      const double x =
          cs.ta ? bf.a[b * bf.bsa + kk * bf.lda + i] : bf.a[b * bf.bsa + i * bf.lda + kk];
      const double y =
          cs.tb ? bf.b[b * bf.bsb + j * bf.ldb + kk] : bf.b[b * bf.bsb + kk * bf.ldb + j];
      ref += x * y;
      scale += std::fabs(x * y);
    }
    const double c = bf.c[b * bf.bsd + i * bf.ldd + j];
    ref = cs.alpha * ref + cs.beta * c;
    scale = std::fabs(cs.alpha) * scale + std::fabs(cs.beta * c) + 1e-30;
    const double g = got[b * bf.bsd + i * bf.ldd + j];
    if (!std::isfinite(g)) {
      ++e.bad;
      continue;
    }
    const double r = std::fabs(g - ref) / scale;
    e.max = std::max(e.max, r);
    e.mean += r;
  }
  e.mean /= double(std::max<size_t>(1, at.size()));
  return e;
}

static std::vector<float> fetch(const Buffers& bf, const float* d) {
  std::vector<float> h(bf.c.size());
  CK(cudaMemcpy(h.data(), d, h.size() * 4, cudaMemcpyDeviceToHost));
  return h;
}

static void check_one(const Case& cs) {
  Buffers bf = make(cs);
  std::vector<std::array<int64_t, 3>> at;
  if (cs.samples == 0) {
    for (int64_t b = 0; b < cs.batch; ++b)
      for (int64_t i = 0; i < cs.m; ++i)
        for (int64_t j = 0; j < cs.n; ++j) at.push_back({b, i, j});
  } else {
    for (int s = 0; s < cs.samples; ++s)
      at.push_back({int64_t(g_rng() % cs.batch), int64_t(g_rng() % cs.m), int64_t(g_rng() % cs.n)});
  }
  const Tf32x3Problem p = problem(cs, bf, bf.dd);
  void* ws = nullptr;
  const size_t wsb = blutrain::linalg::kern::gemm_tf32x3_workspace_bytes(p, 0);
  if (wsb) CK(cudaMalloc(&ws, wsb));

  // Ours: D poisoned (NaN) except where C lives in place; the ld padding is poisoned too and
  // must stay so.
  CK(cudaMemset(bf.dd, 0xff, bf.c.size() * 4));
  run_ours(cs, bf, bf.dd, ws);
  CK(cudaDeviceSynchronize());
  std::vector<float> ours = fetch(bf, bf.dd);
  int pad_changed = 0;
  for (int64_t b = 0; b < cs.batch; ++b)
    for (int64_t i = 0; i < cs.m; ++i)
      for (int64_t j = cs.n; j < bf.ldd; ++j) {
        const float v = ours[b * bf.bsd + i * bf.ldd + j];
        if (!(cs.in_place && cs.beta != 0) && !std::isnan(v)) ++pad_changed;
      }
  // Bitwise repeatable.
  run_ours(cs, bf, bf.dd, ws);
  std::vector<float> again = fetch(bf, bf.dd);
  const bool same = std::memcmp(ours.data(), again.data(), ours.size() * 4) == 0;

  run_cublas(cs, bf, bf.dd, false);
  std::vector<float> sg = fetch(bf, bf.dd);
  run_cublas(cs, bf, bf.dd, true);
  std::vector<float> tf = fetch(bf, bf.dd);

  const Err eo = compare(cs, bf, ours, at), es = compare(cs, bf, sg, at),
            et = compare(cs, bf, tf, at);
  const double tol = std::max(4 * es.max, 2e-6);
  const bool ok = eo.bad == 0 && eo.max <= tol && pad_changed == 0 && same;
  if (!ok) ++g_fail;
  std::printf(
      "%-28s m%-6lld n%-6lld k%-6lld b%lld %c%c  ours max %.2e mean %.2e | sgemm %.2e "
      "%.2e | tf32 %.2e  %s%s%s%s\n",
      cs.name, (long long)cs.m, (long long)cs.n, (long long)cs.k, (long long)cs.batch,
      cs.ta ? 'T' : 'N', cs.tb ? 'T' : 'N', eo.max, eo.mean, es.max, es.mean, et.max,
      ok ? "PASS" : "FAIL", eo.bad ? " (non-finite)" : "", pad_changed ? " (pad written)" : "",
      same ? "" : " (not repeatable)");
  if (ws) cudaFree(ws);
  release(bf);
}

static void check(const Case& cs) {
  for (int v = 0; v < 3; ++v) {
    if (v == 1) continue;  // the unpromoted variant's error is ~10x SGEMM's: timed, not checked
    blutrain::linalg::kern::g_variant = v;
    std::printf("[v%d] ", v);
    check_one(cs);
  }
  blutrain::linalg::kern::g_variant = 0;
}

static float median_ms(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

static void bench(const Case& cs) {
  Buffers bf = make(cs);
  const Tf32x3Problem p = problem(cs, bf, bf.dd);
  void* ws = nullptr;
  const size_t wsb = blutrain::linalg::kern::gemm_tf32x3_workspace_bytes(p, 0);
  if (wsb) CK(cudaMalloc(&ws, wsb));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto time = [&](auto fn) {
    for (int i = 0; i < 3; ++i) fn();
    std::vector<float> t;
    for (int i = 0; i < 15; ++i) {
      CK(cudaEventRecord(e0));
      fn();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      t.push_back(ms);
    }
    return median_ms(t);
  };
  float tv[3];
  for (int v = 0; v < 3; ++v) {
    blutrain::linalg::kern::g_variant = v;
    void* wv = nullptr;
    const size_t wb = blutrain::linalg::kern::gemm_tf32x3_workspace_bytes(p, 0);
    if (wb) CK(cudaMalloc(&wv, wb));
    tv[v] = time([&] { run_ours(cs, bf, bf.dd, wv); });
    if (wv) cudaFree(wv);
  }
  blutrain::linalg::kern::g_variant = 0;
  const float to = tv[0];
  const float ts = time([&] { run_cublas(cs, bf, bf.dd, false); });
  const float tt = time([&] { run_cublas(cs, bf, bf.dd, true); });
  const double tf = 2.0 * cs.m * cs.n * cs.k * cs.batch * 1e-9;
  std::printf(
      "%-24s m%-6lld n%-6lld k%-6lld %c%c splits-ws %6.1f MB | ours %7.3f ms %6.1f TF/s | "
      "sgemm %7.3f ms %6.1f | tf32 %7.3f ms %6.1f | ours/sgemm %.2fx | unpromoted 128x256 "
      "%6.1f, cvt split %6.1f TF/s\n",
      cs.name, (long long)cs.m, (long long)cs.n, (long long)cs.k, cs.ta ? 'T' : 'N',
      cs.tb ? 'T' : 'N', wsb / 1048576.0, to, tf / to, ts, tf / ts, tt, tf / tt, ts / to,
      tf / tv[1], tf / tv[2]);
  cudaEventDestroy(e0), cudaEventDestroy(e1);
  if (ws) cudaFree(ws);
  release(bf);
}

int main(int argc, char** argv) {
  const bool bench_only = argc > 1 && std::strcmp(argv[1], "--bench") == 0;
  CB(cublasCreate(&g_h));
  if (!bench_only) {
    std::printf("== checks (error = |got - ref| / sum|a b|, float64 reference)\n");
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        check({"tiny", 1, 1, 1, 1, ta, tb, 0, 1, 0, false, 0});
        check({"odd", 7, 13, 5, 1, ta, tb, 3, 1, 0, false, 0});
        check({"partial tiles", 130, 129, 33, 1, ta, tb, 4, 1, 0, false, 0});
        check({"alpha beta", 200, 300, 100, 1, ta, tb, 1, -0.75, 0.5, false, 0});
        check({"beta in place", 257, 64, 96, 1, ta, tb, 0, 1, 1, true, 0});
        check({"batch", 65, 70, 40, 3, ta, tb, 2, 1, 0, false, 0});
        check({"split-k", 200, 136, 8200, 1, ta, tb, 0, 1, 0, false, 3000});
        check({"split-k beta batch", 128, 128, 4096, 2, ta, tb, 4, 0.5, 1, true, 3000});
      }
    check({"gpt2 qkv fwd", 16384, 2304, 768, 1, 0, 1, 0, 1, 0, false, 4096});
    check({"gpt2 fc1 dX", 16384, 768, 3072, 1, 0, 0, 0, 1, 0, false, 4096});
    check({"gpt2 fc1 dW", 3072, 768, 16384, 1, 1, 0, 0, 1, 0, false, 4096});
    check({"gpt2 proj dW +=", 768, 768, 16384, 1, 1, 0, 0, 1, 1, true, 4096});
    check({"gpt2 lm head fwd", 2048, 50304, 768, 1, 0, 1, 0, 1, 0, false, 4096});
  }
  std::printf("== bench (GPT-2 124M, B16 T1024)\n");
  bench({"qkv fwd", 16384, 2304, 768, 1, 0, 1, 0, 1, 0, false, 0});
  bench({"proj fwd", 16384, 768, 768, 1, 0, 1, 0, 1, 0, false, 0});
  bench({"fc1 fwd", 16384, 3072, 768, 1, 0, 1, 0, 1, 0, false, 0});
  bench({"fc2 fwd", 16384, 768, 3072, 1, 0, 1, 0, 1, 0, false, 0});
  bench({"fc2 dX", 16384, 3072, 768, 1, 0, 0, 0, 1, 0, false, 0});
  bench({"fc1 dX", 16384, 768, 3072, 1, 0, 0, 0, 1, 0, false, 0});
  bench({"qkv dW", 2304, 768, 16384, 1, 1, 0, 0, 1, 0, false, 0});
  bench({"proj dW", 768, 768, 16384, 1, 1, 0, 0, 1, 0, false, 0});
  bench({"fc1 dW", 3072, 768, 16384, 1, 1, 0, 0, 1, 0, false, 0});
  bench({"fc2 dW", 768, 3072, 16384, 1, 1, 0, 0, 1, 0, false, 0});
  bench({"lm head fwd (chunk)", 2048, 50304, 768, 1, 0, 1, 0, 1, 0, false, 0});
  bench({"lm head dX (chunk)", 2048, 768, 50304, 1, 0, 0, 0, 1, 0, false, 0});
  bench({"lm head dW (chunk)", 50304, 768, 2048, 1, 1, 0, 0, 1, 1, true, 0});
  cublasDestroy(g_h);
  std::printf("%s: %d check(s) failed\n", g_fail ? "FAIL" : "OK", g_fail);
  return g_fail ? 1 : 0;
}
