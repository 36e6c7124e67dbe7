#include "caching_pool.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>

namespace bt::alloc {

std::string format_bytes(uint64_t bytes) {
  static const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double v = double(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 5) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

namespace {

size_t round_size(size_t size) {
  return (size + kMinBlockSize - 1) / kMinBlockSize * kMinBlockSize;
}

size_t segment_size_for(size_t rounded) {
  if (rounded <= kSmallRequest) return kSmallSegment;
  if (rounded < kMidRequest) return kLargeSegment;
  return (rounded + kLargeRounding - 1) / kLargeRounding * kLargeRounding;
}

// A remainder is split off when it can serve a request of the same pool.
bool should_split(const Block* block, size_t size) {
  const size_t rest = block->size - size;
  return block->small ? rest >= kMinBlockSize : rest > kSmallRequest;
}

template <typename T>
void update_peak(T now, T& peak) {
  if (now > peak) peak = now;
}

}  // namespace

bool CachingPool::BlockOrder::operator()(const Block* a, const Block* b) const {
  if (a->stream != b->stream) return a->stream < b->stream;
  if (a->size != b->size) return a->size < b->size;
  return a->addr < b->addr;
}

CachingPool::CachingPool(std::unique_ptr<MemorySource> source, std::unique_ptr<EventSupport> events,
                         bool key_by_stream)
    : source_(std::move(source)), events_(std::move(events)), key_by_stream_(key_by_stream) {
  pools_[0];
}

CachingPool::~CachingPool() {
  // Process teardown: drivers may already be gone, so memory is left to the OS
  // and only our bookkeeping is freed.
  for (auto& [base, seg] : segments_) {
    for (Block* b = seg->head; b;) {
      Block* next = b->next;
      delete b;
      b = next;
    }
    delete seg;
  }
}

CachingPool::Pools& CachingPool::pools_for(int32_t pool_id) { return pools_[pool_id]; }

int32_t CachingPool::pool_for_stream(StreamId stream) const {
  if (capturing_.empty()) return 0;
  auto it = capturing_.find(stream);
  return it == capturing_.end() ? 0 : it->second;
}

void CachingPool::note_reserved(int64_t delta) {
  st_.reserved_bytes += delta;
  update_peak(st_.reserved_bytes, st_.reserved_bytes_peak);
}

void CachingPool::note_allocated(int64_t bytes, int64_t requested) {
  st_.allocated_bytes += bytes;
  st_.requested_bytes += requested;
  update_peak(st_.allocated_bytes, st_.allocated_bytes_peak);
  update_peak(st_.requested_bytes, st_.requested_bytes_peak);
}

void CachingPool::insert_free(Block* block) {
  Pools& pools = pools_for(block->pool_id);
  (block->small ? pools.small : pools.large).insert(block);
  block->in_free_set = true;
}

void CachingPool::erase_free(Block* block) {
  Pools& pools = pools_for(block->pool_id);
  (block->small ? pools.small : pools.large).erase(block);
  block->in_free_set = false;
}

Block* CachingPool::find_free(FreeSet& set, StreamId stream, size_t size) {
  Block key;
  key.stream = stream;
  key.size = size;
  auto it = set.lower_bound(&key);
  if (it == set.end() || (*it)->stream != stream) return nullptr;
  Block* block = *it;
  set.erase(it);
  block->in_free_set = false;
  return block;
}

// Marks `block` allocated with `size` bytes, splitting off the remainder.
Block* CachingPool::take(Block* block, size_t size, size_t requested) {
  if (should_split(block, size)) {
    Block* rest = new Block;
    rest->addr = block->addr + size;
    rest->size = block->size - size;
    rest->stream = block->stream;
    rest->pool_id = block->pool_id;
    rest->small = block->small;
    rest->segment = block->segment;
    rest->prev = block;
    rest->next = block->next;
    if (rest->next) rest->next->prev = rest;
    block->next = rest;
    block->size = size;
    insert_free(rest);
  }
  block->allocated = true;
  block->requested = requested;
  live_[block->addr] = block;
  note_allocated(int64_t(block->size), int64_t(requested));
  st_.active_blocks++;
  st_.alloc_count++;
  return block;
}

Block* CachingPool::grow(Pools& pools, int32_t pool_id, bool small, StreamId stream, size_t size,
                         bool exact) {
  if (!exact && !small && expandable_ && pool_id == 0 && source_->supports_expandable())
    return grow_expandable(pools, stream, size);
  const size_t bytes = exact ? size : segment_size_for(size);
  if (limit_ && st_.reserved_bytes + bytes > limit_) return nullptr;
  const uintptr_t base = source_->allocate(bytes);
  if (!base) return nullptr;
  st_.system_alloc_count++;
  auto* seg = new Segment;
  seg->base = base;
  seg->size = bytes;
  seg->stream = stream;
  seg->pool_id = pool_id;
  seg->small = small;
  auto* block = new Block;
  block->addr = base;
  block->size = bytes;
  block->stream = stream;
  block->pool_id = pool_id;
  block->small = small;
  block->segment = seg;
  seg->head = block;
  segments_[base] = seg;
  pools.segments++;
  st_.segments++;
  note_reserved(int64_t(bytes));
  return block;
}

// Note [Expandable segments]
// Each stream owns one segment whose address range is reserved up front (the
// device's capacity) and mapped from its start as the pool grows. When no free
// block fits, the tail is extended just enough: if the last block is free it
// grows in place, so a request never fails because free memory is split
// between segments. empty_cache() unmaps a free tail in whole granules. The
// blocks inside follow the ordinary split/merge rules.
Block* CachingPool::grow_expandable(Pools& pools, StreamId stream, size_t size) {
  Segment*& seg = expandable_segments_[stream];
  const size_t gran = source_->expand_granularity();
  if (!seg) {
    const size_t va = (source_->total_bytes() + gran - 1) / gran * gran;
    const uintptr_t base = source_->reserve(va);
    if (!base) return nullptr;
    seg = new Segment;
    seg->base = base;
    seg->size = 0;
    seg->reserved_va = va;
    seg->stream = stream;
    seg->expandable = true;
    segments_[base] = seg;
    pools.segments++;
    st_.segments++;
  }
  Block* tail = seg->head;
  while (tail && tail->next) tail = tail->next;
  const bool tail_free = tail && !tail->allocated && tail->in_free_set;
  const size_t have = tail_free ? tail->size : 0;
  const size_t extra = (size - have + gran - 1) / gran * gran;
  if (seg->size + extra > seg->reserved_va) return nullptr;
  if (limit_ && st_.reserved_bytes + extra > limit_) return nullptr;
  if (!source_->grow(seg->base, seg->size, seg->size + extra)) return nullptr;
  st_.system_alloc_count++;
  note_reserved(int64_t(extra));
  Block* block;
  if (tail_free) {
    erase_free(tail);
    tail->size += extra;
    block = tail;
  } else {
    block = new Block;
    block->addr = seg->base + seg->size;
    block->size = extra;
    block->stream = stream;
    block->segment = seg;
    block->prev = tail;
    if (tail)
      tail->next = block;
    else
      seg->head = block;
  }
  seg->size += extra;
  return block;
}

void* CachingPool::malloc(size_t size, StreamId stream) {
  if (size == 0) throw Error(BT_ALLOC_EINVAL, "[malloc] size must be positive, got 0 bytes");
  if (size > kMaxRequest)
    throw Error(BT_ALLOC_EINVAL, "[malloc] size " + std::to_string(size) +
                                     " bytes is beyond any device (a negative size passed as "
                                     "unsigned?); the limit is 2^50 bytes");
  std::lock_guard<std::mutex> lock(mutex_);
  if (!key_by_stream_) stream = 0;
  process_events();
  const int32_t pool_id = pool_for_stream(stream);
  // Note [No caching]: with caching off, a request of the default pool (not under graph capture,
  // where memory may not come from the system) gets a segment of exactly its size, released to
  // the system as soon as it is free: a checker such as compute-sanitizer's memcheck then sees
  // every tensor as its own allocation, so an access past a tensor's end is reported instead of
  // landing in a neighbour of the same segment.  For finding bugs only: every request and free
  // calls the system (cudaMalloc / cudaFree, which synchronises the device).
  const bool exact = uncached(pool_id);
  const size_t rounded = exact ? size : round_size(size);
  // Note [Beyond capacity]: a request larger than the whole device (a huge expanded view
  // materialised, a size computed wrongly) fails without asking the system: no cudaMalloc that
  // must fail (which compute-sanitizer reports as an API error, and which a retry would repeat),
  // and no flush of the cache for memory that could never be enough.
  if (source_->capacity_is_hard() && rounded > source_->total_bytes())
    throw_oom(size, rounded, stream);
  const bool small = rounded <= kSmallRequest;
  Pools& pools = pools_for(pool_id);
  FreeSet& set = small ? pools.small : pools.large;

  Block* block = exact ? nullptr : find_free(set, stream, rounded);
  if (!block) block = grow(pools, pool_id, small, stream, rounded, exact);
  if (!block && !capture_underway()) {
    // Note [OOM retry]: return every wholly free cached segment and try once
    // more. Skipped during graph capture, where freeing memory is illegal.
    st_.cache_flushes++;
    release_cached(true, -1);
    block = grow(pools, pool_id, small, stream, rounded, exact);
  }
  if (!block) throw_oom(size, rounded, stream);
  return reinterpret_cast<void*>(take(block, rounded, size)->addr);
}

void CachingPool::throw_oom(size_t size, size_t rounded, StreamId stream) {
  st_.oom_count++;
  uint64_t free_cached = 0, largest = 0;
  for (auto& [id, pools] : pools_)
    for (FreeSet* s : {&pools.small, &pools.large})
      for (Block* b : *s) {
        free_cached += b->size;
        largest = std::max<uint64_t>(largest, b->size);
      }
  std::string msg = "[malloc] " + std::string(source_->kind()) +
                    " out of memory: tried to allocate " + format_bytes(size) + " (" +
                    format_bytes(rounded) + " rounded) on stream 0x" +
                    [&] {
                      char b[32];
                      std::snprintf(b, sizeof b, "%" PRIxPTR, stream);
                      return std::string(b);
                    }() +
                    ". Capacity " + format_bytes(source_->total_bytes()) + "; BluTrain holds " +
                    format_bytes(st_.reserved_bytes) + " reserved, " +
                    format_bytes(st_.allocated_bytes) + " allocated, " + format_bytes(free_cached) +
                    " cached free (largest free block " + format_bytes(largest) + ")";
  if (limit_) msg += ", limit " + format_bytes(limit_);
  msg +=
      ". Hint: free tensors you no longer need, lower the batch size, raise the limit "
      "(set_memory_fraction), or set BLUTRAIN_ALLOC_CONF=expandable_segments:1 if much memory is "
      "cached but fragmented.";
  throw Error(BT_ALLOC_ENOMEM, msg);
}

bool CachingPool::owns(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_.count(reinterpret_cast<uintptr_t>(ptr)) != 0;
}

bool CachingPool::free(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == live_.end()) return false;
  Block* block = it->second;
  live_.erase(it);
  note_allocated(-int64_t(block->size), -int64_t(block->requested));
  st_.active_blocks--;
  st_.free_count++;
  block->allocated = false;
  block->requested = 0;
  if (!block->stream_uses.empty() && events_) {
    // Note [Cross-stream use]: the block may still be read or written by work
    // queued on the other streams. It rejoins the pool only when an event
    // recorded now on each of them has completed. During graph capture the
    // event would become part of the graph, so blocks of a private pool stay
    // parked until the pool is released instead.
    if (block->pool_id != 0 || capture_underway()) {
      block->pending_events = 1 << 20;  // parked; see release_private_pool
    } else {
      for (StreamId s : block->stream_uses) {
        pending_.emplace_back(events_->record(s), block);
        block->pending_events++;
      }
    }
    block->stream_uses.clear();
    return true;
  }
  block->stream_uses.clear();
  free_block(block);
  return true;
}

bool CachingPool::record_stream(void* ptr, StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == live_.end()) return false;
  Block* block = it->second;
  if (!key_by_stream_ && !events_) return true;  // pageable host memory: nothing to order
  if (stream == block->stream && key_by_stream_) return true;
  if (std::find(block->stream_uses.begin(), block->stream_uses.end(), stream) ==
      block->stream_uses.end())
    block->stream_uses.push_back(stream);
  return true;
}

// Merges `block` with its free neighbours and returns it to its pool.
void CachingPool::free_block(Block* block) {
  for (Block* nb : {block->prev, block->next}) {
    if (!nb || nb->allocated || !nb->in_free_set) continue;
    erase_free(nb);
    if (nb == block->prev) {
      block->addr = nb->addr;
      block->prev = nb->prev;
      if (block->prev)
        block->prev->next = block;
      else
        block->segment->head = block;
    } else {
      block->next = nb->next;
      if (block->next) block->next->prev = block;
    }
    block->size += nb->size;
    delete nb;
  }
  insert_free(block);
  Pools& pools = pools_for(block->pool_id);
  if ((pools.releasing || uncached(block->pool_id)) && !block->prev && !block->next &&
      !block->segment->expandable)
    release_segment(block->segment);
}

void CachingPool::process_events() {
  if (pending_.empty() || !events_ || capture_underway()) return;
  while (!pending_.empty()) {
    auto [event, block] = pending_.front();
    if (!events_->done(event)) break;  // FIFO: later events are usually later still
    events_->destroy(event);
    pending_.pop_front();
    if (--block->pending_events == 0) free_block(block);
  }
}

void CachingPool::release_segment(Segment* seg) {
  Block* block = seg->head;
  erase_free(block);
  pools_for(seg->pool_id).segments--;
  source_->release(seg->base, seg->size);
  st_.system_free_count++;
  note_reserved(-int64_t(seg->size));
  st_.segments--;
  segments_.erase(seg->base);
  delete block;
  delete seg;
}

void CachingPool::shrink_expandable(Segment* seg) {
  Block* tail = seg->head;
  while (tail && tail->next) tail = tail->next;
  if (tail && (tail->allocated || !tail->in_free_set)) return;
  const size_t gran = source_->expand_granularity();
  if (tail) {
    // Unmap whole granules past the last live byte.
    const size_t keep_end = (tail->addr - seg->base + gran - 1) / gran * gran;
    if (keep_end < seg->size) {
      const size_t drop = seg->size - keep_end;
      erase_free(tail);
      source_->shrink(seg->base, keep_end, seg->size);
      st_.system_free_count++;
      note_reserved(-int64_t(drop));
      seg->size = keep_end;
      tail->size -= drop;
      if (tail->size == 0) {
        if (tail->prev)
          tail->prev->next = nullptr;
        else
          seg->head = nullptr;
        delete tail;
      } else {
        insert_free(tail);
      }
    }
  }
  if (seg->size == 0) {  // nothing mapped: give the address range back too
    source_->unreserve(seg->base, seg->reserved_va);
    expandable_segments_.erase(seg->stream);
    segments_.erase(seg->base);
    pools_for(seg->pool_id).segments--;
    st_.segments--;
    delete seg;
  }
}

void CachingPool::release_cached(bool default_pools, int32_t only_pool) {
  process_events();
  std::vector<Segment*> victims, expandable;
  for (auto& [base, seg] : segments_) {
    const bool selected = default_pools ? (seg->pool_id == 0 || pools_for(seg->pool_id).releasing)
                                        : seg->pool_id == only_pool;
    if (!selected) continue;
    if (seg->expandable) {
      expandable.push_back(seg);
      continue;
    }
    Block* b = seg->head;
    if (b && !b->next && !b->allocated && b->in_free_set) victims.push_back(seg);
  }
  for (Segment* seg : victims) release_segment(seg);
  for (Segment* seg : expandable) shrink_expandable(seg);
}

void CachingPool::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (capture_underway())
    throw Error(BT_ALLOC_ESTATE,
                std::string("[empty_cache] a CUDA graph capture is under way on ") + kind() +
                    "; call it after the capture ends");
  release_cached(true, -1);
}

void CachingPool::set_limit(uint64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  limit_ = bytes;
}

void CachingPool::set_fraction(double fraction) {
  if (!(fraction > 0.0 && fraction <= 1.0))
    throw Error(BT_ALLOC_EINVAL, "[set_memory_fraction] fraction must be in (0, 1], got " +
                                     std::to_string(fraction));
  std::lock_guard<std::mutex> lock(mutex_);
  limit_ = uint64_t(fraction * double(source_->total_bytes()));
}

void CachingPool::set_caching(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  caching_ = on;
  if (!on && !capture_underway()) release_cached(true, -1);  // what is cached now goes back
}

void CachingPool::set_expandable(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (on && !source_->supports_expandable())
    throw Error(BT_ALLOC_EINVAL,
                std::string("[set_option] expandable segments are not supported for ") + kind() +
                    " (they need the CUDA virtual memory API)");
  expandable_ = on;
}

bt_alloc_stats CachingPool::stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  bt_alloc_stats s = st_;
  s.largest_free_block = 0;
  s.inactive_split_bytes = 0;
  for (auto& [id, pools] : pools_)
    for (FreeSet* set : {&pools.small, &pools.large})
      for (Block* b : *set) {
        s.largest_free_block = std::max<uint64_t>(s.largest_free_block, b->size);
        if (b->prev || b->next) s.inactive_split_bytes += b->size;
      }
  s.limit_bytes = limit_;
  return s;
}

void CachingPool::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  st_.allocated_bytes_peak = st_.allocated_bytes;
  st_.requested_bytes_peak = st_.requested_bytes;
  st_.reserved_bytes_peak = st_.reserved_bytes;
}

std::vector<bt_alloc_block_info> CachingPool::snapshot() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<bt_alloc_block_info> out;
  for (auto& [base, seg] : segments_)
    for (Block* b = seg->head; b; b = b->next) {
      bt_alloc_block_info info{};
      info.segment_address = seg->base;
      info.address = b->addr;
      info.size = b->size;
      info.requested = b->requested;
      info.stream = b->stream;
      info.allocated = b->allocated || !b->in_free_set;  // pending reuse counts as in use
      info.pool = b->pool_id != 0 ? b->pool_id : (b->small ? 0 : 1);
      info.expandable = seg->expandable;
      out.push_back(info);
    }
  return out;
}

// Note [Graph capture]
// While a stream is captured into a CUDA graph, the addresses its kernels use
// are baked into the graph and replayed later, so they must not be handed to
// anyone else. Allocations on that stream therefore come from a private pool
// of segments of their own. Blocks freed during the capture may be reused by
// later allocations of the same capture (replay repeats the same order), but
// never by other pools. release_private_pool() is called when the graphs are
// destroyed: wholly free segments are returned then, the rest as they empty.
int32_t CachingPool::begin_private_pool(StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (capturing_.count(stream))
    throw Error(BT_ALLOC_ESTATE, "[begin_graph_pool] this stream already has a private pool");
  const int32_t id = next_private_pool_++;
  capturing_[stream] = id;
  pools_[id];
  return id;
}

bool CachingPool::end_private_pool(StreamId stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  return capturing_.erase(stream) != 0;
}

bool CachingPool::release_private_pool(int32_t pool_id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = pools_.find(pool_id);
  if (pool_id < 2 || it == pools_.end()) return false;
  for (auto& [s, id] : capturing_)
    if (id == pool_id)
      throw Error(BT_ALLOC_ESTATE, "[release_graph_pool] pool " + std::to_string(pool_id) +
                                       " is still capturing; end the capture first");
  it->second.releasing = true;
  // Blocks parked for cross-stream use are safe once the graph is gone. Only
  // blocks in a free set are ever merged away, so a parked block is still
  // alive when its turn comes.
  std::vector<Block*> parked;
  std::vector<Segment*> wholly_free;
  for (auto& [base, seg] : segments_) {
    if (seg->pool_id != pool_id) continue;
    for (Block* b = seg->head; b; b = b->next)
      if (!b->allocated && !b->in_free_set) parked.push_back(b);
    if (seg->head && !seg->head->next && seg->head->in_free_set) wholly_free.push_back(seg);
  }
  for (Segment* seg : wholly_free) release_segment(seg);
  for (Block* b : parked) {
    b->pending_events = 0;
    free_block(b);  // merges, and returns the segment once wholly free
  }
  if (it->second.segments == 0) pools_.erase(it);
  return true;
}

}  // namespace bt::alloc
