"""CudaGraphStep: the eager step captured once as a CUDA graph and replayed.

Note [the step as a CUDA graph]: the first WARMUP_STEPS calls run eagerly (the first one
tunes the GEMMs; the graph must not meet a new GEMM shape). The next call copies its batches
into input buffers of its own, captures one whole EagerStep.run over them (every micro-batch's
forward and backward, clipping, AdamW) and replays it; every later call copies its batches into
the same buffers, writes AdamW's lr and step count into the device scalars the captured kernel
reads (Note [AdamW in a CUDA graph] in optim.py) and replays. The optimizer reads those device
scalars from the first eager step on, so eager and replayed steps see the same float32 lr, and
a run is bitwise the eager run whose AdamW reads device scalars too. The losses and norm are
copied out of the graph's output tensors, which the next replay overwrites. Shapes are fixed by
the capture: a batch of another shape is a ValueError naming both.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._tensor import bt
from ..device import is_cuda
from .base import Batch, StepOutput
from .eager import EagerStep

WARMUP_STEPS = 3  # eager steps before the capture (the first one tunes the GEMMs)


def copy_batches(dst: Sequence[tuple[Any, Any]], batches: Sequence[Batch], device: str) -> None:
    """Copy micro-batches into a captured graph's input buffers (same count and shapes)."""
    if len(batches) != len(dst):
        raise ValueError(
            f"[train] cuda-graph: {len(batches)} micro-batches, the graph was captured with "
            f"{len(dst)}"
        )
    for (sx, sy), (x, y) in zip(dst, batches):
        for buf, src in ((sx, x), (sy, y)):
            if tuple(src.shape) != tuple(buf.shape):
                raise ValueError(
                    f"[train] cuda-graph: batch shape {tuple(src.shape)} differs from the "
                    f"captured {tuple(buf.shape)} (a graph replays fixed shapes)"
                )
            buf.copy_(src if isinstance(src, bt.Tensor) else bt.tensor(src, device=device))


class CudaGraphStep(EagerStep):
    """EagerStep's work, replayed as one CUDA graph after WARMUP_STEPS eager steps (see Note
    [the step as a CUDA graph])."""

    name = "cuda-graph"

    @classmethod
    def check(cls, config: Any, device: str) -> None:
        if not is_cuda(device):
            raise ValueError(
                f"[train] step cuda-graph needs a CUDA device, not {device} (use --step eager)"
            )

    def __init__(self, model: Any, config: Any, device: str, group: Any) -> None:
        self.check(config, device)
        super().__init__(model, config, device, group)
        self.optimizer.use_device_scalars(True)  # eager warm-up reads the float32 lr too
        self._graph: Any = None
        self._inputs: list[tuple[Any, Any]] = []
        self._outputs = StepOutput([], None)
        self._eager_steps = 0

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def __call__(self, batches: Sequence[Batch], lr: float) -> StepOutput:
        if self._eager_steps < WARMUP_STEPS:
            self._eager_steps += 1
            return super().__call__(batches, lr)
        opt = self.optimizer
        step = opt.common_step() + 1
        if self._graph is None:
            self._capture(batches, lr, step)
        else:
            opt.advance_steps()
            opt.write_device_scalars(lr, step)
            copy_batches(self._inputs, batches, self.device)
        self._graph.replay()
        out = self._outputs
        norm = out.grad_norm.clone() if out.grad_norm is not None else None
        return StepOutput([x.clone() for x in out.losses], norm)

    def _capture(self, batches: Sequence[Batch], lr: float, step: int) -> None:
        bt.cuda.synchronize()
        bt.cuda.empty_cache()  # the warm-up's cached blocks: the graph gets its own pool
        self._inputs = [
            (
                bt.zeros(tuple(x.shape), dtype=bt.int64, device=self.device),
                bt.zeros(tuple(y.shape), dtype=bt.int64, device=self.device),
            )
            for x, y in batches
        ]
        self.optimizer.write_device_scalars(lr, step)
        copy_batches(self._inputs, batches, self.device)
        g = bt.cuda.CUDAGraph()
        with bt.cuda.graph(g):  # records; the step's counts advance here, on the host
            self._outputs = self.run(self._inputs)
        self._graph = g

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # checked before the graph is dropped: a failed load leaves the step as it was
        self.optimizer.check_state_dict(state)
        self.close()  # the captured graph holds the optimizer tensors about to be replaced
        super().load_state_dict(state)

    def close(self) -> None:
        """Forget the captured graph (its buffers and pool); the next call warms up anew."""
        if self._graph is not None:
            self._graph.reset()
        self._graph = None
        self._inputs = []
        self._outputs = StepOutput([], None)
        self._eager_steps = 0
