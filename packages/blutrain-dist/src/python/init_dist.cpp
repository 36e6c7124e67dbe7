// python/init_dist.cpp: the nanobind module blutrain.dist._dist.
//
// Tensors arrive as blutrain.tensor objects and are read through blutrain-tensor's C ABI
// (describe: pointer, dtype, shape, strides, device); pinned host memory comes from
// blutrain-alloc's C ABI.  Both are imported from their capsules at module init: no link-time
// dependency on either .so.  The module exports its own C ABI table as `_C_API`.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <string>

#include "../core.h"
#include "blutrain/alloc_import.h"
#include "blutrain/tensor_import.h"

namespace nb = nanobind;
using namespace nb::literals;
using namespace bt::dist;

namespace {
const bt_tensor_api* g_tensor = nullptr;
const bt_alloc_api* g_alloc = nullptr;

// A contiguous tensor's memory as the collectives see it.
struct Buf {
  void* data = nullptr;
  size_t numel = 0;
  int dtype = 0;
  int device = -1;  // -1: host
  size_t nbytes() const { return numel * dtype_size(dtype, "buffer"); }
};

Buf buffer(nb::handle obj, const char* op, const char* what) {
  void* h = nullptr;
  if (g_tensor->from_pyobject(obj.ptr(), &h) != BT_TENSOR_OK)
    fail(BT_DIST_EINVAL, std::string("[") + op + "] " + what +
                             " must be a blutrain.tensor Tensor, got " +
                             nb::cast<std::string>(nb::str(obj.type().attr("__name__"))));
  bt_tensor_info info;
  if (g_tensor->describe(h, &info) != BT_TENSOR_OK)
    fail(BT_DIST_EINVAL, std::string("[") + op + "] " + what + ": " + g_tensor->last_error());
  Buf b;
  b.data = info.data;
  b.dtype = info.dtype;
  b.device = info.device;
  b.numel = 1;
  int64_t expect = 1;
  bool contiguous = true;
  for (int i = info.ndim - 1; i >= 0; --i) {
    b.numel *= static_cast<size_t>(info.shape[i]);
    if (info.shape[i] != 1 && info.strides[i] != expect) contiguous = false;
    expect *= info.shape[i];
  }
  if (!contiguous && b.numel > 0)
    fail(BT_DIST_EINVAL, std::string("[") + op + "] " + what +
                             " is not contiguous (collectives need dense memory: call "
                             ".contiguous() first)");
  return b;
}

void* as_stream(uintptr_t s) { return reinterpret_cast<void*>(s); }

void check_device(const Buf& b, const Comm* c, const char* op, const char* what) {
  if (b.device != comm_device(c))
    fail(BT_DIST_EINVAL,
         std::string("[") + op + "] " + what + " is on " +
             (b.device < 0 ? std::string("cpu") : "cuda:" + std::to_string(b.device)) +
             " but the NCCL communicator uses cuda:" + std::to_string(comm_device(c)));
}

void check_same_dtype(const Buf& a, const Buf& b, const char* op) {
  if (a.dtype != b.dtype)
    fail(BT_DIST_EINVAL, std::string("[") + op + "] input is " + dtype_name(a.dtype) +
                             " but output is " + dtype_name(b.dtype));
}

// A Python owner for NCCL communicators: destroyed (or aborted) once.
struct PyComm {
  Comm* c = nullptr;
  Comm* get(const char* op) const {
    if (!c) fail(BT_DIST_EINVAL, std::string("[") + op + "] the NCCL communicator was shut down");
    return c;
  }
  ~PyComm() {
    // At interpreter exit NCCL may already be unusable: abort without waiting.
    if (c) {
      try {
        comm_abort(c);
      } catch (...) {
      }
    }
  }
};

nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>> byte_array(void* data, size_t n, nb::handle owner) {
  size_t shape[1] = {n};
  return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(data, 1, shape, owner);
}

}  // namespace

NB_MODULE(_dist, m) {
  m.doc() = "blutrain.dist._dist: NCCL communicators, the comm stream, staging and kernels";
  g_tensor = bt_tensor_import();
  if (!g_tensor) throw nb::python_error();
  g_alloc = bt_alloc_import();
  if (!g_alloc) throw nb::python_error();

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      if (e.code == BT_DIST_EINVAL)
        PyErr_SetString(PyExc_ValueError, e.what());
      else
        PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  m.attr("_C_API") = nb::capsule(const_cast<bt_dist_api*>(api_table()), BT_DIST_CAPSULE_NAME);
  m.attr("ABI_VERSION") = BT_DIST_ABI_VERSION;
  m.attr("UNIQUE_ID_BYTES") = BT_DIST_UNIQUE_ID_BYTES;

  m.def("built_with_cuda", &built_with_cuda, "Whether this build has the CUDA paths.");
  m.def("built_with_nccl", &built_with_nccl, "Whether this build can load NCCL.");
  m.def("device_count", &device_count, "CUDA devices visible (0 without CUDA).");
  m.def("device_pci_bus_id", &device_pci_bus_id, "device"_a,
        "The CUDA device's PCI bus id: equal in two processes iff they use the same GPU.");
  m.def("nccl_set_candidates", &nccl_set_candidates, "paths"_a,
        "Library files to try before the soname libnccl.so.2 ($BLUTRAIN_NCCL_LIBRARY first).");
  m.def("nccl_version", &nccl_version, "NCCL_VERSION_CODE of libnccl (loads it).");
  m.def("nccl_library_path", &nccl_library_path, "The libnccl file that was opened.");
  m.def(
      "nccl_unique_id",
      []() {
        uint8_t id[BT_DIST_UNIQUE_ID_BYTES];
        nccl_unique_id(id);
        return nb::bytes(reinterpret_cast<const char*>(id), sizeof(id));
      },
      "A fresh NCCL unique id (bytes), made on one rank and broadcast to the others.");

  nb::class_<PyComm>(m, "NcclComm", "An NCCL communicator bound to one CUDA device.")
      .def(
          "__init__",
          [](PyComm* self, nb::bytes uid, int nranks, int rank, int device) {
            if (uid.size() != BT_DIST_UNIQUE_ID_BYTES)
              fail(BT_DIST_EINVAL, "[comm_init] unique id must be " +
                                       std::to_string(BT_DIST_UNIQUE_ID_BYTES) + " bytes, got " +
                                       std::to_string(uid.size()));
            new (self) PyComm();
            std::vector<uint8_t> id(
                static_cast<const uint8_t*>(static_cast<const void*>(uid.c_str())),
                static_cast<const uint8_t*>(static_cast<const void*>(uid.c_str())) + uid.size());
            nb::gil_scoped_release release;  // blocks until every rank has joined
            self->c = comm_init(id.data(), nranks, rank, device);
          },
          "unique_id"_a, "nranks"_a, "rank"_a, "device"_a)
      .def_prop_ro("rank", [](const PyComm& p) { return comm_rank(p.get("rank")); })
      .def_prop_ro("size", [](const PyComm& p) { return comm_size(p.get("size")); })
      .def_prop_ro("device", [](const PyComm& p) { return comm_device(p.get("device")); })
      .def(
          "destroy",
          [](PyComm& p) {
            Comm* c = p.c;
            p.c = nullptr;
            nb::gil_scoped_release release;
            comm_destroy(c);
          },
          "Waits for pending work, then frees the communicator.")
      .def(
          "abort",
          [](PyComm& p) {
            Comm* c = p.c;
            p.c = nullptr;
            nb::gil_scoped_release release;
            comm_abort(c);
          },
          "Frees the communicator without waiting (a peer is gone).")
      .def(
          "async_error", [](PyComm& p) { return comm_async_error(p.get("async_error")); },
          "0 while healthy, else the ncclResult_t of an asynchronous failure.")
      .def(
          "all_reduce",
          [](PyComm& p, nb::handle send_t, nb::handle recv_t, int op, uintptr_t stream) {
            Comm* c = p.get("all_reduce");
            Buf s = buffer(send_t, "all_reduce", "input"),
                r = buffer(recv_t, "all_reduce", "output");
            check_device(s, c, "all_reduce", "input");
            check_device(r, c, "all_reduce", "output");
            check_same_dtype(s, r, "all_reduce");
            if (s.numel != r.numel)
              fail(BT_DIST_EINVAL, "[all_reduce] input has " + std::to_string(s.numel) +
                                       " elements, output " + std::to_string(r.numel));
            all_reduce(c, s.data, r.data, s.numel, s.dtype, op, as_stream(stream));
          },
          "input"_a, "output"_a, "op"_a, "stream"_a)
      .def(
          "reduce_scatter",
          [](PyComm& p, nb::handle send_t, nb::handle recv_t, int op, uintptr_t stream) {
            const char* name = "reduce_scatter";
            Comm* c = p.get(name);
            Buf s = buffer(send_t, name, "input"), r = buffer(recv_t, name, "output");
            check_device(s, c, name, "input");
            check_device(r, c, name, "output");
            check_same_dtype(s, r, name);
            if (s.numel != r.numel * size_t(comm_size(c)))
              fail(BT_DIST_EINVAL, "[reduce_scatter] input has " + std::to_string(s.numel) +
                                       " elements, expected output's " + std::to_string(r.numel) +
                                       " x world size " + std::to_string(comm_size(c)));
            reduce_scatter(c, s.data, r.data, r.numel, s.dtype, op, as_stream(stream));
          },
          "input"_a, "output"_a, "op"_a, "stream"_a)
      .def(
          "all_gather",
          [](PyComm& p, nb::handle send_t, nb::handle recv_t, uintptr_t stream) {
            const char* name = "all_gather";
            Comm* c = p.get(name);
            Buf s = buffer(send_t, name, "input"), r = buffer(recv_t, name, "output");
            check_device(s, c, name, "input");
            check_device(r, c, name, "output");
            check_same_dtype(s, r, name);
            if (r.numel != s.numel * size_t(comm_size(c)))
              fail(BT_DIST_EINVAL, "[all_gather] output has " + std::to_string(r.numel) +
                                       " elements, expected input's " + std::to_string(s.numel) +
                                       " x world size " + std::to_string(comm_size(c)));
            all_gather(c, s.data, r.data, s.numel, s.dtype, as_stream(stream));
          },
          "input"_a, "output"_a, "stream"_a)
      .def(
          "broadcast",
          [](PyComm& p, nb::handle t, int root, uintptr_t stream) {
            Comm* c = p.get("broadcast");
            Buf b = buffer(t, "broadcast", "tensor");
            check_device(b, c, "broadcast", "tensor");
            broadcast(c, b.data, b.data, b.numel, b.dtype, root, as_stream(stream));
          },
          "tensor"_a, "root"_a, "stream"_a)
      .def(
          "send",
          [](PyComm& p, nb::handle t, int peer, uintptr_t stream) {
            Comm* c = p.get("send");
            Buf b = buffer(t, "send", "tensor");
            check_device(b, c, "send", "tensor");
            send(c, b.data, b.numel, b.dtype, peer, as_stream(stream));
          },
          "tensor"_a, "peer"_a, "stream"_a)
      .def(
          "recv",
          [](PyComm& p, nb::handle t, int peer, uintptr_t stream) {
            Comm* c = p.get("recv");
            Buf b = buffer(t, "recv", "tensor");
            check_device(b, c, "recv", "tensor");
            recv(c, b.data, b.numel, b.dtype, peer, as_stream(stream));
          },
          "tensor"_a, "peer"_a, "stream"_a)
      .def(
          "all_to_all",
          [](PyComm& p, nb::handle send_t, nb::handle recv_t, uintptr_t stream) {
            // chunk k of the input goes to rank k; chunk k of the output comes from rank k
            const char* name = "all_to_all";
            Comm* c = p.get(name);
            Buf s = buffer(send_t, name, "input"), r = buffer(recv_t, name, "output");
            check_device(s, c, name, "input");
            check_device(r, c, name, "output");
            check_same_dtype(s, r, name);
            const size_t n = size_t(comm_size(c));
            if (s.numel != r.numel || s.numel % n)
              fail(BT_DIST_EINVAL,
                   "[all_to_all] input and output must have the same size, a "
                   "multiple of the world size " +
                       std::to_string(n) + "; got " + std::to_string(s.numel) + " and " +
                       std::to_string(r.numel));
            const size_t chunk = s.numel / n, es = dtype_size(s.dtype, name);
            auto* sp = static_cast<const char*>(s.data);
            auto* rp = static_cast<char*>(r.data);
            const int me = comm_rank(c);
            // own chunk: a device copy on the same stream
            memcpy_async(rp + me * chunk * es, sp + me * chunk * es, chunk * es, 2, comm_device(c),
                         as_stream(stream));
            group_start();
            try {
              for (size_t k = 0; k < n; ++k) {
                if (int(k) == me) continue;
                send(c, sp + k * chunk * es, chunk, s.dtype, int(k), as_stream(stream));
                recv(c, rp + k * chunk * es, chunk, s.dtype, int(k), as_stream(stream));
              }
            } catch (...) {
              group_end();
              throw;
            }
            group_end();
          },
          "input"_a, "output"_a, "stream"_a);

  m.def("group_start", &group_start);
  m.def("group_end", &group_end);

  // ---- streams and events ------------------------------------------------------------------
  m.def(
      "comm_stream", [](int device) { return reinterpret_cast<uintptr_t>(comm_stream(device)); },
      "device"_a, "The device's communication stream (cudaStream_t as an int).");
  m.def(
      "event_record",
      [](int device, uintptr_t stream) { return event_record(device, as_stream(stream)); },
      "device"_a, "stream"_a, "An event from the pool, recorded on `stream`.");
  m.def(
      "stream_wait_event",
      [](uintptr_t stream, uintptr_t event) { stream_wait_event(as_stream(stream), event); },
      "stream"_a, "event"_a);
  m.def("event_query", &event_query, "event"_a);
  m.def(
      "event_synchronize",
      [](uintptr_t e) {
        nb::gil_scoped_release release;
        event_synchronize(e);
      },
      "event"_a);
  m.def("event_release", &event_release, "event"_a);
  m.def(
      "stream_synchronize",
      [](uintptr_t s) {
        nb::gil_scoped_release release;
        stream_synchronize(as_stream(s));
      },
      "stream"_a);
  m.def("stream_capturing", [](uintptr_t s) { return stream_capturing(as_stream(s)); }, "stream"_a);

  // ---- host memory -------------------------------------------------------------------------
  m.def(
      "host_view",
      [](nb::handle t) {
        Buf b = buffer(t, "host_view", "tensor");
        if (b.device >= 0)
          fail(BT_DIST_EINVAL, "[host_view] tensor is on cuda:" + std::to_string(b.device));
        return byte_array(b.data, b.nbytes(), t);  // the tensor object keeps the memory alive
      },
      "tensor"_a, "The bytes of a contiguous CPU tensor as a numpy uint8 array (shared memory).");
  m.def(
      "pinned_empty",
      [](size_t nbytes) {
        void* p = nullptr;
        if (nbytes && g_alloc->malloc(BT_ALLOC_HOST_PINNED, nbytes, nullptr, &p) != BT_ALLOC_OK)
          fail(BT_DIST_ECUDA, std::string("[stage] pinned host memory: ") + g_alloc->last_error());
        nb::capsule owner(p, [](void* q) noexcept {
          if (q) g_alloc->free(q);
        });
        return byte_array(p, nbytes, owner);
      },
      "nbytes"_a, "Pinned host memory from blutrain.alloc as a numpy uint8 array.");
  m.def(
      "record_host_stream",
      [](nb::ndarray<uint8_t, nb::ndim<1>> a, uintptr_t stream) {
        // pinned blocks are not reused before `stream`'s work at free time has finished
        if (a.size()) g_alloc->record_stream(a.data(), as_stream(stream));
      },
      "array"_a, "stream"_a);
  m.def(
      "copy_d2h",
      [](nb::handle t, nb::ndarray<uint8_t, nb::ndim<1>> host, uintptr_t stream) {
        Buf b = buffer(t, "stage", "tensor");
        if (b.device < 0) fail(BT_DIST_EINVAL, "[stage] tensor is not on a CUDA device");
        if (host.size() < b.nbytes()) fail(BT_DIST_EINVAL, "[stage] host buffer too small");
        memcpy_async(host.data(), b.data, b.nbytes(), 0, b.device, as_stream(stream));
      },
      "tensor"_a, "host"_a, "stream"_a);
  m.def(
      "copy_h2d",
      [](nb::ndarray<uint8_t, nb::ndim<1>> host, nb::handle t, uintptr_t stream) {
        Buf b = buffer(t, "stage", "tensor");
        if (b.device < 0) fail(BT_DIST_EINVAL, "[stage] tensor is not on a CUDA device");
        if (host.size() < b.nbytes()) fail(BT_DIST_EINVAL, "[stage] host buffer too small");
        memcpy_async(b.data, host.data(), b.nbytes(), 1, b.device, as_stream(stream));
      },
      "host"_a, "tensor"_a, "stream"_a);

  m.def(
      "bump_version",
      [](nb::handle t) {
        void* h = nullptr;
        if (g_tensor->from_pyobject(t.ptr(), &h) == BT_TENSOR_OK) g_tensor->bump_version(h);
      },
      "tensor"_a, "Tells autograd the tensor's memory was written (saved copies are stale).");
  m.def(
      "copy_d2d",
      [](nb::handle src, nb::handle dst, uintptr_t stream) {
        Buf s = buffer(src, "copy", "input"), d = buffer(dst, "copy", "output");
        if (s.device < 0 || s.device != d.device || s.nbytes() != d.nbytes())
          fail(BT_DIST_EINVAL, "[copy] input and output must be on one CUDA device, same size");
        memcpy_async(d.data, s.data, s.nbytes(), 2, s.device, as_stream(stream));
      },
      "input"_a, "output"_a, "stream"_a, "output's bytes = input's, on `stream` (CUDA).");

  // ---- kernels -------------------------------------------------------------------------------
  m.def(
      "divide_",
      [](nb::handle t, int divisor, uintptr_t stream) {
        Buf b = buffer(t, "divide", "tensor");
        if (b.device < 0) fail(BT_DIST_EINVAL, "[divide] tensor is not on a CUDA device");
        divide(b.data, b.numel, b.dtype, divisor, b.device, as_stream(stream));
      },
      "tensor"_a, "divisor"_a, "stream"_a, "tensor /= divisor, rounded once (CUDA).");
  m.def(
      "cast_",
      [](nb::handle src, nb::handle dst, int divisor, uintptr_t stream) {
        Buf s = buffer(src, "cast", "input"), d = buffer(dst, "cast", "output");
        if (s.device < 0 || s.device != d.device)
          fail(BT_DIST_EINVAL, "[cast] input and output must be on one CUDA device");
        if (s.numel != d.numel) fail(BT_DIST_EINVAL, "[cast] input and output sizes differ");
        cast(s.data, s.dtype, d.data, d.dtype, s.numel, divisor, s.device, as_stream(stream));
      },
      "input"_a, "output"_a, "divisor"_a, "stream"_a, "output = input (cast) / divisor (CUDA).");
  m.def(
      "ordered_sum_",
      [](nb::handle src, int nchunks, nb::handle dst, int divisor, uintptr_t stream) {
        Buf s = buffer(src, "ordered_sum", "input"), d = buffer(dst, "ordered_sum", "output");
        if (s.device < 0 || s.device != d.device)
          fail(BT_DIST_EINVAL, "[ordered_sum] input and output must be on one CUDA device");
        check_same_dtype(s, d, "ordered_sum");
        if (nchunks < 1 || s.numel != d.numel * size_t(nchunks))
          fail(BT_DIST_EINVAL, "[ordered_sum] input must hold nchunks x output's elements");
        ordered_sum(s.data, nchunks, d.numel, d.data, d.dtype, divisor, d.device,
                    as_stream(stream));
      },
      "input"_a, "nchunks"_a, "output"_a, "divisor"_a, "stream"_a,
      "output = the fixed-order tree sum of input's nchunks chunks, / divisor (CUDA).");
}
