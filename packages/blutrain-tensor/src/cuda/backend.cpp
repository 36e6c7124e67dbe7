// cuda/backend.cpp: device management and copies over the CUDA runtime (see backend.h).
// Every runtime call is checked with BT_CUDA_CHECK, which names the op, file and line.  With no
// driver or no GPU present these raise clear errors: the module still imports.
#include "../backend.h"

#include <cuda_runtime.h>

#define BT_CUDA_CHECK(op, expr)                                                           \
  do {                                                                                    \
    const cudaError_t err_ = (expr);                                                      \
    if (err_ != cudaSuccess) {                                                            \
      throw ::bt::RuntimeError(std::string("[") + (op) +                                  \
                               "] " #expr " failed: " + cudaGetErrorString(err_) + " (" + \
                               __FILE__ + ":" + std::to_string(__LINE__) + ")");          \
    }                                                                                     \
  } while (0)

namespace bt::backend {

bool cuda_built() { return true; }

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

void check_cuda_device(Device d, const char* op) {
  const int n = cuda_device_count();
  if (n == 0) {
    throw RuntimeError(std::string("[") + op + "] cannot use " + d.str() +
                       ": no CUDA device is present (or the driver is missing)");
  }
  if (d.index >= n) {
    throw RuntimeError(std::string("[") + op + "] cannot use " + d.str() + ": only " +
                       std::to_string(n) + " CUDA device(s) are present");
  }
}

void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t nbytes,
                const char* op) {
  if (nbytes == 0) return;
  if (dst_dev.is_cuda())
    BT_CUDA_CHECK(op, cudaSetDevice(dst_dev.index));
  else if (src_dev.is_cuda())
    BT_CUDA_CHECK(op, cudaSetDevice(src_dev.index));
  // Synchronous on the legacy default stream until tensors carry streams (CUDA issue).
  BT_CUDA_CHECK(op, cudaMemcpy(dst, src, nbytes, cudaMemcpyDefault));
}

[[noreturn]] void no_cuda_kernel(const std::string& op) {
  throw NotImplementedError("[" + op + "] has no CUDA implementation in this build");
}

}  // namespace bt::backend
