// Linked when the package is built without CUDA: every CUDA entry raises a clear error.
#include "../linalg_internal.h"

namespace blutrain::linalg {

int cuda_gemm(const bt_linalg_gemm_desc&) {
  return fail(BT_LINALG_ENOCUDA, "[gemm] has no CUDA implementation in this build");
}
int cuda_available() { return 0; }
int cuda_set_alloc_api(const void*) { return BT_LINALG_OK; }
int cuda_get_stat(const char* name, int64_t* v) {
  const std::string n = name;
  if (n == "cache_entries" || n == "cache_hits" || n == "cache_misses" ||
      n == "fallback_epilogues" || n == "tf32x3_calls") {
    *v = 0;
    return BT_LINALG_OK;
  }
  return BT_LINALG_EINVAL;
}
int cuda_save_cache() { return BT_LINALG_OK; }
int cuda_clear_cache(int) { return BT_LINALG_OK; }

}  // namespace blutrain::linalg
