// attention.cpp: the fused attention front and its vjp (kernels: cpu/attention.cpp,
// cuda/attention.cu).
#include "attention.h"

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "autocast.h"  // linear_weight_grads
#include "autograd.h"
#include "ops.h"

namespace bt {

namespace {
bool env_on(const char* name) {
  const char* v = std::getenv(name);
  return v && *v && std::strcmp(v, "0") != 0;
}
std::atomic<bool> g_flash_cpu{env_on("BLUTRAIN_FLASH_ATTENTION_CPU")};

DType lse_dtype(DType d) { return d == DType::Float64 ? DType::Float64 : DType::Float32; }

// The fused kernels read D with unit stride (rows may be strided anyhow).
Tensor unit_last(const Tensor& t) {
  return t.shape().back() <= 1 || t.strides().back() == 1 ? t : contiguous(t);
}
}  // namespace

bool flash_attention_cpu() { return g_flash_cpu.load(std::memory_order_relaxed); }
void set_flash_attention_cpu(bool on) { g_flash_cpu.store(on, std::memory_order_relaxed); }

bool flash_attention_supported(const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4) return false;
  if (q.dtype() != k.dtype() || q.dtype() != v.dtype() || !is_floating(q.dtype())) return false;
  if (q.device() != k.device() || q.device() != v.device()) return false;
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  if (k.size(0) != B || v.size(0) != B || k.size(1) != H || v.size(1) != H) return false;
  if (k.size(3) != D || v.size(3) != D || v.size(2) != S) return false;
  if (L < 1 || S < 1 || D < 1 || (causal && L != S)) return false;
  if (q.device().is_cuda() && D > 256) return false;
  return true;
}

namespace {
// The kernels fold the scale into the exponent after the row max: it must be positive.
void check_scale(double scale, const char* op) {
  if (!(std::isfinite(scale) && scale > 0)) {
    throw ValueError(std::string("[") + op + "] scale must be a positive finite number, got " +
                     std::to_string(scale) +
                     " (scaled_dot_product_attention composes GEMMs for any other scale)");
  }
}
}  // namespace

std::pair<Tensor, Tensor> flash_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                          bool causal, double scale) {
  OpScope scope("flash_attention");  // Note [the op the user called]
  check_scale(scale, "flash_attention");
  if (!flash_attention_supported(q, k, v, causal)) {
    throw ValueError("[flash_attention] unsupported inputs q " + shape_str(q.shape()) + ", k " +
                     shape_str(k.shape()) + ", v " + shape_str(v.shape()) + " (" +
                     dtype_name(q.dtype()) + (causal ? ", causal" : "") +
                     "): needs 4-D (B, H, L, D) q and (B, H, S, D) k, v of one float dtype and "
                     "device, L, S >= 1, L == S when causal, D <= 256 on CUDA");
  }
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3);
  auto outs = apply(std::make_shared<FlashAttention>(scale, causal),
                    {unit_last(q), unit_last(k), unit_last(v)},
                    {{{B, L, H, D}, q.dtype()}, {{B, H, L}, lse_dtype(q.dtype())}}, q.device());
  return {permute(outs[0], {0, 2, 1, 3}), outs[1]};
}

std::vector<Tensor> FlashAttention::vjp(const VjpArgs& a) {
  const Tensor& q = a.inputs[0];
  const Tensor& k = a.inputs[1];
  const Tensor& v = a.inputs[2];
  const Tensor& o = a.outputs[0];
  const Tensor& lse = a.outputs[1];
  Tensor g = unit_last(a.cotangents[0]);
  const Tensor& dl = a.cotangents[1];
  const Tensor glse = dl.defined() ? astype(dl, lse.dtype()) : Tensor();  // undefined: zero
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  // Gradients in q's layout when q is a contiguous (B, H, L, D) tensor (separate leaves: their
  // gradients are then kept as they come), else (B, L|S, H, D) rows, seen as (B, H, L|S, D).
  const bool heads_major = q.is_contiguous();
  auto shape = [&](int64_t rows) {
    return heads_major ? Shape{B, H, rows, D} : Shape{B, rows, H, D};
  };
  auto r = apply(std::make_shared<FlashAttentionBackward>(scale, causal, heads_major),
                 {q, k, v, o, g, lse, glse},
                 {{shape(L), q.dtype()}, {shape(S), k.dtype()}, {shape(S), v.dtype()}}, q.device());
  if (heads_major) return r;
  return {permute(r[0], {0, 2, 1, 3}), permute(r[1], {0, 2, 1, 3}), permute(r[2], {0, 2, 1, 3})};
}

std::vector<Tensor> attention_grad_rows(const std::vector<Tensor>& out, bool heads_major) {
  if (!heads_major) return out;
  std::vector<Tensor> r;
  for (const Tensor& t : out) {
    const auto& s = t.shape();
    const auto& w = t.strides();
    r.push_back(make_view(t, {s[0], s[2], s[1], s[3]}, {w[0], w[2], w[1], w[3]}, t.offset()));
  }
  return r;
}

std::vector<Tensor> FlashAttentionBackward::vjp(const VjpArgs& a) { return Primitive::vjp(a); }

// ---- packed qkv -------------------------------------------------------------------------------

std::vector<Tensor> packed_qkv_views(const Tensor& x, int64_t heads) {
  const int64_t B = x.size(0), T = x.size(1), HD = x.size(2) / 3, D = HD / heads;
  const Strides st{x.strides()[0], D, x.strides()[1], 1};
  std::vector<Tensor> r;
  for (int j = 0; j < 3; ++j) r.push_back(make_view(x, {B, heads, T, D}, st, x.offset() + j * HD));
  return r;
}

std::vector<Tensor> packed_grad_views(const Tensor& dx, int64_t heads) {
  const int64_t B = dx.size(0), T = dx.size(1), HD = dx.size(2) / 3, D = HD / heads;
  const Strides st{dx.strides()[0], dx.strides()[1], D, 1};
  std::vector<Tensor> r;
  for (int j = 0; j < 3; ++j)
    r.push_back(make_view(dx, {B, T, heads, D}, st, dx.offset() + j * HD));
  return r;
}

Tensor packed_qkv_source(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (!grad_enabled() || q.ndim() != 4 || k.shape() != q.shape() || v.shape() != q.shape()) {
    return {};
  }
  for (const Tensor* t : {&q, &k, &v}) {
    if (!t->requires_grad() || !t->grad_fn() || t->is_symbolic() || t->impl()->retains_grad) {
      return {};
    }
  }
  const auto& base_impl = q.impl()->view_base;
  if (!base_impl || k.impl()->view_base != base_impl || v.impl()->view_base != base_impl) return {};
  if (k.storage() != q.storage() || v.storage() != q.storage()) return {};
  Tensor base(base_impl);
  if (!base.storage() || base.storage() != q.storage() || !base.is_contiguous() ||
      base.dtype() != q.dtype() || !base.requires_grad()) {
    return {};
  }
  if (k.strides() != q.strides() || v.strides() != q.strides()) return {};
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), HD = H * D;
  if (B < 1 || H < 1 || T < 1 || D < 1) return {};
  // Strides of size-1 dims are free: take the canonical ones there.
  int64_t sb = q.strides()[0], sh = q.strides()[1], sl = q.strides()[2], sd = q.strides()[3];
  if (D > 1 && sd != 1) return {};
  if (H > 1 && sh != D) return {};
  if (T == 1) sl = B > 1 ? sb : 3 * HD;
  if (B == 1) sb = T * sl;
  if (sl < 3 * HD || sb != T * sl) return {};
  if (k.offset() != q.offset() + HD || v.offset() != q.offset() + 2 * HD) return {};
  // X (B, T, 3 H D): rows r0 + b T + t, columns c0 .. c0 + 3 H D of the base seen as rows of sl.
  const int64_t off = q.offset() - base.offset(), n = base.numel();
  if (off < 0 || n % sl != 0) return {};
  const int64_t r0 = off / sl, c0 = off % sl;
  if (c0 + 3 * HD > sl || (r0 + B * T) * sl > n) return {};
  // their gradients must reach the base unchanged apart from the index map (hook-free views),
  // which the geometry above then fixes
  for (const Tensor* t : {&q, &k, &v}) {
    if (!grad_flows_through_views(*t, base)) return {};
  }
  Tensor x = reshape(base, {n / sl, sl});
  x = slice(x, 0, r0, r0 + B * T, 1);
  x = slice(x, 1, c0, c0 + 3 * HD, 1);
  return view(x, {B, T, 3 * HD});
}

std::pair<Tensor, Tensor> flash_attention_packed(const Tensor& x, int64_t heads, bool causal,
                                                 double scale) {
  check_scale(scale, "flash_attention_packed");
  const bool ok = x.ndim() == 3 && heads >= 1 && is_floating(x.dtype()) && x.size(0) >= 1 &&
                  x.size(1) >= 1 && x.size(2) >= 3 * heads && x.size(2) % (3 * heads) == 0 &&
                  (!x.device().is_cuda() || x.size(2) / (3 * heads) <= 256);
  if (!ok) {
    throw ValueError("[flash_attention_packed] unsupported input " + shape_str(x.shape()) + " (" +
                     dtype_name(x.dtype()) + ") with " + std::to_string(heads) +
                     " heads: needs a float (B, T, 3 * heads * D) tensor, B, T >= 1, D <= 256 on "
                     "CUDA");
  }
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2) / (3 * heads);
  auto outs =
      apply(std::make_shared<FlashAttentionPacked>(scale, causal, heads), {unit_last(x)},
            {{{B, T, heads, D}, x.dtype()}, {{B, heads, T}, lse_dtype(x.dtype())}}, x.device());
  return {permute(outs[0], {0, 2, 1, 3}), outs[1]};
}

std::vector<Tensor> FlashAttentionPacked::vjp(const VjpArgs& a) {
  const Tensor& x = a.inputs[0];
  const Tensor& lse = a.outputs[1];
  Tensor g = unit_last(a.cotangents[0]);
  const Tensor& dl = a.cotangents[1];
  const Tensor glse = dl.defined() ? astype(dl, lse.dtype()) : Tensor();  // undefined: zero
  auto r = apply(std::make_shared<FlashAttentionPackedBackward>(scale, causal, heads),
                 {x, a.outputs[0], g, lse, glse}, {{x.shape(), x.dtype()}}, x.device());
  return {r[0]};
}

std::vector<Tensor> QkvAttention::vjp(const VjpArgs& a) {
  // Only o's cotangent flows (the front returns neither lse nor qkv).
  const Tensor &x = a.inputs[0], &w = a.inputs[1];
  const Tensor& o = a.outputs[0];
  const Tensor& qkv = a.outputs[2];
  const int64_t M = qkv.size(0), N = qkv.size(1), B = M / seq;
  const DType dt = qkv.dtype();
  const bool want_db = has_bias && a.needs[2];
  const DType cs_dtype = dt == DType::Float64 ? DType::Float64 : DType::Float32;
  std::vector<std::pair<Shape, DType>> meta{{{B, seq, N}, dt}};
  if (want_db) meta.push_back({Shape{N}, cs_dtype});
  auto d = apply(std::make_shared<FlashAttentionPackedBackward>(scale, causal, heads, want_db),
                 {view(qkv, {B, seq, N}), o, unit_last(a.cotangents[0]), a.outputs[1], Tensor()},
                 meta, qkv.device());
  const Tensor dqkv = view(d[0], {M, N});
  std::vector<Tensor> r(a.inputs.size());
  if (a.needs[0]) r[0] = matmul(dqkv, w);
  if (a.needs[1]) {
    r[1] = weight_grad_dtype(a, 1, dt) != dt
               ? linear_weight_grads(a, dqkv, x, w.shape(), 1, false).first
               : matmul(transpose(dqkv, 0, 1), x);
  }
  if (want_db) {
    const DType want = weight_grad_dtype(a, 2, dt);
    r[2] = d[1].dtype() == want ? d[1] : astype(d[1], want);
  }
  return r;
}

std::vector<Tensor> FlashAttentionPackedBackward::vjp(const VjpArgs& a) {
  return Primitive::vjp(a);
}

}  // namespace bt
