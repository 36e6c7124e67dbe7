// Internal declarations shared by the front (c_api.cpp) and the backends.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include "blutrain/linalg.h"

namespace blutrain::linalg {

// Records the thread's error message and returns `code` (so call sites can `return fail(...)`).
int fail(int code, const std::string& msg);
int failf(int code, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
void clear_error();

inline size_t dtype_size(int dt) {
  switch (dt) {
    case BT_LINALG_F32:
      return 4;
    case BT_LINALG_F64:
      return 8;
    case BT_LINALG_F16:
      return 2;
    case BT_LINALG_BF16:
      return 2;
    default:
      return 0;
  }
}
inline const char* dtype_name(int dt) {
  switch (dt) {
    case BT_LINALG_F32:
      return "float32";
    case BT_LINALG_F64:
      return "float64";
    case BT_LINALG_F16:
      return "float16";
    case BT_LINALG_BF16:
      return "bfloat16";
    default:
      return "invalid";
  }
}
inline bool epi_has_bias(int e) {
  return e == BT_LINALG_EPI_BIAS || e == BT_LINALG_EPI_BIAS_GELU ||
         e == BT_LINALG_EPI_BIAS_GELU_AUX;
}
inline bool epi_has_gelu(int e) {
  return e == BT_LINALG_EPI_GELU || e == BT_LINALG_EPI_BIAS_GELU || e == BT_LINALG_EPI_GELU_AUX ||
         e == BT_LINALG_EPI_BIAS_GELU_AUX;
}
inline bool epi_writes_aux(int e) {
  return e == BT_LINALG_EPI_GELU_AUX || e == BT_LINALG_EPI_BIAS_GELU_AUX;
}
inline bool epi_reads_aux(int e) {
  return e == BT_LINALG_EPI_DGELU || e == BT_LINALG_EPI_DGELU_BGRAD;
}
inline bool epi_has_bgrad(int e) {
  return e == BT_LINALG_EPI_DGELU_BGRAD || e == BT_LINALG_EPI_BGRAD_A || e == BT_LINALG_EPI_BGRAD_B;
}
// Length of bgrad for the epilogue (row-major terms).
inline int64_t bgrad_len(const bt_linalg_gemm_desc& d) {
  return d.epilogue == BT_LINALG_EPI_BGRAD_A ? d.m : d.n;
}

// Process-wide settings (set_option); read without locks (plain ints, set rarely).
struct Options {
  int64_t autotune = 0;
  // A wide field: beyond the heuristic's top few are the split-K / stream-K variants that
  // can win on skinny shapes (k >> m, n); short kernels make timing them cheap.
  int64_t autotune_candidates = 32;
  int64_t autotune_reps = 5;      // minimum timed runs per candidate (more for short kernels)
  int64_t autotune_flush_l2 = 1;  // time each run with a cold L2, as training sees operands
  int64_t autotune_log = 0;       // 1: print each candidate's timing to stderr
  int64_t workspace_bytes = 32ll << 20;  // bytes; cuBLAS's own default on Hopper
  int64_t persist = 1;
  int64_t num_threads = 0;
  int64_t fused_epilogues = 1;  // 0: always run epilogues as separate kernels (for testing)
  int64_t use_alloc = 1;    // 0: CUDA scratch from cudaMallocAsync even when blutrain-alloc is set
  int64_t fp32_3xtf32 = 1;  // 1: fp32 GEMMs on CUDA (sm_80+) by our 3xTF32 kernel; 0: cuBLAS SGEMM
};
Options& options();

// The algorithm cache file (front owns the path; the CUDA backend loads it lazily).
std::string cache_path();

// Backends. `d` is validated and normalised (struct copied to full size) by the front.
int cpu_gemm(const bt_linalg_gemm_desc& d);
int cpu_load_blas(const char* path);
int cpu_set_num_threads(int n);
int cpu_set_threads_callback(bt_linalg_threads_fn run);
int cpu_set_parallel_for(bt_linalg_parallel_fn run);
int64_t cpu_block_gemms();  // GEMMs split into blocks so far (a test's witness)

int cuda_gemm(const bt_linalg_gemm_desc& d);
int cuda_available();  // 1 if built with CUDA
int cuda_set_alloc_api(const void* table);
int cuda_get_stat(const char* name, int64_t* value);  // cache_entries, cache_hits, ...
int cuda_save_cache();
int cuda_clear_cache(int also_file);

}  // namespace blutrain::linalg
