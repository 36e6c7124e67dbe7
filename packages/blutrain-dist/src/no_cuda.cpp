// no_cuda.cpp: the CPU-only build's side of core.h.  blutrain.dist's CPU tensors go over MPI in
// Python and never come here; every CUDA or NCCL entry raises a clear error.
#include <string>

#include "core.h"

struct bt_dist_comm {};

namespace bt::dist {
namespace {
[[noreturn]] void no_cuda(const char* op) {
  fail(BT_DIST_ENOCUDA, std::string("[") + op +
                            "] blutrain-dist was built without CUDA (rebuild with "
                            "BLUTRAIN_CUDA=ON)");
}
}  // namespace

struct Comm : bt_dist_comm {};

bool built_with_cuda() { return false; }
bool built_with_nccl() { return false; }
void nccl_set_candidates(const std::vector<std::string>&) {}
int nccl_version() { no_cuda("nccl_version"); }
std::string nccl_library_path() { return ""; }
void nccl_unique_id(uint8_t*) { no_cuda("unique_id"); }
Comm* comm_init(const uint8_t*, int, int, int) { no_cuda("comm_init"); }
void comm_destroy(Comm*) {}
void comm_abort(Comm*) {}
int comm_async_error(Comm*) { no_cuda("comm_async_error"); }
int comm_rank(const Comm*) { return -1; }
int comm_size(const Comm*) { return 0; }
int comm_device(const Comm*) { return -1; }
void all_reduce(Comm*, const void*, void*, size_t, int, int, void*) { no_cuda("all_reduce"); }
void reduce_scatter(Comm*, const void*, void*, size_t, int, int, void*) {
  no_cuda("reduce_scatter");
}
void all_gather(Comm*, const void*, void*, size_t, int, void*) { no_cuda("all_gather"); }
void broadcast(Comm*, const void*, void*, size_t, int, int, void*) { no_cuda("broadcast"); }
void send(Comm*, const void*, size_t, int, int, void*) { no_cuda("send"); }
void recv(Comm*, void*, size_t, int, int, void*) { no_cuda("recv"); }
void group_start() { no_cuda("group_start"); }
void group_end() { no_cuda("group_end"); }

int device_count() { return 0; }
std::string device_pci_bus_id(int) { no_cuda("device_pci_bus_id"); }
void* comm_stream(int) { no_cuda("comm_stream"); }
uintptr_t event_record(int, void*) { no_cuda("event_record"); }
void stream_wait_event(void*, uintptr_t) { no_cuda("wait"); }
bool event_query(uintptr_t) { no_cuda("is_completed"); }
void event_synchronize(uintptr_t) { no_cuda("synchronize"); }
void event_release(uintptr_t) {}
void stream_synchronize(void*) { no_cuda("synchronize"); }
bool stream_capturing(void*) { return false; }
void memcpy_async(void*, const void*, size_t, int, int, void*) { no_cuda("stage"); }
void divide(void*, size_t, int, int, int, void*) { no_cuda("divide"); }
void cast(const void*, int, void*, int, size_t, int, int, void*) { no_cuda("cast"); }
void ordered_sum(const void*, int, size_t, void*, int, int, int, void*) { no_cuda("ordered_sum"); }

}  // namespace bt::dist
