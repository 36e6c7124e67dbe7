// The C ABI: a registry of pools (one per CUDA device, one for pinned and one
// for pageable host memory), created on first use, and the exported functions.
//
// Locking rule: pools are created once under `g_create_mutex` and published
// through atomics, so the hot path (malloc/free) takes only the owning pool's
// own lock. Functions never hold two locks at once.
#include <algorithm>
#include <array>
#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <vector>

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

// Edit distance of two short keys (for "did you mean").
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1])});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string trimmed(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t"), e = s.find_last_not_of(" \t");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

// Note [BLUTRAIN_ALLOC_CONF]
// "expandable_segments:1,caching:0": the CUDA device pools' defaults, read once, when the first
// pool is made.  blutrain.alloc's Python module makes the pageable host pool at import, so a bad
// setting stops `import blutrain.alloc` (and every package that imports it) before a model is
// built, rather than surfacing at some later allocation; C/C++ code linking the library gets the
// same error from its first call that makes a pool.  Strict, because a typo silently ignored
// runs the job without the setting: an unknown key, a value other than 0/1/true/false, an entry
// without ':' or a key given twice is an EINVAL error naming the entry, the whole setting and
// the allowed keys, returned by every pool-making call until the variable is fixed (std::call_once
// retries after a throw).
void read_env_options() {
  const char* conf = std::getenv("BLUTRAIN_ALLOC_CONF");
  if (!conf) return;
  const std::string all(conf);
  const std::string where = " in BLUTRAIN_ALLOC_CONF=\"" + all + "\"";
  const std::string allowed = "; allowed keys: expandable_segments (0 or 1), caching (0 or 1)";
  auto fail = [&](const std::string& what) {
    throw Error(BT_ALLOC_EINVAL, "[BLUTRAIN_ALLOC_CONF] " + what + where + allowed);
  };
  bool expandable = g_expandable, caching = g_caching;  // set only once all of it parsed
  bool seen_expandable = false, seen_caching = false;
  size_t start = 0;
  while (start <= all.size()) {
    size_t end = all.find(',', start);
    if (end == std::string::npos) end = all.size();
    const std::string item = trimmed(all.substr(start, end - start));
    start = end + 1;
    if (item.empty()) continue;  // "a:1," and "" are fine
    const size_t colon = item.find(':');
    if (colon == std::string::npos) fail("'" + item + "' is not key:value");
    const std::string key = trimmed(item.substr(0, colon));
    std::string value = trimmed(item.substr(colon + 1));
    for (char& c : value) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    const bool is_expandable = key == "expandable_segments", is_caching = key == "caching";
    bool* out = is_expandable ? &expandable : is_caching ? &caching : nullptr;
    bool* seen = is_expandable ? &seen_expandable : is_caching ? &seen_caching : nullptr;
    if (!out) {
      std::string hint;
      for (const char* k : {"expandable_segments", "caching"})
        if (edit_distance(key, k) <= 3) hint = " (did you mean '" + std::string(k) + "'?)";
      fail("unknown key '" + key + "'" + hint);
    }
    if (*seen) fail("key '" + key + "' is given twice");
    *seen = true;
    if (value == "1" || value == "true")
      *out = true;
    else if (value == "0" || value == "false")
      *out = false;
    else
      fail("'" + key + "' must be 0 or 1 (or true / false), got '" +
           trimmed(item.substr(colon + 1)) + "'");
  }
  g_expandable = expandable;
  g_caching = caching;
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
