// Internal error type: thrown inside the library, turned into a status code and
// a thread-local message at the C ABI boundary (c_api.cpp).
#pragma once

#include <stdexcept>
#include <string>

#include "blutrain/alloc.h"

namespace bt::alloc {

class Error : public std::runtime_error {
 public:
  Error(int code, const std::string& message) : std::runtime_error(message), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

std::string format_bytes(uint64_t bytes);  // "1.50 GiB"

}  // namespace bt::alloc
