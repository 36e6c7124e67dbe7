// cuda/backend.cpp: device management, streams and copies over the CUDA runtime (backend.h and
// runtime.h).  With no driver or no GPU present these raise clear errors: the module still
// imports.
#include "../backend.h"

#include <array>
#include <atomic>
#include <mutex>

#include "runtime.h"

namespace bt {
namespace cuda {

void throw_cuda_error(const char* op, const char* expr, cudaError_t err, const char* file,
                      int line) {
  std::string msg = std::string("[") + op + "] " + expr + " failed: " + cudaGetErrorName(err) +
                    " (" + cudaGetErrorString(err) + ") at " + file + ":" + std::to_string(line);
  // Clear the error (a non-sticky one: a bad argument, out of memory), so that the next op's
  // launch check does not report it again; a sticky one stays (the context is lost anyway).
  cudaGetLastError();
  if (err == cudaErrorMemoryAllocation) {
    throw RuntimeError(msg + "; free memory (blutrain.alloc.empty_cache) or use a smaller batch");
  }
  throw RuntimeError(msg);
}

namespace {
thread_local int t_current_device = -1;
std::mutex g_stream_mutex;
std::array<std::atomic<cudaStream_t>, kMaxDevices> g_current{};
std::array<cudaStream_t, kMaxDevices> g_own{};
std::array<DeviceInfo, kMaxDevices> g_info{};
std::array<std::once_flag, kMaxDevices> g_info_once;

void check_index(int device, const char* op) {
  if (device < 0 || device >= kMaxDevices)
    throw ValueError(std::string("[") + op + "] bad CUDA device index " + std::to_string(device));
}
}  // namespace

void set_device(int device, const char* op) {
  if (device == t_current_device) return;
  check_index(device, op);
  BT_CUDA_CHECK(op, cudaSetDevice(device));
  t_current_device = device;
}

cudaStream_t stream(int device, const char* op) {
  set_device(device, op);
  cudaStream_t s = g_current[device].load(std::memory_order_acquire);
  if (s) return s;
  std::lock_guard<std::mutex> lock(g_stream_mutex);
  if (!g_own[device])
    BT_CUDA_CHECK(op, cudaStreamCreateWithFlags(&g_own[device], cudaStreamNonBlocking));
  s = g_current[device].load(std::memory_order_acquire);
  if (!s) {
    s = g_own[device];
    g_current[device].store(s, std::memory_order_release);
  }
  return s;
}
cudaStream_t stream(Device d, const char* op) { return stream(d.index, op); }

void set_stream(int device, cudaStream_t s) {
  check_index(device, "set_stream");
  std::lock_guard<std::mutex> lock(g_stream_mutex);
  g_current[device].store(s ? s : g_own[device], std::memory_order_release);
}

bool capturing(int device) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  BT_CUDA_CHECK("capturing", cudaStreamIsCapturing(stream(device, "capturing"), &st));
  return st == cudaStreamCaptureStatusActive;
}

const DeviceInfo& device_info(int device) {
  check_index(device, "device_info");
  std::call_once(g_info_once[device], [device] {
    cudaDeviceProp p{};
    BT_CUDA_CHECK("device_info", cudaGetDeviceProperties(&p, device));
    DeviceInfo& i = g_info[device];
    i.sm_count = p.multiProcessorCount;
    i.smem_per_block_optin = p.sharedMemPerBlockOptin;
    i.major = p.major;
    i.minor = p.minor;
    i.l2_bytes = p.l2CacheSize;
  });
  return g_info[device];
}

int elementwise_blocks(int64_t n, int threads, int device) {
  const int64_t needed = (n + threads - 1) / threads;
  const int64_t cap = static_cast<int64_t>(device_info(device).sm_count) * 8;
  return static_cast<int>(std::max<int64_t>(1, std::min(needed, cap)));
}

}  // namespace cuda

namespace backend {

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

void* current_stream(Device d) {
  if (!d.is_cuda()) return nullptr;
  return cuda::stream(d, "current_stream");
}

void set_current_stream(Device d, void* s) {
  cuda::set_stream(d.index, static_cast<cudaStream_t>(s));
}

void synchronize(Device d) {
  if (!d.is_cuda()) return;
  // [graph] a sync while capturing would invalidate the capture with a cryptic runtime error.
  if (cuda::capturing(d.index)) {
    throw RuntimeError("[synchronize] cannot synchronize " + d.str() +
                       " while a CUDA graph is being captured on its stream");
  }
  BT_CUDA_CHECK("synchronize", cudaStreamSynchronize(cuda::stream(d, "synchronize")));
  cuda::check_index_errors(d.index);
}

void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t nbytes,
                const char* op) {
  if (nbytes == 0) {
    // An empty host read is still a host read: the errors the kernels before it recorded raise
    // here, as at any other (outside a capture, where a host read raises below).
    if (!dst_dev.is_cuda() && src_dev.is_cuda() && !cuda::capturing(src_dev.index)) {
      BT_CUDA_CHECK(op, cudaStreamSynchronize(cuda::stream(src_dev, op)));
      cuda::check_index_errors(src_dev.index);
    }
    return;
  }
  const Device dev = dst_dev.is_cuda() ? dst_dev : src_dev;
  cudaStream_t s = cuda::stream(dev, op);
  // [graph] host transfers and peer copies synchronise, which capture forbids: say so clearly.
  const bool host = !dst_dev.is_cuda() || !src_dev.is_cuda();
  if ((host || dst_dev != src_dev) &&
      (cuda::capturing(dev.index) || (src_dev.is_cuda() && cuda::capturing(src_dev.index)))) {
    throw RuntimeError(std::string("[") + op + "] cannot copy " +
                       (!dst_dev.is_cuda()   ? "to the host"
                        : !src_dev.is_cuda() ? "from the host"
                                             : "between devices") +
                       " while a CUDA graph is being captured (host reads such as item(), "
                       "numpy() or .cpu() must stay out of the captured step)");
  }
  if (dst_dev.is_cuda() && src_dev.is_cuda() && dst_dev != src_dev) {
    // Peer copy: order after the source device's work, then run on the destination's stream.
    BT_CUDA_CHECK(op, cudaStreamSynchronize(cuda::stream(src_dev, op)));
    BT_CUDA_CHECK(op, cudaMemcpyPeerAsync(dst, dst_dev.index, src, src_dev.index, nbytes,
                                          cuda::stream(dst_dev, op)));
    return;
  }
  BT_CUDA_CHECK(op, cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, s));
  // A host buffer must be complete (device to host) or free to reuse (host to device) when we
  // return: the host side owns pageable memory the GPU cannot be left reading.
  if (!dst_dev.is_cuda() || !src_dev.is_cuda()) BT_CUDA_CHECK(op, cudaStreamSynchronize(s));
  if (!dst_dev.is_cuda() && src_dev.is_cuda()) cuda::check_index_errors(src_dev.index);
}

[[noreturn]] void no_cuda_kernel(const std::string& op) {
  throw NotImplementedError("[" + op + "] has no CUDA implementation in this build");
}

}  // namespace backend
}  // namespace bt
