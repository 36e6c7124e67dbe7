/* blutrain/linalg_import.h: blutrain-linalg's C ABI table for Python extension modules.
 *
 *   #define BT_CAPI_IMPORTER "blutrain.mypkg"          // names the importer in errors
 *   #include "blutrain/linalg_import.h"
 *   const bt_linalg_api* api = bt_linalg_import();   // once, at module init
 *   if (!api) return NULL;                           // ImportError is set
 *
 * The checks and their messages are blutrain/capi_import.h's, shipped with blutrain-alloc (a
 * dependency of blutrain-linalg): put `python -m blutrain.alloc --include` on the include path.
 */
#ifndef BLUTRAIN_LINALG_IMPORT_H
#define BLUTRAIN_LINALG_IMPORT_H

#include "blutrain/capi_import.h"
#include "blutrain/linalg.h"

static inline const bt_linalg_api* bt_linalg_import(void) {
  return (const bt_linalg_api*)bt_capi_import(BT_CAPI_IMPORTER, "blutrain.linalg",
                                              "blutrain.linalg._linalg", BT_LINALG_CAPSULE_NAME,
                                              BT_LINALG_ABI_VERSION, sizeof(bt_linalg_api));
}

#endif /* BLUTRAIN_LINALG_IMPORT_H */
