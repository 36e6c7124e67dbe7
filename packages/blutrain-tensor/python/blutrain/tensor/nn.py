"""blutrain.tensor.nn: Parameter, Module and the basic layers.

They live here, not in blutrain-models, because blutrain-dist and blutrain-compiler need them and
sit below models in the dependency order: dist registers per-parameter "gradient final" hooks and
builds flat gradient buckets from ``Module.parameters()``, and the compiler captures a Module's
forward and backward.  Models (GPT-2, optimizers, trainer) build on these.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import blutrain.tensor as bt

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
        object.__setattr__(self, name, value)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"[{type(self).__name__}] defines no forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

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


def _uniform(shape: tuple[int, ...], bound: float, dtype: Any) -> Tensor:
    return (bt.rand(*shape, dtype=dtype) * (2 * bound) - bound).detach()


class Linear(Module):
    """y = x W^T + b, W of shape (out_features, in_features) (PyTorch's init)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, dtype: Any = None
    ) -> None:
        super().__init__()
        dtype = dtype or bt.float32
        bound = 1 / math.sqrt(in_features)
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(_uniform((out_features, in_features), bound, dtype))
        self.bias = Parameter(_uniform((out_features,), bound, dtype)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return bt.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}"


class LayerNorm(Module):
    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        dtype = dtype or bt.float32
        self.normalized_shape = (
            (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        )
        self.eps = eps
        self.weight = (
            Parameter(bt.ones(*self.normalized_shape, dtype=dtype)) if elementwise_affine else None
        )
        self.bias = (
            Parameter(bt.zeros(*self.normalized_shape, dtype=dtype))
            if elementwise_affine and bias
            else None
        )

    def forward(self, x: Tensor) -> Tensor:
        return bt.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"


class Embedding(Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: Any = None) -> None:
        super().__init__()
        self.weight = Parameter(bt.randn(num_embeddings, embedding_dim, dtype=dtype or bt.float32))

    def forward(self, idx: Tensor) -> Tensor:
        return bt.embedding(idx, self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, {self.weight.shape[1]}"


class Dropout(Module):
    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
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
    layer_norm = staticmethod(bt.layer_norm)
    embedding = staticmethod(bt.embedding)
    dropout = staticmethod(bt.dropout)
    gelu = staticmethod(bt.gelu)
    softmax = staticmethod(bt.softmax)
    log_softmax = staticmethod(bt.log_softmax)
    cross_entropy = staticmethod(bt.cross_entropy)
    scaled_dot_product_attention = staticmethod(bt.scaled_dot_product_attention)
    relu = staticmethod(bt.relu)
