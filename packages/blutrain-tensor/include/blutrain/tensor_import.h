/* blutrain/tensor_import.h: blutrain-tensor's C ABI table for Python extension modules.
 *
 *   #define BT_CAPI_IMPORTER "blutrain.mypkg"          // names the importer in errors
 *   #include "blutrain/tensor_import.h"
 *   const bt_tensor_api* api = bt_tensor_import();   // once, at module init
 *   if (!api) return NULL;                           // ImportError is set
 *
 * The checks and their messages are blutrain/capi_import.h's, shipped with blutrain-alloc (a
 * dependency of blutrain-tensor): put `python -m blutrain.alloc --include` on the include path.
 */
#ifndef BLUTRAIN_TENSOR_IMPORT_H
#define BLUTRAIN_TENSOR_IMPORT_H

#include "blutrain/capi_import.h"
#include "blutrain/tensor.h"

static inline const bt_tensor_api* bt_tensor_import(void) {
  return (const bt_tensor_api*)bt_capi_import(BT_CAPI_IMPORTER, "blutrain.tensor",
                                              "blutrain.tensor._tensor", BT_TENSOR_CAPSULE_NAME,
                                              BT_TENSOR_ABI_VERSION, sizeof(bt_tensor_api));
}

#endif /* BLUTRAIN_TENSOR_IMPORT_H */
