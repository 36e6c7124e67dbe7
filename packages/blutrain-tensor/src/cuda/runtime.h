// cuda/runtime.h: what every CUDA file of the backend shares on the host side: checked runtime
// calls, the current device and stream, and device properties.
//
// Note [streams]: each device has one "current stream" that every kernel, copy and allocation of
// that device goes to.  By default it is a non-blocking stream blutrain creates on first use (so a
// whole training step can be captured into a CUDA graph, which the legacy default stream forbids).
// set_stream() swaps it (e.g. for PyTorch's current stream when sharing work).  Ops run in issue
// order on that one stream, so no kernel needs an event; only copies to host synchronise.
//
// Locking rule: the stream table is written under a mutex and read lock-free through an atomic
// pointer per device; set_stream() is expected between steps, not while kernels are being issued
// from another thread.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "../tensor.h"

namespace bt::cuda {

[[noreturn]] void throw_cuda_error(const char* op, const char* expr, cudaError_t err,
                                   const char* file, int line);

// Every runtime call and every launch is checked; the error names the op, the call, file and line.
#define BT_CUDA_CHECK(op, expr)                                               \
  do {                                                                        \
    const cudaError_t bt_err_ = (expr);                                       \
    if (bt_err_ != cudaSuccess)                                               \
      ::bt::cuda::throw_cuda_error((op), #expr, bt_err_, __FILE__, __LINE__); \
  } while (0)
#define BT_CUDA_LAUNCH_CHECK(op) BT_CUDA_CHECK((op), cudaGetLastError())

constexpr int kMaxDevices = 64;

// Makes `device` current for this thread (cached: no runtime call when it already is).
void set_device(int device, const char* op);
// The current stream of device `d` (makes d current too).  See Note [streams].
cudaStream_t stream(Device d, const char* op);
cudaStream_t stream(int device, const char* op);
// nullptr restores blutrain's own stream for the device.
void set_stream(int device, cudaStream_t s);
// Whether the current stream of `device` is being captured into a CUDA graph.
bool capturing(int device);

struct DeviceInfo {
  int sm_count = 0;
  size_t smem_per_block_optin = 0;  // bytes a block may use after cudaFuncSetAttribute
  int major = 0, minor = 0;
  size_t l2_bytes = 0;
};
const DeviceInfo& device_info(int device);

// dst (any strided view, e.g. the target of copy_ or an in-place op) = src cast to dst's dtype;
// src broadcast (stride 0) to dst's shape.  In cuda/elementwise.cu.
void copy_cast(const Tensor& dst, const Tensor& src, const char* op);

// Raises IndexError if an index kernel recorded an out-of-range index on `device` since the last
// check (index.cu: kernels never use a bad index; the host learns of it at the next sync).
void check_index_errors(int device);
// [nn helper] index.cu's device-side error record, shared with kernels elsewhere that check
// indices on the device (cross_entropy targets, nn.cu): a kernel records only the first error,
// atomicCAS(&flag, 0, code) and then value / size.  index_error_record() returns the record's
// device address on `device` and arms the next check_index_errors.
struct IndexErrorRecord {
  int flag;  // 0 none, else the op code of the first error (index.cu's are 1-4)
  int pad;
  long long value, size;
};
constexpr int kIndexErrorCrossEntropy = 5;
// integer floor_divide / remainder by zero (elementwise.cu): raised as ZeroDivisionError
constexpr int kDeviceErrorFloorDiv = 6;
constexpr int kDeviceErrorRemainder = 7;
// embedding's index_select: a negative index is out of range too (as PyTorch)
constexpr int kIndexErrorEmbedding = 8;
IndexErrorRecord* index_error_record(int device);

// Grid size for a grid-stride elementwise loop: enough blocks to fill the device a few times over.
int elementwise_blocks(int64_t n, int threads, int device);

}  // namespace bt::cuda
