"""The model kinds: which class a config builds, and models read back from checkpoints.

    model = build_model(model_config("llama-tiny"), device="cpu")   # Llama
    model = build_model(GPT2Config.from_name("tiny"))                # GPT2
    model = model_from_checkpoint("runs/x")                          # whichever kind it saved

The trainer, `blutrain sample / eval / bench` and checkpoints go through here, so a new model
kind is a config class (config.py), a model class, and one line in `model_class`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .checkpoint import CheckpointError, load_checkpoint
from .config import GPT2Config, LlamaConfig, ModelConfig, config_from_dict


def is_llama(config: Any) -> bool:
    return isinstance(config, LlamaConfig)


def model_class(config: ModelConfig) -> type:
    """GPT2 for a GPT2Config, Llama for a LlamaConfig."""
    if isinstance(config, LlamaConfig):
        from .llama import Llama

        return Llama
    if isinstance(config, GPT2Config):
        from .gpt2 import GPT2

        return GPT2
    raise TypeError(f"[model] no model kind for a {type(config).__name__}")


def build_model(config: ModelConfig, device: str | None = None, *, init: bool = True) -> Any:
    """A fresh model of `config`'s kind on `device` (init=False: zero weights, to be loaded)."""
    return model_class(config)(config, device=device, init=init)


def model_from_checkpoint(path: str | os.PathLike, *, device: str | None = None) -> Any:
    """The model of a training checkpoint directory (or of the run directory holding one in
    checkpoint/), of the kind its trainer.json's model_config names, weights checked and
    loaded."""
    p = Path(path)
    if (p / "checkpoint").is_dir() and not (p / "manifest.json").exists():
        p = p / "checkpoint"
    try:
        ck = load_checkpoint(p)
    except (CheckpointError, FileNotFoundError) as e:
        raise type(e)(
            f"{e} (give a run directory of `blutrain train` or its checkpoint/)"
        ) from None
    mc = (ck.trainer or {}).get("model_config")
    if not isinstance(mc, dict):
        raise CheckpointError(
            f"[model] {p}: the checkpoint has no model_config in trainer.json (not written by "
            "the trainer)"
        )
    try:
        config = config_from_dict(mc)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"[model] {p}/trainer.json: model_config: {e}") from None
    model = build_model(config, device=device, init=False)
    model.load_state_dict(ck.weights, source=str(p / "model.safetensors"))
    return model
