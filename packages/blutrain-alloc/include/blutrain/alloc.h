/* blutrain/alloc.h: the C ABI of blutrain-alloc, a caching allocator for host
 * (pageable, pinned) and CUDA device memory.
 *
 * Conventions (shared by every BluTrain package):
 *   - every function returns BT_ALLOC_OK (0) or a negative BT_ALLOC_E* code;
 *     bt_alloc_last_error() then holds a message for the calling thread.
 *   - opaque pointers only; streams are passed as void* (a cudaStream_t, NULL =
 *     the legacy default stream).
 *   - dependents never link against this library: they take the function table
 *     bt_alloc_api from the Python module's `_C_API` capsule (see
 *     blutrain/alloc_import.h) or from bt_alloc_get_api() when linking directly.
 *     The table is append-only: new entries go at the end and bump
 *     BT_ALLOC_ABI_VERSION's minor part.
 */
#ifndef BLUTRAIN_ALLOC_H
#define BLUTRAIN_ALLOC_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h> /* ssize_t */

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define BT_ALLOC_EXPORT __declspec(dllexport)
#else
#define BT_ALLOC_EXPORT __attribute__((visibility("default")))
#endif

/* major << 16 | minor. A dependent built for major M accepts M.x with x >= its minor. */
#define BT_ALLOC_ABI_VERSION ((1u << 16) | 1u) /* 1.1: set_pool_option */
#define BT_ALLOC_CAPSULE_NAME "blutrain.alloc._C_API"

enum bt_alloc_status {
  BT_ALLOC_OK = 0,
  BT_ALLOC_EINVAL = -1,  /* bad argument: size, device, flag */
  BT_ALLOC_ENOMEM = -2,  /* out of memory after releasing the cache and retrying */
  BT_ALLOC_ENOTOWN = -3, /* pointer not allocated by us, or already freed */
  BT_ALLOC_ENOCUDA = -4, /* built without CUDA, or no device present */
  BT_ALLOC_ECUDA = -5,   /* a CUDA runtime/driver call failed */
  BT_ALLOC_ESTATE = -6   /* call not valid now (e.g. ending a pool never begun) */
};

/* Where memory lives. Devices are numbered from 0; kinds below -1 are host. */
#define BT_ALLOC_HOST_PAGEABLE (-1)
#define BT_ALLOC_HOST_PINNED (-2)

/* Statistics of one device (or host kind). Byte counts are in bytes. */
typedef struct bt_alloc_stats {
  uint64_t allocated_bytes; /* held by live allocations (rounded sizes) */
  uint64_t allocated_bytes_peak;
  uint64_t requested_bytes; /* what callers asked for */
  uint64_t requested_bytes_peak;
  uint64_t reserved_bytes; /* obtained from the system (segments) */
  uint64_t reserved_bytes_peak;
  uint64_t active_blocks; /* live allocations */
  uint64_t segments;      /* system allocations held */
  uint64_t alloc_count;   /* successful bt_alloc_malloc calls */
  uint64_t free_count;
  uint64_t system_alloc_count; /* cudaMalloc / cuMemMap / malloc calls */
  uint64_t system_free_count;
  uint64_t oom_count;            /* allocations that failed for lack of memory */
  uint64_t cache_flushes;        /* times the cache was released to retry an allocation */
  uint64_t largest_free_block;   /* bytes, over all cached free blocks */
  uint64_t inactive_split_bytes; /* free bytes inside segments that also hold live blocks */
  uint64_t limit_bytes;          /* per-process cap in force (0 = none) */
} bt_alloc_stats;

/* One block of the snapshot. */
typedef struct bt_alloc_block_info {
  uint64_t segment_address; /* base of the owning segment */
  uint64_t address;
  uint64_t size;      /* bytes */
  uint64_t requested; /* bytes asked for (0 if free) */
  uint64_t stream;    /* stream the block belongs to */
  int32_t allocated;  /* 1 live, 0 free */
  int32_t pool;       /* 0 small, 1 large, >=2 a private (graph) pool id */
  int32_t expandable; /* 1 if the segment is an expandable segment */
  int32_t reserved_;
} bt_alloc_block_info;

typedef struct bt_alloc_api {
  uint32_t abi_version;
  uint32_t struct_size; /* sizeof(bt_alloc_api) of the library that filled it */

  const char* (*last_error)(void);

  /* device >= 0: CUDA device; BT_ALLOC_HOST_PAGEABLE / BT_ALLOC_HOST_PINNED: host. */
  int (*malloc)(int device, size_t size, void* stream, void** out);
  int (*free)(void* ptr);
  /* ptr is used on `stream` too: it is not reused until that work finishes. */
  int (*record_stream)(void* ptr, void* stream);

  int (*get_stats)(int device, bt_alloc_stats* out);
  int (*reset_peak_stats)(int device);
  int (*empty_cache)(int device);
  /* Per-process cap: a fraction in (0, 1] of the device's total memory, or bytes. */
  int (*set_memory_fraction)(int device, double fraction);
  int (*set_memory_limit)(int device, uint64_t bytes); /* 0 removes the cap */

  /* Snapshot: call with out == NULL to get the count, then with room for it. */
  int (*snapshot)(int device, bt_alloc_block_info* out, size_t capacity, size_t* count);

  /* CUDA graph capture: allocations made on `stream` while it captures come from
   * a private pool; release it once every graph that used it is destroyed. */
  int (*begin_graph_pool)(int device, void* stream, int32_t* pool_id);
  int (*end_graph_pool)(int device, void* stream);
  int (*release_graph_pool)(int device, int32_t pool_id);

  /* Options of every CUDA device pool, present and future (see set_pool_option). */
  int (*set_option)(const char* name, int64_t value);
  int (*device_count)(int* count);
  /* Options of one pool (a device or a host kind):
   *   "expandable_segments" 0/1: large blocks in one growing segment per stream
   *     (CUDA virtual memory on devices, mmap on host); default 0. */
  int (*set_pool_option)(int device, const char* name, int64_t value);
} bt_alloc_api;

/* Direct entry points (for C/C++ users who link libblutrain_alloc). */
BT_ALLOC_EXPORT const bt_alloc_api* bt_alloc_get_api(void);
BT_ALLOC_EXPORT const char* bt_alloc_last_error(void);
BT_ALLOC_EXPORT int bt_alloc_malloc(int device, size_t size, void* stream, void** out);
BT_ALLOC_EXPORT int bt_alloc_free(void* ptr);
BT_ALLOC_EXPORT int bt_alloc_record_stream(void* ptr, void* stream);
BT_ALLOC_EXPORT int bt_alloc_get_stats(int device, bt_alloc_stats* out);
BT_ALLOC_EXPORT int bt_alloc_reset_peak_stats(int device);
BT_ALLOC_EXPORT int bt_alloc_empty_cache(int device);

/* Symbols for torch.cuda.memory.CUDAPluggableAllocator (its fixed signatures). */
BT_ALLOC_EXPORT void* bt_alloc_torch_malloc(ssize_t size, int device, void* stream);
BT_ALLOC_EXPORT void bt_alloc_torch_free(void* ptr, ssize_t size, int device, void* stream);

#ifdef __cplusplus
}
#endif
#endif /* BLUTRAIN_ALLOC_H */
