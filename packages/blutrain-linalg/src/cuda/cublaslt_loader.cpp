// cuBLASLt is opened with dlopen rather than linked: a CUDA build of the wheel then imports
// (and its CPU path works) on machines without cuBLAS, and the library is found both in the
// CUDA toolkit and in the nvidia-cublas wheel (which the Python module preloads by path, so
// the soname lookup below finds it). $BLUTRAIN_LINALG_CUBLASLT names a file explicitly.
#include "cublaslt_loader.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include "../linalg_internal.h"

namespace blutrain::linalg::lt {

namespace {
Funcs g_funcs;
const Funcs* g_ok = nullptr;
std::string g_error;
std::once_flag g_once;

void do_load() {
  std::string tried;
  const char* env = std::getenv("BLUTRAIN_LINALG_CUBLASLT");
  const char* candidates[] = {env && *env ? env : nullptr, "libcublasLt.so.13",
                              "/usr/local/cuda/lib64/libcublasLt.so.13", "libcublasLt.so"};
  void* h = nullptr;
  for (const char* c : candidates) {
    if (!c) continue;
    h = dlopen(c, RTLD_NOW | RTLD_LOCAL);
    if (h) break;
    const char* e = dlerror();
    tried += std::string("\n  ") + c + ": " + (e ? e : "not found");
  }
  if (!h) {
    g_error =
        "[gemm] cuBLASLt could not be loaded (pip install nvidia-cublas, or set "
        "BLUTRAIN_LINALG_CUBLASLT). Tried:" +
        tried;
    return;
  }
#define BT_LT_SYM(name)                                                     \
  g_funcs.name = reinterpret_cast<decltype(g_funcs.name)>(dlsym(h, #name)); \
  if (!g_funcs.name) {                                                      \
    g_error = "[gemm] the loaded cuBLASLt lacks " #name;                    \
    return;                                                                 \
  }
  BT_LT_FUNCS(BT_LT_SYM)
#undef BT_LT_SYM
  g_funcs.cublasLtMatmulAlgoConfigGetAttribute =
      reinterpret_cast<decltype(g_funcs.cublasLtMatmulAlgoConfigGetAttribute)>(
          dlsym(h, "cublasLtMatmulAlgoConfigGetAttribute"));
  g_ok = &g_funcs;
}
}  // namespace

const Funcs* load() {
  std::call_once(g_once, do_load);
  if (!g_ok) fail(BT_LINALG_ECUDA, g_error);
  return g_ok;
}

}  // namespace blutrain::linalg::lt
