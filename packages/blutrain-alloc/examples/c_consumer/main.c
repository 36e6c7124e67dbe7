/* Allocates, frees and reuses host memory through the C ABI; prints "ok". */
#include <blutrain/alloc.h>
#include <stdio.h>
#include <string.h>

int main(void) {
  const bt_alloc_api* api = bt_alloc_get_api();
  if (api->abi_version != BT_ALLOC_ABI_VERSION) return 1;
  void* p = NULL;
  if (api->malloc(BT_ALLOC_HOST_PAGEABLE, 1000, NULL, &p) != BT_ALLOC_OK) return 2;
  memset(p, 7, 1000);
  if (bt_alloc_free(p) != BT_ALLOC_OK) return 3;
  void* q = NULL;
  if (bt_alloc_malloc(BT_ALLOC_HOST_PAGEABLE, 900, NULL, &q) != BT_ALLOC_OK || q != p) return 4;
  bt_alloc_free(q);
  if (bt_alloc_free(q) != BT_ALLOC_ENOTOWN) return 5; /* double free is refused */
  printf("double free: %s\n", bt_alloc_last_error());
  bt_alloc_stats s;
  bt_alloc_get_stats(BT_ALLOC_HOST_PAGEABLE, &s);
  if (s.alloc_count != 2 || s.allocated_bytes != 0) return 6;
  printf("ok\n");
  return 0;
}
