// optim.cpp: the fronts of the multi-tensor optimizer primitives (see optim.h): argument checks
// naming the op, the list and the index, then one apply() per call, then version bumps (the
// kernels write their inputs in place, so autograd must see those tensors as changed).
#include "optim.h"

#include <sstream>
#include <string>

#include "autograd.h"
#include "capture.h"
#include "ops.h"

namespace bt {

namespace {

std::string at(const char* list, size_t i) {
  return std::string(list) + "[" + std::to_string(i) + "]";
}

// A double as a reader wants it in a message (std::to_string prints 1e-08 as 0.000000).
std::string num(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

bool is_16bit(DType d) { return d == DType::BFloat16 || d == DType::Float16; }

// A device scalar: a 0-d (or 1-element) float32 tensor on `dev`.
void check_scalar_tensor(const Tensor& t, const char* op, const char* what, Device dev) {
  if (t.numel() != 1) {
    throw ValueError(std::string("[") + op + "] " + what + " must be a 0-d tensor, got shape " +
                     shape_str(t.shape()));
  }
  if (t.dtype() != DType::Float32) {
    throw TypeError(std::string("[") + op + "] " + what + " must be float32, got " +
                    dtype_name(t.dtype()));
  }
  if (t.device() != dev) {
    throw ValueError(std::string("[") + op + "] " + what + " is on " + t.device().str() +
                     " but the tensors are on " + dev.str());
  }
  if (t.is_symbolic() && !active_graph()) {
    throw RuntimeError(std::string("[") + op + "] " + what + " is a symbolic (captured) tensor");
  }
}

void check_list_tensor(const Tensor& t, const char* op, const char* list, size_t i, Device dev,
                       const Tensor& ref) {
  if (!t.defined()) {
    throw ValueError(std::string("[") + op + "] " + at(list, i) + " is None");
  }
  if (t.device() != dev) {
    throw ValueError(std::string("[") + op + "] " + at(list, i) + " is on " + t.device().str() +
                     " but params[0] is on " + dev.str());
  }
  if (ref.defined() && t.shape() != ref.shape()) {
    throw ValueError(std::string("[") + op + "] " + at(list, i) + " has shape " +
                     shape_str(t.shape()) + " but params[" + std::to_string(i) + "] has " +
                     shape_str(ref.shape()));
  }
  if (!t.is_contiguous()) {
    throw ValueError(std::string("[") + op + "] " + at(list, i) +
                     " is not contiguous (the multi-tensor kernels need dense tensors)");
  }
  check_writable(t, op);
}

void bump(const Tensor& t) { t.bump_version(); }

int g_kernel_version = 2;

// Per param: the copy its storage's cast cache keeps for a float32 param's geometry, in a 16-bit
// dtype (the first such entry), else undefined.
std::vector<Tensor> kept_casts(const std::vector<Tensor>& params) {
  std::vector<Tensor> copies(params.size());
  std::lock_guard<std::mutex> lock(cast_cache_mutex());
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& p = params[i];
    if (p.dtype() != DType::Float32 || !p.storage() || !p.storage()->cast_cache) continue;
    for (DType to : {DType::BFloat16, DType::Float16}) {
      if (const CastCache::Entry* e = p.storage()->cast_cache->find(p, to)) {
        copies[i] = e->copy;
        break;
      }
    }
  }
  return copies;
}

// After the kernel wrote the copies: they match their params' new values.
void mark_casts_current(const std::vector<Tensor>& params, const std::vector<Tensor>& copies) {
  std::lock_guard<std::mutex> lock(cast_cache_mutex());
  for (size_t i = 0; i < params.size(); ++i) {
    if (!copies[i].defined()) continue;
    copies[i].bump_version();  // views of the old values saved for backward are stale
    const auto& cache = params[i].storage()->cast_cache;
    CastCache::Entry* e = cache ? cache->find(params[i], copies[i].dtype()) : nullptr;
    if (e && e->copy.storage() == copies[i].storage()) {
      e->from_version = params[i].version();
      e->copy_version = e->copy.version();
    }
  }
}

}  // namespace

void set_optim_kernel_version(int v) {
  if (v != 1 && v != 2) {
    throw ValueError("[adamw_] kernel version must be 1 or 2, got " + std::to_string(v));
  }
  g_kernel_version = v;
}
int optim_kernel_version() { return g_kernel_version; }

void adamw_(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
            const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
            const ScalarArg& lr, double beta1, double beta2, double eps,
            const std::vector<double>& weight_decays, const ScalarArg& step,
            const Tensor& grad_scale) {
  const char* op = "adamw_";
  const size_t n = params.size();
  auto len_check = [&](size_t k, const char* what) {
    if (k != n) {
      throw ValueError(std::string("[") + op + "] got " + std::to_string(n) + " params but " +
                       std::to_string(k) + " " + what);
    }
  };
  len_check(grads.size(), "grads");
  len_check(exp_avgs.size(), "exp_avgs");
  len_check(exp_avg_sqs.size(), "exp_avg_sqs");
  len_check(weight_decays.size(), "weight_decay values");
  if (!(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1)) {
    throw ValueError(std::string("[") + op + "] betas must lie in [0, 1), got (" + num(beta1) +
                     ", " + num(beta2) + ")");
  }
  if (!lr.tensor.defined() && !(lr.value >= 0)) {
    throw ValueError(std::string("[") + op + "] lr must be >= 0, got " + num(lr.value));
  }
  if (!(eps >= 0)) {
    throw ValueError(std::string("[") + op + "] eps must be >= 0, got " + num(eps));
  }
  if (!step.tensor.defined() && !(step.value >= 1)) {
    throw ValueError(std::string("[") + op + "] step must be >= 1 (it counts this update), got " +
                     num(step.value));
  }
  if (n == 0) return;
  if (!params[0].defined()) throw ValueError(std::string("[") + op + "] params[0] is None");
  const Device dev = params[0].device();
  for (size_t i = 0; i < n; ++i) {
    const Tensor& p = params[i];
    check_list_tensor(p, op, "params", i, dev, Tensor());
    check_list_tensor(grads[i], op, "grads", i, dev, p);
    check_list_tensor(exp_avgs[i], op, "exp_avgs", i, dev, p);
    check_list_tensor(exp_avg_sqs[i], op, "exp_avg_sqs", i, dev, p);
    const DType pd = p.dtype();
    if (!is_floating(pd)) {
      throw TypeError(std::string("[") + op + "] " + at("params", i) +
                      " must be floating point, got " + dtype_name(pd));
    }
    if (pd != params[0].dtype()) {
      throw TypeError(std::string("[") + op + "] " + at("params", i) + " is " + dtype_name(pd) +
                      " but params[0] is " + dtype_name(params[0].dtype()) +
                      " (one dtype per call)");
    }
    if (grads[i].dtype() != pd) {
      throw TypeError(std::string("[") + op + "] " + at("grads", i) + " is " +
                      dtype_name(grads[i].dtype()) + " but params[" + std::to_string(i) + "] is " +
                      dtype_name(pd));
    }
    const DType sd = pd == DType::Float64 ? DType::Float64 : DType::Float32;
    for (const auto* st : {&exp_avgs, &exp_avg_sqs}) {
      const char* nm = st == &exp_avgs ? "exp_avgs" : "exp_avg_sqs";
      if ((*st)[i].dtype() != sd) {
        throw TypeError(std::string("[") + op + "] " + at(nm, i) + " is " +
                        dtype_name((*st)[i].dtype()) + " but must be " + dtype_name(sd) + " for " +
                        dtype_name(pd) + " params" +
                        (is_16bit(pd) ? " (16-bit params keep float32 states)" : ""));
      }
    }
    if (!(weight_decays[i] >= 0)) {
      throw ValueError(std::string("[") + op + "] weight_decay[" + std::to_string(i) +
                       "] must be >= 0, got " + num(weight_decays[i]));
    }
  }
  auto prim = std::make_shared<AdamW>();
  prim->n = n;
  prim->lr = lr.value;
  prim->beta1 = beta1;
  prim->beta2 = beta2;
  prim->eps = eps;
  prim->step = step.value;
  prim->weight_decays = weight_decays;
  std::vector<Tensor> in;
  in.reserve(5 * n + 3);
  for (const auto* l : {&params, &grads, &exp_avgs, &exp_avg_sqs}) {
    for (const auto& t : *l) in.push_back(detach(t));
  }
  // The 16-bit casts kept for float32 params (Note [cached casts]): rewritten by the kernel.
  const std::vector<Tensor> copies = kept_casts(params);
  for (const auto& c : copies) prim->has_copies = prim->has_copies || c.defined();
  if (prim->has_copies) in.insert(in.end(), copies.begin(), copies.end());
  if (lr.tensor.defined()) {
    check_scalar_tensor(lr.tensor, op, "lr", dev);
    prim->has_lr = true;
    in.push_back(detach(lr.tensor));
  }
  if (step.tensor.defined()) {
    check_scalar_tensor(step.tensor, op, "step", dev);
    prim->has_step = true;
    in.push_back(detach(step.tensor));
  }
  if (grad_scale.defined()) {
    check_scalar_tensor(grad_scale, op, "grad_scale", dev);
    prim->has_scale = true;
    in.push_back(detach(grad_scale));
  }
  GradModeGuard no_grad(false);
  apply(prim, in, {}, dev);
  for (size_t i = 0; i < n; ++i) {
    bump(params[i]);
    bump(exp_avgs[i]);
    bump(exp_avg_sqs[i]);
  }
  if (prim->has_copies) mark_casts_current(params, copies);
}

Tensor grad_norm(const std::vector<Tensor>& grads) {
  const char* op = "grad_norm";
  std::vector<Tensor> in;
  Device dev;
  bool all64 = true;
  for (size_t i = 0; i < grads.size(); ++i) {
    const Tensor& g = grads[i];
    if (!g.defined()) continue;
    if (in.empty()) dev = g.device();
    check_list_tensor(g, op, "grads", i, dev, Tensor());
    if (!is_floating(g.dtype())) {
      throw TypeError(std::string("[") + op + "] " + at("grads", i) +
                      " must be floating point, got " + dtype_name(g.dtype()));
    }
    all64 = all64 && g.dtype() == DType::Float64;
    in.push_back(detach(g));
  }
  const DType od = (!in.empty() && all64) ? DType::Float64 : DType::Float32;
  GradModeGuard no_grad(false);
  return apply1(std::make_shared<GradNorm>(), in, {}, od, dev);
}

Tensor clip_coef(const Tensor& norm, double max_norm, double eps) {
  const char* op = "clip_coef";
  if (!norm.defined() || norm.numel() != 1 || !is_floating(norm.dtype())) {
    throw ValueError(std::string("[") + op + "] norm must be a 0-d floating tensor");
  }
  // max_norm = inf never clips; a negative or NaN max_norm would flip or poison every gradient.
  if (!(max_norm >= 0) || !(eps >= 0)) {
    throw ValueError(std::string("[") + op + "] max_norm and eps must be >= 0, got max_norm " +
                     num(max_norm) + ", eps " + num(eps));
  }
  GradModeGuard no_grad(false);
  return apply1(std::make_shared<ClipCoef>(max_norm, eps), {detach(norm)}, {}, DType::Float32,
                norm.device());
}

void scale_(const std::vector<Tensor>& grads, const Tensor& coef) {
  const char* op = "scale_";
  std::vector<Tensor> in;
  std::vector<Tensor> kept;
  Device dev = coef.defined() ? coef.device() : Device();
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) continue;
    check_list_tensor(grads[i], op, "tensors", i, dev, Tensor());
    if (!is_floating(grads[i].dtype())) {
      throw TypeError(std::string("[") + op + "] " + at("tensors", i) +
                      " must be floating point, got " + dtype_name(grads[i].dtype()));
    }
    in.push_back(detach(grads[i]));
    kept.push_back(grads[i]);
  }
  if (in.empty()) return;
  check_scalar_tensor(coef, op, "coef", dev);
  in.push_back(detach(coef));
  GradModeGuard no_grad(false);
  apply(std::make_shared<ScaleInplace>(), in, {}, dev);
  for (auto& g : kept) bump(g);
}

std::vector<Tensor> AdamW::vjp(const VjpArgs&) {
  throw RuntimeError("[adamw_] is not differentiable");
}
std::vector<Tensor> GradNorm::vjp(const VjpArgs&) {
  throw RuntimeError("[grad_norm] is not differentiable");
}
std::vector<Tensor> ClipCoef::vjp(const VjpArgs&) {
  throw RuntimeError("[clip_coef] is not differentiable");
}
std::vector<Tensor> ScaleInplace::vjp(const VjpArgs&) {
  throw RuntimeError("[scale_] is not differentiable");
}

}  // namespace bt
