// CUDA backend: device segments from cudaMalloc or the virtual memory API,
// pinned host segments from cudaHostAlloc, cross-stream use through events.
// Plain C++ over the runtime API; the driver API is reached through
// cudaGetDriverEntryPointByVersion so nothing links against libcuda.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <map>
#include <mutex>
#include <vector>

#include "backend.h"

#define BT_CUDA_CHECK(expr)                                                                        \
  do {                                                                                             \
    cudaError_t bt_err_ = (expr);                                                                  \
    if (bt_err_ != cudaSuccess)                                                                    \
      throw ::bt::alloc::Error(BT_ALLOC_ECUDA, std::string("[alloc] ") + #expr + ": " +            \
                                                   cudaGetErrorString(bt_err_) + " (" +            \
                                                   __FILE__ ":" + std::to_string(__LINE__) + ")"); \
  } while (0)

#define BT_CU_CHECK(expr)                                                                         \
  do {                                                                                            \
    CUresult bt_res_ = (expr);                                                                    \
    if (bt_res_ != CUDA_SUCCESS)                                                                  \
      throw ::bt::alloc::Error(BT_ALLOC_ECUDA, std::string("[alloc] ") + #expr +                  \
                                                   " failed with "                                \
                                                   "CUresult " +                                  \
                                                   std::to_string(int(bt_res_)) +                 \
                                                   " (" __FILE__ ":" + std::to_string(__LINE__) + \
                                                   ")");                                          \
  } while (0)

namespace bt::alloc {
namespace {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    BT_CUDA_CHECK(cudaGetDevice(&prev_));
    if (prev_ != device) BT_CUDA_CHECK(cudaSetDevice(device));
    device_ = device;
  }
  ~DeviceGuard() {
    if (prev_ != device_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = 0, device_ = 0;
};

// Driver entry points for expandable segments, loaded once.
struct DriverVmm {
  decltype(&cuMemAddressReserve) address_reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuDeviceGet) device_get = nullptr;
  decltype(&cuDeviceGetAttribute) attribute = nullptr;
  bool ok = false;

  static const DriverVmm& get() {
    static DriverVmm vmm = [] {
      DriverVmm v;
      auto load = [](const char* name, auto& fn) {
        void* p = nullptr;
        cudaDriverEntryPointQueryResult status{};
        if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &status) ==
                cudaSuccess &&
            status == cudaDriverEntryPointSuccess)
          fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
        return fn != nullptr;
      };
      v.ok = load("cuMemAddressReserve", v.address_reserve) &
             load("cuMemAddressFree", v.address_free) & load("cuMemCreate", v.create) &
             load("cuMemRelease", v.release) & load("cuMemMap", v.map) &
             load("cuMemUnmap", v.unmap) & load("cuMemSetAccess", v.set_access) &
             load("cuMemGetAllocationGranularity", v.granularity) &
             load("cuDeviceGet", v.device_get) & load("cuDeviceGetAttribute", v.attribute);
      return v;
    }();
    return vmm;
  }
};

class DeviceSource final : public MemorySource {
 public:
  explicit DeviceSource(int device) : device_(device) {
    DeviceGuard g(device_);
    size_t free_b = 0, total_b = 0;
    BT_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    total_ = total_b;
    kind_ = "CUDA device " + std::to_string(device_);
    const DriverVmm& d = DriverVmm::get();
    int vmm = 0;
    CUdevice cu_dev = 0;
    if (d.ok && d.device_get(&cu_dev, device_) == CUDA_SUCCESS)
      d.attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, cu_dev);
    if (vmm) {
      prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
      prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      prop_.location.id = device_;
      size_t g = 0;
      if (d.granularity(&g, &prop_, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED) == CUDA_SUCCESS && g)
        granularity_ = std::max(g, kLargeRounding);
      vmm_ = true;
    }
  }

  uintptr_t allocate(size_t bytes) override {
    DeviceGuard g(device_);
    // cudaMalloc is legal during a relaxed-mode capture only; see Note [Graph capture].
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    BT_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, bytes);
    cudaThreadExchangeStreamCaptureMode(&mode);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear the sticky-free error state of this thread
      return 0;
    }
    BT_CUDA_CHECK(err);
    return reinterpret_cast<uintptr_t>(p);
  }

  void release(uintptr_t base, size_t) override {
    DeviceGuard g(device_);
    BT_CUDA_CHECK(cudaFree(reinterpret_cast<void*>(base)));
  }

  uint64_t total_bytes() const override { return total_; }
  bool capacity_is_hard() const override { return true; }
  const char* kind() const override { return kind_.c_str(); }

  bool supports_expandable() const override { return vmm_; }
  size_t expand_granularity() const override { return granularity_; }

  uintptr_t reserve(size_t bytes) override {
    CUdeviceptr p = 0;
    if (DriverVmm::get().address_reserve(&p, bytes, granularity_, 0, 0) != CUDA_SUCCESS) return 0;
    return uintptr_t(p);
  }

  // One physical handle per granule, so any granule-aligned tail can be unmapped.
  bool grow(uintptr_t base, size_t from, size_t to) override {
    const DriverVmm& d = DriverVmm::get();
    DeviceGuard g(device_);
    std::vector<CUmemGenericAllocationHandle>& hs = handles_[base];
    size_t at = from;
    for (; at < to; at += granularity_) {
      CUmemGenericAllocationHandle h{};
      const CUresult r = d.create(&h, granularity_, &prop_, 0);
      if (r == CUDA_ERROR_OUT_OF_MEMORY) break;
      BT_CU_CHECK(r);
      BT_CU_CHECK(d.map(CUdeviceptr(base + at), granularity_, 0, h, 0));
      hs.push_back(h);
    }
    if (at < to) {  // out of memory part-way: undo what this call mapped
      shrink(base, from, at);
      return false;
    }
    CUmemAccessDesc access{};
    access.location = prop_.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    BT_CU_CHECK(d.set_access(CUdeviceptr(base + from), to - from, &access, 1));
    return true;
  }

  void shrink(uintptr_t base, size_t from, size_t to) override {
    const DriverVmm& d = DriverVmm::get();
    DeviceGuard g(device_);
    BT_CUDA_CHECK(cudaDeviceSynchronize());  // unmapping memory kernels may still touch
    std::vector<CUmemGenericAllocationHandle>& hs = handles_[base];
    for (size_t at = to; at > from; at -= granularity_) {
      BT_CU_CHECK(d.unmap(CUdeviceptr(base + at - granularity_), granularity_));
      BT_CU_CHECK(d.release(hs.back()));
      hs.pop_back();
    }
  }

  void unreserve(uintptr_t base, size_t bytes) override {
    DriverVmm::get().address_free(CUdeviceptr(base), bytes);
    handles_.erase(base);
  }

 private:
  int device_;
  uint64_t total_ = 0;
  std::string kind_;
  bool vmm_ = false;
  size_t granularity_ = kLargeRounding;
  CUmemAllocationProp prop_{};
  std::map<uintptr_t, std::vector<CUmemGenericAllocationHandle>> handles_;  // by segment base
};

class PinnedSource final : public MemorySource {
 public:
  uintptr_t allocate(size_t bytes) override {
    void* p = nullptr;
    const cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      return 0;
    }
    BT_CUDA_CHECK(err);
    return reinterpret_cast<uintptr_t>(p);
  }
  void release(uintptr_t base, size_t) override {
    BT_CUDA_CHECK(cudaFreeHost(reinterpret_cast<void*>(base)));
  }
  uint64_t total_bytes() const override {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? uint64_t(pages) * uint64_t(page) : 0;
  }
  bool capacity_is_hard() const override { return total_bytes() != 0; }  // (page-locked)
  const char* kind() const override { return "pinned host memory"; }
};

// Events are recycled: creating one costs microseconds, a free with
// cross-stream use needs one per stream.
class CudaEvents final : public EventSupport {
 public:
  ~CudaEvents() override = default;  // process exit: leave events to the driver

  void* record(StreamId stream) override {
    auto s = reinterpret_cast<cudaStream_t>(stream);
    int device = 0;
    BT_CUDA_CHECK(cudaStreamGetDevice(s, &device));
    DeviceGuard g(device);
    cudaEvent_t ev = nullptr;
    if (!cache_.empty()) {
      ev = cache_.back();
      cache_.pop_back();
    } else {
      BT_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    }
    BT_CUDA_CHECK(cudaEventRecord(ev, s));
    return ev;
  }
  bool done(void* event) override {
    const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (err == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    BT_CUDA_CHECK(err);
    return true;
  }
  void destroy(void* event) override { cache_.push_back(static_cast<cudaEvent_t>(event)); }

 private:
  std::vector<cudaEvent_t> cache_;  // guarded by the owning pool's lock
};

}  // namespace

int cuda_device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

std::unique_ptr<CachingPool> make_device_pool(int device) {
  if (cuda_device_count() == 0)
    throw Error(BT_ALLOC_ENOCUDA, "[alloc] CUDA device " + std::to_string(device) +
                                      " requested, but no CUDA device is available (driver "
                                      "missing or no GPU visible)");
  return std::make_unique<CachingPool>(std::make_unique<DeviceSource>(device),
                                       std::make_unique<CudaEvents>(), /*key_by_stream=*/true);
}

std::unique_ptr<CachingPool> make_pinned_pool() {
  if (cuda_device_count() == 0)
    throw Error(BT_ALLOC_ENOCUDA,
                "[alloc] pinned host memory needs a CUDA device, and none is available");
  return std::make_unique<CachingPool>(std::make_unique<PinnedSource>(),
                                       std::make_unique<CudaEvents>(), /*key_by_stream=*/false);
}

}  // namespace bt::alloc
