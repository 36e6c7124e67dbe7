// Pageable host memory: segments from the C library, no streams, no events.
#include <cstdlib>
#include <unistd.h>

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
};

}  // namespace

std::unique_ptr<CachingPool> make_pageable_pool() {
  return std::make_unique<CachingPool>(std::make_unique<PageableSource>(), nullptr,
                                       /*key_by_stream=*/false);
}

}  // namespace bt::alloc
