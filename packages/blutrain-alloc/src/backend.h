// What c_api.cpp needs from a backend. cuda/device_allocator.cpp provides it
// in CUDA builds, cpu/no_cuda.cpp (stubs that raise) otherwise.
#pragma once

#include <memory>

#include "caching_pool.h"

namespace bt::alloc {

int cuda_device_count();  // 0 when built without CUDA or no device is present
std::unique_ptr<CachingPool> make_device_pool(int device);  // throws Error
std::unique_ptr<CachingPool> make_pinned_pool();            // throws Error
std::unique_ptr<CachingPool> make_pageable_pool();          // host_allocator.cpp

}  // namespace bt::alloc
