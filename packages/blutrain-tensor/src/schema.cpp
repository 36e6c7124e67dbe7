// schema.cpp: the op schema table (see schema.h) and each primitive's factory.
#include "schema.h"

#include <algorithm>
#include <map>
#include <mutex>

#include "attention.h"
#include "autocast.h"
#include "nn_fused.h"
#include "optim.h"

namespace bt {

const char* attr_type_name(AttrType t) {
  switch (t) {
    case AttrType::Int:
      return "int";
    case AttrType::Float:
      return "float";
    case AttrType::Bool:
      return "bool";
    case AttrType::String:
      return "str";
    case AttrType::Ints:
      return "ints";
    case AttrType::Floats:
      return "floats";
    case AttrType::Scalar:
      return "scalar";
  }
  return "?";
}

AttrType attr_type_of(const AttrValue& v) {
  // the variant's alternatives, in order: int64_t, double, bool, string, ints, floats
  static const AttrType kinds[] = {AttrType::Int,    AttrType::Float, AttrType::Bool,
                                   AttrType::String, AttrType::Ints,  AttrType::Floats};
  return kinds[v.index()];
}

namespace {

using AT = AttrType;
using Make = std::function<std::shared_ptr<Primitive>(const Attrs&)>;

int64_t I(const Attrs& a, const char* k) { return std::get<int64_t>(a.at(k)); }
double F(const Attrs& a, const char* k) { return std::get<double>(a.at(k)); }
Scalar SC(const Attrs& a, const char* k) {  // an AT::Scalar: exact int64, or a double
  const AttrValue& v = a.at(k);
  return v.index() == 0 ? Scalar::integer(std::get<int64_t>(v))
                        : Scalar::floating(std::get<double>(v));
}
bool B(const Attrs& a, const char* k) { return std::get<bool>(a.at(k)); }
const std::string& S(const Attrs& a, const char* k) { return std::get<std::string>(a.at(k)); }
const std::vector<int64_t>& Is(const Attrs& a, const char* k) {
  return std::get<std::vector<int64_t>>(a.at(k));
}

int reduction_code(const std::string& r) {
  if (r == "none") return 0;
  if (r == "mean") return 1;
  if (r == "sum") return 2;
  throw ValueError("[replay] reduction must be 'none', 'mean' or 'sum', got '" + r + "'");
}

template <typename P, typename... A>
std::shared_ptr<Primitive> mk(A&&... args) {
  return std::make_shared<P>(std::forward<A>(args)...);
}

constexpr unsigned kGemm = kMatmulPrecision | kDeterministic;
constexpr unsigned kAttention = kGemm | kAttentionPrecision;  // float32 attention kernels

std::vector<OpSchema> build() {
  std::vector<OpSchema> v;
  auto add = [&](std::string op, std::string cls,
                 std::vector<std::pair<std::string, AttrType>> attrs, Make make,
                 unsigned numerics = kNumericsNone, bool view = false) {
    OpSchema s;
    s.op = std::move(op);
    s.primitive = std::move(cls);
    s.attrs = std::move(attrs);
    s.make = std::move(make);
    s.numerics = numerics;
    s.view = view;
    v.push_back(std::move(s));
    return &v.back();
  };

  // ---- creation
  add("full", "Full", {{"value", AT::Scalar}},
      [](const Attrs& a) { return mk<Full>(SC(a, "value")); });
  add("arange", "Arange", {{"start", AT::Scalar}, {"step", AT::Scalar}},
      [](const Attrs& a) { return mk<Arange>(SC(a, "start"), SC(a, "step")); });
  add("random", "Random",
      {{"kind", AT::String},
       {"seed", AT::Int},
       {"offset", AT::Int},
       {"a", AT::Float},
       {"b", AT::Float},
       {"low", AT::Int},
       {"high", AT::Int}},
      [](const Attrs& a) {
        const std::string& k = S(a, "kind");
        RandKind kind = k == "uniform"  ? RandKind::Uniform
                        : k == "normal" ? RandKind::Normal
                        : k == "int"
                            ? RandKind::Int
                            : throw ValueError("[replay] random: unknown kind '" + k + "'");
        auto p =
            std::make_shared<Random>(kind, static_cast<uint64_t>(I(a, "seed")),
                                     static_cast<uint64_t>(I(a, "offset")), F(a, "a"), F(a, "b"));
        p->int_low = I(a, "low");
        p->int_range = static_cast<uint64_t>(I(a, "high")) - static_cast<uint64_t>(p->int_low);
        return std::shared_ptr<Primitive>(p);
      });

  // ---- copies (to_device's transfer is run by Graph::replay through the to_device front)
  add("astype", "AsType", {}, [](const Attrs&) { return mk<AsType>(); });
  add("cached_astype", "CachedCast", {}, [](const Attrs&) { return mk<CachedCast>(); });
  add("to_device", "ToDevice", {{"device", AT::String}}, nullptr);

  // ---- views
  add(
      "reshape", "Reshape", {{"shape", AT::Ints}},
      [](const Attrs& a) { return mk<Reshape>(Is(a, "shape")); }, kNumericsNone, true);
  add(
      "permute", "Permute", {{"perm", AT::Ints}},
      [](const Attrs& a) { return mk<Permute>(Is(a, "perm")); }, kNumericsNone, true);
  add(
      "expand", "Expand", {{"shape", AT::Ints}},
      [](const Attrs& a) { return mk<Expand>(Is(a, "shape")); }, kNumericsNone, true);
  const std::vector<std::pair<std::string, AttrType>> slice_attrs = {
      {"dim", AT::Int}, {"start", AT::Int}, {"stop", AT::Int}, {"step", AT::Int}};
  add(
      "slice", "Slice", slice_attrs,
      [](const Attrs& a) {
        return mk<Slice>(I(a, "dim"), I(a, "start"), I(a, "stop"), I(a, "step"));
      },
      kNumericsNone, true);
  add(
      "select", "Select", {{"dim", AT::Int}, {"index", AT::Int}},
      [](const Attrs& a) { return mk<Select>(I(a, "dim"), I(a, "index")); }, kNumericsNone, true);
  add("slice_scatter", "SliceScatter", slice_attrs, [](const Attrs& a) {
    return mk<SliceScatter>(I(a, "dim"), I(a, "start"), I(a, "stop"), I(a, "step"));
  });

  // ---- elementwise (one op name per enum value)
  for (int i = 0; i < 64; ++i) {
    const auto op = static_cast<UnaryOp>(i);
    if (std::string(unary_name(op)) == "?") continue;
    add(unary_name(op), "Unary", {}, [op](const Attrs&) { return mk<Unary>(op); });
  }
  for (int i = 0; i < 64; ++i) {
    const auto op = static_cast<BinaryOp>(i);
    if (std::string(binary_name(op)) == "?") continue;
    add(binary_name(op), "Binary", {}, [op](const Attrs&) { return mk<Binary>(op); });
  }
  add("where", "Where", {}, [](const Attrs&) { return mk<Where>(); });
  add("masked_fill", "MaskedFill", {{"value", AT::Scalar}},
      [](const Attrs& a) { return mk<MaskedFill>(SC(a, "value")); });

  // ---- reductions
  for (int i = 0; i < 64; ++i) {
    const auto op = static_cast<ReduceOp>(i);
    if (std::string(reduce_name(op)) == "?") continue;
    std::vector<std::pair<std::string, AttrType>> at = {{"dims", AT::Ints}, {"keepdim", AT::Bool}};
    if (op == ReduceOp::Var) at.push_back({"correction", AT::Float});
    add(reduce_name(op), "Reduce", at, [op](const Attrs& a) {
      return mk<Reduce>(op, Is(a, "dims"), B(a, "keepdim"),
                        op == ReduceOp::Var ? F(a, "correction") : 1.0);
    });
  }
  for (bool mx : {true, false}) {
    add(mx ? "argmax" : "argmin", "ArgReduce", {{"dim", AT::Int}, {"keepdim", AT::Bool}},
        [mx](const Attrs& a) { return mk<ArgReduce>(mx, I(a, "dim"), B(a, "keepdim")); });
  }

  // ---- indexing, joining
  add("index_select", "IndexSelect", {{"dim", AT::Int}, {"embedding", AT::Bool}},
      [](const Attrs& a) { return mk<IndexSelect>(I(a, "dim"), B(a, "embedding")); });
  add(
      "index_add", "IndexAdd", {{"dim", AT::Int}, {"over_base", AT::Bool}},
      [](const Attrs& a) { return mk<IndexAdd>(I(a, "dim"), B(a, "over_base")); }, kDeterministic);
  add("gather", "Gather", {{"dim", AT::Int}},
      [](const Attrs& a) { return mk<Gather>(I(a, "dim")); });
  add(
      "scatter_add", "ScatterAdd", {{"dim", AT::Int}},
      [](const Attrs& a) { return mk<ScatterAdd>(I(a, "dim")); }, kDeterministic);
  add("cat", "Concatenate", {{"dim", AT::Int}},
      [](const Attrs& a) { return mk<Concatenate>(I(a, "dim")); });

  // ---- neural-network ops
  for (bool lg : {false, true}) {
    add(lg ? "log_softmax" : "softmax", "Softmax", {{"dim", AT::Int}},
        [lg](const Attrs& a) { return mk<Softmax>(I(a, "dim"), lg); });
    add(lg ? "log_softmax_backward" : "softmax_backward", "SoftmaxBackward", {{"log", AT::Bool}},
        [](const Attrs& a) { return mk<SoftmaxBackward>(B(a, "log")); });
  }
  add("layer_norm", "LayerNorm",
      {{"eps", AT::Float}, {"has_weight", AT::Bool}, {"has_bias", AT::Bool}}, [](const Attrs& a) {
        return mk<LayerNorm>(F(a, "eps"), B(a, "has_weight"), B(a, "has_bias"));
      });
  add("cross_entropy", "CrossEntropy",
      {{"ignore_index", AT::Int},
       {"reduction", AT::String},
       {"label_smoothing", AT::Float},
       {"num_classes", AT::Int}},
      [](const Attrs& a) {
        return mk<CrossEntropy>(I(a, "ignore_index"), reduction_code(S(a, "reduction")),
                                F(a, "label_smoothing"), I(a, "num_classes"));
      });
  add("dropout", "Dropout", {{"p", AT::Float}, {"seed", AT::Int}, {"offset", AT::Int}},
      [](const Attrs& a) {
        return mk<Dropout>(F(a, "p"), static_cast<uint64_t>(I(a, "seed")),
                           static_cast<uint64_t>(I(a, "offset")));
      });
  for (bool bias : {false, true}) {
    add(
        bias ? "linear" : "matmul", "Matmul", {{"trans_b", AT::Bool}, {"bias", AT::Bool}},
        [](const Attrs& a) { return mk<Matmul>(B(a, "trans_b"), B(a, "bias")); }, kGemm);
  }

  // ---- fused normalisation / loss (nn_fused.h)
  add("layer_norm_backward", "LayerNormBackward",
      {{"has_weight", AT::Bool},
       {"has_extra", AT::Bool},
       {"need_dweight", AT::Bool},
       {"need_dbias", AT::Bool},
       {"wide_grads", AT::Bool},
       {"need_dsum", AT::Bool}},
      [](const Attrs& a) {
        return mk<LayerNormBackward>(B(a, "has_weight"), B(a, "has_extra"), B(a, "need_dweight"),
                                     B(a, "need_dbias"), B(a, "wide_grads"), B(a, "need_dsum"));
      });
  add("gelu_tanh_backward", "GeluTanhBackward", {},
      [](const Attrs&) { return mk<GeluTanhBackward>(); });
  add("cross_entropy_backward", "CrossEntropyBackward",
      {{"ignore_index", AT::Int},
       {"reduction", AT::String},
       {"label_smoothing", AT::Float},
       {"num_classes", AT::Int},
       {"in_place", AT::Bool}},
      [](const Attrs& a) {
        return mk<CrossEntropyBackward>(I(a, "ignore_index"), reduction_code(S(a, "reduction")),
                                        F(a, "label_smoothing"), I(a, "num_classes"),
                                        B(a, "in_place"));
      });
  add("add_layer_norm", "AddLayerNorm",
      {{"eps", AT::Float},
       {"has_weight", AT::Bool},
       {"has_bias", AT::Bool},
       {"has_residual_bias", AT::Bool}},
      [](const Attrs& a) {
        return mk<AddLayerNorm>(F(a, "eps"), B(a, "has_weight"), B(a, "has_bias"),
                                B(a, "has_residual_bias"));
      });

  // ---- attention (attention.h)
  add(
      "flash_attention", "FlashAttention", {{"scale", AT::Float}, {"causal", AT::Bool}},
      [](const Attrs& a) { return mk<FlashAttention>(F(a, "scale"), B(a, "causal")); }, kAttention);
  add(
      "flash_attention_backward", "FlashAttentionBackward",
      {{"scale", AT::Float}, {"causal", AT::Bool}, {"heads_major", AT::Bool}},
      [](const Attrs& a) {
        return mk<FlashAttentionBackward>(F(a, "scale"), B(a, "causal"), B(a, "heads_major"));
      },
      kAttention);
  add(
      "flash_attention_packed", "FlashAttentionPacked",
      {{"scale", AT::Float}, {"causal", AT::Bool}, {"heads", AT::Int}},
      [](const Attrs& a) {
        return mk<FlashAttentionPacked>(F(a, "scale"), B(a, "causal"), I(a, "heads"));
      },
      kAttention);
  add(
      "flash_attention_packed_backward", "FlashAttentionPackedBackward",
      {{"scale", AT::Float}, {"causal", AT::Bool}, {"heads", AT::Int}, {"colsum", AT::Bool}},
      [](const Attrs& a) {
        return mk<FlashAttentionPackedBackward>(F(a, "scale"), B(a, "causal"), I(a, "heads"),
                                                B(a, "colsum"));
      },
      kAttention);
  add(
      "qkv_attention", "QkvAttention",
      {{"scale", AT::Float},
       {"causal", AT::Bool},
       {"heads", AT::Int},
       {"seq", AT::Int},
       {"bias", AT::Bool}},
      [](const Attrs& a) {
        return mk<QkvAttention>(F(a, "scale"), B(a, "causal"), I(a, "heads"), I(a, "seq"),
                                B(a, "bias"));
      },
      kAttention);

  // ---- fused linear layers (autocast.h)
  add(
      "linear_gelu", "LinearGelu", {{"bias", AT::Bool}},
      [](const Attrs& a) { return mk<LinearGelu>(B(a, "bias")); }, kGemm);
  add(
      "linear_weight_grad", "LinearWeightGrad", {{"bias", AT::Bool}},
      [](const Attrs& a) { return mk<LinearWeightGrad>(B(a, "bias")); }, kGemm);
  add(
      "linear_dgelu", "LinearDgelu", {{"bgrad", AT::Bool}},
      [](const Attrs& a) { return mk<LinearDgelu>(B(a, "bgrad")); }, kGemm);
  add(
      "linear_gelu_linear", "LinearGeluLinear",
      {{"bias1", AT::Bool}, {"bias2", AT::Bool}, {"recompute", AT::Bool}},
      [](const Attrs& a) {
        return mk<LinearGeluLinear>(B(a, "bias1"), B(a, "bias2"), B(a, "recompute"));
      },
      kGemm);
  add(
      "linear_cross_entropy", "LinearCrossEntropy",
      {{"ignore_index", AT::Int},
       {"num_classes", AT::Int},
       {"chunk_rows", AT::Int},
       {"need_dx", AT::Bool},
       {"need_dw", AT::Bool},
       {"mean", AT::Bool}},
      [](const Attrs& a) {
        return mk<LinearCrossEntropy>(I(a, "ignore_index"), I(a, "num_classes"), I(a, "chunk_rows"),
                                      B(a, "need_dx"), B(a, "need_dw"), B(a, "mean"));
      },
      kGemm);

  // ---- optimizer (optim.h): in place, no outputs of their own
  OpSchema* adamw = add("adamw_", "AdamW",
                        {{"lr", AT::Float},
                         {"beta1", AT::Float},
                         {"beta2", AT::Float},
                         {"eps", AT::Float},
                         {"step", AT::Float},
                         {"n", AT::Int},
                         {"weight_decays", AT::Floats},
                         {"has_lr", AT::Bool},
                         {"has_step", AT::Bool},
                         {"has_scale", AT::Bool},
                         {"has_copies", AT::Bool}},
                        [](const Attrs& a) {
                          auto p = std::make_shared<AdamW>();
                          p->n = static_cast<size_t>(I(a, "n"));
                          p->lr = F(a, "lr");
                          p->beta1 = F(a, "beta1");
                          p->beta2 = F(a, "beta2");
                          p->eps = F(a, "eps");
                          p->step = F(a, "step");
                          p->weight_decays = std::get<std::vector<double>>(a.at("weight_decays"));
                          p->has_lr = B(a, "has_lr");
                          p->has_step = B(a, "has_step");
                          p->has_scale = B(a, "has_scale");
                          p->has_copies = B(a, "has_copies");
                          return std::static_pointer_cast<Primitive>(p);
                        });
  // params, exp_avgs, exp_avg_sqs, and the kept 16-bit copies (grads and scalars are read only)
  adamw->mutates = [](const Attrs& a, size_t) {
    const int64_t n = I(a, "n");
    std::vector<int64_t> m;
    for (int64_t i = 0; i < n; ++i) m.push_back(i);
    for (int64_t i = 2 * n; i < 4 * n; ++i) m.push_back(i);
    if (B(a, "has_copies")) {
      for (int64_t i = 4 * n; i < 5 * n; ++i) m.push_back(i);
    }
    return m;
  };
  add("grad_norm", "GradNorm", {}, [](const Attrs&) { return mk<GradNorm>(); });
  add("clip_coef", "ClipCoef", {{"max_norm", AT::Float}, {"eps", AT::Float}},
      [](const Attrs& a) { return mk<ClipCoef>(F(a, "max_norm"), F(a, "eps")); });
  OpSchema* scale =
      add("scale_", "ScaleInplace", {}, [](const Attrs&) { return mk<ScaleInplace>(); });
  scale->mutates = [](const Attrs&, size_t n) {  // every input but the last (the coefficient)
    std::vector<int64_t> m;
    for (size_t i = 0; i + 1 < n; ++i) m.push_back(static_cast<int64_t>(i));
    return m;
  };

  // ---- graph-only ops (no primitive): run by Graph::replay itself
  OpSchema* copy = add("copy_", "", {}, nullptr);  // (dst, src): dst = src, in place
  copy->mutates = [](const Attrs&, size_t) { return std::vector<int64_t>{0}; };
  // (leaf, grad[, prev]): the leaf's new .grad = grad, or prev + grad written into prev
  OpSchema* acc = add("accumulate_grad", "", {}, nullptr);
  acc->mutates = [](const Attrs&, size_t n) {
    return n == 3 ? std::vector<int64_t>{2} : std::vector<int64_t>{};
  };

  std::sort(v.begin(), v.end(), [](const OpSchema& a, const OpSchema& b) { return a.op < b.op; });
  return v;
}

}  // namespace

const std::vector<OpSchema>& op_schemas() {
  static const std::vector<OpSchema> table = build();
  return table;
}

const OpSchema* find_schema(const std::string& op) {
  static const std::map<std::string, const OpSchema*> index = [] {
    std::map<std::string, const OpSchema*> m;
    for (const auto& s : op_schemas()) m[s.op] = &s;
    return m;
  }();
  auto it = index.find(op);
  return it == index.end() ? nullptr : it->second;
}

void check_attrs(const OpSchema& s, const Attrs& attrs, const char* who) {
  const std::string pre = std::string("[") + who + "] " + s.op + ": ";
  for (const auto& [name, type] : s.attrs) {
    auto it = attrs.find(name);
    if (it == attrs.end()) {
      throw RuntimeError(pre + "attribute '" + name + "' (" + attr_type_name(type) +
                         ") is missing from the node (schema.cpp lists it)");
    }
    const AttrType got = attr_type_of(it->second);
    if (got != type &&
        !(type == AttrType::Scalar && (got == AttrType::Int || got == AttrType::Float))) {
      throw RuntimeError(pre + "attribute '" + name + "' is " +
                         attr_type_name(attr_type_of(it->second)) + ", the schema says " +
                         attr_type_name(type));
    }
  }
  if (attrs.size() != s.attrs.size()) {
    for (const auto& [name, v] : attrs) {
      bool known = false;
      for (const auto& sa : s.attrs) known = known || sa.first == name;
      if (!known) {
        throw RuntimeError(pre + "attribute '" + name +
                           "' is not in the op's schema (add it to schema.cpp)");
      }
    }
  }
}

std::vector<int64_t> mutated_inputs(const OpSchema& s, const Attrs& attrs, size_t n_inputs) {
  return s.mutates ? s.mutates(attrs, n_inputs) : std::vector<int64_t>{};
}

std::vector<std::string> enum_op_names() {
  std::vector<std::string> names;
  for (int i = 0; i < 64; ++i) {
    for (const char* n :
         {unary_name(static_cast<UnaryOp>(i)), binary_name(static_cast<BinaryOp>(i)),
          reduce_name(static_cast<ReduceOp>(i))}) {
      if (std::string(n) != "?") names.push_back(n);
    }
  }
  return names;
}

}  // namespace bt
