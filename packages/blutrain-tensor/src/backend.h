// backend.h: what the device-neutral core asks of a backend beyond per-primitive kernels.
// src/cuda/ implements these with the CUDA runtime; src/cpu/no_cuda.cpp implements them for a
// build without CUDA (every entry raises "[op] ... built without CUDA").
#pragma once

#include <string>

#include "tensor.h"

namespace bt::backend {

bool cuda_built();
int cuda_device_count();  // 0 where no driver/GPU is present
// Throws a clear RuntimeError naming `op` unless `d` is a usable CUDA device.
void check_cuda_device(Device d, const char* op);
// The stream work on `d` goes to (a cudaStream_t; nullptr for the CPU).  See cuda/runtime.h.
void* current_stream(Device d);
// nullptr restores blutrain's own stream for the device.
void set_current_stream(Device d, void* stream);
// Waits for all work queued on d's current stream (no-op on the CPU).
void synchronize(Device d);
// Copy nbytes between (host or device) pointers; one side may be host.
void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t nbytes,
                const char* op);
// Bytes of scratch (Note [caller-given scratch], tensor.h) that index_add on d, with `index_numel`
// indices into a dim of `dim_size` and `cols` elements per index (the product of the other
// dims), takes from a ScratchScope so that it makes no allocator call; 0 on the CPU.
int64_t index_add_scratch_bytes(Device d, int64_t index_numel, int64_t dim_size, int64_t cols,
                                DType dtype);
// The message every CUDA stub raises: "[op] has no CUDA implementation in this build".
[[noreturn]] void no_cuda_kernel(const std::string& op);

}  // namespace bt::backend
