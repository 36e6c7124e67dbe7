"""The step seam: one optimizer step of a training run, as the loop sees it.

The loop (trainer.Trainer.fit) owns the schedule, the data, evaluation, logging and
checkpoints; a Step owns everything between "here are this step's micro-batches and its
learning rate" and "the parameters are updated":

    out = step(batches, lr)     # forward + backward of every micro-batch, clip, update
    out.losses, out.grad_norm   # 0-d device tensors: read back later, in one host sync

and the optimizer's state (`state_dict` / `load_state_dict`), so that a step whose optimizer
state is sharded over ranks (ZeRO) can gather and scatter it itself.

Contract (what the loop relies on; each implementation documents how it meets it):

- `__call__(batches, lr)` takes the `grad_accum` micro-batches of one optimizer step, each an
  (inputs, targets) pair of (B, T) int64 token ids: numpy arrays, or tensors already on the
  device (the loop uploads a GPU run's batches ahead of time). It runs forward and backward of
  each (their gradients add up, each loss scaled by 1 / len(batches)), reduces gradients over
  ranks where it has ranks, clips the global gradient norm to `config.grad_clip` (0: off), and
  updates the parameters with AdamW at learning rate `lr`. It must not force a host sync (no
  .item(), no .numpy() of device tensors): the loop queues many steps and reads their
  outputs back at its log points.
- It returns a StepOutput whose tensors stay valid until the loop reads them (copy them out
  of buffers that the next call overwrites). `losses` are this rank's unscaled micro-batch
  losses (a distributed step may return every rank's: the loop averages them all).
- `state_dict()` returns {"meta": JSON-able, "tensors": {name: numpy array}}: the optimizer's
  whole state. Every rank calls it (it may be collective); rank 0's result is written.
- `load_state_dict(state)` takes what `state_dict()` returned (possibly in another run, with
  another world size), checks all of it first and raises ValueError naming what does not fit,
  leaving the optimizer untouched; then loads it. Every rank calls it with the full state.
- `process_group(config)` (a classmethod) gives the loop the ranks the step runs on; the
  default is one process. It is called before the model and the step are built, as is
  `check(config, device)`, which refuses settings the step cannot run with.
- `close()` frees what the step holds beyond the model (a captured graph, communicators).

A step reads its settings from the TrainConfig it is given (grad_accum, grad_clip, lr, betas,
weight_decay, gemm_autotune...), and may add fields of its own to TrainConfig.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ..process_group import ProcessGroup, SingleProcess

if TYPE_CHECKING:
    from ..train_config import TrainConfig

# One micro-batch: (inputs, targets), each (B, T) int64 token ids (numpy or device tensors).
Batch = tuple[Any, Any]


@dataclass
class StepOutput:
    """What one step leaves on the device for the loop to read back later."""

    losses: list[Any]  # one 0-d float32 tensor per micro-batch: the unscaled loss
    grad_norm: Any | None  # 0-d tensor: the global gradient norm before clipping; None: unmeasured


class Step(ABC):
    """One way of taking an optimizer step (see the module docstring for the contract)."""

    name: ClassVar[str]  # the TrainConfig.step value that picks this class

    def __init__(self, model: Any, config: TrainConfig, device: str, group: ProcessGroup) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.group = group

    @classmethod
    def process_group(cls, config: TrainConfig) -> ProcessGroup:
        """The processes this kind of step runs on (one, unless it is distributed)."""
        return SingleProcess()

    @classmethod
    def check(cls, config: TrainConfig, device: str) -> None:
        """Raise ValueError for settings this step cannot run with, before anything is built."""
        return None

    @abstractmethod
    def __call__(self, batches: Sequence[Batch], lr: float) -> StepOutput:
        """One optimizer step over `batches` at learning rate `lr`, without a host sync."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state: {"meta": JSON-able, "tensors": {name: numpy array}}."""

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()`'s result; check everything before changing anything."""

    def close(self) -> None:  # noqa: B027 - optional for implementations
        """Release what the step holds beyond the model (captured graphs, communicators)."""
