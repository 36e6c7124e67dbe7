/* A minimal extension module that imports blutrain.alloc's C ABI the way dependent packages
 * do (blutrain/alloc_import.h, blutrain/capi_import.h); built by test_alloc_c_abi.py. */
#include <Python.h>

#ifndef BT_CAPI_IMPORTER
#define BT_CAPI_IMPORTER "alloc_probe"
#endif
#include "blutrain/alloc_import.h"

static PyObject* roundtrip(PyObject* self, PyObject* args) {
  const bt_alloc_api* api = bt_alloc_import();
  if (!api) return NULL;
  void* p = NULL;
  if (api->malloc(BT_ALLOC_HOST_PAGEABLE, 4096, NULL, &p) != BT_ALLOC_OK) {
    PyErr_SetString(PyExc_RuntimeError, api->last_error());
    return NULL;
  }
  PyObject* addr = PyLong_FromVoidPtr(p);
  api->free(p);
  return addr;
}

/* Imports the table again (whatever sys.modules holds now): None, or the ImportError. */
static PyObject* try_import(PyObject* self, PyObject* args) {
  if (!bt_alloc_import()) return NULL;
  Py_RETURN_NONE;
}

static PyMethodDef methods[] = {{"roundtrip", roundtrip, METH_NOARGS, NULL},
                                {"try_import", try_import, METH_NOARGS, NULL},
                                {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, MODNAME, NULL, -1, methods};

#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
PyMODINIT_FUNC CAT(PyInit_, MODNAME_ID)(void) {
  if (!bt_alloc_import()) return NULL; /* refuse at import, like real dependents */
  return PyModule_Create(&module);
}
