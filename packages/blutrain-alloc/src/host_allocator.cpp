// Pageable host memory: segments from the C library, no streams, no events.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>

#include "backend.h"

namespace bt::alloc {
namespace {

constexpr size_t kHostAlignment = 4096;  // bytes: a page, so blocks suit any SIMD width

class PageableSource final : public MemorySource {
 public:
  uintptr_t allocate(size_t bytes) override {
    void* p = nullptr;
    if (posix_memalign(&p, kHostAlignment, bytes) != 0) return 0;
    return reinterpret_cast<uintptr_t>(p);
  }
  void release(uintptr_t base, size_t) override { std::free(reinterpret_cast<void*>(base)); }
  uint64_t total_bytes() const override {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? uint64_t(pages) * uint64_t(page) : 0;
  }
  const char* kind() const override { return "pageable host memory"; }

  // Expandable segments on host: reserve address space with no access, then
  // grant and revoke access in granules (the pages themselves appear on first
  // touch and go back with MADV_DONTNEED). This is what the CUDA virtual memory
  // API does on the device, so the same pool code is tested on any machine.
  bool supports_expandable() const override { return true; }
  size_t expand_granularity() const override { return kLargeRounding; }
  uintptr_t reserve(size_t bytes) override {
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? 0 : reinterpret_cast<uintptr_t>(p);
  }
  bool grow(uintptr_t base, size_t from, size_t to) override {
    return mprotect(reinterpret_cast<void*>(base + from), to - from, PROT_READ | PROT_WRITE) == 0;
  }
  void shrink(uintptr_t base, size_t from, size_t to) override {
    void* p = reinterpret_cast<void*>(base + from);
    madvise(p, to - from, MADV_DONTNEED);
    mprotect(p, to - from, PROT_NONE);
  }
  void unreserve(uintptr_t base, size_t bytes) override {
    munmap(reinterpret_cast<void*>(base), bytes);
  }
};

}  // namespace

std::unique_ptr<CachingPool> make_pageable_pool() {
  return std::make_unique<CachingPool>(std::make_unique<PageableSource>(), nullptr,
                                       /*key_by_stream=*/false);
}

}  // namespace bt::alloc
