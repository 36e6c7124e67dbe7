// cuBLASLt entry points, opened with dlopen (see cublaslt_loader.cpp for why).
#pragma once

#include <cublasLt.h>

namespace blutrain::linalg::lt {

#define BT_LT_FUNCS(X)                    \
  X(cublasLtCreate)                       \
  X(cublasLtDestroy)                      \
  X(cublasLtGetVersion)                   \
  X(cublasLtGetStatusString)              \
  X(cublasLtMatmul)                       \
  X(cublasLtMatmulDescCreate)             \
  X(cublasLtMatmulDescDestroy)            \
  X(cublasLtMatmulDescSetAttribute)       \
  X(cublasLtMatrixLayoutCreate)           \
  X(cublasLtMatrixLayoutDestroy)          \
  X(cublasLtMatrixLayoutSetAttribute)     \
  X(cublasLtMatmulPreferenceCreate)       \
  X(cublasLtMatmulPreferenceDestroy)      \
  X(cublasLtMatmulPreferenceSetAttribute) \
  X(cublasLtMatmulAlgoGetHeuristic)       \
  X(cublasLtMatmulAlgoCheck)

struct Funcs {
#define BT_LT_DECL(name) decltype(&::name) name = nullptr;
  BT_LT_FUNCS(BT_LT_DECL)
#undef BT_LT_DECL
  // Optional (NULL when absent): only the autotune log reads algorithm configurations.
  decltype(&::cublasLtMatmulAlgoConfigGetAttribute) cublasLtMatmulAlgoConfigGetAttribute = nullptr;
};

// Loads cuBLASLt once; returns nullptr and sets the thread's error ("[gemm] ...") on failure.
const Funcs* load();

}  // namespace blutrain::linalg::lt
