// cpu/index.cpp: index_select, index_add, gather, scatter_add and cat on the CPU.
// Inputs are made contiguous first (a no-op in the common case); indices are range-checked in a
// serial pass so no exception is thrown inside an OpenMP region.
#include <cstring>

#include "../primitives.h"
#include "loops.h"

namespace bt {

using cpu::contiguous_raw;

// Reads an int32/int64 index tensor as int64 values, checking the range [-size, size).
static std::vector<int64_t> read_indices(const Tensor& idx_in, int64_t size, const char* op,
                                         int64_t dim, bool negative = true) {
  Tensor idx = contiguous_raw(idx_in);
  const int64_t n = idx.numel();
  std::vector<int64_t> r(n);
  if (idx.dtype() == DType::Int64) {
    std::memcpy(r.data(), idx.data_ptr(op), n * sizeof(int64_t));
  } else if (idx.dtype() == DType::Int32) {
    const int32_t* p = static_cast<const int32_t*>(idx.data_ptr(op));
    for (int64_t i = 0; i < n; ++i) r[i] = p[i];
  } else {
    throw TypeError(std::string("[") + op + "] index must be int32 or int64, got " +
                    dtype_name(idx.dtype()));
  }
  for (auto& v : r) {
    if (v < (negative ? -size : 0) || v >= size) {
      throw IndexError(std::string("[") + op + "] index " + std::to_string(v) +
                       " is out of range for dim " + std::to_string(dim) + " of size " +
                       std::to_string(size));
    }
    if (v < 0) v += size;
  }
  return r;
}

static void split3(const Shape& s, int64_t dim, int64_t& outer, int64_t& mid, int64_t& inner) {
  outer = 1;
  inner = 1;
  for (int64_t d = 0; d < dim; ++d) outer *= s[d];
  mid = s[dim];
  for (int64_t d = dim + 1; d < static_cast<int64_t>(s.size()); ++d) inner *= s[d];
}

// Whether t has an expanded dim (stride 0, size > 1): a contiguous copy of such a view can be far
// larger than its memory (ones(1).expand(2**40)), so kernels read it in place.
static bool has_expanded_dim(const Tensor& t) {
  for (int64_t d = 0; d < t.ndim(); ++d) {
    if (t.strides()[d] == 0 && t.shape()[d] > 1) return true;
  }
  return false;
}

// Element offsets (in x's strides) of every row-major position of x's dims [d0, d1).
static std::vector<int64_t> dim_offsets(const Tensor& x, int64_t d0, int64_t d1) {
  std::vector<int64_t> offs{0};
  for (int64_t d = d0; d < d1; ++d) {
    std::vector<int64_t> next;
    next.reserve(offs.size() * static_cast<size_t>(x.shape()[d]));
    for (int64_t o : offs) {
      for (int64_t i = 0; i < x.shape()[d]; ++i) next.push_back(o + i * x.strides()[d]);
    }
    offs.swap(next);
  }
  return offs;
}

// index_select reading a strided x in place (x with expanded dims): out (outer, J, inner).
static void index_select_strided(const Tensor& x, int64_t dim, const std::vector<int64_t>& idx,
                                 const Tensor& out, const char* op) {
  const auto outer = dim_offsets(x, 0, dim), inner = dim_offsets(x, dim + 1, x.ndim());
  const int64_t J = static_cast<int64_t>(idx.size()), sd = x.strides()[dim];
  const int64_t n_in = static_cast<int64_t>(inner.size());
  dispatch_all(x.dtype(), op, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* src = static_cast<const T*>(x.data_ptr(op));
    T* dst = static_cast<T*>(out.data_ptr(op));
    cpu::parallel_for(static_cast<int64_t>(outer.size()) * J, n_in, [&](int64_t r) {
      const int64_t o = r / J, j = r % J;
      const T* row = src + outer[o] + idx[j] * sd;
      T* orow = dst + r * n_in;
      for (int64_t i = 0; i < n_in; ++i) orow[i] = row[inner[i]];
    });
  });
}

void IndexSelect::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  if (has_expanded_dim(in[0]) && out[0].numel() > 0) {
    index_select_strided(
        in[0], dim,
        read_indices(in[1], in[0].shape()[dim], embedding ? "embedding" : name(), dim, !embedding),
        out[0], name());
    return;
  }
  Tensor x = contiguous_raw(in[0]);
  int64_t outer, D, inner;
  split3(x.shape(), dim, outer, D, inner);
  const auto idx = read_indices(in[1], D, embedding ? "embedding" : name(), dim, !embedding);
  const int64_t J = static_cast<int64_t>(idx.size());
  const size_t es = itemsize(x.dtype());
  const char* src = static_cast<const char*>(x.data_ptr(name()));
  char* dst = static_cast<char*>(out[0].data_ptr(name()));
  cpu::parallel_for(outer * J, inner, [&](int64_t r) {
    const int64_t o = r / J, j = r % J;
    std::memcpy(dst + (o * J + j) * inner * es, src + (o * D + idx[j]) * inner * es, inner * es);
  });
}

void IndexAdd::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  if (out[0].numel() && out[0].data_ptr(name()) != in[0].data_ptr(name())) {
    cpu::copy_raw(out[0], in[0]);
  }
  Tensor src = contiguous_raw(in[2]);
  int64_t outer, D, inner;
  split3(out[0].shape(), dim, outer, D, inner);
  const auto idx = read_indices(in[1], D, name(), dim);
  const int64_t J = static_cast<int64_t>(idx.size());
  dispatch_all(out[0].dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = compute_t<T>;
    T* o = static_cast<T*>(out[0].data_ptr(name()));
    const T* s = static_cast<const T*>(src.data_ptr(name()));
    // Parallel over (outer, inner) columns: repeated indices then never race.
    cpu::parallel_for(outer, J * inner, [&](int64_t ob) {
      for (int64_t j = 0; j < J; ++j) {
        T* orow = o + (ob * D + idx[j]) * inner;
        const T* srow = s + (ob * J + j) * inner;
        for (int64_t i = 0; i < inner; ++i) orow[i] = static_cast<T>(C(orow[i]) + C(srow[i]));
      }
    });
  });
}

// Offsets of a contiguous tensor of `shape` for every element of `ishape` (row-major), with the
// coordinate along `dim` replaced by the index value.
void Gather::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  // x is read through its own strides: an expanded view is not copied (see has_expanded_dim)
  const Tensor& x = in[0];
  const Shape& is = in[1].shape();
  const auto idx = read_indices(in[1], x.shape()[dim], name(), dim);
  const Strides xs = x.strides();
  const int64_t n = static_cast<int64_t>(idx.size()), nd = static_cast<int64_t>(is.size());
  dispatch_all(x.dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    const T* s = static_cast<const T*>(x.data_ptr(name()));
    T* o = static_cast<T*>(out[0].data_ptr(name()));
    cpu::parallel_for(n, 8, [&](int64_t e) {
      int64_t rem = e, off = 0;
      for (int64_t d = nd - 1; d >= 0; --d) {
        const int64_t c = rem % is[d];
        rem /= is[d];
        off += (d == dim ? idx[e] : c) * xs[d];
      }
      o[e] = s[off];
    });
  });
}

void ScatterAdd::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  cpu::copy_raw(out[0], in[0]);
  Tensor src = contiguous_raw(in[2]);
  const Shape& is = in[1].shape();
  const auto idx = read_indices(in[1], out[0].shape()[dim], name(), dim);
  const Strides os = contiguous_strides(out[0].shape());
  const int64_t n = static_cast<int64_t>(idx.size()), nd = static_cast<int64_t>(is.size());
  dispatch_all(out[0].dtype(), name(), [&](auto tag) {
    using T = typename decltype(tag)::type;
    using C = compute_t<T>;
    const T* s = static_cast<const T*>(src.data_ptr(name()));
    T* o = static_cast<T*>(out[0].data_ptr(name()));
    for (int64_t e = 0; e < n; ++e) {  // serial: indices may repeat
      int64_t rem = e, off = 0;
      for (int64_t d = nd - 1; d >= 0; --d) {
        const int64_t c = rem % is[d];
        rem /= is[d];
        off += (d == dim ? idx[e] : c) * os[d];
      }
      o[off] = static_cast<T>(C(o[off]) + C(s[e]));
    }
  });
}

void Concatenate::eval_cpu(const std::vector<Tensor>& in, std::vector<Tensor>& out) {
  int64_t outer, Dout, inner;
  split3(out[0].shape(), dim, outer, Dout, inner);
  const size_t es = itemsize(out[0].dtype());
  char* dst = static_cast<char*>(out[0].data_ptr(name()));
  int64_t at = 0;
  for (const Tensor& t0 : in) {
    Tensor t = contiguous_raw(t0);
    const int64_t D = t.shape()[dim];
    const char* src = static_cast<const char*>(t.data_ptr(name()));
    const size_t row = D * inner * es;
    cpu::parallel_for(outer, D * inner, [&](int64_t o) {
      std::memcpy(dst + (o * Dout + at) * inner * es, src + o * row, row);
    });
    at += D;
  }
}

}  // namespace bt
