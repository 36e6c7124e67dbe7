"""CompiledStep: the eager step compiled by blutrain-compiler into one program.

Note [the step compiled]: the first call runs eagerly (it creates AdamW's moments and, on a
GPU, tunes the GEMMs). The second call compiles EagerStep.run (every micro-batch's forward and
backward, the gradient norm and clip coefficient, AdamW, zero_grad) with
blutrain.compiler.compile: the capture reads AdamW's lr and step count from the device scalars
(Note [AdamW in a CUDA graph] in optim.py), so they are runtime inputs and a schedule never
recompiles; the micro-batches are the compiled function's arguments. Later calls write lr and
the step count into those scalars and run the program (fused kernels, GEMMs through
blutrain.linalg, a static memory plan); a batch of another shape recompiles (logged). The
host-side step counts advance with each call (a captured step advanced them once, during its
capture). The model computes its loss with bt.cross_entropy (GPT2.numpy_loss = False), the op a
capture records, in the eager warm-up too. Needs blutrain-compiler (pip install
packages/blutrain-compiler); the check says so before anything is built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .._tensor import bt
from .base import Batch, StepOutput
from .eager import EagerStep

WARMUP_STEPS = 1  # eager steps before compiling (AdamW's state exists, GEMMs are tuned)


class CompiledStep(EagerStep):
    """EagerStep's work as one compiled program (see Note [the step compiled])."""

    name = "compiled"

    @classmethod
    def check(cls, config: Any, device: str) -> None:
        try:
            import blutrain.compiler  # noqa: F401
        except ImportError as e:
            raise ValueError(
                f"[train] step compiled needs blutrain-compiler ({e}); install "
                "packages/blutrain-compiler or use --step eager"
            ) from None

    def __init__(self, model: Any, config: Any, device: str, group: Any) -> None:
        self.check(config, device)
        super().__init__(model, config, device, group)
        if hasattr(model, "numpy_loss"):
            model.numpy_loss = False  # bt.cross_entropy: what a capture records
        self.optimizer.use_device_scalars(True)
        self._compiled: Any = None
        self._eager_steps = 0

    def _run_flat(self, *xs: Any) -> tuple[Any, ...]:
        out = self.run([(xs[i], xs[i + 1]) for i in range(0, len(xs), 2)])
        return (*out.losses, out.grad_norm) if out.grad_norm is not None else tuple(out.losses)

    def __call__(self, batches: Sequence[Batch], lr: float) -> StepOutput:
        if self._eager_steps < WARMUP_STEPS:
            self._eager_steps += 1
            return super().__call__(batches, lr)
        import blutrain.compiler as btc

        if self._compiled is None:
            self._compiled = btc.compile(self._run_flat)
        opt = self.optimizer
        opt.write_device_scalars(lr, opt.common_step() + 1)
        xs: list[Any] = []
        for x, y in batches:
            for t in (x, y):
                xs.append(t if isinstance(t, bt.Tensor) else bt.tensor(t, device=self.device))
        before = len(self._compiled.programs)
        out = self._compiled(*xs)
        if len(self._compiled.programs) == before:  # ran without Python: count the step here
            opt.advance_steps()
        out = out if isinstance(out, tuple) else (out,)
        n = len(batches)
        return StepOutput(list(out[:n]), out[n] if len(out) > n else None)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.optimizer.check_state_dict(state)
        self.close()  # the program reads the optimizer tensors about to be replaced
        super().load_state_dict(state)

    def close(self) -> None:
        """Forget the compiled programs (the disk cache keeps their code)."""
        self._compiled = None
        self._eager_steps = 0
