// Trace replay for the benchmark (bench/bench_alloc.py): times malloc/free
// pairs of a recorded allocation trace through one of several allocators, in
// C++, so that no Python call overhead enters the per-operation figure.
#pragma once

#include <cstddef>
#include <cstdint>

#include "blutrain/alloc.h"

extern "C" {

typedef struct bt_alloc_replay_result {
  double total_ns;     // wall time of all operations
  uint64_t ops;        // mallocs + frees
  uint64_t peak_live;  // bytes requested and live at the peak
  int32_t status;
} bt_alloc_replay_result;

// trace: n rows of (op, id, size): op 0 = malloc `size` bytes as `id`, op 1 = free `id`.
// backend: 0 blutrain.alloc, 1 cudaMalloc/cudaFree, 2 cudaMallocAsync/cudaFreeAsync,
// 3 malloc/free (host).
BT_ALLOC_EXPORT int bt_alloc_bench_replay(const int64_t* trace, size_t n, int backend, int device,
                                          void* stream, int repeats, bt_alloc_replay_result* out);
BT_ALLOC_EXPORT const char* bt_alloc_library_path(void);
}
