/* blutrain/capi_import.h: the one importer of the BluTrain packages' C ABI tables, for Python
 * extension modules (the numpy `_C_API` pattern; DESIGN.md, "The C ABI between packages").
 * Header-only, C and C++, Python's limited API.  Shipped with blutrain-alloc, the lowest
 * package; every <pkg>_import.h (alloc, linalg, tensor, and the packages above them) calls it.
 *
 * A package's native module `blutrain.<pkg>._<pkg>` holds its function table in a PyCapsule
 * named "blutrain.<pkg>._C_API", attribute `_C_API`.  Every table starts with
 *     uint32_t abi_version;   major << 16 | minor
 *     uint32_t struct_size;   sizeof(table) in the library that filled it
 * A dependent takes the table when the majors agree, the installed minor is at least the one it
 * was built for, and the table is at least as long as the one it knows (same version from other
 * sources may be shorter).  Anything else (the module cannot be imported, it has no `_C_API`, that
 * is not a capsule or is another package's, the version or the size is refused) is an ImportError
 * naming both sides: the importer, the provider, and the versions each has.
 *
 * The importer's name comes from BT_CAPI_IMPORTER, defined before the include
 * (`#define BT_CAPI_IMPORTER "blutrain.tensor"`), else "this module".
 */
#ifndef BLUTRAIN_CAPI_IMPORT_H
#define BLUTRAIN_CAPI_IMPORT_H

#include <Python.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifndef BT_CAPI_IMPORTER
#define BT_CAPI_IMPORTER "this module"
#endif

/* The first members of every package's function table. */
typedef struct bt_capi_header {
  uint32_t abi_version;
  uint32_t struct_size;
} bt_capi_header;

/* The pending exception's message as a new str (clears it): what an import failed with. */
static inline PyObject* bt_capi_take_error_message(void) {
  PyObject* msg = NULL;
#if (defined(Py_LIMITED_API) && Py_LIMITED_API + 0 >= 0x030C0000) || \
    (!defined(Py_LIMITED_API) && PY_VERSION_HEX >= 0x030C0000)
  PyObject* exc = PyErr_GetRaisedException();
  if (exc) {
    msg = PyObject_Str(exc);
    Py_DECREF(exc);
  }
#else
  PyObject *type = NULL, *value = NULL, *tb = NULL;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  if (value) msg = PyObject_Str(value);
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
#endif
  if (!msg) {
    PyErr_Clear();
    msg = PyUnicode_FromString("unknown error");
  }
  return msg;
}

/* The function table of `provider` (e.g. "blutrain.alloc"), found as capsule `capsule_name` in
 * attribute _C_API of `module` (e.g. "blutrain.alloc._alloc"), for `importer`, which was built
 * for ABI `want_version` with a `want_size`-byte table.  NULL with an ImportError set when
 * refused. */
static inline const void* bt_capi_import(const char* importer, const char* provider,
                                         const char* module, const char* capsule_name,
                                         uint32_t want_version, size_t want_size) {
  const unsigned want_major = want_version >> 16, want_minor = want_version & 0xffffu;
  PyObject* mod = PyImport_ImportModule(module);
  if (!mod) {
    const int missing = PyErr_ExceptionMatches(PyExc_ModuleNotFoundError);
    PyObject* why = bt_capi_take_error_message();
    if (missing) { /* not installed: say what to install (the distribution: blutrain-alloc) */
      char dist[64];
      size_t i = 0;
      for (; provider[i] && i + 1 < sizeof dist; ++i)
        dist[i] = provider[i] == '.' ? '-' : provider[i];
      dist[i] = 0;
      PyErr_Format(PyExc_ImportError,
                   "[%s] needs %s's C ABI %u.%u but cannot import %s: %S; pip install %s", importer,
                   provider, want_major, want_minor, module, why, dist);
    } else { /* installed but failing (e.g. a bad BLUTRAIN_ALLOC_CONF): its own message */
      PyErr_Format(PyExc_ImportError, "[%s] needs %s's C ABI %u.%u but importing %s failed: %S",
                   importer, provider, want_major, want_minor, module, why);
    }
    Py_XDECREF(why);
    return NULL;
  }
  PyObject* cap = PyObject_GetAttrString(mod, "_C_API");
  Py_DECREF(mod);
  if (!cap) {
    PyErr_Clear();
    PyErr_Format(PyExc_ImportError,
                 "[%s] %s has no _C_API capsule, but %s needs %s's C ABI %u.%u from it: "
                 "reinstall %s",
                 importer, module, importer, provider, want_major, want_minor, provider);
    return NULL;
  }
  const char* found_name = PyCapsule_GetName(cap);
  if (!found_name && PyErr_Occurred()) { /* not a capsule at all */
    PyErr_Clear();
    PyObject* type_name = PyObject_GetAttrString((PyObject*)Py_TYPE(cap), "__name__");
    if (!type_name) PyErr_Clear();
    PyErr_Format(PyExc_ImportError,
                 "[%s] %s._C_API is a %S, not the capsule '%s' of %s's C ABI (%s needs %u.%u)",
                 importer, module, type_name ? type_name : Py_None, capsule_name, provider,
                 importer, want_major, want_minor);
    Py_XDECREF(type_name);
    Py_DECREF(cap);
    return NULL;
  }
  const bt_capi_header* api = NULL;
  if (found_name && strcmp(found_name, capsule_name) == 0) {
    api = (const bt_capi_header*)PyCapsule_GetPointer(cap, capsule_name);
    if (!api) PyErr_Clear();
  }
  if (!api) {
    PyErr_Format(PyExc_ImportError,
                 "[%s] %s._C_API is the capsule '%s', not '%s' with %s's C ABI table (%s needs "
                 "%u.%u)",
                 importer, module, found_name ? found_name : "(unnamed)", capsule_name, provider,
                 importer, want_major, want_minor);
    Py_DECREF(cap);
    return NULL;
  }
  Py_DECREF(cap); /* the providing module keeps the table alive: it is never unloaded */
  const uint32_t have = api->abi_version;
  const unsigned have_major = have >> 16, have_minor = have & 0xffffu;
  if (have_major != want_major || have_minor < want_minor) {
    PyErr_Format(PyExc_ImportError,
                 "[%s] %s C ABI %u.%u is installed, but %s was built for %u.%u: rebuild %s "
                 "against the installed %s, or install a %s with C ABI %u.%u or a newer %u.x",
                 importer, provider, have_major, have_minor, importer, want_major, want_minor,
                 importer, provider, provider, want_major, want_minor, want_major);
    return NULL;
  }
  if (api->struct_size < want_size) {
    PyErr_Format(PyExc_ImportError,
                 "[%s] %s C ABI %u.%u is installed with a %u-byte function table, but %s was "
                 "built for a %u-byte one of the same version: reinstall %s and %s from the "
                 "same sources",
                 importer, provider, have_major, have_minor, (unsigned)api->struct_size, importer,
                 (unsigned)want_size, provider, importer);
    return NULL;
  }
  return api;
}

#endif /* BLUTRAIN_CAPI_IMPORT_H */
