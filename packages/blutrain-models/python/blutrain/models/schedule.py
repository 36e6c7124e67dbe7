"""The learning-rate schedule: linear warmup, then cosine decay (GPT-2's, nanoGPT's, llm.c's)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


class CosineSchedule:
    """Linear warmup to max_lr over warmup_steps, then cosine decay to min_lr at max_steps.

    ``sched(step)`` for step = 0, 1, ...: (step + 1) / warmup * max_lr during warmup (so the
    first step is not wasted at lr 0, as nanoGPT and llm.c do), min_lr from max_steps on.

    The decay runs from (decay_start, decay_start_lr) to (max_steps, min_lr); a fresh schedule
    starts it at (warmup_steps, max_lr). `extend(step, max_steps, min_lr)` re-plans the rest
    of a run from `step` on: the cosine restarts from the learning rate the schedule has there,
    so a longer (or shorter) run continues smoothly and the learning rate never rises.
    """

    def __init__(
        self,
        max_lr: float,
        warmup_steps: int,
        max_steps: int,
        min_lr: float | None = None,
        *,
        decay_start: int | None = None,
        decay_start_lr: float | None = None,
    ) -> None:
        if warmup_steps < 0 or max_steps < 1:
            raise ValueError(
                f"[CosineSchedule] need warmup_steps >= 0 and max_steps >= 1, got "
                f"{warmup_steps}, {max_steps}"
            )
        self.max_lr = float(max_lr)
        self.min_lr = float(max_lr * 0.1 if min_lr is None else min_lr)
        self.warmup_steps = int(warmup_steps)
        self.max_steps = int(max_steps)
        self.decay_start = self.warmup_steps if decay_start is None else int(decay_start)
        self.decay_start_lr = self.max_lr if decay_start_lr is None else float(decay_start_lr)
        if self.decay_start < self.warmup_steps:
            raise ValueError(
                f"[CosineSchedule] decay_start {self.decay_start} is inside the warmup "
                f"({self.warmup_steps} steps)"
            )

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.max_lr * (step + 1) / self.warmup_steps
        if step >= self.max_steps:
            return self.min_lr
        start, top = self.decay_start, self.decay_start_lr
        span = max(1, self.max_steps - start)
        ratio = max(0, step - start) / span
        coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
        return self.min_lr + coeff * (top - self.min_lr)

    def extend(self, step: int, max_steps: int, min_lr: float) -> CosineSchedule:
        """The schedule of a run resumed at `step` with a new end (max_steps, min_lr).

        Steps before `step` have run. From max(step, warmup_steps) on, the cosine runs from the
        learning rate this schedule gives there down to min_lr at max_steps. Raises ValueError
        when that would raise the learning rate (min_lr above it) or when the run already ended.
        """
        if max_steps <= step:
            raise ValueError(
                f"[CosineSchedule] max_steps {max_steps}: the run is already at step {step}"
            )
        start = max(int(step), self.warmup_steps)
        top = self.decay_start_lr if start == self.decay_start else self(start)
        if min_lr > top:
            raise ValueError(
                f"[CosineSchedule] min_lr {min_lr:g} is above the learning rate {top:g} the run "
                f"has at step {start}: a continued run never raises its learning rate"
            )
        return CosineSchedule(
            self.max_lr,
            self.warmup_steps,
            max_steps,
            min_lr,
            decay_start=start,
            decay_start_lr=top,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
            "warmup_steps": self.warmup_steps,
            "max_steps": self.max_steps,
            "decay_start": self.decay_start,
            "decay_start_lr": self.decay_start_lr,
        }

    @classmethod
    def from_state(cls, d: Mapping[str, Any]) -> CosineSchedule:
        """From `state_dict()`; ValueError when a key is missing or not a number."""
        try:
            return cls(
                float(d["max_lr"]),
                int(d["warmup_steps"]),
                int(d["max_steps"]),
                float(d["min_lr"]),
                decay_start=int(d["decay_start"]),
                decay_start_lr=float(d["decay_start_lr"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"[CosineSchedule] not a schedule state ({e!r}): {d!r:.200}") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CosineSchedule) and self.state_dict() == other.state_dict()

    def __repr__(self) -> str:
        return f"CosineSchedule({self.state_dict()})"


def cosine_lr(
    step: int, max_lr: float, warmup_steps: int, max_steps: int, min_lr: float | None = None
) -> float:
    return CosineSchedule(max_lr, warmup_steps, max_steps, min_lr)(step)
