/* blutrain/tensor.h: the C ABI of blutrain-tensor.
 *
 * Small on purpose: other packages (blutrain-dist, blutrain-compiler) exchange tensors through
 * Python objects and DLPack; what they need in C is to look inside a blutrain Tensor they were
 * handed (pointer, dtype, shape, strides, device) and to tell autograd that they wrote into one
 * (e.g. an all-reduce writing a gradient in place).
 *
 * Conventions (shared by every BluTrain package):
 *   - every function returns BT_TENSOR_OK (0) or a negative BT_TENSOR_E* code;
 *     last_error() then holds a message for the calling thread.
 *   - dependents take the table bt_tensor_api from the Python module's `_C_API` capsule
 *     (blutrain/tensor_import.h); the table is append-only: new entries go at the end and bump
 *     BT_TENSOR_ABI_VERSION's minor part.
 */
#ifndef BLUTRAIN_TENSOR_H
#define BLUTRAIN_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* major << 16 | minor. A dependent built for major M accepts M.x with x >= its minor. */
#define BT_TENSOR_ABI_VERSION ((1u << 16) | 0u)
#define BT_TENSOR_CAPSULE_NAME "blutrain.tensor._C_API"
#define BT_TENSOR_MAX_DIMS 16

enum bt_tensor_status {
  BT_TENSOR_OK = 0,
  BT_TENSOR_EINVAL = -1 /* bad argument: not a tensor, symbolic tensor, null pointer */
};

/* Element types (values fixed: they are bt::DType's). */
typedef enum bt_tensor_dtype {
  BT_TENSOR_BOOL = 0,
  BT_TENSOR_UINT8 = 1,
  BT_TENSOR_INT32 = 2,
  BT_TENSOR_INT64 = 3,
  BT_TENSOR_FLOAT16 = 4,
  BT_TENSOR_BFLOAT16 = 5,
  BT_TENSOR_FLOAT32 = 6,
  BT_TENSOR_FLOAT64 = 7
} bt_tensor_dtype;

typedef struct bt_tensor_info {
  void* data; /* address of element [0, ..., 0] */
  int32_t ndim;
  int32_t dtype;  /* bt_tensor_dtype */
  int32_t device; /* -1: host; >= 0: CUDA device */
  int32_t reserved_;
  int64_t shape[BT_TENSOR_MAX_DIMS];
  int64_t strides[BT_TENSOR_MAX_DIMS]; /* in elements */
} bt_tensor_info;

typedef struct bt_tensor_api {
  uint32_t abi_version;
  uint32_t struct_size; /* sizeof(bt_tensor_api) of the library that filled it */

  const char* (*last_error)(void);
  /* A borrowed handle to the Tensor inside a Python object (a PyObject*), valid while the
   * object lives. */
  int (*from_pyobject)(void* pyobject, void** handle);
  int (*describe)(void* handle, bt_tensor_info* out);
  /* Call after writing into a tensor's memory: autograd then detects a stale saved tensor. */
  int (*bump_version)(void* handle);
} bt_tensor_api;

#ifdef __cplusplus
}
#endif
#endif /* BLUTRAIN_TENSOR_H */
