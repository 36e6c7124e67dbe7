/* blutrain/alloc_import.h: blutrain-alloc's C ABI table for Python extension modules.
 *
 *   #define BT_CAPI_IMPORTER "blutrain.mypkg"          // names the importer in errors
 *   #include "blutrain/alloc_import.h"
 *   const bt_alloc_api* api = bt_alloc_import();     // once, at module init
 *   if (!api) return NULL;                           // ImportError is set
 *
 * The checks and their messages are blutrain/capi_import.h's (shared by every package).
 */
#ifndef BLUTRAIN_ALLOC_IMPORT_H
#define BLUTRAIN_ALLOC_IMPORT_H

#include "blutrain/alloc.h"
#include "blutrain/capi_import.h"

/* The version this code needs; overridable only to test the refusal. */
#ifndef BT_ALLOC_IMPORT_WANT_VERSION
#define BT_ALLOC_IMPORT_WANT_VERSION BT_ALLOC_ABI_VERSION
#endif

static inline const bt_alloc_api* bt_alloc_import(void) {
  return (const bt_alloc_api*)bt_capi_import(BT_CAPI_IMPORTER, "blutrain.alloc",
                                             "blutrain.alloc._alloc", BT_ALLOC_CAPSULE_NAME,
                                             BT_ALLOC_IMPORT_WANT_VERSION, sizeof(bt_alloc_api));
}

#endif /* BLUTRAIN_ALLOC_IMPORT_H */
