// comm.cpp: NCCL communicators and collectives on device buffers (CUDA builds).
//
// A Comm is one ncclComm_t bound to one device.  Collectives run on the stream the caller
// passes (blutrain.dist passes the device's communication stream, ordered after the compute
// stream by an event: streams.cpp, Note [stream order]).  AVG is exact for any world size
// (Note [fused average]).  bool travels as uint8 with SUM as logical or (MAX).
//
// Note [fused average]: the mean over n ranks must be the sum rounded once and divided by n,
// rounded once.  NCCL's ncclAvg on floating types multiplies every rank's input by 1/n (rounded
// to the dtype) before summing.  When n is a power of two, 1/n is exact and scaling by it
// commutes with every rounding of the sum (an exponent shift), so ncclAvg gives the same bits
// as SUM then / n, minus one pass over the buffer; we use it then for float32, float64 and
// bfloat16 (whose exponent range is float32's).  Not for float16: its small range makes
// x * 2^-k lose bits to subnormals where a gradient still has them.  Any other n: ncclSum, then
// our divide kernel on the same stream (rounded once through double).
#include <cstring>
#include <string>

#include "nccl_lib.h"

struct bt_dist_comm {};  // the C ABI's opaque handle: a bt::dist::Comm

namespace bt::dist {

struct Comm : bt_dist_comm {
  ncclComm_t comm = nullptr;
  int device = 0, rank = 0, nranks = 1;
};

namespace {

ncclDataType_t nccl_dtype(int dtype, const char* op) {
  switch (dtype) {
    case 0:
    case 1:
      return ncclUint8;
    case 2:
      return ncclInt32;
    case 3:
      return ncclInt64;
    case 4:
      return ncclFloat16;
    case 5:
      return ncclBfloat16;
    case 6:
      return ncclFloat32;
    case 7:
      return ncclFloat64;
    default:
      fail(BT_DIST_EINVAL, std::string("[") + op + "] unknown dtype code " + std::to_string(dtype));
  }
}

// Whether AVG over nranks runs as NCCL's ncclAvg (Note [fused average]): float32 (6),
// float64 (7), bfloat16 (5) and a power-of-two world size above 1.
bool fused_average(int dtype, int nranks) {
  const bool pow2 = nranks > 1 && (nranks & (nranks - 1)) == 0;
  return pow2 && (dtype == 5 || dtype == 6 || dtype == 7);
}

// The NCCL reduction for (op, dtype); AVG maps to ncclAvg where exact (Note [fused average]),
// else to SUM (our division follows).
ncclRedOp_t nccl_op(int op, int dtype, int nranks, const char* name) {
  const bool is_bool = dtype == 0;
  switch (op) {
    case BT_DIST_SUM:
      return is_bool ? ncclMax : ncclSum;
    case BT_DIST_AVG:
      if (!dtype_is_floating(dtype))
        fail(BT_DIST_EINVAL, std::string("[") + name + "] op 'avg' needs a floating dtype, got " +
                                 dtype_name(dtype));
      return fused_average(dtype, nranks) ? ncclAvg : ncclSum;
    case BT_DIST_MAX:
      return ncclMax;
    case BT_DIST_MIN:
      return ncclMin;
    default:
      fail(BT_DIST_EINVAL, std::string("[") + name + "] unknown reduction " + std::to_string(op) +
                               " (sum 0, avg 1, max 2, min 3)");
  }
}

void check_comm(const Comm* c, const char* op) {
  if (!c || !c->comm)
    fail(BT_DIST_EINVAL, std::string("[") + op + "] the communicator is null or destroyed");
}

void set_device(int device, const char* op) { BT_DIST_CUDA_CHECK(op, cudaSetDevice(device)); }

}  // namespace

void nccl_unique_id(uint8_t* out) {
  static_assert(sizeof(ncclUniqueId) == BT_DIST_UNIQUE_ID_BYTES, "ncclUniqueId size changed");
  ncclUniqueId id;
  BT_NCCL_CHECK("unique_id", nccl::lib("unique_id").ncclGetUniqueId(&id));
  std::memcpy(out, &id, sizeof(id));
}

Comm* comm_init(const uint8_t* unique_id, int nranks, int rank, int device) {
  const char* op = "comm_init";
  if (!unique_id) fail(BT_DIST_EINVAL, "[comm_init] unique_id is null");
  if (nranks < 1 || rank < 0 || rank >= nranks)
    fail(BT_DIST_EINVAL, "[comm_init] rank " + std::to_string(rank) + " is not in [0, " +
                             std::to_string(nranks) + ")");
  const auto& f = nccl::lib(op);
  set_device(device, op);
  ncclUniqueId id;
  std::memcpy(&id, unique_id, sizeof(id));
  auto* c = new Comm;
  c->device = device;
  c->rank = rank;
  c->nranks = nranks;
  const ncclResult_t r = f.ncclCommInitRank(&c->comm, nranks, id, rank);
  if (r != ncclSuccess) {
    delete c;
    nccl::throw_nccl_error(op, "ncclCommInitRank(&comm, nranks, id, rank)", r, __FILE__, __LINE__);
  }
  return c;
}

void comm_destroy(Comm* c) {
  if (!c) return;
  if (c->comm) {
    const auto& f = nccl::lib("comm_destroy");
    set_device(c->device, "comm_destroy");
    if (f.ncclCommFinalize) BT_NCCL_CHECK("comm_destroy", f.ncclCommFinalize(c->comm));
    BT_NCCL_CHECK("comm_destroy", f.ncclCommDestroy(c->comm));
  }
  delete c;
}

void comm_abort(Comm* c) {
  if (!c) return;
  if (c->comm) {
    const auto& f = nccl::lib("comm_abort");
    cudaSetDevice(c->device);
    f.ncclCommAbort(c->comm);  // best effort: a peer is gone
  }
  delete c;
}

int comm_async_error(Comm* c) {
  check_comm(c, "comm_async_error");
  ncclResult_t err = ncclSuccess;
  BT_NCCL_CHECK("comm_async_error",
                nccl::lib("comm_async_error").ncclCommGetAsyncError(c->comm, &err));
  return err == ncclInProgress ? 0 : int(err);
}

int comm_rank(const Comm* c) { return c ? c->rank : -1; }
int comm_size(const Comm* c) { return c ? c->nranks : 0; }
int comm_device(const Comm* c) { return c ? c->device : -1; }

void all_reduce(Comm* c, const void* send, void* recv, size_t count, int dtype, int op,
                void* stream) {
  const char* name = "all_reduce";
  check_comm(c, name);
  const ncclDataType_t dt = nccl_dtype(dtype, name);
  const ncclRedOp_t rop = nccl_op(op, dtype, c->nranks, name);
  if (count == 0) return;
  set_device(c->device, name);
  auto s = static_cast<cudaStream_t>(stream);
  BT_NCCL_CHECK(name, nccl::lib(name).ncclAllReduce(send, recv, count, dt, rop, c->comm, s));
  if (op == BT_DIST_AVG && c->nranks > 1 && !fused_average(dtype, c->nranks))
    divide(recv, count, dtype, c->nranks, c->device, stream);
}

void reduce_scatter(Comm* c, const void* send, void* recv, size_t recv_count, int dtype, int op,
                    void* stream) {
  const char* name = "reduce_scatter";
  check_comm(c, name);
  const ncclDataType_t dt = nccl_dtype(dtype, name);
  const ncclRedOp_t rop = nccl_op(op, dtype, c->nranks, name);
  if (recv_count == 0) return;
  set_device(c->device, name);
  auto s = static_cast<cudaStream_t>(stream);
  BT_NCCL_CHECK(name,
                nccl::lib(name).ncclReduceScatter(send, recv, recv_count, dt, rop, c->comm, s));
  if (op == BT_DIST_AVG && c->nranks > 1 && !fused_average(dtype, c->nranks))
    divide(recv, recv_count, dtype, c->nranks, c->device, stream);
}

void all_gather(Comm* c, const void* send, void* recv, size_t send_count, int dtype, void* stream) {
  const char* name = "all_gather";
  check_comm(c, name);
  const ncclDataType_t dt = nccl_dtype(dtype, name);
  if (send_count == 0) return;
  set_device(c->device, name);
  BT_NCCL_CHECK(name, nccl::lib(name).ncclAllGather(send, recv, send_count, dt, c->comm,
                                                    static_cast<cudaStream_t>(stream)));
}

void broadcast(Comm* c, const void* send, void* recv, size_t count, int dtype, int root,
               void* stream) {
  const char* name = "broadcast";
  check_comm(c, name);
  const ncclDataType_t dt = nccl_dtype(dtype, name);
  if (root < 0 || root >= c->nranks)
    fail(BT_DIST_EINVAL, "[broadcast] root " + std::to_string(root) + " is not in [0, " +
                             std::to_string(c->nranks) + ")");
  if (count == 0) return;
  set_device(c->device, name);
  BT_NCCL_CHECK(name, nccl::lib(name).ncclBroadcast(send, recv, count, dt, root, c->comm,
                                                    static_cast<cudaStream_t>(stream)));
}

void send(Comm* c, const void* buf, size_t count, int dtype, int peer, void* stream) {
  const char* name = "send";
  check_comm(c, name);
  const ncclDataType_t dt = nccl_dtype(dtype, name);
  if (peer < 0 || peer >= c->nranks || peer == c->rank)
    fail(BT_DIST_EINVAL, "[send] peer " + std::to_string(peer) + " is not another rank of [0, " +
                             std::to_string(c->nranks) + ")");
  if (count == 0) return;
  set_device(c->device, name);
  BT_NCCL_CHECK(name, nccl::lib(name).ncclSend(buf, count, dt, peer, c->comm,
                                               static_cast<cudaStream_t>(stream)));
}

void recv(Comm* c, void* buf, size_t count, int dtype, int peer, void* stream) {
  const char* name = "recv";
  check_comm(c, name);
  const ncclDataType_t dt = nccl_dtype(dtype, name);
  if (peer < 0 || peer >= c->nranks || peer == c->rank)
    fail(BT_DIST_EINVAL, "[recv] peer " + std::to_string(peer) + " is not another rank of [0, " +
                             std::to_string(c->nranks) + ")");
  if (count == 0) return;
  set_device(c->device, name);
  BT_NCCL_CHECK(name, nccl::lib(name).ncclRecv(buf, count, dt, peer, c->comm,
                                               static_cast<cudaStream_t>(stream)));
}

void group_start() { BT_NCCL_CHECK("group_start", nccl::lib("group_start").ncclGroupStart()); }
void group_end() { BT_NCCL_CHECK("group_end", nccl::lib("group_end").ncclGroupEnd()); }

bool built_with_nccl() { return true; }

}  // namespace bt::dist
