// cuda/graph.h: CUDA graphs (capture a whole training step on blutrain's current stream, replay it)
// and CUDA events (timing, waits), for python/blutrain/tensor/cuda.py.
//
// Note [graph capture]: CudaGraph::capture_begin starts cudaStreamBeginCapture (thread-local
// mode) on the device's current stream (cuda/runtime.h, Note [streams]).  Every op then records
// its kernels into the graph instead of running them; replay() launches the instantiated graph on
// the current stream.  Memory: the Python side brackets the capture with blutrain-alloc's
// begin_graph_pool / end_graph_pool, so every allocation made on the stream during capture comes
// from a private pool that nothing else reuses while the graph lives (the addresses are baked into
// the graph); reset() destroys the graph and the Python side releases the pool.  Host syncs during
// capture raise (backend.cpp checks cuda::capturing in copy_bytes and synchronize).
//
// Note [memset nodes]: libraries zero small scratch words with cudaMemsetAsync before their
// kernels (cuBLASLt before each persistent GEMM: GPT-2's bf16 step captures 108).  In a replay
// a memset node costs ~4 us of idle GPU around it (0.45 ms a step, session 28's trace), where a
// kernel node follows a kernel node with next to none.  capture_end therefore replaces every
// 1-D or 2-D memset node by a kernel node that writes the same bytes, with the same
// dependencies (memsets_as_kernels, on by default; BLUTRAIN_GRAPH_MEMSETS=keep turns the default
// off).  Stream order is kept: the fill runs where the memset ran.
//
// In a build without CUDA the same symbols exist (inline, below) and raise clear errors.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "../tensor.h"

namespace bt::cuda {

class CudaGraph {
 public:
  CudaGraph() = default;
  ~CudaGraph();
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;

  // Begins capturing the current stream of `device` (throws if this graph already holds one).
  // memsets_as_kernels: whether capture_end turns memset nodes into fill kernels (Note
  // [memset nodes]).
  void capture_begin(int device, bool memsets_as_kernels = true);
  // Ends the capture and instantiates the graph; throws (and discards it) if the capture was
  // invalidated by an operation not allowed while capturing.
  void capture_end();
  // Ends a capture after an error without throwing; the graph is discarded.
  void capture_abort() noexcept;
  // Launches the graph on the current stream of its device (asynchronous, like any op).
  void replay();
  // Destroys the graph (a no-op when empty); ends a capture still under way.
  void reset() noexcept;

  bool capturing() const { return capturing_; }
  bool captured() const { return exec_ != nullptr; }
  int device() const { return device_; }
  int64_t num_nodes() const;
  // Memset nodes capture_end replaced by fill kernels (Note [memset nodes]).
  int64_t memsets_replaced() const { return memsets_replaced_; }
  // Writes a Graphviz description of the captured graph (cudaGraphDebugDotPrint).
  void debug_dump(const std::string& path) const;

 private:
  void* graph_ = nullptr;           // cudaGraph_t
  void* exec_ = nullptr;            // cudaGraphExec_t
  void* capture_stream_ = nullptr;  // cudaStream_t being captured
  int device_ = -1;
  bool capturing_ = false;
  bool memsets_as_kernels_ = true;
  int64_t memsets_replaced_ = 0;
};

// Events, as integer handles (cudaEvent_t).  record() enqueues on the device's current stream.
uintptr_t event_create(int device, bool enable_timing);
void event_destroy(uintptr_t event) noexcept;
void event_record(uintptr_t event, int device);
void event_synchronize(uintptr_t event);
bool event_query(uintptr_t event);
// Milliseconds from `start` to `end` (both recorded with timing enabled, and complete).
float event_elapsed_ms(uintptr_t start, uintptr_t end);

// Streams of bt.cuda.Stream, as integer handles (cudaStream_t): non-blocking, with a priority
// (lower is more urgent; stream_priority_range gives the device's [greatest, least]).
uintptr_t stream_create(int device, int priority);
void stream_destroy(uintptr_t stream) noexcept;
void stream_synchronize(uintptr_t stream);
bool stream_query(uintptr_t stream);
// `stream` waits (on the device, not the host) until `event`'s recorded work is done.
void stream_wait_event(uintptr_t stream, uintptr_t event);
// Records `event` on `stream` (rather than on the device's current stream).
void event_record_on(uintptr_t event, uintptr_t stream);
std::pair<int, int> stream_priority_range(int device);

std::string device_name(int device);
// Whether the current stream of `device` is being captured (false without CUDA).
bool stream_capturing(int device);

#ifndef BT_WITH_CUDA
// ---- a build without CUDA: every entry raises ------------------------------------------------
[[noreturn]] inline void no_cuda_graph(const char* op) {
  throw RuntimeError(std::string("[") + op +
                     "] blutrain-tensor was built without CUDA (rebuild with BLUTRAIN_CUDA=ON)");
}
inline CudaGraph::~CudaGraph() = default;
inline void CudaGraph::capture_begin(int, bool) { no_cuda_graph("CUDAGraph.capture_begin"); }
inline void CudaGraph::capture_end() { no_cuda_graph("CUDAGraph.capture_end"); }
inline void CudaGraph::capture_abort() noexcept {}
inline void CudaGraph::replay() { no_cuda_graph("CUDAGraph.replay"); }
inline void CudaGraph::reset() noexcept {}
inline int64_t CudaGraph::num_nodes() const { return 0; }
inline void CudaGraph::debug_dump(const std::string&) const {
  no_cuda_graph("CUDAGraph.debug_dump");
}
inline uintptr_t event_create(int, bool) { no_cuda_graph("Event"); }
inline void event_destroy(uintptr_t) noexcept {}
inline void event_record(uintptr_t, int) { no_cuda_graph("Event.record"); }
inline void event_synchronize(uintptr_t) { no_cuda_graph("Event.synchronize"); }
inline bool event_query(uintptr_t) { no_cuda_graph("Event.query"); }
inline float event_elapsed_ms(uintptr_t, uintptr_t) { no_cuda_graph("Event.elapsed_time"); }
inline std::string device_name(int) { no_cuda_graph("get_device_name"); }
inline uintptr_t stream_create(int, int) { no_cuda_graph("Stream"); }
inline void stream_destroy(uintptr_t) noexcept {}
inline void stream_synchronize(uintptr_t) { no_cuda_graph("Stream.synchronize"); }
inline bool stream_query(uintptr_t) { no_cuda_graph("Stream.query"); }
inline void stream_wait_event(uintptr_t, uintptr_t) { no_cuda_graph("Stream.wait_event"); }
inline void event_record_on(uintptr_t, uintptr_t) { no_cuda_graph("Event.record"); }
inline std::pair<int, int> stream_priority_range(int) { no_cuda_graph("Stream"); }
inline bool stream_capturing(int) { return false; }
#endif

}  // namespace bt::cuda
