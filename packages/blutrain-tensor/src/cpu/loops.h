// cpu/loops.h: strided N-operand iteration for CPU kernels.
//
// for_each_strided(shape, {strides of operand 0..N-1}, body) calls
//   body(offsets, n, inner_strides)
// for runs of n elements along the innermost (collapsed) dim; offsets and strides are in elements.
// Dims where every operand is contiguous with its neighbour are merged first, so a contiguous op
// is one long run (split into chunks for the thread pool, parallel.h).  Bodies test for unit/zero
// inner strides so the compiler vectorises the common cases.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "../tensor.h"
#include "parallel.h"

namespace bt::cpu {

constexpr int64_t kChunk = 16384;        // elements per work item
constexpr int64_t kParallelMin = 32768;  // below this many elements run serially

template <size_t N, typename Body>
void for_each_strided(const Shape& shape_in, const std::array<Strides, N>& strides_in,
                      Body&& body) {
  // Drop size-1 dims, then merge mergeable neighbours.
  Shape shape;
  std::array<Strides, N> st;
  for (size_t d = 0; d < shape_in.size(); ++d) {
    if (shape_in[d] == 1) continue;
    if (shape_in[d] == 0) return;
    shape.push_back(shape_in[d]);
    for (size_t k = 0; k < N; ++k) st[k].push_back(strides_in[k][d]);
  }
  // Iterate in operand 0's memory order (outermost = largest stride): an output that took a
  // transposed input's layout is then walked, and merged, like a contiguous one.
  {
    std::vector<size_t> order(shape.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return std::abs(st[0][a]) > std::abs(st[0][b]); });
    Shape s2(shape.size());
    std::array<Strides, N> st2;
    for (size_t k = 0; k < N; ++k) st2[k].resize(shape.size());
    for (size_t i = 0; i < order.size(); ++i) {
      s2[i] = shape[order[i]];
      for (size_t k = 0; k < N; ++k) st2[k][i] = st[k][order[i]];
    }
    shape.swap(s2);
    st.swap(st2);
  }
  if (shape.empty()) {
    std::array<int64_t, N> off{}, in{};
    body(off, int64_t{1}, in);
    return;
  }
  Shape ms{shape[0]};
  std::array<Strides, N> mst;
  for (size_t k = 0; k < N; ++k) mst[k].push_back(st[k][0]);
  for (size_t d = 1; d < shape.size(); ++d) {
    bool merge = true;
    for (size_t k = 0; k < N; ++k) merge = merge && (mst[k].back() == st[k][d] * shape[d]);
    if (merge) {
      ms.back() *= shape[d];
      for (size_t k = 0; k < N; ++k) mst[k].back() = st[k][d];
    } else {
      ms.push_back(shape[d]);
      for (size_t k = 0; k < N; ++k) mst[k].push_back(st[k][d]);
    }
  }
  const int64_t nd = static_cast<int64_t>(ms.size());
  const int64_t inner = ms[nd - 1];
  int64_t rows = 1;
  for (int64_t d = 0; d < nd - 1; ++d) rows *= ms[d];
  const int64_t chunks = (inner + kChunk - 1) / kChunk;
  const int64_t units = rows * chunks;
  std::array<int64_t, N> instr;
  for (size_t k = 0; k < N; ++k) instr[k] = mst[k][nd - 1];
  auto run = [&](int64_t u) {
    int64_t row = u / chunks, c = u % chunks;
    std::array<int64_t, N> off{};
    int64_t rem = row;
    for (int64_t d = nd - 2; d >= 0; --d) {
      const int64_t i = rem % ms[d];
      rem /= ms[d];
      for (size_t k = 0; k < N; ++k) off[k] += i * mst[k][d];
    }
    const int64_t start = c * kChunk, n = std::min(kChunk, inner - start);
    for (size_t k = 0; k < N; ++k) off[k] += start * instr[k];
    body(off, n, instr);
  };
  const int64_t total = rows * inner;
  // Work items of at least kChunk elements each (whole rows when rows are short).
  const int64_t grain =
      total >= kParallelMin ? std::max<int64_t>(1, kChunk / std::min(inner, kChunk)) : units;
  parallel_ranges(units, grain, [&](int64_t b, int64_t e) {
    for (int64_t u = b; u < e; ++u) run(u);
  });
}

// Parallel loop over [0, n) for row-wise kernels: f(i) for each item, each about
// `work_per_item` elements of work; serial below kParallelMin in all, else ranges of at least
// kChunk / 2 elements of work.
template <typename F>
void parallel_for(int64_t n, int64_t work_per_item, F&& f) {
  const int64_t w = std::max<int64_t>(work_per_item, 1);
  const int64_t grain = n * w >= kParallelMin ? std::max<int64_t>(1, kChunk / 2 / w) : n;
  parallel_ranges(n, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) f(i);
  });
}

// Raw helpers that bypass autograd and capture (kernels only).
Tensor contiguous_raw(const Tensor& t);               // t itself when already contiguous
void copy_raw(const Tensor& dst, const Tensor& src);  // same shape; casts; any strides
// o[i] = tanh(a[i]), the Tanh op's own contiguous loop (so a fused kernel gets its bits);
// T: float, double, bfloat16, float16.
template <typename T>
void tanh_raw(const T* a, T* o, int64_t n);

}  // namespace bt::cpu
