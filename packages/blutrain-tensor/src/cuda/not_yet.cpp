// cuda/not_yet.cpp: CUDA build, primitives whose CUDA kernels have not landed yet.  Each raises
// "[op] has no CUDA implementation in this build".  The CUDA issue moves a primitive from this
// list to a .cu file (kernels section, then a launcher taking a stream) as its kernel lands.
#include "../backend.h"
#include "../primitives.h"

namespace bt {

#define BT_NOT_YET(Name)                                                  \
  void Name::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) { \
    backend::no_cuda_kernel(name());                                      \
  }
BT_NOT_YET(Full)
BT_NOT_YET(Arange)
BT_NOT_YET(Random)
BT_NOT_YET(AsType)
BT_NOT_YET(SliceScatter)
BT_NOT_YET(Unary)
BT_NOT_YET(Binary)
BT_NOT_YET(Where)
BT_NOT_YET(MaskedFill)
BT_NOT_YET(Reduce)
BT_NOT_YET(ArgReduce)
BT_NOT_YET(IndexSelect)
BT_NOT_YET(IndexAdd)
BT_NOT_YET(Gather)
BT_NOT_YET(ScatterAdd)
BT_NOT_YET(Concatenate)
BT_NOT_YET(Softmax)
BT_NOT_YET(LayerNorm)
BT_NOT_YET(CrossEntropy)
BT_NOT_YET(Dropout)

// Host <-> device transfers already work: a contiguous byte copy.
void ToDevice::eval_gpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  Tensor src = in[0];
  if (!src.is_contiguous()) {
    throw NotImplementedError(
        "[to_device] copying a non-contiguous tensor to CUDA needs the "
        "CUDA copy kernel (not in this build yet); call contiguous() first");
  }
  backend::copy_bytes(out[0].data_ptr(name()), out[0].device(), src.data_ptr(name()), src.device(),
                      out[0].numel() * itemsize(out[0].dtype()), name());
}

}  // namespace bt
