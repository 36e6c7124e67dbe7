// runtime.cpp: blutrain-compiler's runtime: PTX modules loaded and launched with the CUDA driver
// API, and zero-copy views of planned buffers.
//
// Policy: libcuda.so.1 is opened with dlopen on first use (no link-time dependency), so this
// module builds without a CUDA toolkit and imports on machines without a driver; every CUDA
// path then fails with a Python error naming the call.  Kernels launch on the stream handle the
// caller passes (blutrain.tensor's current stream), in the primary context of the device, the
// one the CUDA runtime (and so blutrain.tensor) uses.  Every driver call is checked by CU_CHECK,
// which names the call, file and line.
#include <dlfcn.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace {

// ---- the driver entry points we use (types as in cuda.h) ------------------------------------
using CUresult = int;
using CUdevice = int;
using CUcontext = void*;
using CUmodule = void*;
using CUfunction = void*;
using CUstream = void*;

struct Driver {
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuModuleLoadData)(CUmodule*, const void*);
  CUresult (*cuModuleUnload)(CUmodule);
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, CUstream, void**, void**);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuFuncSetAttribute)(CUfunction, int, int);
  std::string error;  // why the driver could not be loaded
  bool ok = false;
};

Driver& driver() {
  static Driver d;
  static std::once_flag once;
  std::call_once(once, [] {
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      d.error = std::string("libcuda.so.1 not found (") + dlerror() + ")";
      return;
    }
    bool all = true;
    auto sym = [&](auto& fp, const char* name) {
      void* p = dlsym(h, name);
      if (!p) all = false;
      std::memcpy(&fp, &p, sizeof(p));
    };
    sym(d.cuInit, "cuInit");
    sym(d.cuDeviceGet, "cuDeviceGet");
    sym(d.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    sym(d.cuCtxSetCurrent, "cuCtxSetCurrent");
    sym(d.cuModuleLoadData, "cuModuleLoadData");
    sym(d.cuModuleUnload, "cuModuleUnload");
    sym(d.cuModuleGetFunction, "cuModuleGetFunction");
    sym(d.cuLaunchKernel, "cuLaunchKernel");
    sym(d.cuGetErrorString, "cuGetErrorString");
    sym(d.cuFuncSetAttribute, "cuFuncSetAttribute");
    if (!all) {
      d.error = "libcuda.so.1 lacks a driver entry point this runtime needs";
      return;
    }
    d.ok = true;
  });
  return d;
}

void check(CUresult r, const char* call, const char* file, int line) {
  if (r == 0) return;
  const char* s = nullptr;
  if (driver().cuGetErrorString) driver().cuGetErrorString(r, &s);
  throw std::runtime_error(std::string("[compile runtime] ") + call +
                           " failed: " + (s ? s : "unknown error") + " (" + std::to_string(r) +
                           ") at " + file + ":" + std::to_string(line));
}
#define CU_CHECK(call) check((call), #call, __FILE__, __LINE__)

Driver& need_driver(const char* what) {
  Driver& d = driver();
  if (!d.ok) throw std::runtime_error(std::string("[compile runtime] ") + what + ": " + d.error);
  return d;
}

void make_current(int device) {
  Driver& d = need_driver("CUDA");
  static std::once_flag init;
  std::call_once(init, [&] { CU_CHECK(d.cuInit(0)); });
  CUdevice dev;
  CU_CHECK(d.cuDeviceGet(&dev, device));
  CUcontext ctx;
  CU_CHECK(d.cuDevicePrimaryCtxRetain(&ctx, dev));
  CU_CHECK(d.cuCtxSetCurrent(ctx));
}

// A loaded module (kept alive by Python).
struct Module {
  CUmodule mod = nullptr;
  int device = 0;
  ~Module() {
    if (mod && driver().ok) driver().cuModuleUnload(mod);
  }
};

}  // namespace

NB_MODULE(_runtime, m) {
  m.doc() = "blutrain-compiler runtime: PTX loading and launches (CUDA driver API), buffer views";

  m.def(
      "cuda_available",
      []() -> std::string { return driver().ok ? std::string() : driver().error; },
      "Empty when the CUDA driver could be loaded, else why not.");

  nb::class_<Module>(m, "Module", "A PTX module loaded on one device.")
      .def(
          "__init__",
          [](Module* self, nb::bytes ptx, int device) {
            new (self) Module();
            make_current(device);
            std::string text(ptx.c_str(), ptx.size());
            CU_CHECK(need_driver("cuModuleLoadData").cuModuleLoadData(&self->mod, text.c_str()));
            self->device = device;
          },
          "ptx"_a, "device"_a = 0)
      .def(
          "function",
          [](Module& self, const std::string& name) {
            CUfunction f;
            CU_CHECK(driver().cuModuleGetFunction(&f, self.mod, name.c_str()));
            return reinterpret_cast<uintptr_t>(f);
          },
          "name"_a, "The handle of kernel `name`.");

  // Arguments: a string of kinds ('p' pointer / 'q' int64 / 'i' int32 / 'f' float32) and the
  // values as int64 bit patterns (floats as their float32 bits).
  m.def(
      "launch",
      [](uintptr_t fn, std::vector<unsigned> grid, std::vector<unsigned> block, unsigned shmem,
         uintptr_t stream, const std::string& kinds, const std::vector<int64_t>& values) {
        if (grid.size() != 3 || block.size() != 3)
          throw std::invalid_argument("[compile runtime] launch: grid and block need 3 dims");
        if (kinds.size() != values.size())
          throw std::invalid_argument("[compile runtime] launch: kinds and values differ");
        Driver& d = need_driver("cuLaunchKernel");
        std::vector<int64_t> storage(values.size());
        std::vector<void*> params(values.size());
        for (size_t i = 0; i < values.size(); ++i) {
          storage[i] = values[i];
          if (kinds[i] == 'i') {
            int32_t v = static_cast<int32_t>(values[i]);
            std::memcpy(&storage[i], &v, 4);
          } else if (kinds[i] == 'f') {
            uint32_t v = static_cast<uint32_t>(values[i]);
            std::memcpy(&storage[i], &v, 4);
          }
          params[i] = &storage[i];
        }
        CU_CHECK(d.cuLaunchKernel(reinterpret_cast<CUfunction>(fn), grid[0], grid[1], grid[2],
                                  block[0], block[1], block[2], shmem,
                                  reinterpret_cast<CUstream>(stream), params.data(), nullptr));
      },
      "fn"_a, "grid"_a, "block"_a, "shmem"_a, "stream"_a, "kinds"_a, "values"_a,
      "Launches a kernel on `stream` (a CUstream handle; 0 is the legacy default stream).");

  // A DLPack-able view of `nbytes` at `ptr` (no ownership): the arena's buffers as tensors.
  m.def(
      "view",
      [](uintptr_t ptr, std::vector<size_t> shape, std::vector<int64_t> strides, int code, int bits,
         int device_type, int device_id, nb::handle owner) {
        nb::dlpack::dtype dt{static_cast<uint8_t>(code), static_cast<uint8_t>(bits), 1};
        return nb::ndarray<>(reinterpret_cast<void*>(ptr), shape.size(), shape.data(), owner,
                             strides.data(), dt, device_type, device_id);
      },
      "ptr"_a, "shape"_a, "strides"_a, "code"_a, "bits"_a, "device_type"_a, "device_id"_a,
      "owner"_a.none(), "A DLPack view of memory at ptr (owner keeps it alive).");
}
