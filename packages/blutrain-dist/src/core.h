// core.h: blutrain-dist's C++ core as the C ABI (c_api.cpp) and the Python module
// (python/init_dist.cpp) see it: errors, dtypes, NCCL communicators and collectives, the
// communication stream and events, staging copies and the few kernels a reduction needs.
//
// Policy.  CPU tensors never reach this layer: blutrain.dist moves them with MPI (mpi4py) in
// Python, so no MPI ABI is compiled in and one build serves MPICH and Open MPI alike.  CUDA
// tensors go through NCCL (opened with dlopen: nccl_lib.cpp) on one communication stream per
// device, ordered with the caller's compute stream by events (streams.cpp, Note [stream order]);
// or, for the MPI backend, through pinned host memory (copy_d2h / copy_h2d).
//
// Every failing NCCL or CUDA call throws Error with a message that starts with the operation and
// names the call, file and line.  A build without CUDA compiles no_cuda.cpp instead of the CUDA
// sources: every entry below raises "[op] blutrain-dist was built without CUDA".
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "blutrain/dist.h"

namespace bt::dist {

struct Error : std::runtime_error {
  Error(int c, const std::string& msg) : std::runtime_error(msg), code(c) {}
  int code;  // a bt_dist_status
};
[[noreturn]] void fail(int code, const std::string& msg);

// Element size of a bt_tensor_dtype; throws BT_DIST_EINVAL naming op for an unknown code.
size_t dtype_size(int dtype, const char* op);
const char* dtype_name(int dtype);
bool dtype_is_floating(int dtype);
const char* op_name(int op);

bool built_with_cuda();
bool built_with_nccl();

// ---- NCCL (nccl_lib.cpp, comm.cpp) ---------------------------------------------------------
// Files tried, in order, before the soname "libnccl.so.2": blutrain.dist passes the
// nvidia-nccl-cu13 wheel's library; $BLUTRAIN_NCCL_LIBRARY comes first when set.
void nccl_set_candidates(const std::vector<std::string>& paths);
int nccl_version();               // loads libnccl; throws BT_DIST_ENCCL with every path tried
std::string nccl_library_path();  // the file that was opened ("" before the first load)
void nccl_unique_id(uint8_t* out);

struct Comm;  // = bt_dist_comm
Comm* comm_init(const uint8_t* unique_id, int nranks, int rank, int device);
void comm_destroy(Comm* c);
void comm_abort(Comm* c);
int comm_async_error(Comm* c);  // 0: healthy
int comm_rank(const Comm* c);
int comm_size(const Comm* c);
int comm_device(const Comm* c);

void all_reduce(Comm* c, const void* send, void* recv, size_t count, int dtype, int op,
                void* stream);
void reduce_scatter(Comm* c, const void* send, void* recv, size_t recv_count, int dtype, int op,
                    void* stream);
void all_gather(Comm* c, const void* send, void* recv, size_t send_count, int dtype, void* stream);
void broadcast(Comm* c, const void* send, void* recv, size_t count, int dtype, int root,
               void* stream);
void send(Comm* c, const void* buf, size_t count, int dtype, int peer, void* stream);
void recv(Comm* c, void* buf, size_t count, int dtype, int peer, void* stream);
void group_start();
void group_end();

// ---- streams and events (cuda/streams.cpp) --------------------------------------------------
int device_count();
// The device's PCI bus id ("0000:1B:00.0"): two processes see the same GPU iff these match,
// whatever CUDA_VISIBLE_DEVICES renumbered.
std::string device_pci_bus_id(int device);
// The device's communication stream: created on first use, non-blocking, highest priority.
void* comm_stream(int device);
// An event (from a per-device pool, timing off) recorded on `stream` now.
uintptr_t event_record(int device, void* stream);
void stream_wait_event(void* stream, uintptr_t event);
bool event_query(uintptr_t event);
void event_synchronize(uintptr_t event);
void event_release(uintptr_t event);  // back to the pool; the event must be complete or unused
void stream_synchronize(void* stream);
bool stream_capturing(void* stream);
// Copies between device memory and pinned host memory on `stream` (kind: 0 = D2H, 1 = H2D,
// 2 = device to device).
void memcpy_async(void* dst, const void* src, size_t nbytes, int kind, int device, void* stream);

// ---- kernels (cuda/kernels.cu), all on `stream` ---------------------------------------------
// buf[i] = buf[i] / divisor, rounded once in the buffer's (floating) dtype.
void divide(void* buf, size_t n, int dtype, int divisor, int device, void* stream);
// dst[i] = src[i] (cast), divided by divisor first when divisor > 1 (rounded once).
void cast(const void* src, int src_dtype, void* dst, int dst_dtype, size_t n, int divisor,
          int device, void* stream);
// dst[i] = the fixed-order sum of src[k * chunk + i] over k < nchunks (Note [ordered sum] in
// kernels.cu: a left-leaning binary tree, the shape gradient accumulation builds), then / divisor.
void ordered_sum(const void* src, int nchunks, size_t chunk, void* dst, int dtype, int divisor,
                 int device, void* stream);

// The C ABI table (c_api.cpp), exported by the Python module as the `_C_API` capsule.
const bt_dist_api* api_table();

}  // namespace bt::dist
