// cuda/device_errors.h: how a kernel that checks values on the device (an index out of range, an
// integer division by zero, a cross-entropy target) reports the first error it finds, so that the
// host raises it at the next synchronisation naming the op the user called.  The record itself
// and check_index_errors() are index.cu's (runtime.h, [nn helper] IndexErrorRecord).
//
// Note [device errors name the op the user called]
// The error is raised later, at a sync inside another op (item, to, synchronize), so the name
// must travel with the record: the record's flag is a `code` that packs the kind of error (low
// 8 bits: runtime.h's constants, index.cu's 1-4) and an id of the op the user called when the
// kernel was launched (detail::outer_op(), else the launching primitive's name; ids interned on
// the host, bits 8 and up).  device_error_code() makes it at launch, check_index_errors() names
// that op ("[remainder_] integer division by zero", "[getitem] index 7 is out of range ...").
// Cost: one host-side lookup per launch of such a kernel; a CUDA graph replays the captured code.
#pragma once

#include <cstddef>

#include "runtime.h"

namespace bt::cuda {

constexpr int kDeviceErrorKindBits = 8;
constexpr int kDeviceErrorKindMask = (1 << kDeviceErrorKindBits) - 1;

// kind | (id of the op the user called, or of `op` when no OpScope is open) << 8.
int device_error_code(int kind, const char* op);

// What a checking kernel is given: where to record and the code to record (a null record records
// nothing: the bench programs pass nullptr).
struct DeviceErrorSink {
  IndexErrorRecord* rec = nullptr;
  int code = 0;
  DeviceErrorSink(std::nullptr_t = nullptr) {}  // NOLINT (implicit: a null sink)
  DeviceErrorSink(IndexErrorRecord* r, int c) : rec(r), code(c) {}
};
// index_error_record(device) (which arms the next check) with device_error_code(kind, op).
DeviceErrorSink device_error_sink(int device, int kind, const char* op);

#ifdef __CUDACC__
// Records (value, size) under the sink's code unless an earlier error holds the record.
__device__ __forceinline__ void record_device_error(const DeviceErrorSink& sink, long long value,
                                                    long long size) {
  if (sink.rec && atomicCAS(&sink.rec->flag, 0, sink.code) == 0) {
    sink.rec->value = value;
    sink.rec->size = size;
  }
}
#endif

}  // namespace bt::cuda
