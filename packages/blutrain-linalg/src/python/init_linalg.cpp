// nanobind module blutrain.linalg._linalg: the C ABI table as a capsule, a thin `gemm` that
// takes raw pointers (the Python layer in blutrain/linalg/__init__.py checks shapes and names
// them in errors), DLPack introspection and allocation of outputs through blutrain-alloc.
#include <dlfcn.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "blutrain/linalg.h"

// Names this module in the errors of the capsule importer (blutrain/capi_import.h).
#define BT_CAPI_IMPORTER "blutrain.linalg"
#include "blutrain/alloc_import.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

const bt_linalg_api* g_api = nullptr;
const bt_alloc_api* g_alloc = nullptr;  // NULL when blutrain.alloc is not importable
std::string g_alloc_error;

[[noreturn]] void raise_code(int rc) {
  const char* msg = g_api->last_error();
  switch (rc) {
    case BT_LINALG_EINVAL:
      throw nb::value_error(msg);
    case BT_LINALG_ENOTSUP:
      throw nb::type_error(msg);
    case BT_LINALG_ENOMEM:
      throw std::bad_alloc();
    default:
      throw std::runtime_error(msg);
  }
}
inline void check(int rc) {
  if (rc != BT_LINALG_OK) raise_code(rc);
}

// (ptr, ld, batch_stride, dtype) or None.
using Operand = std::optional<std::tuple<uintptr_t, int64_t, int64_t, int>>;
bt_linalg_matrix to_matrix(const Operand& o) {
  bt_linalg_matrix m{};
  if (o) {
    m.ptr = reinterpret_cast<const void*>(std::get<0>(*o));
    m.ld = std::get<1>(*o);
    m.batch_stride = std::get<2>(*o);
    m.dtype = std::get<3>(*o);
  }
  return m;
}

// A descriptor built once from gemm's arguments; `launch` runs it (the caller sets pointers).
struct GemmPlan {
  bt_linalg_gemm_desc desc;
  GemmPlan(int64_t mm, int64_t n, int64_t k, int64_t batch, int transa, int transb,
           const Operand& a, const Operand& b, const Operand& c, const Operand& d, double alpha,
           double beta, int compute, int epilogue, const Operand& bias, const Operand& aux,
           const Operand& bgrad, int device) {
    bt_linalg_gemm_desc_init(&desc);
    desc.m = mm;
    desc.n = n;
    desc.k = k;
    desc.batch = batch;
    desc.transa = transa;
    desc.transb = transb;
    desc.a = to_matrix(a);
    desc.b = to_matrix(b);
    desc.c = to_matrix(c);
    desc.d = to_matrix(d);
    desc.alpha = alpha;
    desc.beta = beta;
    desc.compute = compute;
    desc.epilogue = epilogue;
    desc.bias = to_matrix(bias);
    desc.aux = to_matrix(aux);
    desc.bgrad = to_matrix(bgrad);
    desc.device = device;
  }
  void launch() {
    int rc;
    {
      // CPU GEMMs can be long; a CUDA launch can block on a full queue or autotune.
      nb::gil_scoped_release release;
      rc = g_api->gemm(&desc);
    }
    check(rc);
  }
};

int dtype_code(nb::dlpack::dtype t) {
  using C = nb::dlpack::dtype_code;
  if (t.lanes != 1) return -1;
  if (t.code == (uint8_t)C::Float && t.bits == 32) return BT_LINALG_F32;
  if (t.code == (uint8_t)C::Float && t.bits == 64) return BT_LINALG_F64;
  if (t.code == (uint8_t)C::Float && t.bits == 16) return BT_LINALG_F16;
  if (t.code == (uint8_t)C::Bfloat && t.bits == 16) return BT_LINALG_BF16;
  return -1;
}
nb::dlpack::dtype to_dl(int code) {
  using C = nb::dlpack::dtype_code;
  switch (code) {
    case BT_LINALG_F32:
      return {(uint8_t)C::Float, 32, 1};
    case BT_LINALG_F64:
      return {(uint8_t)C::Float, 64, 1};
    case BT_LINALG_F16:
      return {(uint8_t)C::Float, 16, 1};
    case BT_LINALG_BF16:
      return {(uint8_t)C::Bfloat, 16, 1};
    default:
      throw nb::value_error("[empty] invalid dtype code");
  }
}

}  // namespace

NB_MODULE(_linalg, m) {
  m.doc() = "blutrain-linalg's native module: the C ABI capsule and raw-pointer GEMM entry.";
  g_api = bt_linalg_get_api();

  // blutrain-alloc supplies CUDA workspaces and output buffers. Importing it is soft so the
  // CPU path works in a checkout where alloc is not installed; CUDA calls then fall back to
  // cudaMallocAsync for workspaces and refuse to allocate outputs (see `empty`).
  g_alloc = bt_alloc_import();
  if (!g_alloc) {
    g_alloc_error = nb::cast<std::string>(nb::steal(bt_capi_take_error_message()));
  }
  g_api->set_alloc_api(g_alloc);

  m.attr("_C_API") = nb::capsule((void*)g_api, BT_LINALG_CAPSULE_NAME);
  m.attr("ABI_VERSION") = BT_LINALG_ABI_VERSION;
  m.attr("F32") = (int)BT_LINALG_F32;
  m.attr("F64") = (int)BT_LINALG_F64;
  m.attr("F16") = (int)BT_LINALG_F16;
  m.attr("BF16") = (int)BT_LINALG_BF16;

  m.def(
      "gemm",
      [](int64_t mm, int64_t n, int64_t k, int64_t batch, int transa, int transb, Operand a,
         Operand b, Operand c, Operand d, double alpha, double beta, int compute, int epilogue,
         Operand bias, Operand aux, Operand bgrad, int device, uintptr_t stream) {
        GemmPlan p(mm, n, k, batch, transa, transb, a, b, c, d, alpha, beta, compute, epilogue,
                   bias, aux, bgrad, device);
        p.desc.stream = reinterpret_cast<void*>(stream);
        p.launch();
      },
      "m"_a, "n"_a, "k"_a, "batch"_a, "transa"_a, "transb"_a, "a"_a.none(), "b"_a.none(),
      "c"_a.none(), "d"_a.none(), "alpha"_a, "beta"_a, "compute"_a, "epilogue"_a, "bias"_a.none(),
      "aux"_a.none(), "bgrad"_a.none(), "device"_a, "stream"_a,
      "Raw row-major GEMM over pointers (see blutrain/linalg.h). Operands are\n"
      "(ptr, ld, batch_stride, dtype) tuples in elements, or None. No shape checks beyond\n"
      "the C library's: use blutrain.linalg.matmul.");

  nb::class_<GemmPlan>(m, "GemmPlan",
                       "A gemm descriptor without its pointers, built once and run many times\n"
                       "(the hot path of blutrain.linalg.matmul for repeated shapes).")
      .def(nb::init<int64_t, int64_t, int64_t, int64_t, int, int, Operand, Operand, Operand,
                    Operand, double, double, int, int, Operand, Operand, Operand, int>(),
           "m"_a, "n"_a, "k"_a, "batch"_a, "transa"_a, "transb"_a, "a"_a.none(), "b"_a.none(),
           "c"_a.none(), "d"_a.none(), "alpha"_a, "beta"_a, "compute"_a, "epilogue"_a,
           "bias"_a.none(), "aux"_a.none(), "bgrad"_a.none(), "device"_a,
           "Takes gemm's arguments less the stream; operand pointers are replaced per run.")
      .def(
          "run",
          [](GemmPlan& p, uintptr_t a, uintptr_t b, uintptr_t c, uintptr_t d, uintptr_t bias,
             uintptr_t aux, uintptr_t bgrad, uintptr_t stream) {
            p.desc.a.ptr = reinterpret_cast<const void*>(a);
            p.desc.b.ptr = reinterpret_cast<const void*>(b);
            p.desc.c.ptr = reinterpret_cast<const void*>(c);
            p.desc.d.ptr = reinterpret_cast<const void*>(d);
            p.desc.bias.ptr = reinterpret_cast<const void*>(bias);
            p.desc.aux.ptr = reinterpret_cast<const void*>(aux);
            p.desc.bgrad.ptr = reinterpret_cast<const void*>(bgrad);
            p.desc.stream = reinterpret_cast<void*>(stream);
            p.launch();
          },
          "a"_a, "b"_a, "c"_a, "d"_a, "bias"_a, "aux"_a, "bgrad"_a, "stream"_a,
          "Runs the descriptor on these pointers (0 for operands the plan does not use)\n"
          "and this stream.");

  m.def(
      "describe",
      [](nb::ndarray<nb::ro> x) {
        std::vector<int64_t> shape(x.ndim()), strides(x.ndim());
        for (size_t i = 0; i < x.ndim(); ++i) {
          shape[i] = (int64_t)x.shape(i);
          strides[i] = x.stride(i);
        }
        return std::make_tuple((uintptr_t)x.data(), shape, strides, dtype_code(x.dtype()),
                               x.device_type(), x.device_id());
      },
      "x"_a,
      "Imports a DLPack / buffer-protocol object: (ptr, shape, strides in elements, dtype code\n"
      "or -1, DLPack device type, device id). The caller keeps `x` alive while using ptr.");

  m.def(
      "empty",
      [](std::vector<int64_t> shape, int dtype, int device, uintptr_t stream) {
        if (!g_alloc)
          throw std::runtime_error(
              "[gemm] allocating a CUDA output needs blutrain-alloc, which "
              "could not be imported: " +
              g_alloc_error);
        size_t count = 1;
        for (int64_t s : shape) count *= (size_t)s;
        const nb::dlpack::dtype dt = to_dl(dtype);
        const size_t bytes = count * (dt.bits / 8);
        void* p = nullptr;
        const int dev = device < 0 ? BT_ALLOC_HOST_PAGEABLE : device;
        if (int rc = g_alloc->malloc(dev, bytes ? bytes : 1, (void*)stream, &p)) {
          const std::string msg = g_alloc->last_error();
          if (rc == BT_ALLOC_ENOMEM) throw std::bad_alloc();
          throw std::runtime_error("[gemm] could not allocate the output: " + msg);
        }
        nb::capsule owner(p, [](void* q) noexcept { g_alloc->free(q); });
        std::vector<size_t> sh(shape.begin(), shape.end());
        // array_api: a nanobind.nb_ndarray object with __dlpack__ / __dlpack_device__ (a bare
        // ndarray<> would be returned as a one-shot DLPack capsule).
        return nb::ndarray<nb::array_api>(
            p, sh.size(), sh.data(), owner, nullptr, dt,
            device < 0 ? nb::device::cpu::value : nb::device::cuda::value, device < 0 ? 0 : device);
      },
      "shape"_a, "dtype"_a, "device"_a, "stream"_a,
      "A C-contiguous array from blutrain-alloc (device -1: host) exposing DLPack; the memory\n"
      "returns to the allocator, ordered on `stream`, when the last reference goes.");

  m.def(
      "set_option",
      [](const std::string& name, int64_t v) { check(g_api->set_option(name.c_str(), v)); },
      "name"_a, "value"_a, "Sets a library option (see blutrain/linalg.h: autotune, ...).");
  m.def(
      "get_option",
      [](const std::string& name) {
        int64_t v = 0;
        check(g_api->get_option(name.c_str(), &v));
        return v;
      },
      "name"_a, "Reads a library option or statistic (cuda, cache_entries, cache_hits, ...).");
  m.def(
      "cache_path",
      []() {
        size_t need = 0;
        g_api->get_cache_path(nullptr, 0, &need);
        std::string s(need, '\0');
        g_api->get_cache_path(s.data(), s.size(), &need);
        s.resize(need ? need - 1 : 0);
        return s;
      },
      "Path of the persisted cuBLASLt algorithm cache.");
  m.def(
      "set_cache_path",
      [](std::optional<std::string> p) { check(g_api->set_cache_path(p ? p->c_str() : nullptr)); },
      "path"_a.none(), "Moves the algorithm cache to `path` (None: the default).");
  m.def("save_cache", []() { check(g_api->save_cache()); }, "Writes the algorithm cache now.");
  m.def(
      "clear_cache", [](bool also_file) { check(g_api->clear_cache(also_file)); },
      "also_file"_a = false, "Forgets cached algorithm choices (and deletes the file if asked).");
  m.def(
      "load_blas", [](const std::string& p) { check(g_api->load_blas(p.c_str())); }, "path"_a,
      "Opens the CPU BLAS (libscipy_openblas.so) by path; the first successful call wins.");
  m.def(
      "library_path",
      []() {
        Dl_info info{};
        if (!dladdr((void*)&bt_linalg_get_api, &info) || !info.dli_fname)
          throw std::runtime_error("[library_path] dladdr failed");
        return std::string(info.dli_fname);
      },
      "Path of the loaded libblutrain_linalg shared library.");
  m.def(
      "alloc_available", []() { return g_alloc != nullptr; },
      "Whether blutrain.alloc's C ABI was imported.");
  m.def(
      "alloc_error", []() { return g_alloc_error; },
      "Why blutrain.alloc could not be imported ('' if it was).");
}
