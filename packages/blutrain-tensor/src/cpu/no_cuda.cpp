// cpu/no_cuda.cpp: the CUDA side of a build without CUDA.  Every primitive's eval_gpu raises
// "[op] has no CUDA implementation in this build", and placing memory on a CUDA device raises
// too, so a CUDA tensor can never reach a kernel here.
//
// The CUDA backend (its own issue) replaces this file with src/cuda/*.cu: one eval_gpu per
// primitive (same names, same inputs as eval_cpu), plus the backend.h functions over the runtime.
// A primitive without a CUDA kernel yet keeps a stub in src/cuda/not_yet.cpp (same X-macro).
#include "../backend.h"
#include "../primitives.h"

namespace bt {

namespace backend {
bool cuda_built() { return false; }
int cuda_device_count() { return 0; }
void check_cuda_device(Device d, const char* op) {
  throw RuntimeError(std::string("[") + op + "] cannot use " + d.str() +
                     ": blutrain-tensor was built without CUDA (rebuild with BLUTRAIN_CUDA=ON)");
}
void* current_stream(Device) { return nullptr; }
void synchronize(Device) {}
void set_current_stream(Device d, void*) { check_cuda_device(d, "set_stream"); }
void copy_bytes(void*, Device dst, const void*, Device src, size_t, const char* op) {
  throw RuntimeError(std::string("[") + op + "] cannot copy from " + src.str() + " to " +
                     dst.str() + ": blutrain-tensor was built without CUDA");
}
int64_t index_add_scratch_bytes(Device, int64_t, int64_t, int64_t, DType) { return 0; }
[[noreturn]] void no_cuda_kernel(const std::string& op) {
  throw NotImplementedError("[" + op + "] has no CUDA implementation in this build");
}
}  // namespace backend

#define BT_NO_CUDA(Name)                                                  \
  void Name::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) { \
    backend::no_cuda_kernel(name());                                      \
  }
BT_NO_CUDA(Full)
BT_NO_CUDA(Arange)
BT_NO_CUDA(Random)
BT_NO_CUDA(AsType)
BT_NO_CUDA(ToDevice)
BT_NO_CUDA(SliceScatter)
BT_NO_CUDA(Unary)
BT_NO_CUDA(Binary)
BT_NO_CUDA(Where)
BT_NO_CUDA(MaskedFill)
BT_NO_CUDA(Reduce)
BT_NO_CUDA(ArgReduce)
BT_NO_CUDA(IndexSelect)
BT_NO_CUDA(IndexAdd)
BT_NO_CUDA(Gather)
BT_NO_CUDA(ScatterAdd)
BT_NO_CUDA(Concatenate)
BT_NO_CUDA(Softmax)
BT_NO_CUDA(LayerNorm)
BT_NO_CUDA(CrossEntropy)
BT_NO_CUDA(Dropout)
BT_NO_CUDA(Matmul)

}  // namespace bt
