// cuda/streams.cpp: the communication streams, a pool of events, and staging copies.
//
// Note [stream order]: a collective on a CUDA tensor runs on its device's communication stream,
// not on the compute stream that produced the tensor, so backward's kernels keep running while
// NCCL moves a finished bucket.  Order is kept by events, never by a host sync:
//   compute --record(e1)--> comm waits e1 --> collective --record(e2)--> compute waits e2 (wait())
// The tensors' memory is marked in use on the comm stream (blutrain.alloc's record_stream, done
// by the caller), so a tensor freed on the compute stream is not handed out again before the
// collective that reads it has finished.
//
// Locking rule: one mutex guards the stream table and the event pool; CUDA calls on a stream or
// event are made outside it.  Pool events are created with timing off (cheaper to record/wait).
#include <mutex>
#include <vector>

#include "../nccl_lib.h"

namespace bt::dist {
namespace {
constexpr int kMaxDevices = 64;
std::mutex g_mutex;
cudaStream_t g_streams[kMaxDevices] = {};
struct PooledEvent {
  cudaEvent_t event;
  int device;
};
std::vector<PooledEvent> g_free;  // released events, any device

std::vector<std::pair<cudaEvent_t, int>> g_owner;  // every pool event -> its device

int event_device(cudaEvent_t e) {
  for (const auto& [ev, dev] : g_owner)
    if (ev == e) return dev;
  return -1;
}

void check_device(int device, const char* op) {
  int n = 0;
  BT_DIST_CUDA_CHECK(op, cudaGetDeviceCount(&n));
  if (device < 0 || device >= n || device >= kMaxDevices)
    fail(BT_DIST_EINVAL, std::string("[") + op + "] cannot use cuda:" + std::to_string(device) +
                             ": " + std::to_string(n) + " CUDA device(s) present");
}
}  // namespace

bool built_with_cuda() { return true; }

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::string device_pci_bus_id(int device) {
  check_device(device, "device_pci_bus_id");
  char id[32] = {};  // "domain:bus:device.function", 13 characters
  BT_DIST_CUDA_CHECK("device_pci_bus_id", cudaDeviceGetPCIBusId(id, sizeof(id), device));
  return std::string(id);
}

void* comm_stream(int device) {
  check_device(device, "comm_stream");
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_streams[device]) {
    BT_DIST_CUDA_CHECK("comm_stream", cudaSetDevice(device));
    int lo = 0, hi = 0;  // numerically lower = higher priority
    BT_DIST_CUDA_CHECK("comm_stream", cudaDeviceGetStreamPriorityRange(&lo, &hi));
    BT_DIST_CUDA_CHECK("comm_stream",
                       cudaStreamCreateWithPriority(&g_streams[device], cudaStreamNonBlocking, hi));
  }
  return g_streams[device];
}

uintptr_t event_record(int device, void* stream) {
  cudaEvent_t e = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    for (size_t i = 0; i < g_free.size(); ++i) {
      if (g_free[i].device == device) {
        e = g_free[i].event;
        g_free[i] = g_free.back();
        g_free.pop_back();
        break;
      }
    }
  }
  BT_DIST_CUDA_CHECK("event_record", cudaSetDevice(device));
  if (!e) {
    BT_DIST_CUDA_CHECK("event_record", cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    std::lock_guard<std::mutex> lock(g_mutex);
    g_owner.emplace_back(e, device);
  }
  BT_DIST_CUDA_CHECK("event_record", cudaEventRecord(e, static_cast<cudaStream_t>(stream)));
  return reinterpret_cast<uintptr_t>(e);
}

void event_release(uintptr_t event) {
  if (!event) return;
  auto e = reinterpret_cast<cudaEvent_t>(event);
  std::lock_guard<std::mutex> lock(g_mutex);
  const int dev = event_device(e);
  if (dev >= 0) g_free.push_back({e, dev});
}

void stream_wait_event(void* stream, uintptr_t event) {
  BT_DIST_CUDA_CHECK("wait", cudaStreamWaitEvent(static_cast<cudaStream_t>(stream),
                                                 reinterpret_cast<cudaEvent_t>(event), 0));
}

bool event_query(uintptr_t event) {
  const cudaError_t e = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
  if (e == cudaErrorNotReady) return false;
  BT_DIST_CUDA_CHECK("is_completed", e);
  return true;
}

void event_synchronize(uintptr_t event) {
  BT_DIST_CUDA_CHECK("synchronize", cudaEventSynchronize(reinterpret_cast<cudaEvent_t>(event)));
}

void stream_synchronize(void* stream) {
  BT_DIST_CUDA_CHECK("synchronize", cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

bool stream_capturing(void* stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  BT_DIST_CUDA_CHECK("capturing", cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &st));
  return st != cudaStreamCaptureStatusNone;
}

void memcpy_async(void* dst, const void* src, size_t nbytes, int kind, int device, void* stream) {
  if (nbytes == 0) return;
  BT_DIST_CUDA_CHECK("stage", cudaSetDevice(device));
  BT_DIST_CUDA_CHECK("stage", cudaMemcpyAsync(dst, src, nbytes,
                                              kind == 0   ? cudaMemcpyDeviceToHost
                                              : kind == 1 ? cudaMemcpyHostToDevice
                                                          : cudaMemcpyDeviceToDevice,
                                              static_cast<cudaStream_t>(stream)));
}

}  // namespace bt::dist
