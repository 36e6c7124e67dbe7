// ln_harness.cuh: what the row-kernel harnesses (ln_fwd_check.cu, ln_bwd_check.cu, nn_check.cu)
// share beyond harness_common.cuh: the device's limits, bf16 / float conversions, fetching outputs
// as floats, the error and bit-equality helpers of their checks, their timing (median of batched
// calls), the per-case summary and main.  Included after harness_common.cuh.
#pragma once
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

using bf16 = __nv_bfloat16;

static int g_fail = 0;              // failing checks
static int g_sms = 0, g_major = 0;  // multiprocessors, compute capability major
static size_t g_optin = 0;          // opt-in shared memory per block, bytes

static float to_f(float v) { return v; }
static float to_f(bf16 v) { return __bfloat162float(v); }
template <typename T>
static T from_f(float v);
template <>
float from_f<float>(float v) {
  return v;
}
template <>
bf16 from_f<bf16>(float v) {
  return __float2bfloat16(v);
}
template <typename T>
static const char* tname() {
  return sizeof(T) == 2 ? "bf16" : "fp32";
}

// n device elements as floats in h
template <typename T>
static void fetch(const T* d, size_t n, std::vector<float>& h) {
  const std::vector<T> t = hcopy(d, n);
  h.resize(n);
  for (size_t i = 0; i < n; ++i) h[i] = to_f(t[i]);
}
// rel_err of fetched values against r, no floor on max |r| (an all-zero r: max |g - r|)
static double rel_err_f(const std::vector<float>& g, const std::vector<double>& r) {
  return rel_err(r, [&](size_t i) { return double(g[i]); }, 0.0);
}
static bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// Median over kSamples of the mean time of kBatch back-to-back calls of f (as in a training step:
// launch latency hidden, the gaps between dependent kernels counted), after 5 warm-ups.
constexpr int kSamples = 15, kBatch = 10;
template <typename F>
static float median_ms(F&& f) {
  return time_ms(f, 5, kSamples, kBatch);
}

// Per timed case: the library default's %copy and the best variant's.
struct CaseSummary {
  std::string name, def, best;
  float def_pct = 0, best_pct = 0;
};
static std::vector<CaseSummary> g_summary;

// [--check | --bench] (default both): reads the device's limits, runs check() and / or bench(),
// prints the summary (titled `what`) and "name: all PASS" or the failure count; exit status 1 on
// any FAIL.
template <typename Check, typename Bench>
static int ln_harness_main(int argc, char** argv, const char* name, const char* what, Check&& check,
                           Bench&& bench) {
  const bool do_check = argc < 2 || std::string(argv[1]) != "--bench";
  const bool do_bench = argc < 2 || std::string(argv[1]) != "--check";
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  g_sms = prop.multiProcessorCount;
  g_major = prop.major;
  g_optin = prop.sharedMemPerBlockOptin;
  std::printf("device %s, %d SMs, %zu KB opt-in shared memory per block\n", prop.name, g_sms,
              g_optin / 1024);
  if (do_check) check();
  if (do_bench) {
    bench();
    std::printf("\nsummary (%% of a D2D copy%s): library default | best variant\n", what);
    for (const CaseSummary& c : g_summary) {
      std::printf("  %-20s %5.1f%% %-30s | %5.1f%% %s\n", c.name.c_str(), c.def_pct, c.def.c_str(),
                  c.best_pct, c.best.c_str());
    }
  }
  std::printf(g_fail ? "%s: %d FAIL\n" : "%s: all PASS\n", name, g_fail);
  return g_fail ? 1 : 0;
}
