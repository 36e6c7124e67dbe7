// cuda/copy.cpp: host <-> device transfers (a contiguous byte copy on the current stream; the
// front makes CUDA sources contiguous first).
#include "../backend.h"
#include "../primitives.h"

namespace bt {

void ToDevice::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  Tensor src = in[0];
  if (!src.is_contiguous()) {
    throw RuntimeError("[to_device] internal: the source must be contiguous (the front copies)");
  }
  backend::copy_bytes(out[0].data_ptr(name()), out[0].device(), src.data_ptr(name()), src.device(),
                      out[0].numel() * itemsize(out[0].dtype()), name());
}

}  // namespace bt
