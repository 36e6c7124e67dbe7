// cuda/common.cu: host helpers of common.cuh that need the device types.
#include "common.cuh"

namespace bt::cuda {

StridedOffset make_offset(const Shape& shape, const Strides& strides, const char* op) {
  // Drop size-1 dims, then merge dim d into d-1 when stride[d-1] == size[d] * stride[d].
  int64_t sz[64], st[64];
  int n = 0;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] == 1) continue;
    if (n > 0 && st[n - 1] == shape[d] * strides[d]) {
      sz[n - 1] *= shape[d];
      st[n - 1] = strides[d];
    } else {
      if (n == 64) break;
      sz[n] = shape[d];
      st[n] = strides[d];
      ++n;
    }
  }
  StridedOffset o;
  if (n == 0 || (n == 1 && st[0] == 1)) return o;  // contiguous
  if (n > kMaxDims) {
    throw NotImplementedError(std::string("[") + op + "] a strided view with " + std::to_string(n) +
                              " non-mergeable dims exceeds the CUDA kernels' " +
                              std::to_string(kMaxDims) + "; call contiguous() first");
  }
  o.ndim = n;
  for (int d = 0; d < n; ++d) {
    o.sizes[d] = sz[d];
    o.strides[d] = st[d];
  }
  return o;
}

}  // namespace bt::cuda
