// ops.h: the backend-neutral front.  Each op promotes dtypes, broadcasts, checks shapes and
// builds its primitive node (see primitives.h); errors name the op.
#pragma once

#include <optional>
#include <vector>

#include "primitives.h"
#include "tensor.h"

namespace bt {

// ---- creation ------------------------------------------------------------------------------
Tensor full(const Shape& shape, double value, DType dtype, Device device, const char* op = "full");
// value exact for integers; a value the dtype cannot hold (NaN into int64, 300 into uint8) is a
// ValueError naming op.
Tensor full(const Shape& shape, Scalar value, DType dtype, Device device, const char* op = "full");
Tensor zeros(const Shape& shape, DType dtype, Device device);
Tensor ones(const Shape& shape, DType dtype, Device device);
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor empty(const Shape& shape, DType dtype, Device device);
Tensor arange(double start, double stop, double step, DType dtype, Device device);
// Integral start, stop and step: exact int64 values; every value must fit dtype (no bool).
Tensor arange(Scalar start, Scalar stop, Scalar step, DType dtype, Device device);
Tensor rand(const Shape& shape, DType dtype, Device device);
Tensor randn(const Shape& shape, DType dtype, Device device);
Tensor randint(int64_t low, int64_t high, const Shape& shape, DType dtype, Device device);
void manual_seed(uint64_t seed);
uint64_t initial_seed();
// Reserves n counters of the global generator: returns (seed, offset).
std::pair<uint64_t, uint64_t> next_philox(uint64_t n);

// ---- copies, dtype and device --------------------------------------------------------------
Tensor astype(const Tensor& x, DType dtype);  // a copy only when the dtype changes
Tensor to_device(const Tensor& x, Device device);
Tensor contiguous(const Tensor& x);
Tensor clone(const Tensor& x);
// x cast to `dtype`, kept with x's storage and reused while x is unchanged (Note [cached casts],
// primitives.h): for a master weight's compute copy.  Differentiable (the gradient goes to x);
// the result shares the kept copy's memory.  Plain astype when disabled, for non-floating
// dtypes, symbolic tensors and in capture mode.
Tensor cached_astype(const Tensor& x, DType dtype);
// Frees the casts cached_astype keeps for x's storage (every geometry and dtype).
void drop_cast_cache(const Tensor& x);
// Bytes held by the casts kept for x's storage.
int64_t cast_cache_bytes(const Tensor& x);
// Process-wide switch (default on): off, cached_astype is astype (no copy kept or reused).
void set_cast_cache_enabled(bool enabled);
bool cast_cache_enabled();

// ---- views ---------------------------------------------------------------------------------
Tensor reshape(const Tensor& x, Shape shape);  // a view where strides allow, else a copy
// x (..., n) as (rows, n), rows the product of the leading dims (reshape(x, {-1, n}), which is
// ambiguous for n == 0).  x must have at least one dim.
Tensor as_rows(const Tensor& x);
Tensor view(const Tensor& x, Shape shape);  // a view or an error
Tensor flatten(const Tensor& x, int64_t start = 0, int64_t end = -1);
Tensor permute(const Tensor& x, std::vector<int64_t> perm);
Tensor transpose(const Tensor& x, int64_t d0, int64_t d1);
Tensor expand(const Tensor& x, const Shape& shape);  // -1 keeps a dim
Tensor broadcast_to(const Tensor& x, const Shape& shape);
Tensor slice(const Tensor& x, int64_t dim, std::optional<int64_t> start,
             std::optional<int64_t> stop, int64_t step);
Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length);
Tensor select(const Tensor& x, int64_t dim, int64_t index);
std::vector<Tensor> split(const Tensor& x, int64_t size, int64_t dim);
std::vector<Tensor> split_sizes(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim);
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim);
Tensor squeeze(const Tensor& x, std::optional<int64_t> dim);
Tensor unsqueeze(const Tensor& x, int64_t dim);
Tensor slice_scatter(const Tensor& base, const Tensor& src, int64_t dim, int64_t start,
                     int64_t stop, int64_t step);

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);
// Sums `g` down to `shape` (the vjp of broadcasting).
Tensor sum_to(const Tensor& g, const Shape& shape);

// ---- elementwise ---------------------------------------------------------------------------
Tensor unary(UnaryOp op, const Tensor& x);
Tensor binary(BinaryOp op, const Tensor& a, const Tensor& b);
Tensor binary(BinaryOp op, const Tensor& a, Scalar b);
Tensor binary(BinaryOp op, Scalar a, const Tensor& b);
inline Tensor add(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Add, a, b); }
inline Tensor sub(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Sub, a, b); }
inline Tensor mul(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Mul, a, b); }
inline Tensor div(const Tensor& a, const Tensor& b) { return binary(BinaryOp::Div, a, b); }
inline Tensor mul(const Tensor& a, double b) { return binary(BinaryOp::Mul, a, Scalar{b, 2}); }
inline Tensor add(const Tensor& a, double b) { return binary(BinaryOp::Add, a, Scalar{b, 2}); }
inline Tensor neg(const Tensor& x) { return unary(UnaryOp::Neg, x); }
Tensor gelu(const Tensor& x, bool tanh_approx);
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
Tensor where(const Tensor& cond, const Tensor& a, Scalar b);
Tensor masked_fill(const Tensor& x, const Tensor& mask, Scalar value);
// "[op] mask is on ... but the input is on ..." unless both share a device (a 0-d mask too).
void check_mask_device(const Tensor& x, const Tensor& mask, const char* op);

// In place: computes op(x, y) out of place, writes it into x's memory, bumps x's version and
// moves x's autograd history onto the result.  Returns x.
Tensor& inplace(Tensor& x, const Tensor& result, const char* op);
Tensor& copy_(Tensor& dst, const Tensor& src);
// x.fill_(number): as inplace(x, full({}, v)), but a contiguous tensor outside autograd and
// capture is written by the Full kernel in place (no 0-d staging tensor: no allocator call).
Tensor& fill_(Tensor& x, Scalar v, const char* op);

// ---- reductions ----------------------------------------------------------------------------
// dims empty: all dims.
Tensor reduce(ReduceOp op, const Tensor& x, std::vector<int64_t> dims, bool keepdim,
              double correction = 1);
inline Tensor sum(const Tensor& x, std::vector<int64_t> dims = {}, bool keepdim = false) {
  return reduce(ReduceOp::Sum, x, std::move(dims), keepdim);
}
Tensor argreduce(bool is_max, const Tensor& x, std::optional<int64_t> dim, bool keepdim);

// ---- indexing, joining ---------------------------------------------------------------------
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);
// writes `out` (contiguous, of the result's shape and dtype); no autograd, not captured;
// embedding: embedding()'s index rules and messages
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index, const Tensor& out,
                    bool embedding = false);
// over_base: the result is written over base's memory (the caller checked donatable(base)).
Tensor index_add(const Tensor& base, int64_t dim, const Tensor& index, const Tensor& src,
                 bool over_base = false);
Tensor gather(const Tensor& x, int64_t dim, const Tensor& index);
Tensor scatter_add(const Tensor& base, int64_t dim, const Tensor& index, const Tensor& src);
Tensor cat(const std::vector<Tensor>& xs, int64_t dim);
Tensor stack(const std::vector<Tensor>& xs, int64_t dim);
Tensor embedding(const Tensor& weight, const Tensor& index);
Tensor masked_select_bool(const Tensor& x, const Tensor& mask);  // x[mask]

// ---- neural-network ops --------------------------------------------------------------------
Tensor softmax(const Tensor& x, int64_t dim, bool log);
// recompute: the output is rebuilt in backward by whichever op saves it, instead of being kept
// (Note [recomputed activations], primitives.h).  out_dtype: the output's dtype (default x's); a
// 16-bit output of a float32 x is one kernel (Note [float32 residual stream], nn_fused.h), other
// pairs normalise in x's dtype and cast.
Tensor layer_norm(const Tensor& x, const Shape& normalized_shape, const Tensor& weight,
                  const Tensor& bias, double eps, bool recompute = false,
                  std::optional<DType> out_dtype = std::nullopt);
Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index,
                     const std::string& reduction, double label_smoothing,
                     std::optional<DType> loss_dtype = std::nullopt);
Tensor dropout(const Tensor& x, double p, bool training);
Tensor matmul(const Tensor& a, const Tensor& b);
Tensor bmm(const Tensor& a, const Tensor& b);
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias);
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& attn_mask, double dropout_p, bool is_causal,
                                    std::optional<double> scale);
// Scales every gradient in place so their global L2 norm is at most max_norm; returns the norm
// before clipping (a 0-d float32 tensor).
Tensor clip_grad_norm_(const std::vector<Tensor>& grads, double max_norm, double eps = 1e-6);

}  // namespace bt
