// common.cpp: errors and dtype helpers shared by every build.
#include <string>

#include "core.h"

namespace bt::dist {

void fail(int code, const std::string& msg) { throw Error(code, msg); }

namespace {
struct DtypeInfo {
  const char* name;
  size_t size;
  bool floating;
};
// Indexed by bt_tensor_dtype (blutrain/tensor.h).
constexpr DtypeInfo kDtypes[] = {{"bool", 1, false},   {"uint8", 1, false},  {"int32", 4, false},
                                 {"int64", 8, false},  {"float16", 2, true}, {"bfloat16", 2, true},
                                 {"float32", 4, true}, {"float64", 8, true}};
constexpr int kNumDtypes = sizeof(kDtypes) / sizeof(kDtypes[0]);
}  // namespace

size_t dtype_size(int dtype, const char* op) {
  if (dtype < 0 || dtype >= kNumDtypes)
    fail(BT_DIST_EINVAL, std::string("[") + op + "] unknown dtype code " + std::to_string(dtype));
  return kDtypes[dtype].size;
}

const char* dtype_name(int dtype) {
  return dtype >= 0 && dtype < kNumDtypes ? kDtypes[dtype].name : "unknown";
}

bool dtype_is_floating(int dtype) {
  return dtype >= 0 && dtype < kNumDtypes && kDtypes[dtype].floating;
}

const char* op_name(int op) {
  switch (op) {
    case BT_DIST_SUM:
      return "sum";
    case BT_DIST_AVG:
      return "avg";
    case BT_DIST_MAX:
      return "max";
    case BT_DIST_MIN:
      return "min";
    default:
      return "unknown";
  }
}

}  // namespace bt::dist
