// cuda/graph.cu: CUDA graph capture / replay and CUDA events over the runtime (graph.h; see
// Note [graph capture] and Note [memset nodes] there).
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "graph.h"
#include "runtime.h"

namespace bt::cuda {

namespace {
cudaGraph_t as_graph(void* p) { return static_cast<cudaGraph_t>(p); }
cudaGraphExec_t as_exec(void* p) { return static_cast<cudaGraphExec_t>(p); }
cudaEvent_t as_event(uintptr_t h) { return reinterpret_cast<cudaEvent_t>(h); }

void check_event(uintptr_t h, const char* op) {
  if (!h) throw RuntimeError(std::string("[") + op + "] the event was never created");
}

// ================================ kernels ======================================================

// A memset node's work: `height` rows of `width` elements of `elem_bytes` (1, 2 or 4) bytes,
// `pitch` bytes apart, each set to the low bytes of `value` (cudaMemsetParams).
__global__ void memset_fill(unsigned char* __restrict__ dst, size_t pitch, unsigned value,
                            unsigned elem_bytes, size_t width, size_t height) {
  const size_t n = width * height;
  for (size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    unsigned char* p = dst + (i / width) * pitch + (i % width) * elem_bytes;
    if (elem_bytes == 4) {
      *reinterpret_cast<unsigned*>(p) = value;
    } else if (elem_bytes == 2) {
      *reinterpret_cast<unsigned short*>(p) = static_cast<unsigned short>(value);
    } else {
      *p = static_cast<unsigned char>(value);
    }
  }
}

// ================================ graph rewriting ==============================================

constexpr unsigned kFillThreads = 256;
constexpr unsigned kFillMaxBlocks = 1024;  // grid-stride beyond (large memsets are rare here)

// CUDA 13 gives every edge its data (port / type); CUDA 12 the plain node lists.
#if CUDART_VERSION >= 13000
using EdgeData = std::vector<cudaGraphEdgeData>;
cudaError_t node_deps(cudaGraphNode_t n, cudaGraphNode_t* out, EdgeData* ed, size_t* count) {
  return cudaGraphNodeGetDependencies(n, out, ed ? ed->data() : nullptr, count);
}
cudaError_t node_dependents(cudaGraphNode_t n, cudaGraphNode_t* out, EdgeData* ed, size_t* count) {
  return cudaGraphNodeGetDependentNodes(n, out, ed ? ed->data() : nullptr, count);
}
cudaError_t add_edges(cudaGraph_t g, const cudaGraphNode_t* from, const cudaGraphNode_t* to,
                      const EdgeData* ed, size_t count) {
  return cudaGraphAddDependencies(g, from, to, ed ? ed->data() : nullptr, count);
}
#else
using EdgeData = std::vector<char>;  // unused
cudaError_t node_deps(cudaGraphNode_t n, cudaGraphNode_t* out, EdgeData*, size_t* count) {
  return cudaGraphNodeGetDependencies(n, out, count);
}
cudaError_t node_dependents(cudaGraphNode_t n, cudaGraphNode_t* out, EdgeData*, size_t* count) {
  return cudaGraphNodeGetDependentNodes(n, out, count);
}
cudaError_t add_edges(cudaGraph_t g, const cudaGraphNode_t* from, const cudaGraphNode_t* to,
                      const EdgeData*, size_t count) {
  return cudaGraphAddDependencies(g, from, to, count);
}
#endif

// Replaces memset node `m` of `g` by a memset_fill kernel node with the same in- and out-edges
// (Note [memset nodes]); false (the node kept) for a memset it cannot express.
bool memset_to_kernel(cudaGraph_t g, cudaGraphNode_t m, const char* op) {
  cudaMemsetParams mp = {};
  BT_CUDA_CHECK(op, cudaGraphMemsetNodeGetParams(m, &mp));
  if (mp.elementSize != 1 && mp.elementSize != 2 && mp.elementSize != 4) return false;
  size_t n_in = 0, n_out = 0;
  BT_CUDA_CHECK(op, node_deps(m, nullptr, nullptr, &n_in));
  BT_CUDA_CHECK(op, node_dependents(m, nullptr, nullptr, &n_out));
  std::vector<cudaGraphNode_t> in(n_in), out(n_out);
  EdgeData in_ed(n_in), out_ed(n_out);
  BT_CUDA_CHECK(op, node_deps(m, in.data(), &in_ed, &n_in));
  BT_CUDA_CHECK(op, node_dependents(m, out.data(), &out_ed, &n_out));

  unsigned char* dst = static_cast<unsigned char*>(mp.dst);
  size_t pitch = mp.height > 1 ? mp.pitch : mp.width * mp.elementSize;
  unsigned value = mp.value, elem = mp.elementSize;
  size_t width = mp.width, height = mp.height;
  void* args[] = {&dst, &pitch, &value, &elem, &width, &height};
  const size_t n = width * height;
  cudaKernelNodeParams kp = {};
  kp.func = reinterpret_cast<void*>(memset_fill);
  kp.gridDim = dim3(static_cast<unsigned>(std::max<size_t>(
      1, std::min<size_t>(kFillMaxBlocks, (n + kFillThreads - 1) / kFillThreads))));
  kp.blockDim = dim3(kFillThreads);
  kp.kernelParams = args;  // copied into the node

  cudaGraphNode_t k = nullptr;
  // In-edges of a memset are plain (default) edges, as the kernel node's are.
  BT_CUDA_CHECK(op, cudaGraphAddKernelNode(&k, g, in.data(), n_in, &kp));
  BT_CUDA_CHECK(op, cudaGraphDestroyNode(m));  // and its edges
  if (n_out) {
    std::vector<cudaGraphNode_t> from(n_out, k);
    BT_CUDA_CHECK(op, add_edges(g, from.data(), out.data(), &out_ed, n_out));
  }
  return true;
}

int64_t memsets_to_kernels(cudaGraph_t g, const char* op) {
  size_t count = 0;
  BT_CUDA_CHECK(op, cudaGraphGetNodes(g, nullptr, &count));
  std::vector<cudaGraphNode_t> nodes(count);
  BT_CUDA_CHECK(op, cudaGraphGetNodes(g, nodes.data(), &count));
  int64_t replaced = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    BT_CUDA_CHECK(op, cudaGraphNodeGetType(node, &type));
    if (type == cudaGraphNodeTypeMemset && memset_to_kernel(g, node, op)) ++replaced;
  }
  return replaced;
}
}  // namespace

CudaGraph::~CudaGraph() { reset(); }

void CudaGraph::capture_begin(int device, bool memsets_as_kernels) {
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
  memsets_as_kernels_ = memsets_as_kernels;
  memsets_replaced_ = 0;
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
  if (memsets_as_kernels_) {
    try {
      memsets_replaced_ = memsets_to_kernels(g, op);
    } catch (...) {
      cudaGraphDestroy(g);
      throw;
    }
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

uintptr_t stream_create(int device, int priority) {
  set_device(device, "Stream");
  cudaStream_t s = nullptr;
  BT_CUDA_CHECK("Stream", cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, priority));
  return reinterpret_cast<uintptr_t>(s);
}

void stream_destroy(uintptr_t stream) noexcept {
  if (stream) cudaStreamDestroy(reinterpret_cast<cudaStream_t>(stream));
}

void stream_synchronize(uintptr_t stream) {
  BT_CUDA_CHECK("Stream.synchronize",
                cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)));
}

bool stream_query(uintptr_t stream) {
  const cudaError_t err = cudaStreamQuery(reinterpret_cast<cudaStream_t>(stream));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  BT_CUDA_CHECK("Stream.query", err);
  return true;
}

void stream_wait_event(uintptr_t stream, uintptr_t event) {
  check_event(event, "Stream.wait_event");
  BT_CUDA_CHECK("Stream.wait_event",
                cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), as_event(event), 0));
}

void event_record_on(uintptr_t event, uintptr_t stream) {
  check_event(event, "Event.record");
  BT_CUDA_CHECK("Event.record",
                cudaEventRecord(as_event(event), reinterpret_cast<cudaStream_t>(stream)));
}

std::pair<int, int> stream_priority_range(int device) {
  set_device(device, "Stream");
  int least = 0, greatest = 0;
  BT_CUDA_CHECK("Stream", cudaDeviceGetStreamPriorityRange(&least, &greatest));
  return {greatest, least};
}

std::string device_name(int device) {
  cudaDeviceProp p{};
  BT_CUDA_CHECK("get_device_name", cudaGetDeviceProperties(&p, device));
  return p.name;
}

bool stream_capturing(int device) { return capturing(device); }

}  // namespace bt::cuda
