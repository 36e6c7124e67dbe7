// A build without CUDA: device and pinned memory raise a clear error.
#include "backend.h"

namespace bt::alloc {

int cuda_device_count() { return 0; }

std::unique_ptr<CachingPool> make_device_pool(int device) {
  throw Error(BT_ALLOC_ENOCUDA, "[alloc] CUDA device " + std::to_string(device) +
                                    " requested, but blutrain-alloc was built without CUDA "
                                    "(rebuild with BLUTRAIN_CUDA=ON)");
}

std::unique_ptr<CachingPool> make_pinned_pool() {
  throw Error(BT_ALLOC_ENOCUDA,
              "[alloc] pinned host memory needs CUDA, but blutrain-alloc was built without it "
              "(rebuild with BLUTRAIN_CUDA=ON)");
}

}  // namespace bt::alloc
