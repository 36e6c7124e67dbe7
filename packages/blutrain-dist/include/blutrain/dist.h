/* blutrain/dist.h: the C ABI of blutrain-dist: NCCL communicators and collectives on device
 * buffers, ordered on the caller's CUDA stream.
 *
 * What C/C++ code (another package, a custom kernel library) needs to join BluTrain's distributed
 * execution without Python: build a communicator from a unique id that the caller distributes
 * (blutrain.dist broadcasts it over MPI), and run collectives on raw device pointers.  libnccl is
 * opened at run time (dlopen), so a build of this package imports where NCCL is absent and says
 * so at the first call.  Every NCCL and CUDA call is checked; a failure returns BT_DIST_ENCCL or
 * BT_DIST_ECUDA with a message naming the call, file and line in last_error().
 *
 * Conventions (shared by every BluTrain package):
 *   - every function returns BT_DIST_OK (0) or a negative BT_DIST_E* code; last_error() then holds
 *     a message for the calling thread, starting with the operation: "[all_reduce] ...".
 *   - dependents take the table bt_dist_api from the Python module's `_C_API` capsule
 *     (blutrain/dist_import.h); the table is append-only: new entries go at the end and bump
 *     BT_DIST_ABI_VERSION's minor part.
 *   - dtypes are bt_tensor_dtype values (blutrain/tensor.h); streams are cudaStream_t as void*.
 */
#ifndef BLUTRAIN_DIST_H
#define BLUTRAIN_DIST_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* major << 16 | minor. A dependent built for major M accepts M.x with x >= its minor. */
#define BT_DIST_ABI_VERSION ((1u << 16) | 0u)
#define BT_DIST_CAPSULE_NAME "blutrain.dist._C_API"
#define BT_DIST_UNIQUE_ID_BYTES 128 /* sizeof(ncclUniqueId) */

enum bt_dist_status {
  BT_DIST_OK = 0,
  BT_DIST_EINVAL = -1,  /* bad argument: null pointer, dtype, op, rank, count */
  BT_DIST_ENOCUDA = -2, /* built without CUDA, or no device present */
  BT_DIST_ENCCL = -3,   /* libnccl could not be loaded, or an NCCL call failed */
  BT_DIST_ECUDA = -4    /* a CUDA runtime call failed */
};

/* Reductions.  AVG is SUM followed by a division by the communicator's size (x / n, rounded once
 * in the buffer's dtype: exact averaging for any size, unlike a premultiplied 1/n). */
typedef enum bt_dist_op {
  BT_DIST_SUM = 0,
  BT_DIST_AVG = 1,
  BT_DIST_MAX = 2,
  BT_DIST_MIN = 3
} bt_dist_op;

typedef struct bt_dist_comm bt_dist_comm; /* an NCCL communicator bound to one device */

typedef struct bt_dist_api {
  uint32_t abi_version;
  uint32_t struct_size; /* sizeof(bt_dist_api) of the library that filled it */

  const char* (*last_error)(void);
  /* NCCL_VERSION_CODE of the loaded libnccl (e.g. 22805 for 2.28.5); loads it on first use. */
  int (*nccl_version)(int* version);
  /* A fresh unique id (BT_DIST_UNIQUE_ID_BYTES bytes) that rank 0 makes and every rank receives. */
  int (*unique_id)(uint8_t* out);
  /* Collective over all nranks: every rank calls it with the same id. */
  int (*comm_init)(const uint8_t* unique_id, int nranks, int rank, int device, bt_dist_comm** out);
  int (*comm_destroy)(bt_dist_comm* comm); /* waits for the communicator's pending work */
  int (*comm_abort)(bt_dist_comm* comm);   /* frees it without waiting (a peer is gone) */
  /* *error = 0 while healthy, else the ncclResult_t of an asynchronous failure. */
  int (*comm_async_error)(bt_dist_comm* comm, int* error);

  /* Collectives on `stream`.  In place when send == recv (for reduce_scatter: send + rank *
   * recv_count == recv; for all_gather: recv + rank * send_count == send). */
  int (*all_reduce)(bt_dist_comm* comm, const void* send, void* recv, size_t count, int dtype,
                    int op, void* stream);
  int (*reduce_scatter)(bt_dist_comm* comm, const void* send, void* recv, size_t recv_count,
                        int dtype, int op, void* stream);
  int (*all_gather)(bt_dist_comm* comm, const void* send, void* recv, size_t send_count, int dtype,
                    void* stream);
  int (*broadcast)(bt_dist_comm* comm, const void* send, void* recv, size_t count, int dtype,
                   int root, void* stream);
  int (*send)(bt_dist_comm* comm, const void* buf, size_t count, int dtype, int peer, void* stream);
  int (*recv)(bt_dist_comm* comm, void* buf, size_t count, int dtype, int peer, void* stream);
  /* Bracket several calls so NCCL issues them together (e.g. an all-to-all from sends/recvs). */
  int (*group_start)(void);
  int (*group_end)(void);
} bt_dist_api;

#ifdef __cplusplus
}
#endif
#endif /* BLUTRAIN_DIST_H */
