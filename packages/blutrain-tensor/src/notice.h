// notice.h: one-time notices from host code, for what a user should know but that is not an
// error: a kernel falling back to a slower path for a shape (cuda/nn_fused.cu's mixed layer-norm
// backward, Note [mixed v6 shared memory]).  notice_once(key, text) writes
// "blutrain.tensor: <text>" to stderr the first time `key` is seen in the process and keeps the
// text (notices(): bt._C._notices() for tests); later calls with a seen key only look it up.
// Locking: one mutex over the seen keys and the texts; the stderr write happens under it, so two
// threads' lines never interleave.  Call it from host code only, off the hot path's common case
// (a key a shape, not a line an op).
#pragma once

#include <string>
#include <vector>

namespace bt {

// Returns true when this call wrote the notice (key not seen before).
bool notice_once(const std::string& key, const std::string& text);
// The texts written so far, in order.
std::vector<std::string> notices();

}  // namespace bt
