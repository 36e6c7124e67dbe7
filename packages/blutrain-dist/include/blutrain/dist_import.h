/* blutrain/dist_import.h: header-only importer of blutrain-dist's C ABI for Python extension
 * modules (the numpy `_C_API` pattern).
 *
 *   const bt_dist_api* api = bt_dist_import();   // once, at module init
 *   if (!api) return NULL;                       // ImportError is set
 *
 * The table is refused, with an ImportError naming both versions, when its major version differs
 * from the one this code was compiled against or its minor version is older.
 */
#ifndef BLUTRAIN_DIST_IMPORT_H
#define BLUTRAIN_DIST_IMPORT_H

#include <Python.h>

#include "blutrain/dist.h"

static inline const bt_dist_api* bt_dist_import(void) {
  PyObject* mod = PyImport_ImportModule("blutrain.dist._dist");
  if (!mod) return NULL;
  PyObject* cap = PyObject_GetAttrString(mod, "_C_API");
  Py_DECREF(mod);
  if (!cap) return NULL;
  const bt_dist_api* api = (const bt_dist_api*)PyCapsule_GetPointer(cap, BT_DIST_CAPSULE_NAME);
  Py_DECREF(cap);
  if (!api) return NULL;
  const uint32_t have = api->abi_version, want = BT_DIST_ABI_VERSION;
  if ((have >> 16) != (want >> 16) || (have & 0xffffu) < (want & 0xffffu) ||
      api->struct_size < sizeof(bt_dist_api)) {
    PyErr_Format(PyExc_ImportError,
                 "blutrain.dist C ABI %u.%u is installed, but this module was built for %u.%u: "
                 "rebuild it against the installed blutrain-dist, or install a matching one",
                 have >> 16, have & 0xffffu, want >> 16, want & 0xffffu);
    return NULL;
  }
  return api;
}

#endif /* BLUTRAIN_DIST_IMPORT_H */
