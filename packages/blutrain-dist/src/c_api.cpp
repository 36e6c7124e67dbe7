// c_api.cpp: the C ABI table (blutrain/dist.h) over core.h: exceptions become status codes and a
// thread-local message.
#include <string>

#include "core.h"

namespace bt::dist {
namespace {
thread_local std::string g_last_error;

template <typename F>
int guard(F&& f) {
  try {
    f();
    return BT_DIST_OK;
  } catch (const Error& e) {
    g_last_error = e.what();
    return e.code;
  } catch (const std::exception& e) {
    g_last_error = e.what();
    return BT_DIST_EINVAL;
  }
}

Comm* as_comm(bt_dist_comm* c) { return reinterpret_cast<Comm*>(c); }

const char* c_last_error() { return g_last_error.c_str(); }
int c_nccl_version(int* v) {
  return guard([&] {
    if (!v) fail(BT_DIST_EINVAL, "[nccl_version] null argument");
    *v = nccl_version();
  });
}
int c_unique_id(uint8_t* out) {
  return guard([&] {
    if (!out) fail(BT_DIST_EINVAL, "[unique_id] null argument");
    nccl_unique_id(out);
  });
}
int c_comm_init(const uint8_t* id, int nranks, int rank, int device, bt_dist_comm** out) {
  return guard([&] {
    if (!out) fail(BT_DIST_EINVAL, "[comm_init] null argument");
    *out = reinterpret_cast<bt_dist_comm*>(comm_init(id, nranks, rank, device));
  });
}
int c_comm_destroy(bt_dist_comm* c) {
  return guard([&] { comm_destroy(as_comm(c)); });
}
int c_comm_abort(bt_dist_comm* c) {
  return guard([&] { comm_abort(as_comm(c)); });
}
int c_comm_async_error(bt_dist_comm* c, int* err) {
  return guard([&] {
    if (!err) fail(BT_DIST_EINVAL, "[comm_async_error] null argument");
    *err = comm_async_error(as_comm(c));
  });
}
int c_all_reduce(bt_dist_comm* c, const void* s, void* r, size_t n, int dt, int op, void* st) {
  return guard([&] { all_reduce(as_comm(c), s, r, n, dt, op, st); });
}
int c_reduce_scatter(bt_dist_comm* c, const void* s, void* r, size_t n, int dt, int op, void* st) {
  return guard([&] { reduce_scatter(as_comm(c), s, r, n, dt, op, st); });
}
int c_all_gather(bt_dist_comm* c, const void* s, void* r, size_t n, int dt, void* st) {
  return guard([&] { all_gather(as_comm(c), s, r, n, dt, st); });
}
int c_broadcast(bt_dist_comm* c, const void* s, void* r, size_t n, int dt, int root, void* st) {
  return guard([&] { broadcast(as_comm(c), s, r, n, dt, root, st); });
}
int c_send(bt_dist_comm* c, const void* b, size_t n, int dt, int peer, void* st) {
  return guard([&] { send(as_comm(c), b, n, dt, peer, st); });
}
int c_recv(bt_dist_comm* c, void* b, size_t n, int dt, int peer, void* st) {
  return guard([&] { recv(as_comm(c), b, n, dt, peer, st); });
}
int c_group_start() {
  return guard([] { group_start(); });
}
int c_group_end() {
  return guard([] { group_end(); });
}

const bt_dist_api g_api = {BT_DIST_ABI_VERSION,
                           sizeof(bt_dist_api),
                           c_last_error,
                           c_nccl_version,
                           c_unique_id,
                           c_comm_init,
                           c_comm_destroy,
                           c_comm_abort,
                           c_comm_async_error,
                           c_all_reduce,
                           c_reduce_scatter,
                           c_all_gather,
                           c_broadcast,
                           c_send,
                           c_recv,
                           c_group_start,
                           c_group_end};
}  // namespace

const bt_dist_api* api_table() { return &g_api; }

}  // namespace bt::dist
