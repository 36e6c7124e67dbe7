"""blutrain.tensor.nn: Parameter, Module and the basic layers.

They live here, not in blutrain-models, because blutrain-dist and blutrain-compiler need them and
sit below models in the dependency order: dist registers per-parameter "gradient final" hooks and
builds flat gradient buckets from ``Module.parameters()``, and the compiler captures a Module's
forward and backward.  Models (GPT-2, optimizers, trainer) build on these.

Precision (see blutrain.tensor.amp): ``module.set_precision(bt.amp.Policy(...))`` sets a layer's
compute / parameter / output dtypes for it and its children (a child's own policy wins);
``module.set_checkpoint(True)`` recomputes its activations in backward (bt.checkpoint).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import blutrain.tensor as bt

from . import amp as _amp
from ._tensor import Tensor


class Parameter(Tensor):
    """A leaf tensor that a Module registers as trainable (requires_grad=True by default)."""

    def __init__(self, data: Tensor, requires_grad: bool = True) -> None:
        super().__init__(data.detach())
        if requires_grad:
            self.requires_grad_(True)

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()


class Module:
    """Base class of layers: registers Parameters and sub-Modules assigned as attributes."""

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_precision_own", None)  # set_precision on this module
        object.__setattr__(self, "_precision", None)  # effective: own, else the parent's
        object.__setattr__(self, "_precision_parent", None)  # what the parent passed down
        object.__setattr__(self, "_checkpoint", False)

    def __setattr__(self, name: str, value: Any) -> None:
        if "_parameters" not in self.__dict__:
            raise AttributeError("[Module] call super().__init__() before assigning attributes")
        params, mods = self.__dict__["_parameters"], self.__dict__["_modules"]
        params.pop(name, None)
        mods.pop(name, None)
        if isinstance(value, Parameter):
            params[name] = value
        elif isinstance(value, Module):
            mods[name] = value
            if self.__dict__.get("_precision") is not None:
                value._inherit_precision(self._precision)
        object.__setattr__(self, name, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"[{type(self).__name__}] defines no forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.__dict__.get("_checkpoint") and self.training and bt.is_grad_enabled():
            return bt.checkpoint(self.forward, *args, **kwargs)
        return self.forward(*args, **kwargs)

    # ---- precision and recomputation -------------------------------------------------------
    def set_precision(self, policy: _amp.Policy | None) -> Module:
        """Sets this module's precision policy (bt.amp.Policy), inherited by its children unless
        they set their own; None returns this module to inheriting its parent's. Converts
        parameters to ``policy.param`` (call it before building the optimizer) and applies
        ``policy.matmul_precision`` process-wide. Returns self."""
        if policy is not None and not isinstance(policy, _amp.Policy):
            raise TypeError(f"[set_precision] expected a bt.amp.Policy or None, got {policy!r}")
        object.__setattr__(self, "_precision_own", policy)
        if policy is not None and policy.matmul_precision is not None:
            bt.set_float32_matmul_precision(policy.matmul_precision)
        self._inherit_precision(self.__dict__.get("_precision_parent"))
        return self

    def _inherit_precision(self, parent: _amp.Policy | None) -> None:
        object.__setattr__(self, "_precision_parent", parent)
        own = self.__dict__.get("_precision_own")
        eff = own if own is not None else parent
        object.__setattr__(self, "_precision", eff)
        if eff is not None and eff.param is not None:
            for name, p in list(self._parameters.items()):
                if p.dtype != eff.param and p.is_floating_point():
                    with bt.no_grad():
                        q = Parameter(p.to(eff.param), requires_grad=p.requires_grad)
                    setattr(self, name, q)
        for m in self._modules.values():
            m._inherit_precision(eff)

    @property
    def precision(self) -> _amp.Policy | None:
        """The policy in effect for this module (its own, an ancestor's, or bt.autocast's)."""
        return _amp.effective_policy(self.__dict__.get("_precision"))

    def set_checkpoint(self, enabled: bool = True) -> Module:
        """Recompute this module's activations in backward instead of storing them (training
        mode, grad enabled): its forward runs through bt.checkpoint. Returns self."""
        object.__setattr__(self, "_checkpoint", bool(enabled))
        return self

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        seen: set[int] = set()
        for name, m in self.named_modules(prefix):
            for pname, p in m._parameters.items():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                yield (f"{name}.{pname}" if name else pname), p

    def parameters(self) -> Iterator[Parameter]:
        for _, p in self.named_parameters():
            yield p

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        yield prefix, self
        for name, m in self._modules.items():
            yield from m.named_modules(f"{prefix}.{name}" if prefix else name)

    def modules(self) -> Iterator[Module]:
        for _, m in self.named_modules():
            yield m

    def children(self) -> Iterator[Module]:
        yield from self._modules.values()

    def train(self, mode: bool = True) -> Module:
        for m in self.modules():
            object.__setattr__(m, "training", mode)
        return self

    def eval(self) -> Module:
        return self.train(False)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters():
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                with bt.no_grad():
                    p.grad.zero_()

    def state_dict(self) -> OrderedDict[str, Tensor]:
        return OrderedDict((n, p.detach()) for n, p in self.named_parameters())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        own = dict(self.named_parameters())
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if missing or unexpected:
            raise KeyError(f"[load_state_dict] missing {missing}, unexpected {unexpected}")
        with bt.no_grad():
            for n, p in own.items():
                src = state[n] if isinstance(state[n], Tensor) else bt.tensor(state[n])
                if tuple(src.shape) != tuple(p.shape):
                    raise ValueError(
                        f"[load_state_dict] {n}: shape {tuple(src.shape)} vs {tuple(p.shape)}"
                    )
                p.copy_(src)

    def to(self, device: str | None = None, dtype: Any = None) -> Module:
        """Moves parameters to device and casts the floating ones to dtype; returns self.
        A parameter that changes becomes a new leaf Parameter (its .grad is dropped: build the
        optimizer afterwards); one shared by several modules (tied weights) stays shared."""
        moved: dict[int, Parameter] = {}
        for m in list(self.modules()):
            for name, p in list(m._parameters.items()):
                if id(p) not in moved:
                    t = p.detach()
                    if dtype is not None and t.dtype in _FLOATING:
                        t = t.to(dtype)
                    if device is not None:
                        t = t.to(device)
                    same = t.dtype == p.dtype and t.device == p.device
                    moved[id(p)] = p if same else Parameter(t, requires_grad=p.requires_grad)
                if moved[id(p)] is not p:  # in place in the registry: setattr would reorder
                    m._parameters[name] = moved[id(p)]
                    object.__setattr__(m, name, moved[id(p)])
        return self

    def cuda(self, device: int | str = 0) -> Module:
        return self.to(device if isinstance(device, str) else f"cuda:{device}")

    def cpu(self) -> Module:
        return self.to("cpu")

    def name_parameters(self) -> None:
        """Sets each parameter's .name to its qualified name (capture graphs show it)."""
        for n, p in self.named_parameters():
            p.name = n

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        for name, m in self._modules.items():
            sub = repr(m).replace("\n", "\n  ")
            lines.append(f"  ({name}): {sub}")
        return "\n".join(lines) + (")" if len(lines) == 1 else "\n)")


_FLOATING = (bt.float16, bt.bfloat16, bt.float32, bt.float64)


def _sizes(op: str, **sizes: Any) -> None:
    for what, n in sizes.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"[{op}] {what} must be a non-negative int, got {n!r}")


def _uniform(shape: tuple[int, ...], bound: float, dtype: Any) -> Tensor:
    return (bt.rand(*shape, dtype=dtype) * (2 * bound) - bound).detach()


class Linear(Module):
    """y = x W^T + b, W of shape (out_features, in_features) (PyTorch's init).

    activation="gelu_tanh" fuses gelu_tanh into the GEMM (bt.linear_gelu). Under a precision
    policy the input, weight and bias are cast to policy.compute (differentiable casts: float32
    master weights get float32 gradients) and the output to policy.output when set.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        dtype: Any = None,
        activation: str | None = None,
    ) -> None:
        super().__init__()
        if activation not in (None, "gelu_tanh"):
            raise ValueError(f"[Linear] activation must be None or 'gelu_tanh', got {activation!r}")
        _sizes("Linear", in_features=in_features, out_features=out_features)
        dtype = dtype or bt.float32
        bound = 1 / math.sqrt(in_features) if in_features else 0.0  # nothing to scale for 0
        self.in_features, self.out_features = in_features, out_features
        self.activation = activation
        self.weight = Parameter(_uniform((out_features, in_features), bound, dtype))
        self.bias = Parameter(_uniform((out_features,), bound, dtype)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        f = _amp.linear_gelu if self.activation == "gelu_tanh" else bt.linear
        p = self.precision
        if p is None:
            return f(x, self.weight, self.bias)
        return p.finish(f(p.cast(x), p.cast(self.weight), p.cast(self.bias)))

    def extra_repr(self) -> str:
        act = f", activation={self.activation!r}" if self.activation else ""
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}{act}"


def gelu_mlp(fc: Linear, proj: Linear, x: Tensor) -> Tensor:
    """proj(gelu_tanh(fc(x))) through bt.linear_gelu_linear (two GEMMs; the backward's
    gelu' is a GEMM epilogue), honouring fc's precision policy for the compute dtype and
    proj's for the output dtype. fc and proj keep their parameters (state dicts unchanged)."""
    p = fc.precision
    c = p.cast if p is not None else (lambda t: t)
    y = _amp.linear_gelu_linear(c(x), c(fc.weight), c(fc.bias), c(proj.weight), c(proj.bias))
    q = proj.precision
    return y if q is None else q.finish(y)


def self_attention(c_attn: Linear, x: Tensor, heads: int, is_causal: bool = False) -> Tensor:
    """Self-attention on c_attn(x) split into q, k, v (each (B, T, heads, D) as (B, heads, T, D))
    through bt.qkv_attention: one node whose backward takes c_attn's bias gradient from the
    attention kernels. Honours c_attn's precision policy (compute dtype in, output dtype out).
    Returns (B, T, heads * D), the input of the output projection."""
    p = c_attn.precision
    c = p.cast if p is not None else (lambda t: t)
    y = bt.qkv_attention(c(x), c(c_attn.weight), c(c_attn.bias), heads, is_causal=is_causal)
    return y if p is None else p.finish(y)


class LayerNorm(Module):
    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        dtype: Any = None,
        recompute: bool = False,
    ) -> None:
        super().__init__()
        dtype = dtype or bt.float32
        self.normalized_shape = (
            (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        )
        self.eps = eps
        # rebuild the output in backward rather than keep it (bt.layer_norm's recompute)
        self.recompute = recompute
        self.weight = (
            Parameter(bt.ones(*self.normalized_shape, dtype=dtype)) if elementwise_affine else None
        )
        self.bias = (
            Parameter(bt.zeros(*self.normalized_shape, dtype=dtype))
            if elementwise_affine and bias
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        # The kernel computes in float32 for 16-bit x and returns x's dtype (the affine
        # parameters are cast to it, differentiably), so bf16 activations stay bf16.
        p = self.precision
        if p is not None:
            x = p.cast(x)
        y = bt.layer_norm(
            x, self.normalized_shape, self.weight, self.bias, self.eps, recompute=self.recompute
        )
        return y if p is None else p.finish(y)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}" + (
            ", recompute=True" if self.recompute else ""
        )


class Embedding(Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: Any = None) -> None:
        super().__init__()
        _sizes("Embedding", num_embeddings=num_embeddings, embedding_dim=embedding_dim)
        self.weight = Parameter(bt.randn(num_embeddings, embedding_dim, dtype=dtype or bt.float32))

    def forward(self, idx: Tensor) -> Tensor:
        # Gather from the master table, then cast the rows (cheaper than casting the table).
        p = self.precision
        y = bt.embedding(idx, self.weight)
        return y if p is None else p.finish(p.cast(y))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}"


class Dropout(Module):
    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"[Dropout] p must be in [0, 1], got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return bt.dropout(x, self.p, self.training)


class GELU(Module):
    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return bt.gelu(x, self.approximate)


class ModuleList(Module):
    def __init__(self, modules: list[Module] | None = None) -> None:
        super().__init__()
        for m in modules or []:
            self.append(m)

    def append(self, m: Module) -> None:
        setattr(self, str(len(self._modules)), m)

    def __getitem__(self, i: int) -> Module:
        return list(self._modules.values())[i]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())


class Sequential(ModuleList):
    def __init__(self, *modules: Module) -> None:
        super().__init__(list(modules))

    def forward(self, x: Any) -> Any:
        for m in self:
            x = m(x)
        return x


class functional:  # noqa: N801 (a namespace, as torch.nn.functional)
    linear = staticmethod(bt.linear)
    linear_gelu = staticmethod(_amp.linear_gelu)
    linear_gelu_linear = staticmethod(_amp.linear_gelu_linear)
    layer_norm = staticmethod(bt.layer_norm)
    embedding = staticmethod(bt.embedding)
    dropout = staticmethod(bt.dropout)
    gelu = staticmethod(bt.gelu)
    softmax = staticmethod(bt.softmax)
    log_softmax = staticmethod(bt.log_softmax)
    cross_entropy = staticmethod(bt.cross_entropy)
    scaled_dot_product_attention = staticmethod(bt.scaled_dot_product_attention)
    qkv_attention = staticmethod(bt.qkv_attention)
    relu = staticmethod(bt.relu)
