"""Optimizers and schedules over blutrain.tensor parameters.

    from blutrain.models.optim import AdamW, CosineSchedule, clip_grad_norm_
    opt = AdamW(model.named_parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    sched = CosineSchedule(max_lr=6e-4, warmup_steps=100, max_steps=5000, min_lr=6e-5)
    for step in range(5000):
        for micro in range(accum):                 # gradient accumulation: grads add up
            loss = model(x, y, return_logits=False)[1]  # the loss alone (no whole logits)
            (loss / accum).backward()
        norm = clip_grad_norm_(model.parameters(), 1.0)
        opt.set_lr(sched(step))
        opt.step()
        opt.zero_grad()

AdamW is PyTorch's (Loshchilov & Hutter's decoupled weight decay), step for step the same
arithmetic as ``torch.optim.AdamW`` (single-tensor path), so losses agree with PyTorch to float
rounding. Weight decay applies only to tensors with dim >= 2 (matmul weights and embeddings),
never to biases and LayerNorm weights, as in GPT-2/nanoGPT/llm.c.

By default (``fused=None``) the step runs blutrain-tensor's multi-tensor kernel
(``bt.optim.adamw_``: one CUDA launch for every parameter, OpenMP loops on the CPU; the same
arithmetic, operation for operation); ``fused=False`` keeps the per-tensor Python path below as
the reference. Clipping without a host sync: ``norm, coef = grad_norm_and_clip_coef(params,
max_norm)`` then ``opt.step(grad_scale=coef)`` (the coefficient multiplies every gradient inside
the AdamW kernel, so the gradients are never rewritten).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ._tensor import bt
from .schedule import CosineSchedule, cosine_lr  # noqa: F401 - re-exported


def _named(params: Any) -> list[tuple[str, bt.Tensor]]:
    """(name, tensor) pairs from named_parameters(), a dict, or plain tensors (named by index)."""
    if isinstance(params, bt.Tensor):
        raise TypeError("[AdamW] params must be an iterable of tensors, not a single tensor")
    if isinstance(params, Mapping):
        items = list(params.items())
    else:
        items = list(params)
    out: list[tuple[str, bt.Tensor]] = []
    for i, item in enumerate(items):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            name, p = item
        else:
            name, p = str(i), item
        if not isinstance(p, bt.Tensor):
            raise TypeError(f"[AdamW] parameter {name!r} is a {type(p).__name__}, not a bt.Tensor")
        if not p.is_floating_point():
            raise TypeError(f"[AdamW] parameter {name!r} has dtype {p.dtype}, not floating point")
        out.append((name, p))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError("[AdamW] parameter names must be unique")
    if not out:
        raise ValueError("[AdamW] got an empty parameter list")
    return out


def _capturing(device: str) -> bool:
    """Whether a step is being recorded, not run: a bt.capture() (blutrain-compiler's graphs)
    or `device`'s current stream capturing a CUDA graph."""
    if bt.is_capturing():
        return True
    return device.startswith("cuda") and bt.cuda.is_current_stream_capturing(device)


def _state_dtype(p: bt.Tensor) -> Any:
    """The fused kernel keeps float32 moments for 16-bit parameters (float64 for float64)."""
    return bt.float64 if p.dtype == bt.float64 else bt.float32


class AdamW:
    """AdamW with decoupled weight decay; decay only on tensors with dim >= 2.

    params: ``model.named_parameters()`` (names make the state dict readable and checkable),
    a dict name -> tensor, or plain tensors. `no_decay` overrides which names get no decay
    (default: every tensor with dim < 2).
    """

    def __init__(
        self,
        params: Any,
        lr: float = 6e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        no_decay: Iterable[str] | None = None,
        fused: bool | None = None,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"[AdamW] lr must be >= 0, got {lr}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"[AdamW] betas must lie in [0, 1), got {betas}")
        if not eps >= 0:
            raise ValueError(f"[AdamW] eps must be >= 0, got {eps}")
        if not weight_decay >= 0:
            raise ValueError(f"[AdamW] weight_decay must be >= 0, got {weight_decay}")
        self.params = _named(params)
        self.lr = float(lr)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        nd = set(no_decay) if no_decay is not None else None
        self.decay = {n: (p.ndim >= 2 if nd is None else n not in nd) for n, p in self.params}
        # None: the multi-tensor kernel on every device; False: the Python reference path.
        self.fused = fused is None or bool(fused)
        # name -> {"step": int, "exp_avg": Tensor, "exp_avg_sq": Tensor}, created lazily
        self.state: dict[str, dict[str, Any]] = {}
        # device -> (lr, step) 0-d float32 tensors the fused kernel reads (use_device_scalars)
        self._dev_scalars: dict[str, tuple[bt.Tensor, bt.Tensor]] | None = None
        # device -> numpy views of those tensors, on the CPU (Note [scalars written in place])
        self._dev_step = 0

    # -- the step --------------------------------------------------------------------------------
    def set_lr(self, lr: float) -> None:
        self.lr = float(lr)

    # Note [AdamW in a CUDA graph]: a captured step() bakes its scalar kernel arguments in, so a
    # replay would reuse the captured lr and step count (the bias corrections). With device
    # scalars on, the fused kernel reads lr and the step from 0-d float32 tensors instead. An
    # eager step() writes them itself; under a capture it only checks them, and the caller
    # writes them before each replay (write_device_scalars) and advances the host-side step
    # counts (advance_steps: checkpoints read them), as a replay runs no Python. lr is then a
    # float32 (the kernel derives its coefficients in double from it, as from a host lr), so
    # eager steps with device scalars and replays give the same bits.
    def use_device_scalars(self, on: bool = True) -> None:
        """Read lr and the step count from device tensors (see Note [AdamW in a CUDA graph])."""
        if not on:
            self._dev_scalars = None
            return
        if not self.fused:
            raise ValueError("[AdamW] device scalars need the fused kernel (fused=None or True)")
        self._dev_scalars = {}
        for _, p in self.params:
            dev = str(p.device)
            if dev not in self._dev_scalars:
                lr_t = bt.zeros((), dtype=bt.float32, device=dev)
                step_t = bt.zeros((), dtype=bt.float32, device=dev)
                self._dev_scalars[dev] = (lr_t, step_t)
        self.write_device_scalars(self.lr, self.common_step() + 1)

    def common_step(self) -> int:
        """The step count every parameter's state shares (0 before the first step); raises when
        they differ (a parameter that missed updates), which one set of device scalars cannot
        express."""
        steps = {int(st["step"]) for st in self.state.values()}
        if len(steps) > 1:
            raise RuntimeError(
                f"[AdamW] parameters are at different step counts {sorted(steps)[:4]}: one "
                "device step count cannot serve them (device scalars / CUDA graphs)"
            )
        return steps.pop() if steps else 0

    # Note [scalars written in place]: a compiled or replayed step makes no allocator call in
    # its steady state, so writing its scalars must make none either: fill_ with a Python number
    # writes a contiguous tensor outside autograd in place on every device (blutrain.tensor's
    # Note [fill_ without an allocation]), the float32 rounding of the same double as before.
    def write_device_scalars(self, lr: float, step: int) -> None:
        """Set the device lr and step count the next step() (or graph replay) reads."""
        if self._dev_scalars is None:
            raise RuntimeError("[AdamW] write_device_scalars: call use_device_scalars() first")
        self.lr = float(lr)
        self._dev_step = int(step)
        for lr_t, step_t in self._dev_scalars.values():
            lr_t.fill_(self.lr)
            step_t.fill_(float(step))

    def advance_steps(self) -> None:
        """Count one step on the host for every parameter with state (what a graph replay of
        step() does on the device without running this Python)."""
        for st in self.state.values():
            st["step"] += 1

    @bt.no_grad()
    def step(self, grad_scale: bt.Tensor | None = None) -> None:
        """One update of every parameter that has a gradient (others are left alone).

        grad_scale: an optional 0-d float32 tensor on the parameters' device multiplying every
        gradient (a clip coefficient from `grad_norm_and_clip_coef`; read on the device).
        """
        if self.fused:
            self._step_fused(grad_scale)
            return
        if bt.is_capturing():
            raise RuntimeError(
                "[AdamW] a captured step needs the fused kernel (fused=None or True) with "
                "device scalars (use_device_scalars()), so lr and the step count are graph inputs"
            )
        b1, b2 = self.betas
        lr, eps, wd = self.lr, self.eps, self.weight_decay
        for name, p in self.params:
            g = p.grad
            if g is None:
                continue
            if grad_scale is not None:
                g = g * grad_scale
            st = self._state_for(name, p)
            st["step"] += 1
            t = st["step"]
            m, v = st["exp_avg"], st["exp_avg_sq"]
            if wd and self.decay[name]:
                p.mul_(1 - lr * wd)
            # m = lerp(m, g, 1 - b1) = m + (1 - b1) (g - m), as torch's lerp_
            m.add_((g - m) * (1 - b1))
            v.mul_(b2).add_(g * g * (1 - b2))
            bias1 = 1 - b1**t
            bias2_sqrt = math.sqrt(1 - b2**t)
            denom = v.sqrt() / bias2_sqrt + eps
            p.sub_(m / denom * (lr / bias1))

    def _state_for(self, name: str, p: bt.Tensor) -> dict[str, Any]:
        st = self.state.get(name)
        if st is None:
            sd = _state_dtype(p) if self.fused else p.dtype
            st = {"step": 0, "exp_avg": bt.zeros_like(p, sd), "exp_avg_sq": bt.zeros_like(p, sd)}
            self.state[name] = st
        return st

    def _step_fused(self, grad_scale: bt.Tensor | None) -> None:
        # One kernel call per (device, dtype, step count): normally a single call for the model.
        groups: dict[tuple[str, str, int], list[tuple[str, bt.Tensor, bt.Tensor]]] = {}
        for name, p in self.params:
            g = p.grad
            if g is None:
                continue
            if not p.is_contiguous():  # the kernel needs dense memory: reference path for it
                if self._dev_scalars is not None:
                    raise RuntimeError(
                        f"[AdamW] parameter {name} is not contiguous: its reference path takes "
                        "host scalars, which device scalars (CUDA graphs) cannot"
                    )
                self._step_one_reference(name, p, g, grad_scale)
                continue
            if not g.is_contiguous():
                g = g.contiguous()
            st = self._state_for(name, p)
            st["step"] += 1
            key = (str(p.device), str(p.dtype), st["step"])
            groups.setdefault(key, []).append((name, p, g))
        for (dev, _, step), items in groups.items():
            st = [self.state[n] for n, _, _ in items]
            lr_arg: Any = self.lr
            step_arg: Any = float(step)
            if self._dev_scalars is None and bt.is_capturing():
                raise RuntimeError(
                    "[AdamW] capturing a step: call use_device_scalars() before the capture, so "
                    "lr and the step count are graph inputs, not constants baked into the graph"
                )
            if self._dev_scalars is not None:  # Note [AdamW in a CUDA graph]
                if dev not in self._dev_scalars:
                    raise RuntimeError(f"[AdamW] no device scalars on {dev}: parameters moved?")
                if not _capturing(dev):
                    self.write_device_scalars(self.lr, step)  # eager: this step's values
                elif step != self._dev_step:
                    raise RuntimeError(
                        f"[AdamW] the device scalars hold step {self._dev_step}, but parameters "
                        f"on {dev} take step {step}: call write_device_scalars(lr, {step}) "
                        "before the capture"
                    )
                lr_arg, step_arg = self._dev_scalars[dev]
            bt.optim.adamw_(
                [p for _, p, _ in items],
                [g for _, _, g in items],
                [s["exp_avg"] for s in st],
                [s["exp_avg_sq"] for s in st],
                lr=lr_arg,
                step=step_arg,
                betas=self.betas,
                eps=self.eps,
                weight_decay=[self.weight_decay if self.decay[n] else 0.0 for n, _, _ in items],
                grad_scale=grad_scale,
            )

    def _step_one_reference(
        self, name: str, p: bt.Tensor, g: bt.Tensor, grad_scale: bt.Tensor | None
    ) -> None:
        fused, self.fused = self.fused, False
        saved = self.params
        try:
            self.params = [(name, p)]
            self.step(grad_scale)
        finally:
            self.fused, self.params = fused, saved

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, p in self.params:
            if set_to_none or p.grad is None:
                p.grad = None
            else:
                with bt.no_grad():
                    p.grad.zero_()

    # -- state -------------------------------------------------------------------------------------
    def hyperparameters(self) -> dict[str, Any]:
        return {
            "lr": self.lr,
            "betas": list(self.betas),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            "no_decay": sorted(n for n, d in self.decay.items() if not d),
        }

    def state_dict(self) -> dict[str, Any]:
        """{"hyperparameters": JSON-able, "steps": {name: int}, "tensors": {"exp_avg/<name>":
        numpy float32, "exp_avg_sq/<name>": ...}}: the tensors go to a safetensors file, the rest
        to JSON (see `save_checkpoint(optimizer=sd["tensors"], trainer={... sd["meta"]})`)."""
        tensors: dict[str, np.ndarray] = {}
        steps: dict[str, int] = {}
        for name, st in self.state.items():
            steps[name] = int(st["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                tensors[f"{key}/{name}"] = np.array(st[key].detach().cpu().numpy(), copy=True)
        return {
            "meta": {"hyperparameters": self.hyperparameters(), "steps": steps},
            "tensors": tensors,
        }

    def check_state_dict(self, state: Mapping[str, Any]) -> None:
        """Raise ValueError naming what in `state` does not fit these parameters (unknown names,
        missing moments, shapes, bad hyperparameters); changes nothing."""
        self._parse_state(state)

    def _parse_state(
        self, state: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, tuple[int, np.ndarray, np.ndarray]]]:
        """(hyperparameters, name -> (step, exp_avg, exp_avg_sq)), all checked."""
        where = "[AdamW] load_state_dict"
        try:
            meta, tensors = state["meta"], state["tensors"]
            hp, steps = meta["hyperparameters"], meta["steps"]
            parsed_hp = {
                "lr": float(hp["lr"]),
                "betas": (float(hp["betas"][0]), float(hp["betas"][1])),
                "eps": float(hp["eps"]),
                "weight_decay": float(hp["weight_decay"]),
                "no_decay": {str(n) for n in hp.get("no_decay", [])},
            }
            steps = {str(n): s for n, s in dict(steps).items()}
            tensors = dict(tensors)
        except (KeyError, TypeError, ValueError, IndexError):
            raise ValueError(
                f"{where}: not an AdamW state dict (needs 'meta' with 'hyperparameters' (lr, "
                "betas, eps, weight_decay) and 'steps', and 'tensors')"
            ) from None
        own = dict(self.params)
        unknown = sorted(set(steps) - set(own))
        if unknown:
            raise ValueError(f"{where}: state for unknown parameter(s) {unknown[:5]}")
        expected = {f"{k}/{n}" for n in steps for k in ("exp_avg", "exp_avg_sq")}
        missing = sorted(expected - set(tensors))
        extra = sorted(set(tensors) - expected)
        if missing or extra:
            raise ValueError(f"{where}: missing tensor(s) {missing[:5]}, unexpected {extra[:5]}")
        out: dict[str, tuple[int, np.ndarray, np.ndarray]] = {}
        for name, step in steps.items():
            if not isinstance(step, int) or isinstance(step, bool) or step < 0:
                raise ValueError(f"{where}: step of {name} is {step!r}, not an int >= 0")
            p = own[name]
            moments = []
            for key in ("exp_avg", "exp_avg_sq"):
                a = np.asarray(tensors[f"{key}/{name}"])
                if tuple(a.shape) != tuple(p.shape):
                    raise ValueError(
                        f"{where}: {key}/{name} has shape {tuple(a.shape)}, "
                        f"the parameter has {tuple(p.shape)}"
                    )
                if a.dtype.kind != "f":
                    raise ValueError(f"{where}: {key}/{name} has dtype {a.dtype}, not floating")
                moments.append(a)
            out[name] = (step, moments[0], moments[1])
        return parsed_hp, out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state_dict()`'s form (tensors may come back from a safetensors file).

        Everything is checked first (see check_state_dict): on an error nothing changes.
        """
        hp, parsed = self._parse_state(state)
        own = dict(self.params)
        new_state: dict[str, dict[str, Any]] = {}
        for name, (step, m, v) in parsed.items():
            p = own[name]
            sd = _state_dtype(p) if self.fused else p.dtype
            new_state[name] = {
                "step": step,
                "exp_avg": bt.tensor(np.ascontiguousarray(m), dtype=sd, device=str(p.device)),
                "exp_avg_sq": bt.tensor(np.ascontiguousarray(v), dtype=sd, device=str(p.device)),
            }
        self.lr = hp["lr"]
        self.betas = hp["betas"]
        self.eps = hp["eps"]
        self.weight_decay = hp["weight_decay"]
        self.decay = {n: n not in hp["no_decay"] for n, _ in self.params}
        self.state = new_state


# ---------------------------------------------------------------------------------------------
# learning rate and clipping


def clip_grad_norm_(
    parameters: Iterable[bt.Tensor], max_norm: float, sync: bool = True
) -> float | bt.Tensor:
    """Scale all .grad in place so their global L2 norm is at most max_norm; returns the norm
    before clipping (a float; inf or nan when a gradient is not finite). max_norm <= 0 or inf
    only measures. sync=False returns the norm as a 0-d tensor on the gradients' device instead
    (no host sync: on CUDA the norm, the coefficient and the scaling all stay on the device)."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0 if sync else bt.tensor(0.0)
    if max_norm is None or not math.isfinite(max_norm) or max_norm <= 0:
        if not sync:
            return bt.optim.grad_norm([p.grad for p in params])
        with bt.no_grad():
            total = None
            for p in params:
                s = (p.grad.double() * p.grad.double()).sum()
                total = s if total is None else total + s
            return float(math.sqrt(float(total.item())))
    norm = bt.clip_grad_norm_(params, float(max_norm))
    return float(norm.item()) if sync else norm


def grad_norm_and_clip_coef(
    parameters: Iterable[bt.Tensor], max_norm: float | None, eps: float = 1e-6
) -> tuple[bt.Tensor | None, bt.Tensor | None]:
    """(global gradient norm, clip coefficient) as 0-d tensors on the gradients' device, without
    a host sync and without touching the gradients: pass the coefficient to
    ``AdamW.step(grad_scale=coef)``. The coefficient is None when max_norm is None, <= 0 or inf
    (only measure); both are None when no parameter has a gradient."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None, None
    norm = bt.optim.grad_norm(grads)
    if max_norm is None or not math.isfinite(max_norm) or max_norm <= 0:
        return norm, None
    return norm, bt.optim.clip_coef(norm, float(max_norm), eps)
