// python/init_cuda.cpp: the CUDA runtime surface of blutrain.tensor (streams, synchronisation,
// determinism).  In a build without CUDA these raise or return the CPU answers.
#include <nanobind/stl/string.h>

#include "../backend.h"
#include "../cuda/graph.h"
#include "init.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace bt::python {

void init_cuda(nb::module_& m) {
  m.def(
      "_with_scratch",
      [](const Tensor& region, nb::callable fn) {
        ScratchScope scope(region);
        return fn();
      },
      "region"_a, "fn"_a,
      "Runs fn() with ops' internal temporaries carved from region, a contiguous uint8 tensor "
      "(Note [caller-given scratch]); returns what fn returns.");
  m.def(
      "_index_add_scratch_bytes",
      [](const std::string& device, int64_t index_numel, int64_t dim_size, int64_t cols,
         const std::string& dtype) {
        return backend::index_add_scratch_bytes(Device::parse(device, "_index_add_scratch_bytes"),
                                                index_numel, dim_size, cols,
                                                dtype_from_name(dtype));
      },
      "device"_a, "index_numel"_a, "dim_size"_a, "cols"_a, "dtype"_a,
      "Bytes of scratch index_add takes on device (0 on the CPU): Note [caller-given scratch].");
  m.def(
      "_cuda_synchronize",
      [](int device) {
        nb::gil_scoped_release release;
        backend::synchronize(Device{Device::CUDA, device});
      },
      "device"_a = 0, "Waits for all work queued on the device's current stream.");
  m.def(
      "_cuda_current_stream",
      [](int device) {
        return reinterpret_cast<uintptr_t>(backend::current_stream(Device{Device::CUDA, device}));
      },
      "device"_a = 0, "The device's current stream as an integer cudaStream_t handle.");
  m.def(
      "_cuda_set_stream",
      [](int device, uintptr_t handle) {
        backend::set_current_stream(Device{Device::CUDA, device}, reinterpret_cast<void*>(handle));
      },
      "device"_a, "stream"_a,
      "Makes `stream` (a cudaStream_t handle; 0 restores blutrain's own) the device's current "
      "stream.");
  m.def("use_deterministic_algorithms", &set_deterministic_algorithms, "mode"_a,
        "Bitwise-reproducible kernels on one device (no float atomics, pinned GEMM algorithms).");
  m.def("are_deterministic_algorithms_enabled", &deterministic_algorithms,
        "Whether determinism mode is on.");

  // ---- graphs and events (cuda/graph.h); python/blutrain/tensor/cuda.py wraps these ----------
  nb::class_<cuda::CudaGraph>(m, "_CUDAGraph",
                              "A CUDA graph of work captured on blutrain's current stream.")
      .def(nb::init<>())
      .def("capture_begin", &cuda::CudaGraph::capture_begin, "device"_a,
           "memsets_as_kernels"_a = true,
           "Begins capturing the device's current stream (thread-local mode); with "
           "memsets_as_kernels, capture_end turns memset nodes into fill kernels.")
      .def("capture_end", &cuda::CudaGraph::capture_end,
           "Ends the capture and instantiates the graph (raises if it was invalidated).")
      .def("capture_abort", &cuda::CudaGraph::capture_abort,
           "Ends a capture after an error, discarding the graph.")
      .def(
          "replay",
          [](cuda::CudaGraph& g) {
            nb::gil_scoped_release release;
            g.replay();
          },
          "Launches the graph on the current stream of its device.")
      .def("reset", &cuda::CudaGraph::reset, "Destroys the graph.")
      .def_prop_ro("capturing", &cuda::CudaGraph::capturing)
      .def_prop_ro("captured", &cuda::CudaGraph::captured)
      .def_prop_ro("device", &cuda::CudaGraph::device)
      .def("num_nodes", &cuda::CudaGraph::num_nodes, "Nodes of the captured graph.")
      .def_prop_ro("memsets_replaced", &cuda::CudaGraph::memsets_replaced,
                   "Memset nodes capture_end replaced by fill kernels.")
      .def("debug_dump", &cuda::CudaGraph::debug_dump, "path"_a,
           "Writes the graph as Graphviz text.");
  m.def("_cuda_event_create", &cuda::event_create, "device"_a, "enable_timing"_a,
        "Creates a CUDA event on `device`; returns its handle.");
  m.def("_cuda_event_destroy", &cuda::event_destroy, "event"_a, "Destroys an event handle.");
  m.def("_cuda_event_record", &cuda::event_record, "event"_a, "device"_a,
        "Records the event on the device's current stream.");
  m.def(
      "_cuda_event_synchronize",
      [](uintptr_t e) {
        nb::gil_scoped_release release;
        cuda::event_synchronize(e);
      },
      "event"_a, "Waits until the event's work is done.");
  m.def("_cuda_event_query", &cuda::event_query, "event"_a,
        "Whether the event's work is done (never blocks).");
  m.def("_cuda_event_elapsed_time", &cuda::event_elapsed_ms, "start"_a, "end"_a,
        "Milliseconds between two completed timing events.");
  m.def("_cuda_device_name", &cuda::device_name, "device"_a, "The device's name.");
  m.def("_cuda_stream_create", &cuda::stream_create, "device"_a, "priority"_a,
        "Creates a non-blocking stream on `device`; returns its handle.");
  m.def("_cuda_stream_destroy", &cuda::stream_destroy, "stream"_a, "Destroys a stream handle.");
  m.def(
      "_cuda_stream_synchronize",
      [](uintptr_t s) {
        nb::gil_scoped_release release;
        cuda::stream_synchronize(s);
      },
      "stream"_a, "Waits until the stream's queued work is done.");
  m.def("_cuda_stream_query", &cuda::stream_query, "stream"_a,
        "Whether the stream's queued work is done (never blocks).");
  m.def("_cuda_stream_wait_event", &cuda::stream_wait_event, "stream"_a, "event"_a,
        "The stream waits (on the device) for the event's work.");
  m.def("_cuda_event_record_on", &cuda::event_record_on, "event"_a, "stream"_a,
        "Records the event on a given stream.");
  m.def(
      "_cuda_stream_priority_range",
      [](int device) {
        auto [g, l] = cuda::stream_priority_range(device);
        return nb::make_tuple(g, l);
      },
      "device"_a, "(greatest, least) stream priority of the device (lower is more urgent).");
  m.def("_cuda_is_capturing", &cuda::stream_capturing, "device"_a = 0,
        "Whether the device's current stream is being captured into a CUDA graph.");
}

}  // namespace bt::python
