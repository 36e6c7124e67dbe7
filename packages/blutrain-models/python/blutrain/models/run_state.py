"""What a trainer checkpoint holds beyond the weights, and reading it back with every part
checked before anything is loaded.

trainer.json (written by Trainer.save):

    step            optimizer steps taken (int >= 0)
    model_config    GPT2Config or LlamaConfig fields
    train_config    TrainConfig fields of the run that wrote it
    schedule        the learning-rate schedule (optim.CosineSchedule.state_dict())
    loader          the training DataLoader's position (DataLoader.state_dict())
    optimizer       the step's optimizer state, less its tensors (in optimizer.safetensors)
    history         {"train": [[step, loss], ...], "val": [[step, loss], ...]}

The training loop does not draw random numbers (no dropout; samples are seeded by the step), so
the step, the schedule, the loader's position, the weights and the optimizer's state are the
whole of a run's state: a run resumed from them continues bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .checkpoint import CheckpointError, check_tensors, load_checkpoint
from .config import ModelConfig, config_from_dict
from .schedule import CosineSchedule

RESUME_HINT = "resume from an intact checkpoint, or start a new run in another --out-dir"
_REQUIRED = {
    "step": int,
    "model_config": dict,
    "train_config": dict,
    "loader": dict,
    "optimizer": dict,
}


@dataclass
class SavedRun:
    """A checked trainer checkpoint."""

    path: Path
    step: int
    model_config: ModelConfig
    train_config: dict[str, Any]
    schedule: CosineSchedule
    loader: dict[str, Any]
    optimizer: dict[str, Any]  # {"meta": ..., "tensors": ...}
    weights: dict[str, np.ndarray]
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)


# Note [settings of older runs]: a resumed run keeps its settings (cli.config_from_args reads
# them back from trainer.json), so a setting an older trainer.json lacks, or one whose default
# has changed since, is read as what that run trained with, not as today's default:
# - residual_dtype (issue 38): the field came with the float32 residual stream (2026-12-04); a
#   GPT-2 run written before it trained with the stream in bf16, so a missing value reads
#   "compute"; a run that stored it (the default was "compute" until 2026-12-05) keeps what it
#   stored. A LLaMA run has no such choice (its stream is always in the compute dtype and the
#   trainer refuses a value other than the default), so what it stored is dropped and today's
#   default applies.
# A --config FILE is not a run's record: a field it omits takes today's default, as any field.
def _as_trained(tc: dict[str, Any], model_config: Any) -> dict[str, Any]:
    tc = dict(tc)
    if isinstance(model_config, dict) and model_config.get("model_type") == "llama":
        tc.pop("residual_dtype", None)
    else:
        tc.setdefault("residual_dtype", "compute")
    return tc


def saved_train_config(path: str | Path) -> dict[str, Any]:
    """The train_config a checkpoint was written with (its trainer.json alone, not verified),
    with what an older run left out read as it trained (Note [settings of older runs])."""
    import json

    p = Path(path) / "trainer.json"
    try:
        d = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"[resume] {p}: cannot read it ({e}); resume from an intact checkpoint, or start a "
            "new run in another --out-dir"
        ) from None
    tc = d.get("train_config") if isinstance(d, dict) else None
    if not isinstance(tc, dict):
        raise CheckpointError(f"[resume] {p}: holds no train_config object; {RESUME_HINT}")
    return _as_trained(tc, d.get("model_config"))


def _history(h: Any, where: str) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {"train": [], "val": []}
    if h is None:
        return out
    if not isinstance(h, dict):
        raise CheckpointError(f"{where}: history is not an object")
    for key in ("train", "val"):
        rows = h.get(key, [])
        if not isinstance(rows, list):
            raise CheckpointError(f"{where}: history.{key} is not a list")
        for r in rows:
            ok = (
                isinstance(r, list)
                and len(r) == 2
                and isinstance(r[0], int)
                and isinstance(r[1], (int, float))
            )
            if not ok:
                raise CheckpointError(f"{where}: history.{key} holds {r!r:.60}, not [step, loss]")
            out[key].append((int(r[0]), float(r[1])))
    return out


def read_saved_run(path: str | Path, model_config: ModelConfig) -> SavedRun:
    """Read and check a trainer checkpoint for a model of `model_config`: the manifest, every
    file's size and hash, every tensor's name, shape and dtype, finite weights, and
    trainer.json's fields. Raises CheckpointError (a ValueError) or FileNotFoundError: one line
    naming what is wrong and what to do."""
    try:
        return _read(Path(path), model_config)
    except (CheckpointError, FileNotFoundError) as e:
        msg = str(e)
        for prefix in ("[load_checkpoint] ", "[checkpoint] ", "[safetensors] "):
            msg = msg.removeprefix(prefix)
        if "start a new run" not in msg:
            msg = f"{msg}; {RESUME_HINT}"
        raise type(e)(f"[resume] {msg}") from None


def _read(path: Path, model_config: ModelConfig) -> SavedRun:
    expected = {k: (s, np.float32) for k, s in model_config.param_shapes().items()}
    where = f"{path / 'trainer.json'}"
    ck = load_checkpoint(path)
    tr = ck.trainer
    if tr is None:
        raise CheckpointError(f"{path}: holds no trainer.json (not a training run)")
    for key, typ in _REQUIRED.items():
        v = tr.get(key)
        if not isinstance(v, typ) or isinstance(v, bool):
            raise CheckpointError(
                f"{where}: {key!r} is {'missing' if v is None else repr(v)[:60]}, expected "
                f"{'an int' if typ is int else 'an object'}"
            )
    step = tr["step"]
    if step < 0:
        raise CheckpointError(f"{where}: step is {step}, expected an int >= 0")
    try:
        saved_model = config_from_dict(tr["model_config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: model_config: {e}") from None
    if type(saved_model) is not type(model_config):
        raise CheckpointError(
            f"{where}: the checkpoint holds a {type(saved_model).__name__} model, this run "
            f"trains a {type(model_config).__name__} one"
        )
    if saved_model != model_config:
        diff = [
            f"{k} {getattr(saved_model, k)} (this run: {getattr(model_config, k)})"
            for k in model_config.to_dict()
            if getattr(saved_model, k) != getattr(model_config, k)
        ]
        raise CheckpointError(
            f"{path} holds another model: {', '.join(diff)}; resume with that model's --model, "
            "or start a new run in another --out-dir"
        )
    check_tensors(ck.weights, expected, path / "model.safetensors")
    for name, a in ck.weights.items():
        if not np.isfinite(a).all():
            raise CheckpointError(f"{path / 'model.safetensors'}: tensor {name!r} holds NaN or inf")
    try:
        if "schedule" in tr:
            schedule = CosineSchedule.from_state(tr["schedule"])
        else:  # written before schedules were saved: the run's config
            tc = tr["train_config"]
            schedule = CosineSchedule(
                float(tc["lr"]), int(tc["warmup_steps"]), int(tc["max_steps"]), tc.get("min_lr")
            )
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"{where}: schedule: {str(e).removeprefix('[CosineSchedule] ')}"
        ) from None
    return SavedRun(
        path=path,
        step=step,
        model_config=saved_model,
        train_config=_as_trained(tr["train_config"], tr["model_config"]),
        schedule=schedule,
        loader=tr["loader"],
        optimizer={"meta": tr["optimizer"], "tensors": ck.optimizer or {}},
        weights=ck.weights,
        history=_history(tr.get("history"), where),
    )
