// cpu/gelu.cpp: GeluTanhBackward on the CPU, one pass in L1-sized blocks (Note [gelu backward],
// gelu_kernels.h). Compiled with -ffp-contract=off (CMakeLists.txt).
#include "../backend.h"
#include "../nn_fused.h"
#include "gelu_kernels.h"
#include "loops.h"

namespace bt {

void GeluTanhBackward::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  Tensor x = cpu::contiguous_raw(in[0]), dy = cpu::contiguous_raw(in[1]);
  const int64_t n = x.numel();
  dispatch_float(x.dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* xp = static_cast<const T*>(x.data_ptr(name()));
    const T* gp = static_cast<const T*>(dy.data_ptr(name()));
    T* o = static_cast<T*>(out[0].data_ptr(name()));
    const cpu::gelu::Consts<T> q;
    constexpr int64_t kBlock = 512;  // elements whose u and t stay in L1 between the passes
    cpu::parallel_ranges(n, n >= cpu::kParallelMin ? cpu::kChunk : n, [&](int64_t b, int64_t e) {
      T u[kBlock], t[kBlock];
      for (int64_t i = b; i < e; i += kBlock) {
        const int64_t m = std::min(kBlock, e - i);
        cpu::gelu::backward_pre<T>(xp + i, u, m, q);
        cpu::tanh_raw<T>(u, t, m);
        cpu::gelu::backward_post<T>(xp + i, t, gp + i, o + i, m, q);
      }
    });
  });
}

#ifndef BT_WITH_CUDA
void GeluTanhBackward::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {
  backend::no_cuda_kernel(name());
}
#endif

}  // namespace bt
