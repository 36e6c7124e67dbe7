/* blutrain/tensor_import.h: header-only importer of blutrain-tensor's C ABI for
 * Python extension modules (the numpy `_C_API` pattern).
 *
 *   const bt_tensor_api* api = bt_tensor_import();   // once, at module init
 *   if (!api) return NULL;                           // ImportError is set
 *
 * The table is refused, with an ImportError naming both versions, when its
 * major version differs from the one this code was compiled against or its
 * minor version is older.
 */
#ifndef BLUTRAIN_TENSOR_IMPORT_H
#define BLUTRAIN_TENSOR_IMPORT_H

#include <Python.h>

#include "blutrain/tensor.h"

static inline const bt_tensor_api* bt_tensor_import(void) {
  PyObject* mod = PyImport_ImportModule("blutrain.tensor._tensor");
  if (!mod) return NULL;
  PyObject* cap = PyObject_GetAttrString(mod, "_C_API");
  Py_DECREF(mod);
  if (!cap) return NULL;
  const bt_tensor_api* api =
      (const bt_tensor_api*)PyCapsule_GetPointer(cap, BT_TENSOR_CAPSULE_NAME);
  Py_DECREF(cap);
  if (!api) return NULL;
  const uint32_t have = api->abi_version, want = BT_TENSOR_ABI_VERSION;
  if ((have >> 16) != (want >> 16) || (have & 0xffffu) < (want & 0xffffu) ||
      api->struct_size < sizeof(bt_tensor_api)) {
    PyErr_Format(PyExc_ImportError,
                 "blutrain.tensor C ABI %u.%u is installed, but this module was built for %u.%u: "
                 "rebuild it against the installed blutrain-tensor, or install a matching one",
                 have >> 16, have & 0xffffu, want >> 16, want & 0xffffu);
    return NULL;
  }
  return api;
}

#endif /* BLUTRAIN_TENSOR_IMPORT_H */
