// attention.cpp: the fused attention front and its vjp (kernels: cpu/attention.cpp,
// cuda/attention.cu).
#include "attention.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

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

std::pair<Tensor, Tensor> flash_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                          bool causal, double scale) {
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
  Tensor glse = a.cotangents[1];
  glse = astype(glse, lse.dtype());
  const int64_t B = q.size(0), H = q.size(1), L = q.size(2), D = q.size(3), S = k.size(2);
  auto r =
      apply(std::make_shared<FlashAttentionBackward>(scale, causal), {q, k, v, o, g, lse, glse},
            {{{B, L, H, D}, q.dtype()}, {{B, S, H, D}, k.dtype()}, {{B, S, H, D}, v.dtype()}},
            q.device());
  return {permute(r[0], {0, 2, 1, 3}), permute(r[1], {0, 2, 1, 3}), permute(r[2], {0, 2, 1, 3})};
}

std::vector<Tensor> FlashAttentionBackward::vjp(const VjpArgs& a) { return Primitive::vjp(a); }

}  // namespace bt
