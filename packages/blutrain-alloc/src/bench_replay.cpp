#include "bench_replay.h"

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#ifdef BT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace {
thread_local std::string tl_replay_error;

// Returns 0 or an error code; one pass over the trace.
int replay_once(const int64_t* trace, size_t n, int backend, int device, void* stream,
                std::vector<void*>& slots, bt_alloc_replay_result* out, bool timed) {
  auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < n; ++i) {
    const int64_t op = trace[3 * i], id = trace[3 * i + 1], size = trace[3 * i + 2];
    void*& slot = slots[size_t(id)];
    if (op == 0) {
      switch (backend) {
        case 0:
          if (int rc = bt_alloc_malloc(device, size_t(size), stream, &slot)) return rc;
          break;
#ifdef BT_WITH_CUDA
        case 1:
          if (cudaMalloc(&slot, size_t(size)) != cudaSuccess) return BT_ALLOC_ENOMEM;
          break;
        case 2:
          if (cudaMallocAsync(&slot, size_t(size), static_cast<cudaStream_t>(stream)) !=
              cudaSuccess)
            return BT_ALLOC_ENOMEM;
          break;
#endif
        case 3:
          slot = std::malloc(size_t(size));
          break;
        default:
          return BT_ALLOC_ENOCUDA;
      }
    } else {
      switch (backend) {
        case 0:
          bt_alloc_free(slot);
          break;
#ifdef BT_WITH_CUDA
        case 1:
          cudaFree(slot);
          break;
        case 2:
          cudaFreeAsync(slot, static_cast<cudaStream_t>(stream));
          break;
#endif
        case 3:
          std::free(slot);
          break;
      }
      slot = nullptr;
    }
  }
#ifdef BT_WITH_CUDA
  if (backend == 2) cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
#endif
  if (timed)
    out->total_ns +=
        std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
  return 0;
}
}  // namespace

extern "C" int bt_alloc_bench_replay(const int64_t* trace, size_t n, int backend, int device,
                                     void* stream, int repeats, bt_alloc_replay_result* out) {
  *out = {};
  int64_t max_id = -1, live = 0;
  for (size_t i = 0; i < n; ++i) {
    max_id = std::max(max_id, trace[3 * i + 1]);
    live += trace[3 * i] == 0 ? trace[3 * i + 2] : 0;
  }
  std::vector<void*> slots(size_t(max_id + 1), nullptr);
  std::vector<int64_t> sizes(size_t(max_id + 1), 0);
  int64_t now = 0, peak = 0;
  for (size_t i = 0; i < n; ++i) {  // peak of live requested bytes
    const int64_t id = trace[3 * i + 1];
    if (trace[3 * i] == 0) {
      sizes[id] = trace[3 * i + 2];
      now += sizes[id];
    } else {
      now -= sizes[id];
    }
    peak = std::max(peak, now);
  }
  out->peak_live = uint64_t(peak);
  if (int rc = replay_once(trace, n, backend, device, stream, slots, out, false))  // warm-up
    return out->status = rc;
  for (int r = 0; r < repeats; ++r)
    if (int rc = replay_once(trace, n, backend, device, stream, slots, out, true))
      return out->status = rc;
  out->ops = uint64_t(n) * uint64_t(repeats);
  return 0;
}

extern "C" const char* bt_alloc_library_path(void) {
  static std::string path = [] {
    Dl_info info{};
    return dladdr(reinterpret_cast<void*>(&bt_alloc_library_path), &info) && info.dli_fname
               ? std::string(info.dli_fname)
               : std::string();
  }();
  return path.c_str();
}
