"""Distributed steps over blutrain.dist: DDP (DDPStep) and ZeRO stage 1 / 2 (Zero1Step,
Zero2Step), chosen by ``--dist ddp|zero1|zero2``.  Launch ``mpirun -n 4 blutrain train --dist
ddp ...`` (or mpiexec, or srun); without a launcher they run as one rank.

Each rank trains on its own rows of every global batch (the loop's loaders slice by rank), so a
step consumes world_size x grad_accum x batch_size rows.  Gradients are averaged over ranks
while backward runs.  The step returns every rank's micro-batch losses (one small all-gather, no
host sync), so the loop's mean is the global batch's mean, computed as a one-rank run with the
same global batch computes it (every rank sees the same numbers and stops together on a
non-finite one).  The optimizer state is returned whole by ``state_dict()`` (ZeRO gathers its
shards on every rank) in AdamW's own format, so a run resumes at another world size, or with
another step, and bit-exactly at the same one.

Hot path: no zero fill between steps (the next window's first gradient replaces each bucket's
values: blutrain.dist's Note on buckets), no host sync, the clip coefficient read on the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

from ..gpt2 import gemm_autotune
from ..optim import AdamW, grad_norm_and_clip_coef
from ..process_group import ProcessGroup
from .base import Batch, Step, StepOutput


def _dist() -> Any:
    try:
        import blutrain.dist as dist
    except ImportError as e:  # pragma: no cover - an optional package
        raise ImportError(
            f"[train] the distributed steps need blutrain-dist ({e}): pip install "
            "packages/blutrain-dist"
        ) from e
    return dist


class DistGroup(ProcessGroup):
    """The loop's view of blutrain.dist's process group."""

    def __init__(self, device_request: str) -> None:
        dist = _dist()
        self.dist = dist
        if not dist.is_initialized():
            dev = {"auto": None, "cuda": "cuda"}.get(device_request, device_request)
            dist.init(device=dev)

    @property
    def rank(self) -> int:
        return self.dist.rank()

    @property
    def world_size(self) -> int:
        return self.dist.world_size()

    def all_reduce(self, value: float, op: str = "sum") -> float:
        if op not in ("sum", "mean"):
            raise ValueError(f"[all_reduce] op {op!r} is not one of sum, mean")
        from .._tensor import bt

        t = bt.tensor([float(value)], dtype=bt.float64)
        self.dist.all_reduce(t, "avg" if op == "mean" else "sum")
        return float(t.item())

    def barrier(self) -> None:
        self.dist.barrier()

    def device(self, requested: str) -> str:
        if requested.startswith("cuda"):
            return self.dist.device()  # cuda:<local rank>
        return requested

    def __repr__(self) -> str:
        return f"DistGroup(rank {self.rank} of {self.world_size}, {self.dist.backend()})"


class _DistStep(Step):
    """Forward and backward of each micro-batch (the last one synchronises the gradients),
    clipping by the global norm, the update; losses averaged over ranks on the device."""

    @classmethod
    def process_group(cls, config: Any) -> ProcessGroup:
        return DistGroup(config.device)

    def _micro_batches(self, batches: Sequence[Batch], fwd: Any, no_sync: Any) -> list[Any]:
        n = len(batches)
        losses = []
        with gemm_autotune(self.config.gemm_autotune, self.device):
            for i, (x, y) in enumerate(batches):
                with no_sync() if i < n - 1 else contextlib.nullcontext():
                    loss = fwd(x, y, return_logits=False)[1]
                    (loss / n if n > 1 else loss).backward()
                losses.append(loss.detach())
        from .._tensor import bt

        stacked = bt.stack(losses)
        world = self.dist.world_size()
        if world == 1:
            return [stacked[i] for i in range(n)]
        every = bt.empty(world * n, dtype=stacked.dtype, device=stacked.device)
        self.dist.all_gather(every, stacked)  # no host sync: the loop reads it later
        return [every[i] for i in range(world * n)]

    def close(self) -> None:
        pass


class DDPStep(_DistStep):
    """DistributedDataParallel + AdamW: every rank holds the whole optimizer state."""

    name = "ddp"

    def __init__(self, model: Any, config: Any, device: str, group: Any) -> None:
        super().__init__(model, config, device, group)
        self.dist = _dist()
        self.ddp = self.dist.DistributedDataParallel(model)
        self.optimizer = AdamW(
            model.named_parameters(),
            lr=config.lr,
            betas=(config.beta1, config.beta2),
            weight_decay=config.weight_decay,
        )
        self.params = list(model.parameters())

    def __call__(self, batches: Sequence[Batch], lr: float) -> StepOutput:
        self.optimizer.set_lr(lr)
        losses = self._micro_batches(batches, self.ddp, self.ddp.no_sync)
        norm, coef = grad_norm_and_clip_coef(self.params, self.config.grad_clip)
        self.optimizer.step(grad_scale=coef)
        # no zero_grad: .grad stays a view of its bucket, overwritten by the next backward
        return StepOutput(losses, norm)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


class _ZeroStep(_DistStep):
    stage = 1

    def __init__(self, model: Any, config: Any, device: str, group: Any) -> None:
        super().__init__(model, config, device, group)
        self.dist = _dist()
        self.optimizer = self.dist.ZeroOptimizer(
            AdamW(
                model.named_parameters(),
                lr=config.lr,
                betas=(config.beta1, config.beta2),
                weight_decay=config.weight_decay,
            ),
            stage=self.stage,
        )

    def __call__(self, batches: Sequence[Batch], lr: float) -> StepOutput:
        self.optimizer.set_lr(lr)
        losses = self._micro_batches(batches, self.model, self.optimizer.no_sync)
        clip = self.config.grad_clip
        norm, coef = self.optimizer.grad_norm_and_clip_coef(clip if clip and clip > 0 else None)
        self.optimizer.step(grad_scale=coef)
        return StepOutput(losses, norm)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.full_state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.load_full_state_dict(state)


class Zero1Step(_ZeroStep):
    """ZeRO stage 1: AdamW's state (and float32 masters of 16-bit parameters) sharded."""

    name = "zero1"
    stage = 1


class Zero2Step(_ZeroStep):
    """ZeRO stage 2: gradients sharded too (a bucket is freed once reduced)."""

    name = "zero2"
    stage = 2


__all__ = ["DDPStep", "DistGroup", "Zero1Step", "Zero2Step"]
