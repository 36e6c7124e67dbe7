// python/init_attention.cpp: bindings of src/attention.h (see init.h).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>

#include <algorithm>
#include <cmath>
#include <optional>

#include "../attention.h"
#include "init.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace bt::python {

void init_attention(nanobind::module_& m) {
  m.def(
      "flash_attention",
      [](const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
         std::optional<double> scale) {
        const double sc = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(q.shape().back()));
        return flash_attention(q, k, v, causal, sc);
      },
      "query"_a, "key"_a, "value"_a, "is_causal"_a = false, "scale"_a = nb::none(),
      "flash_attention(q, k, v, is_causal=False, scale=None) -> (out, lse)\n\n"
      "The fused attention kernel: q (B, H, L, D), k and v (B, H, S, D) (any strides on B, H and\n"
      "the sequence dim). out (B, H, L, D) is a view of a (B, L, H, D) contiguous tensor, so\n"
      "out.transpose(1, 2).view(B, L, H * D) is free; lse (B, H, L) is the rows' logsumexp\n"
      "(float32; float64 for float64 inputs). Causal needs L == S. Differentiable in q, k, v (and\n"
      "through lse). A causal row never reads masked (later) keys; a row whose scores are all\n"
      "-inf has out 0 and lse -inf and passes no gradient (scaled_dot_product_attention's\n"
      "docstring: where this differs from PyTorch).");
  m.def(
      "flash_attention_packed",
      [](const Tensor& x, int64_t heads, bool causal, std::optional<double> scale) {
        const double d = static_cast<double>(x.shape().back() / (3 * std::max<int64_t>(heads, 1)));
        const double sc = scale ? *scale : 1.0 / std::sqrt(std::max(d, 1.0));
        return flash_attention_packed(x, heads, causal, sc);
      },
      "x"_a, "heads"_a, "is_causal"_a = false, "scale"_a = nb::none(),
      "flash_attention_packed(x, heads, is_causal=False, scale=None) -> (out, lse)\n\n"
      "Self-attention on a packed x (B, T, 3 * heads * D): q, k, v are its three split(heads * D,\n"
      "-1) slices viewed (B, T, heads, D) and transposed.  Same outputs as flash_attention; the\n"
      "backward gives x a single (B, T, 3 * heads * D) gradient.");
  m.def(
      "qkv_attention",
      [](const Tensor& x, const Tensor& weight, std::optional<Tensor> bias, int64_t heads,
         bool causal, std::optional<double> scale) {
        return qkv_attention(x, weight, bias ? *bias : Tensor(), heads, causal, scale);
      },
      "x"_a, "weight"_a, "bias"_a.none(), "heads"_a, "is_causal"_a = false, "scale"_a = nb::none(),
      "qkv_attention(x, weight, bias, heads, is_causal=False, scale=None) -> Tensor\n\n"
      "A transformer's qkv projection and self-attention as one op: x (B, T, C), weight\n"
      "(3 * heads * D, C), bias (3 * heads * D,) or None -> (B, T, heads * D), the attention\n"
      "output before the output projection.  The same values as linear(x, weight, bias) split\n"
      "into q, k, v, each viewed (B, T, heads, D).transpose(1, 2), passed to\n"
      "scaled_dot_product_attention and transposed back.  Where the fused kernels run (as\n"
      "scaled_dot_product_attention decides) it is one autograd node whose backward gets the\n"
      "bias gradient from the attention backward's kernels instead of a separate pass over the\n"
      "(B * T, 3 C) gradient; elsewhere it is that composition.  Non-finite values as\n"
      "scaled_dot_product_attention's docstring says (a causal row never reads later positions).");
  m.def(
      "_packed_qkv_source",
      [](const Tensor& q, const Tensor& k, const Tensor& v) -> std::optional<Tensor> {
        Tensor x = packed_qkv_source(q, k, v);
        if (!x.defined()) return std::nullopt;
        return x;
      },
      "query"_a, "key"_a, "value"_a,
      "The packed (B, T, 3C) source scaled_dot_product_attention would use for q, k, v, or None "
      "(then it takes the unpacked path).");
  m.def("_set_flash_attention_cpu", &set_flash_attention_cpu, "on"_a,
        "Whether scaled_dot_product_attention uses the fused kernel on the CPU too (default off, "
        "or BLUTRAIN_FLASH_ATTENTION_CPU=1).");
  m.def("_flash_attention_cpu", &flash_attention_cpu,
        "Whether scaled_dot_product_attention uses the fused kernel on the CPU.");
}

}  // namespace bt::python
