/* blutrain/alloc_import.h: header-only importer of blutrain-alloc's C ABI for
 * Python extension modules (the numpy `_C_API` pattern).
 *
 *   const bt_alloc_api* api = bt_alloc_import();   // once, at module init
 *   if (!api) return NULL;                         // ImportError is set
 *
 * The table is refused, with an ImportError naming both versions, when its
 * major version differs from the one this code was compiled against or its
 * minor version is older.
 */
#ifndef BLUTRAIN_ALLOC_IMPORT_H
#define BLUTRAIN_ALLOC_IMPORT_H

#include <Python.h>

#include "blutrain/alloc.h"

/* The version this code needs; overridable only to test the refusal. */
#ifndef BT_ALLOC_IMPORT_WANT_VERSION
#define BT_ALLOC_IMPORT_WANT_VERSION BT_ALLOC_ABI_VERSION
#endif

static inline const bt_alloc_api* bt_alloc_import(void) {
  PyObject* mod = PyImport_ImportModule("blutrain.alloc._alloc");
  if (!mod) return NULL;
  PyObject* cap = PyObject_GetAttrString(mod, "_C_API");
  Py_DECREF(mod);
  if (!cap) return NULL;
  const bt_alloc_api* api = (const bt_alloc_api*)PyCapsule_GetPointer(cap, BT_ALLOC_CAPSULE_NAME);
  Py_DECREF(cap);
  if (!api) return NULL;
  const uint32_t have = api->abi_version, want = BT_ALLOC_IMPORT_WANT_VERSION;
  if ((have >> 16) != (want >> 16) || (have & 0xffffu) < (want & 0xffffu)) {
    PyErr_Format(PyExc_ImportError,
                 "blutrain.alloc C ABI %u.%u is installed, but this module was built for %u.%u: "
                 "rebuild it against the installed blutrain-alloc, or install a matching one",
                 have >> 16, have & 0xffffu, want >> 16, want & 0xffffu);
    return NULL;
  }
  /* Same version, shorter table: a development build between two version bumps. */
  if (want == BT_ALLOC_ABI_VERSION && api->struct_size < sizeof(bt_alloc_api)) {
    PyErr_Format(PyExc_ImportError,
                 "blutrain.alloc C ABI %u.%u is installed with a %u-byte function table, but this "
                 "module needs %u bytes: reinstall blutrain-alloc from the same sources",
                 have >> 16, have & 0xffffu, (unsigned)api->struct_size,
                 (unsigned)sizeof(bt_alloc_api));
    return NULL;
  }
  return api;
}

#endif /* BLUTRAIN_ALLOC_IMPORT_H */
