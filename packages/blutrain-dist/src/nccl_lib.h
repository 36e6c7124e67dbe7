// nccl_lib.h: libnccl opened at run time, and the checked-call macros of the CUDA build.
//
// NCCL is not linked: a CUDA build of blutrain-dist then imports, and its MPI backend works, on
// machines without NCCL; and the library is found wherever it lives (the nvidia-nccl-cu13 wheel,
// the toolkit, $BLUTRAIN_NCCL_LIBRARY) without an rpath.  The header comes from the toolkit or
// the wheel at build time, so the function types below are NCCL's own.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include "core.h"

namespace bt::dist::nccl {

// Functions every NCCL >= 2.18 has (our GPU machine runs 2.28).
#define BT_NCCL_FUNCS(X)   \
  X(ncclGetVersion)        \
  X(ncclGetUniqueId)       \
  X(ncclCommInitRank)      \
  X(ncclCommDestroy)       \
  X(ncclCommAbort)         \
  X(ncclCommGetAsyncError) \
  X(ncclGetErrorString)    \
  X(ncclAllReduce)         \
  X(ncclReduceScatter)     \
  X(ncclAllGather)         \
  X(ncclBroadcast)         \
  X(ncclSend)              \
  X(ncclRecv)              \
  X(ncclGroupStart)        \
  X(ncclGroupEnd)

struct Funcs {
#define BT_NCCL_DECL(name) decltype(&::name) name = nullptr;
  BT_NCCL_FUNCS(BT_NCCL_DECL)
#undef BT_NCCL_DECL
  // optional (null when the library lacks them)
  decltype(&::ncclGetLastError) ncclGetLastError = nullptr;
  decltype(&::ncclCommFinalize) ncclCommFinalize = nullptr;
};

// The loaded library's functions; throws Error(BT_DIST_ENCCL) naming op and every path tried.
const Funcs& lib(const char* op);

[[noreturn]] void throw_nccl_error(const char* op, const char* expr, ncclResult_t r,
                                   const char* file, int line);
[[noreturn]] void throw_cuda_error(const char* op, const char* expr, cudaError_t e,
                                   const char* file, int line);

}  // namespace bt::dist::nccl

// Every NCCL call is checked; the error names the op, the call, file and line.
#define BT_NCCL_CHECK(op, expr)                                                   \
  do {                                                                            \
    const ncclResult_t bt_r_ = (expr);                                            \
    if (bt_r_ != ncclSuccess && bt_r_ != ncclInProgress)                          \
      ::bt::dist::nccl::throw_nccl_error((op), #expr, bt_r_, __FILE__, __LINE__); \
  } while (0)
#define BT_DIST_CUDA_CHECK(op, expr)                                              \
  do {                                                                            \
    const cudaError_t bt_e_ = (expr);                                             \
    if (bt_e_ != cudaSuccess)                                                     \
      ::bt::dist::nccl::throw_cuda_error((op), #expr, bt_e_, __FILE__, __LINE__); \
  } while (0)
