// cuda/graph.cpp: CUDA graph capture / replay and CUDA events over the runtime (graph.h; see
// Note [graph capture] there).
#include "graph.h"

#include <cuda_runtime.h>

#include "runtime.h"

namespace bt::cuda {

namespace {
cudaGraph_t as_graph(void* p) { return static_cast<cudaGraph_t>(p); }
cudaGraphExec_t as_exec(void* p) { return static_cast<cudaGraphExec_t>(p); }
cudaEvent_t as_event(uintptr_t h) { return reinterpret_cast<cudaEvent_t>(h); }

void check_event(uintptr_t h, const char* op) {
  if (!h) throw RuntimeError(std::string("[") + op + "] the event was never created");
}
}  // namespace

CudaGraph::~CudaGraph() { reset(); }

void CudaGraph::capture_begin(int device) {
  const char* op = "CUDAGraph.capture_begin";
  if (capturing_ || exec_) {
    throw RuntimeError(std::string("[") + op +
                       "] this graph already holds a capture; call reset() before capturing again");
  }
  cudaStream_t s = stream(device, op);
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  BT_CUDA_CHECK(op, cudaStreamIsCapturing(s, &st));
  if (st != cudaStreamCaptureStatusNone) {
    throw RuntimeError(std::string("[") + op + "] the current stream of cuda:" +
                       std::to_string(device) + " is already being captured (nested capture)");
  }
  // Thread-local: another thread's unrelated CUDA calls do not invalidate this capture.
  BT_CUDA_CHECK(op, cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  capture_stream_ = s;
  device_ = device;
  capturing_ = true;
}

void CudaGraph::capture_end() {
  const char* op = "CUDAGraph.capture_end";
  if (!capturing_) throw RuntimeError(std::string("[") + op + "] no capture is under way");
  set_device(device_, op);
  cudaGraph_t g = nullptr;
  const cudaError_t err = cudaStreamEndCapture(static_cast<cudaStream_t>(capture_stream_), &g);
  capturing_ = false;
  capture_stream_ = nullptr;
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear it: the stream is usable again once the capture has ended
    if (g) cudaGraphDestroy(g);
    throw RuntimeError(
        std::string("[") + op + "] the capture was invalidated (" + cudaGetErrorName(err) + ": " +
        cudaGetErrorString(err) +
        "): an operation not allowed while capturing ran (a host synchronisation, a legacy "
        "default-stream call, or work joined from another stream); warm the step up before "
        "capturing and keep host reads out of it");
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t ierr = cudaGraphInstantiate(&exec, g, 0);
  if (ierr != cudaSuccess) {
    cudaGetLastError();
    cudaGraphDestroy(g);
    throw_cuda_error(op, "cudaGraphInstantiate(&exec, graph, 0)", ierr, __FILE__, __LINE__);
  }
  graph_ = g;
  exec_ = exec;
}

void CudaGraph::capture_abort() noexcept {
  if (!capturing_) return;
  cudaGraph_t g = nullptr;
  cudaSetDevice(device_);
  cudaStreamEndCapture(static_cast<cudaStream_t>(capture_stream_), &g);
  if (g) cudaGraphDestroy(g);
  cudaGetLastError();
  capturing_ = false;
  capture_stream_ = nullptr;
}

void CudaGraph::replay() {
  const char* op = "CUDAGraph.replay";
  if (!exec_) {
    throw RuntimeError(std::string("[") + op +
                       "] nothing captured: capture a step with `with bt.cuda.graph(g): ...`");
  }
  BT_CUDA_CHECK(op, cudaGraphLaunch(as_exec(exec_), stream(device_, op)));
}

void CudaGraph::reset() noexcept {
  capture_abort();
  if (exec_) cudaGraphExecDestroy(as_exec(exec_));
  if (graph_) cudaGraphDestroy(as_graph(graph_));
  exec_ = nullptr;
  graph_ = nullptr;
}

int64_t CudaGraph::num_nodes() const {
  if (!graph_) return 0;
  size_t n = 0;
  BT_CUDA_CHECK("CUDAGraph.num_nodes", cudaGraphGetNodes(as_graph(graph_), nullptr, &n));
  return static_cast<int64_t>(n);
}

void CudaGraph::debug_dump(const std::string& path) const {
  if (!graph_) throw RuntimeError("[CUDAGraph.debug_dump] nothing captured");
  BT_CUDA_CHECK("CUDAGraph.debug_dump", cudaGraphDebugDotPrint(as_graph(graph_), path.c_str(),
                                                               cudaGraphDebugDotFlagsVerbose));
}

uintptr_t event_create(int device, bool enable_timing) {
  set_device(device, "Event");
  cudaEvent_t e = nullptr;
  BT_CUDA_CHECK("Event", cudaEventCreateWithFlags(
                             &e, enable_timing ? cudaEventDefault : cudaEventDisableTiming));
  return reinterpret_cast<uintptr_t>(e);
}

void event_destroy(uintptr_t event) noexcept {
  if (event) cudaEventDestroy(as_event(event));
}

void event_record(uintptr_t event, int device) {
  check_event(event, "Event.record");
  BT_CUDA_CHECK("Event.record", cudaEventRecord(as_event(event), stream(device, "Event.record")));
}

void event_synchronize(uintptr_t event) {
  check_event(event, "Event.synchronize");
  BT_CUDA_CHECK("Event.synchronize", cudaEventSynchronize(as_event(event)));
}

bool event_query(uintptr_t event) {
  check_event(event, "Event.query");
  const cudaError_t err = cudaEventQuery(as_event(event));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  BT_CUDA_CHECK("Event.query", err);
  return true;
}

float event_elapsed_ms(uintptr_t start, uintptr_t end) {
  check_event(start, "Event.elapsed_time");
  check_event(end, "Event.elapsed_time");
  float ms = 0.f;
  BT_CUDA_CHECK("Event.elapsed_time", cudaEventElapsedTime(&ms, as_event(start), as_event(end)));
  return ms;
}

std::string device_name(int device) {
  cudaDeviceProp p{};
  BT_CUDA_CHECK("get_device_name", cudaGetDeviceProperties(&p, device));
  return p.name;
}

bool stream_capturing(int device) { return capturing(device); }

}  // namespace bt::cuda
