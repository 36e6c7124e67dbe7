// blutrain.alloc._alloc: Python bindings of the C ABI, and the `_C_API`
// capsule through which other BluTrain packages reach the same allocator.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <vector>

#include "bench_replay.h"
#include "blutrain/alloc.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

struct OutOfMemory {};

nb::object g_oom_type;

// Raises the Python exception that fits a status code.
void check(int rc) {
  if (rc == BT_ALLOC_OK) return;
  const char* msg = bt_alloc_last_error();
  switch (rc) {
    case BT_ALLOC_ENOMEM:
      PyErr_SetString(g_oom_type.ptr(), msg);
      throw nb::python_error();
    case BT_ALLOC_EINVAL:
    case BT_ALLOC_ENOTOWN:
      throw nb::value_error(msg);
    default:
      throw std::runtime_error(msg);
  }
}

size_t checked_size(const char* op, int64_t size) {
  if (size <= 0)
    throw nb::value_error(
        ("[" + std::string(op) + "] size must be positive, got " + std::to_string(size) + " bytes")
            .c_str());
  return size_t(size);
}

void* as_ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

nb::dict stats_dict(int device) {
  bt_alloc_stats s{};
  check(bt_alloc_get_stats(device, &s));
  nb::dict d;
#define BT_FIELD(name) d[#name] = s.name
  BT_FIELD(allocated_bytes);
  BT_FIELD(allocated_bytes_peak);
  BT_FIELD(requested_bytes);
  BT_FIELD(requested_bytes_peak);
  BT_FIELD(reserved_bytes);
  BT_FIELD(reserved_bytes_peak);
  BT_FIELD(active_blocks);
  BT_FIELD(segments);
  BT_FIELD(alloc_count);
  BT_FIELD(free_count);
  BT_FIELD(system_alloc_count);
  BT_FIELD(system_free_count);
  BT_FIELD(oom_count);
  BT_FIELD(cache_flushes);
  BT_FIELD(largest_free_block);
  BT_FIELD(inactive_split_bytes);
  BT_FIELD(limit_bytes);
#undef BT_FIELD
  return d;
}

nb::list snapshot_list(int device) {
  const bt_alloc_api* api = bt_alloc_get_api();
  size_t count = 0;
  check(api->snapshot(device, nullptr, 0, &count));
  std::vector<bt_alloc_block_info> blocks(count + 64);  // room for a concurrent change
  check(api->snapshot(device, blocks.data(), blocks.size(), &count));
  blocks.resize(std::min(count, blocks.size()));
  nb::list out;
  for (const auto& b : blocks) {
    nb::dict d;
    d["segment"] = b.segment_address;
    d["address"] = b.address;
    d["size"] = b.size;
    d["requested"] = b.requested;
    d["stream"] = b.stream;
    d["allocated"] = bool(b.allocated);
    d["pool"] = b.pool == 0 ? "small" : b.pool == 1 ? "large" : "graph:" + std::to_string(b.pool);
    d["expandable"] = bool(b.expandable);
    out.append(d);
  }
  return out;
}

}  // namespace

NB_MODULE(_alloc, m) {
  m.doc() = "Low-level bindings of blutrain-alloc's C ABI; use blutrain.alloc instead.";
  g_oom_type = nb::borrow(PyErr_NewExceptionWithDoc(
      "blutrain.alloc.OutOfMemoryError",
      "Raised when memory cannot be found even after the cache was released; the message holds "
      "the allocator's statistics.",
      PyExc_MemoryError, nullptr));
  m.attr("OutOfMemoryError") = g_oom_type;
  m.attr("HOST_PAGEABLE") = BT_ALLOC_HOST_PAGEABLE;
  m.attr("HOST_PINNED") = BT_ALLOC_HOST_PINNED;
  m.attr("ABI_VERSION") = BT_ALLOC_ABI_VERSION;
  m.attr("_C_API") = nb::steal(
      PyCapsule_New(const_cast<bt_alloc_api*>(bt_alloc_get_api()), BT_ALLOC_CAPSULE_NAME, nullptr));
  // Making the first pool reads BLUTRAIN_ALLOC_CONF: a bad setting fails this import, naming the
  // key (Note [BLUTRAIN_ALLOC_CONF] in src/c_api.cpp).
  {
    bt_alloc_stats s{};
    check(bt_alloc_get_stats(BT_ALLOC_HOST_PAGEABLE, &s));
  }

  m.def(
      "malloc",
      [](int64_t size, int device, uintptr_t stream) {
        void* p = nullptr;
        const size_t n = checked_size("malloc", size);
        int rc;
        {
          nb::gil_scoped_release nogil;
          rc = bt_alloc_malloc(device, n, as_ptr(stream), &p);
        }
        check(rc);
        return reinterpret_cast<uintptr_t>(p);
      },
      "size"_a, "device"_a = BT_ALLOC_HOST_PAGEABLE, "stream"_a = 0,
      "malloc(size: int, device: int = -1, stream: int = 0) -> int\n\n"
      "Allocate `size` bytes on `device` (CUDA index, -1 pageable host, -2 pinned host) for use "
      "on `stream` (a cudaStream_t as int; 0 = default stream). Returns the address.");
  m.def(
      "free", [](uintptr_t ptr) { check(bt_alloc_free(as_ptr(ptr))); }, "ptr"_a,
      "free(ptr: int) -> None\n\nReturn a block to the cache. Raises ValueError for a pointer "
      "this allocator does not own or already freed.");
  m.def(
      "record_stream",
      [](uintptr_t ptr, uintptr_t stream) {
        check(bt_alloc_record_stream(as_ptr(ptr), as_ptr(stream)));
      },
      "ptr"_a, "stream"_a,
      "record_stream(ptr: int, stream: int) -> None\n\nDeclare that `ptr` is used on `stream`: "
      "after free() it is reused only once that stream's work queued so far is done.");
  m.def("stats", &stats_dict, "device"_a = BT_ALLOC_HOST_PAGEABLE,
        "stats(device: int = -1) -> dict\n\nCounters and byte totals of one device's pool.");
  m.def(
      "reset_peak_stats", [](int device) { check(bt_alloc_reset_peak_stats(device)); },
      "device"_a = BT_ALLOC_HOST_PAGEABLE,
      "reset_peak_stats(device: int = -1) -> None\n\nSet the peaks to the current values.");
  m.def(
      "empty_cache", [](int device) { check(bt_alloc_empty_cache(device)); },
      "device"_a = BT_ALLOC_HOST_PAGEABLE,
      "empty_cache(device: int = -1) -> None\n\nReturn every wholly free cached segment to the "
      "system.");
  m.def(
      "set_memory_fraction",
      [](double fraction, int device) {
        check(bt_alloc_get_api()->set_memory_fraction(device, fraction));
      },
      "fraction"_a, "device"_a,
      "set_memory_fraction(fraction: float, device: int) -> None\n\nCap this process's reserved "
      "memory on `device` at `fraction` of its capacity.");
  m.def(
      "set_memory_limit",
      [](int64_t bytes, int device) {
        if (bytes < 0) throw nb::value_error("[set_memory_limit] bytes must be >= 0 (0 = no cap)");
        check(bt_alloc_get_api()->set_memory_limit(device, uint64_t(bytes)));
      },
      "bytes"_a, "device"_a,
      "set_memory_limit(bytes: int, device: int) -> None\n\nCap reserved memory at `bytes` "
      "(0 removes the cap).");
  m.def("snapshot", &snapshot_list, "device"_a = BT_ALLOC_HOST_PAGEABLE,
        "snapshot(device: int = -1) -> list[dict]\n\nEvery block of every segment, in address "
        "order.");
  m.def(
      "begin_graph_pool",
      [](int device, uintptr_t stream) {
        int32_t id = 0;
        check(bt_alloc_get_api()->begin_graph_pool(device, as_ptr(stream), &id));
        return id;
      },
      "device"_a, "stream"_a,
      "begin_graph_pool(device: int, stream: int) -> int\n\nRoute allocations on `stream` to a "
      "new private pool (before starting a CUDA graph capture). Returns the pool id.");
  m.def(
      "end_graph_pool",
      [](int device, uintptr_t stream) {
        check(bt_alloc_get_api()->end_graph_pool(device, as_ptr(stream)));
      },
      "device"_a, "stream"_a,
      "end_graph_pool(device: int, stream: int) -> None\n\nStop routing `stream` to its private "
      "pool (after the capture ended).");
  m.def(
      "release_graph_pool",
      [](int device, int32_t pool) { check(bt_alloc_get_api()->release_graph_pool(device, pool)); },
      "device"_a, "pool"_a,
      "release_graph_pool(device: int, pool: int) -> None\n\nThe graphs that used `pool` are "
      "gone: its memory may be returned and reused.");
  m.def(
      "set_option",
      [](const std::string& name, int64_t value) {
        check(bt_alloc_get_api()->set_option(name.c_str(), value));
      },
      "name"_a, "value"_a,
      "set_option(name: str, value: int) -> None\n\nSet an allocator option, e.g. "
      "('expandable_segments', 1).");
  m.def(
      "set_pool_option",
      [](int device, const std::string& name, int64_t value) {
        check(bt_alloc_get_api()->set_pool_option(device, name.c_str(), value));
      },
      "device"_a, "name"_a, "value"_a,
      "set_pool_option(device: int, name: str, value: int) -> None\n\nSet an option of one "
      "pool, e.g. ('expandable_segments', 1).");
  m.def(
      "device_count",
      [] {
        int n = 0;
        check(bt_alloc_get_api()->device_count(&n));
        return n;
      },
      "device_count() -> int\n\nNumber of visible CUDA devices (0 without CUDA).");
  m.def(
      "library_path", [] { return std::string(bt_alloc_library_path()); },
      "library_path() -> str\n\nPath of the loaded libblutrain_alloc shared library.");
  m.def(
      "replay_trace",
      [](nb::ndarray<const int64_t, nb::shape<-1, 3>, nb::c_contig, nb::device::cpu> trace,
         const std::string& backend, int device, uintptr_t stream, int repeats) {
        const int code = backend == "blutrain"          ? 0
                         : backend == "cudaMalloc"      ? 1
                         : backend == "cudaMallocAsync" ? 2
                         : backend == "malloc"          ? 3
                                                        : -1;
        if (code < 0)
          throw nb::value_error(("[replay_trace] unknown backend '" + backend +
                                 "'; use blutrain, cudaMalloc, cudaMallocAsync or malloc")
                                    .c_str());
        bt_alloc_replay_result r{};
        int rc;
        {
          nb::gil_scoped_release nogil;
          rc = bt_alloc_bench_replay(trace.data(), trace.shape(0), code, device, as_ptr(stream),
                                     repeats, &r);
        }
        if (rc == BT_ALLOC_ENOCUDA)
          throw std::runtime_error("[replay_trace] backend '" + backend +
                                   "' needs a CUDA build of blutrain-alloc");
        check(rc);
        nb::dict d;
        d["total_ns"] = r.total_ns;
        d["ops"] = r.ops;
        d["peak_live_bytes"] = r.peak_live;
        return d;
      },
      "trace"_a, "backend"_a, "device"_a, "stream"_a = 0, "repeats"_a = 5,
      "replay_trace(trace, backend, device, stream=0, repeats=5) -> dict\n\nTime an allocation "
      "trace (rows of op, id, size; op 0 malloc, 1 free) through one allocator, in C++.");
}
