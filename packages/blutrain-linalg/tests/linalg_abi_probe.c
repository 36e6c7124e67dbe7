/* A minimal extension module that imports blutrain.linalg's C ABI the way dependent packages
 * (blutrain-tensor) do, and runs a CPU GEMM through the table; built by test_c_abi.py. */
#include <Python.h>

#include "blutrain/linalg_import.h"

/* D (2x2) = A (2x3) @ B (3x2) + bias, row-major, through the table. */
static PyObject* gemm_bias(PyObject* self, PyObject* args) {
  const bt_linalg_api* api = bt_linalg_import();
  if (!api) return NULL;
  float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 0, 0, 1, 1, 1}, bias[2] = {10, 20}, d[4] = {0};
  bt_linalg_gemm_desc desc;
  bt_linalg_gemm_desc_init(&desc);
  desc.m = 2, desc.n = 2, desc.k = 3;
  desc.a.ptr = a, desc.a.ld = 3, desc.a.dtype = BT_LINALG_F32;
  desc.b.ptr = b, desc.b.ld = 2, desc.b.dtype = BT_LINALG_F32;
  desc.d.ptr = d, desc.d.ld = 2, desc.d.dtype = BT_LINALG_F32;
  desc.epilogue = BT_LINALG_EPI_BIAS;
  desc.bias.ptr = bias, desc.bias.dtype = BT_LINALG_F32;
  if (api->gemm(&desc) != BT_LINALG_OK) {
    PyErr_SetString(PyExc_RuntimeError, api->last_error());
    return NULL;
  }
  /* A descriptor too short to hold the mandatory fields is refused, with a message. */
  desc.struct_size = 8;
  int rc = api->gemm(&desc);
  return Py_BuildValue("(ffff)is", d[0], d[1], d[2], d[3], rc, api->last_error());
}

static PyMethodDef methods[] = {{"gemm_bias", gemm_bias, METH_NOARGS, NULL}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, MODNAME, NULL, -1, methods};

#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
PyMODINIT_FUNC CAT(PyInit_, MODNAME_ID)(void) {
  if (!bt_linalg_import()) return NULL; /* refuse at import, like real dependents */
  return PyModule_Create(&module);
}
