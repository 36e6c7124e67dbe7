// The caching pool: the allocation policy shared by every kind of memory
// (CUDA device, pinned host, pageable host). Kinds differ only in their
// MemorySource (how segments are obtained from the system) and EventSupport
// (how cross-stream use is tracked); the policy below is the same for all,
// which is why the host build in CI exercises the exact code the GPU runs.
//
// Policy
// ------
// * Sizes round up to kMinBlockSize (512 B) multiples, so every block is
//   512-byte aligned relative to its 4 KiB- (host) or 2 MiB- (CUDA) aligned
//   segment.
// * Two pools: requests <= kSmallRequest (1 MiB) come from 2 MiB segments
//   (kSmallSegment); larger ones from segments of 20 MiB (requests under
//   10 MiB) or of the request rounded up to 2 MiB. Keeping small blocks apart
//   stops them from pinning large segments.
// * Free blocks are kept per pool in a set ordered by (stream, size, address):
//   best fit on the caller's stream. A block freed on stream s is reused at
//   once by the next request on s, because work queued on s is ordered after
//   the free.
// * A block larger than needed is split when the remainder is worth keeping
//   (>= 512 B in the small pool, > 1 MiB in the large one); freed blocks merge
//   with free neighbours of the same segment, so a segment whose blocks are all
//   free is one block again and can be returned by empty_cache().
// * A block used on other streams (record_stream) is not reused when freed:
//   an event is recorded on each of those streams and the block waits until
//   all have completed (see Note [Cross-stream use]).
// * When the system refuses a segment, every cached segment that is wholly free
//   is returned and the request retried once; then an OutOfMemory error carries
//   the statistics.  A request above the capacity of device or pinned memory
//   fails at once, asking the system nothing (Note [Beyond capacity]).
// * Optional expandable segments (CUDA virtual memory): one growing segment
//   per stream for the large pool, so freed space at the end of the mapped
//   range is always reusable by a bigger request (see Note [Expandable segments]).
// * Optional no-caching mode (set_caching(false); BLUTRAIN_ALLOC_CONF=caching:0), for memory
//   checkers: see Note [No caching].
//
// Locking rule: every public method takes `mutex_` for its whole duration and
// never calls user code while holding it. The only system calls made under the
// lock are the MemorySource / EventSupport ones (segment allocation and release,
// event record / query). Pools never take another pool's lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "blutrain/alloc.h"
#include "errors.h"

namespace bt::alloc {

constexpr size_t kKiB = 1024;
constexpr size_t kMiB = 1024 * kKiB;
constexpr size_t kMinBlockSize = 512;       // bytes: allocation granule
constexpr size_t kSmallRequest = 1 * kMiB;  // bytes: largest request served by the small pool
constexpr size_t kSmallSegment = 2 * kMiB;  // bytes: segment size of the small pool
constexpr size_t kMidRequest = 10 * kMiB;  // bytes: large requests below this share 20 MiB segments
constexpr size_t kLargeSegment = 20 * kMiB;  // bytes
constexpr size_t kLargeRounding = 2 * kMiB;  // bytes: bigger segments round up to this
// bytes: no request may exceed this; larger values are almost surely a negative
// number passed as size_t.
constexpr size_t kMaxRequest = size_t(1) << 50;

using StreamId = uintptr_t;

struct Segment;

struct Block {
  uintptr_t addr = 0;
  size_t size = 0;       // bytes, a multiple of kMinBlockSize
  size_t requested = 0;  // bytes asked for; 0 when free
  StreamId stream = 0;
  int32_t pool_id = 0;  // 0: default pools; >= 2: a private (graph capture) pool
  bool small = false;
  bool allocated = false;
  bool in_free_set = false;
  int pending_events = 0;             // events still to complete before reuse
  std::vector<StreamId> stream_uses;  // other streams this block was used on
  Block* prev = nullptr;              // neighbours within the segment
  Block* next = nullptr;
  Segment* segment = nullptr;
};

struct Segment {
  uintptr_t base = 0;
  size_t size = 0;  // bytes mapped (== reserved) for this segment
  StreamId stream = 0;
  int32_t pool_id = 0;
  bool small = false;
  bool expandable = false;
  size_t reserved_va = 0;  // expandable: bytes of address space reserved
  Block* head = nullptr;
};

// Where segments come from. Implementations report failure to find memory by
// returning 0 (the pool then frees its cache and retries) and other failures by
// throwing Error.
class MemorySource {
 public:
  virtual ~MemorySource() = default;
  virtual uintptr_t allocate(size_t bytes) = 0;
  virtual void release(uintptr_t base, size_t bytes) = 0;
  virtual uint64_t total_bytes() const = 0;  // capacity, for memory fractions
  // Whether no single request above total_bytes() can ever succeed (device and pinned memory;
  // not pageable host memory, which the kernel may overcommit): the pool then refuses such a
  // request at once (Note [Beyond capacity]).
  virtual bool capacity_is_hard() const { return false; }
  virtual const char* kind() const = 0;  // "CUDA device 0", "pinned host", ...

  // Expandable segments (optional). reserve() returns the base of a range of
  // `bytes` address space; grow()/shrink() map or unmap [base+from, base+to).
  virtual bool supports_expandable() const { return false; }
  virtual size_t expand_granularity() const { return kLargeRounding; }
  virtual uintptr_t reserve(size_t /*bytes*/) { return 0; }
  virtual bool grow(uintptr_t /*base*/, size_t /*from*/, size_t /*to*/) { return false; }
  virtual void shrink(uintptr_t /*base*/, size_t /*from*/, size_t /*to*/) {}
  virtual void unreserve(uintptr_t /*base*/, size_t /*bytes*/) {}
};

// Cross-stream use tracking (CUDA events). Host pageable memory has none.
class EventSupport {
 public:
  virtual ~EventSupport() = default;
  virtual void* record(StreamId stream) = 0;  // an event recorded on `stream`
  virtual bool done(void* event) = 0;         // completed? (never blocks)
  virtual void destroy(void* event) = 0;
};

class CachingPool {
 public:
  CachingPool(std::unique_ptr<MemorySource> source, std::unique_ptr<EventSupport> events,
              bool key_by_stream);
  ~CachingPool();
  CachingPool(const CachingPool&) = delete;
  CachingPool& operator=(const CachingPool&) = delete;

  void* malloc(size_t size, StreamId stream);  // throws Error
  // Returns false if `ptr` is not a live allocation of this pool.
  bool free(void* ptr);
  bool record_stream(void* ptr, StreamId stream);
  bool owns(void* ptr);

  bt_alloc_stats stats();
  void reset_peak_stats();
  void empty_cache();
  void set_limit(uint64_t bytes);
  void set_fraction(double fraction);
  void set_expandable(bool on);
  void set_caching(bool on);
  std::vector<bt_alloc_block_info> snapshot();

  int32_t begin_private_pool(StreamId stream);
  bool end_private_pool(StreamId stream);
  bool release_private_pool(int32_t pool_id);

  const char* kind() const { return source_->kind(); }

 private:
  struct BlockOrder {
    bool operator()(const Block* a, const Block* b) const;
  };
  using FreeSet = std::set<Block*, BlockOrder>;
  struct Pools {  // one default pair, and one per private (graph) pool
    FreeSet small, large;
    bool releasing = false;  // private pool whose graphs are gone
    int64_t segments = 0;
  };

  Pools& pools_for(int32_t pool_id);
  int32_t pool_for_stream(StreamId stream) const;
  Block* find_free(FreeSet& set, StreamId stream, size_t size);
  Block* grow(Pools& pools, int32_t pool_id, bool small, StreamId stream, size_t size, bool exact);
  Block* grow_expandable(Pools& pools, StreamId stream, size_t size);
  Block* take(Block* block, size_t size, size_t requested);
  void free_block(Block* block);
  void insert_free(Block* block);
  void erase_free(Block* block);
  void process_events();
  void release_cached(bool default_pools, int32_t only_pool);
  void release_segment(Segment* seg);
  void shrink_expandable(Segment* seg);
  [[noreturn]] void throw_oom(size_t size, size_t rounded, StreamId stream);
  void note_reserved(int64_t delta);
  void note_allocated(int64_t bytes, int64_t requested);
  // While a private pool is capturing, events may not be queried and memory
  // may not be returned to the system (both would break the capture).
  bool capture_underway() const { return !capturing_.empty(); }
  // Blocks of `pool_id` bypass the cache (Note [No caching]): caching is off, and the pool is
  // the default one with no capture under way.
  bool uncached(int32_t pool_id) const { return !caching_ && pool_id == 0 && !capture_underway(); }

  std::mutex mutex_;
  std::unique_ptr<MemorySource> source_;
  std::unique_ptr<EventSupport> events_;
  const bool key_by_stream_;
  bool expandable_ = false;
  bool caching_ = true;

  std::map<int32_t, Pools> pools_;         // 0 = default
  std::map<StreamId, int32_t> capturing_;  // stream -> private pool id
  int32_t next_private_pool_ = 2;
  std::map<uintptr_t, Segment*> segments_;            // by base address
  std::map<StreamId, Segment*> expandable_segments_;  // one per stream
  std::unordered_map<uintptr_t, Block*> live_;        // allocated blocks by address
  std::deque<std::pair<void*, Block*>> pending_;      // events for cross-stream frees
  uint64_t limit_ = 0;                                // bytes; 0 = none
  bt_alloc_stats st_{};
};

}  // namespace bt::alloc
