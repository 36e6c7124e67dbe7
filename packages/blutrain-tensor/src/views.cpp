// views.cpp: the view primitives' geometry (device-neutral: no data is touched, so the same code
// serves CPU, CUDA and symbolic tensors).
#include <optional>

#include "primitives.h"

namespace bt {

// Strides for viewing (shape, strides) as new_shape without a copy, or nullopt (PyTorch's
// computeStride: dims may be split or merged only inside runs that are contiguous together).
std::optional<Strides> view_strides(const Shape& old_shape, const Strides& old_strides,
                                    const Shape& new_shape) {
  const int64_t numel = shape_numel(old_shape);
  if (numel == 0 || old_shape.empty()) return contiguous_strides(new_shape);
  Strides ns(new_shape.size());
  int64_t view_d = static_cast<int64_t>(new_shape.size()) - 1;
  int64_t chunk_base = old_strides.back(), tensor_numel = 1, view_numel = 1;
  for (int64_t td = static_cast<int64_t>(old_shape.size()) - 1; td >= 0; --td) {
    tensor_numel *= old_shape[td];
    if (td == 0 || (old_shape[td - 1] != 1 && old_strides[td - 1] != tensor_numel * chunk_base)) {
      while (view_d >= 0 && (view_numel < tensor_numel || new_shape[view_d] == 1)) {
        ns[view_d] = view_numel * chunk_base;
        view_numel *= new_shape[view_d];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (td > 0) {
        chunk_base = old_strides[td - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return ns;
}

Tensor Reshape::eval_view(const std::vector<Tensor>& in) {
  const Tensor& x = in[0];
  auto st = view_strides(x.shape(), x.strides(), shape);
  if (!st) throw RuntimeError("[reshape] internal: input is not viewable as " + shape_str(shape));
  return make_view(x, shape, *st, x.offset());
}

Tensor Permute::eval_view(const std::vector<Tensor>& in) {
  const Tensor& x = in[0];
  Shape s(perm.size());
  Strides st(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) {
    s[i] = x.shape()[perm[i]];
    st[i] = x.strides()[perm[i]];
  }
  return make_view(x, s, st, x.offset());
}

Tensor Expand::eval_view(const std::vector<Tensor>& in) {
  const Tensor& x = in[0];
  const int64_t lead = static_cast<int64_t>(shape.size()) - x.ndim();
  Strides st(shape.size(), 0);
  for (int64_t d = 0; d < x.ndim(); ++d) {
    st[lead + d] = (x.shape()[d] == 1 && shape[lead + d] != 1) ? 0 : x.strides()[d];
  }
  return make_view(x, shape, st, x.offset());
}

Tensor Slice::eval_view(const std::vector<Tensor>& in) {
  const Tensor& x = in[0];
  Shape s = x.shape();
  Strides st = x.strides();
  s[dim] = stop > start ? (stop - start + step - 1) / step : 0;
  const int64_t off = x.offset() + (s[dim] > 0 ? start * st[dim] : 0);
  st[dim] *= step;
  return make_view(x, s, st, off);
}

Tensor Select::eval_view(const std::vector<Tensor>& in) {
  const Tensor& x = in[0];
  Shape s = x.shape();
  Strides st = x.strides();
  const int64_t off = x.offset() + index * st[dim];
  s.erase(s.begin() + dim);
  st.erase(st.begin() + dim);
  return make_view(x, s, st, off);
}

Tensor CachedCast::eval_view(const std::vector<Tensor>& in) {
  const Tensor& copy = in[1];
  return make_view(copy, copy.shape(), copy.strides(), copy.offset());
}

// Views never reach a kernel.
#define BT_VIEW_NO_KERNEL(Name)                                                         \
  void Name::eval_cpu(const std::vector<Tensor>&, std::vector<Tensor>&) {               \
    throw RuntimeError(std::string("[") + name() + "] internal: a view has no kernel"); \
  }                                                                                     \
  void Name::eval_gpu(const std::vector<Tensor>&, std::vector<Tensor>&) {               \
    throw RuntimeError(std::string("[") + name() + "] internal: a view has no kernel"); \
  }
BT_VIEW_NO_KERNEL(Reshape)
BT_VIEW_NO_KERNEL(Permute)
BT_VIEW_NO_KERNEL(Expand)
BT_VIEW_NO_KERNEL(Slice)
BT_VIEW_NO_KERNEL(Select)
BT_VIEW_NO_KERNEL(CachedCast)

}  // namespace bt
