"""Ways of taking one optimizer step, behind one interface (`Step`, in base.py).

The training loop (trainer.py) picks a class by `TrainConfig.step_name` and never asks which one
runs. A new way of stepping is a new class here plus one line in `_STEPS`, not a branch in the
loop: see "Writing a step" in the package README.

    eager       EagerStep: forward, backward, clipping and AdamW as eager ops (eager.py)
    cuda-graph  CudaGraphStep: the same step captured once as a CUDA graph and replayed
                (cuda_graph.py)
    ddp         DDPStep: data parallel over blutrain.dist (dist.py)
    zero1/2     Zero1Step / Zero2Step: blutrain.dist's ZeroOptimizer, stage 1 or 2 (dist.py)
    compiled    CompiledStep: the same step compiled by blutrain-compiler (compiled.py)

The distributed ones are picked by TrainConfig.dist (`blutrain train --dist ddp`, launched by
mpirun / mpiexec / srun), which wins over TrainConfig.step (TrainConfig.step_name).

Each entry names its module and class; the module is imported only when the step is chosen,
so a step that needs another package (blutrain-dist, blutrain-compiler) costs nothing to the
others. This file and base.py need no tensor library.
"""

from __future__ import annotations

import importlib

from .base import Batch, Step, StepOutput

__all__ = ["Batch", "Step", "StepOutput", "register_step", "step_class", "step_names"]

# TrainConfig.step name -> "module:Class" (modules relative to this package)
_STEPS: dict[str, str] = {
    "eager": ".eager:EagerStep",
    "cuda-graph": ".cuda_graph:CudaGraphStep",
    "ddp": ".dist:DDPStep",
    "zero1": ".dist:Zero1Step",
    "zero2": ".dist:Zero2Step",
    "compiled": ".compiled:CompiledStep",
}


def step_names() -> list[str]:
    """The names TrainConfig.step accepts."""
    return list(_STEPS)


def register_step(name: str, target: str) -> None:
    """Make `name` choose the Step class at `target` ("package.module:Class"; a leading dot is
    relative to blutrain.models.steps)."""
    if ":" not in target:
        raise ValueError(f"[register_step] target {target!r} is not 'module:Class'")
    _STEPS[name] = target


def step_class(name: str) -> type[Step]:
    """The Step class `name` picks (imports its module)."""
    if name not in _STEPS:
        raise ValueError(f"[train] step {name!r} is not one of {', '.join(_STEPS)}")
    module, cls = _STEPS[name].split(":")
    found = getattr(importlib.import_module(module, __name__), cls)
    if not (isinstance(found, type) and issubclass(found, Step)):
        raise TypeError(f"[train] step {name!r}: {_STEPS[name]} is not a Step subclass")
    return found
