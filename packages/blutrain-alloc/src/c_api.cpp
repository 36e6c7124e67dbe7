// The C ABI: a registry of pools (one per CUDA device, one for pinned and one
// for pageable host memory), created on first use, and the exported functions.
//
// Locking rule: pools are created once under `g_create_mutex` and published
// through atomics, so the hot path (malloc/free) takes only the owning pool's
// own lock. Functions never hold two locks at once.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>

#include "backend.h"

namespace bt::alloc {
namespace {

constexpr int kMaxDevices = 64;
thread_local std::string tl_error;
std::mutex g_create_mutex;
std::array<std::atomic<CachingPool*>, kMaxDevices> g_devices{};
std::atomic<CachingPool*> g_pinned{nullptr};
std::atomic<CachingPool*> g_pageable{nullptr};
std::atomic<int> g_device_count{-1};
// Options for CUDA device pools, present and future; guarded by g_create_mutex.
bool g_expandable = false;
bool g_caching = true;
constexpr const char* kKnownOptions = "expandable_segments, caching";

void apply_option(CachingPool& p, const std::string& name, int64_t value) {
  if (name == "expandable_segments")
    p.set_expandable(value != 0);
  else if (name == "caching")
    p.set_caching(value != 0);
  else
    throw Error(BT_ALLOC_EINVAL,
                "[set_option] unknown option '" + name + "'; known: " + kKnownOptions);
}

// BLUTRAIN_ALLOC_CONF="expandable_segments:1,caching:0": read once,
// before any pool exists.
void read_env_options() {
  const char* conf = std::getenv("BLUTRAIN_ALLOC_CONF");
  if (!conf) return;
  const std::string s(conf);
  auto flag = [&](const std::string& key, bool& out) {
    const auto pos = s.find(key + ":");
    if (pos == std::string::npos) return;
    const size_t at = pos + key.size() + 1;
    out = at < s.size() && (s[at] == '1' || s[at] == 'T' || s[at] == 't');
  };
  flag("expandable_segments", g_expandable);
  flag("caching", g_caching);
}

int device_count() {
  int n = g_device_count.load(std::memory_order_acquire);
  if (n < 0) {
    n = cuda_device_count();
    g_device_count.store(n, std::memory_order_release);
  }
  return n;
}

std::atomic<CachingPool*>* slot_for(int device) {
  if (device == BT_ALLOC_HOST_PAGEABLE) return &g_pageable;
  if (device == BT_ALLOC_HOST_PINNED) return &g_pinned;
  if (device < 0)
    throw Error(BT_ALLOC_EINVAL, "[alloc] device " + std::to_string(device) +
                                     " is not valid: use a CUDA device index >= 0, -1 (pageable "
                                     "host) or -2 (pinned host)");
  const int n = device_count();
  if (device >= n || device >= kMaxDevices) {
    if (n == 0) make_device_pool(device);  // throws the "no CUDA" error of the backend
    throw Error(BT_ALLOC_EINVAL, "[alloc] CUDA device " + std::to_string(device) +
                                     " does not exist: " + std::to_string(n) +
                                     " device(s) are visible");
  }
  return &g_devices[device];
}

CachingPool& pool(int device) {
  std::atomic<CachingPool*>* slot = slot_for(device);
  CachingPool* p = slot->load(std::memory_order_acquire);
  if (p) return *p;
  std::lock_guard<std::mutex> lock(g_create_mutex);
  static std::once_flag env_once;
  std::call_once(env_once, read_env_options);
  p = slot->load(std::memory_order_relaxed);
  if (!p) {
    std::unique_ptr<CachingPool> made = device == BT_ALLOC_HOST_PAGEABLE ? make_pageable_pool()
                                        : device == BT_ALLOC_HOST_PINNED ? make_pinned_pool()
                                                                         : make_device_pool(device);
    if (device >= 0) {
      if (g_expandable) made->set_expandable(true);
      if (!g_caching) made->set_caching(false);
    }
    p = made.release();  // lives until process exit: pools outlive every user
    slot->store(p, std::memory_order_release);
  }
  return *p;
}

// Pools that exist now, for free() and record_stream() of a bare pointer.
template <typename F>
bool for_each_pool(F&& f) {
  for (int d = 0; d < kMaxDevices; ++d)
    if (CachingPool* p = g_devices[d].load(std::memory_order_acquire))
      if (f(*p)) return true;
  for (auto* slot : {&g_pinned, &g_pageable})
    if (CachingPool* p = slot->load(std::memory_order_acquire))
      if (f(*p)) return true;
  return false;
}

template <typename F>
int guarded(F&& f) {
  try {
    f();
    return BT_ALLOC_OK;
  } catch (const Error& e) {
    tl_error = e.what();
    return e.code();
  } catch (const std::bad_alloc&) {
    tl_error = "[alloc] host out of memory for the allocator's own bookkeeping";
    return BT_ALLOC_ENOMEM;
  } catch (const std::exception& e) {
    tl_error = std::string("[alloc] ") + e.what();
    return BT_ALLOC_ECUDA;
  }
}

Error not_owned(const char* op, void* ptr) {
  char buf[160];
  std::snprintf(buf, sizeof buf,
                "[%s] pointer %p was not allocated by blutrain.alloc, or was already freed", op,
                ptr);
  return Error(BT_ALLOC_ENOTOWN, buf);
}

}  // namespace
}  // namespace bt::alloc

using namespace bt::alloc;

extern "C" {

const char* bt_alloc_last_error(void) { return tl_error.c_str(); }

int bt_alloc_malloc(int device, size_t size, void* stream, void** out) {
  return guarded([&] {
    if (!out) throw Error(BT_ALLOC_EINVAL, "[malloc] out must not be NULL");
    *out = nullptr;
    *out = pool(device).malloc(size, reinterpret_cast<StreamId>(stream));
  });
}

int bt_alloc_free(void* ptr) {
  return guarded([&] {
    if (!ptr) return;  // like free(NULL)
    if (!for_each_pool([&](CachingPool& p) { return p.free(ptr); })) throw not_owned("free", ptr);
  });
}

int bt_alloc_record_stream(void* ptr, void* stream) {
  return guarded([&] {
    const auto s = reinterpret_cast<StreamId>(stream);
    if (!for_each_pool([&](CachingPool& p) { return p.record_stream(ptr, s); }))
      throw not_owned("record_stream", ptr);
  });
}

int bt_alloc_get_stats(int device, bt_alloc_stats* out) {
  return guarded([&] {
    if (!out) throw Error(BT_ALLOC_EINVAL, "[stats] out must not be NULL");
    *out = pool(device).stats();
  });
}

int bt_alloc_reset_peak_stats(int device) {
  return guarded([&] { pool(device).reset_peak_stats(); });
}

int bt_alloc_empty_cache(int device) {
  return guarded([&] { pool(device).empty_cache(); });
}

static int set_memory_fraction(int device, double fraction) {
  return guarded([&] { pool(device).set_fraction(fraction); });
}

static int set_memory_limit(int device, uint64_t bytes) {
  return guarded([&] { pool(device).set_limit(bytes); });
}

static int snapshot(int device, bt_alloc_block_info* out, size_t capacity, size_t* count) {
  return guarded([&] {
    if (!count) throw Error(BT_ALLOC_EINVAL, "[snapshot] count must not be NULL");
    auto blocks = pool(device).snapshot();
    *count = blocks.size();
    if (out) std::memcpy(out, blocks.data(), std::min(capacity, blocks.size()) * sizeof blocks[0]);
  });
}

static int begin_graph_pool(int device, void* stream, int32_t* pool_id) {
  return guarded([&] {
    if (device < 0) throw Error(BT_ALLOC_EINVAL, "[begin_graph_pool] needs a CUDA device");
    const int32_t id = pool(device).begin_private_pool(reinterpret_cast<StreamId>(stream));
    if (pool_id) *pool_id = id;
  });
}

static int end_graph_pool(int device, void* stream) {
  return guarded([&] {
    if (!pool(device).end_private_pool(reinterpret_cast<StreamId>(stream)))
      throw Error(BT_ALLOC_ESTATE, "[end_graph_pool] no private pool was begun on this stream");
  });
}

static int release_graph_pool(int device, int32_t pool_id) {
  return guarded([&] {
    if (!pool(device).release_private_pool(pool_id))
      throw Error(BT_ALLOC_EINVAL,
                  "[release_graph_pool] no private pool " + std::to_string(pool_id));
  });
}

static int set_option(const char* name, int64_t value) {
  return guarded([&] {
    if (!name) throw Error(BT_ALLOC_EINVAL, "[set_option] name must not be NULL");
    const std::string key(name);
    {
      std::lock_guard<std::mutex> lock(g_create_mutex);
      if (key == "expandable_segments") g_expandable = value != 0;
      if (key == "caching") g_caching = value != 0;
    }
    bool any = false;
    for (int d = 0; d < kMaxDevices; ++d)
      if (CachingPool* p = g_devices[d].load()) {
        apply_option(*p, key, value);
        any = true;
      }
    if (!any && key != "expandable_segments" && key != "caching")
      throw Error(BT_ALLOC_EINVAL,
                  "[set_option] unknown option '" + key + "'; known: " + kKnownOptions);
  });
}

static int get_device_count(int* count) {
  return guarded([&] {
    if (!count) throw Error(BT_ALLOC_EINVAL, "[device_count] count must not be NULL");
    *count = device_count();
  });
}

static int set_pool_option(int device, const char* name, int64_t value) {
  return guarded([&] {
    if (!name) throw Error(BT_ALLOC_EINVAL, "[set_pool_option] name must not be NULL");
    apply_option(pool(device), name, value);
  });
}

static const bt_alloc_api g_api = {
    BT_ALLOC_ABI_VERSION, sizeof(bt_alloc_api),   bt_alloc_last_error, bt_alloc_malloc,
    bt_alloc_free,        bt_alloc_record_stream, bt_alloc_get_stats,  bt_alloc_reset_peak_stats,
    bt_alloc_empty_cache, set_memory_fraction,    set_memory_limit,    snapshot,
    begin_graph_pool,     end_graph_pool,         release_graph_pool,  set_option,
    get_device_count,     set_pool_option,
};

const bt_alloc_api* bt_alloc_get_api(void) { return &g_api; }

// torch.cuda.memory.CUDAPluggableAllocator calls these; torch turns NULL into
// its own out-of-memory error, and our message is printed to help.
void* bt_alloc_torch_malloc(ssize_t size, int device, void* stream) {
  if (size == 0) return nullptr;
  void* p = nullptr;
  if (bt_alloc_malloc(device, size_t(size), stream, &p) != BT_ALLOC_OK) {
    std::fprintf(stderr, "blutrain.alloc: %s\n", tl_error.c_str());
    return nullptr;
  }
  return p;
}

void bt_alloc_torch_free(void* ptr, ssize_t, int, void*) {
  if (bt_alloc_free(ptr) != BT_ALLOC_OK)
    std::fprintf(stderr, "blutrain.alloc: %s\n", tl_error.c_str());
}

}  // extern "C"
