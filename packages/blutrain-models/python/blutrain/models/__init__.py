"""blutrain.models: GPT-2 and a LLaMA-style model -- config, tokenizer, data, checkpoints, CLI.

This part needs only numpy, tiktoken, safetensors and rich; the model, optimizers and trainer
(over blutrain.tensor) come in their own modules and are imported only when used.
"""

import importlib

from .checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from .config import EOT_TOKEN, GPT2_VOCAB_SIZE, GPT2Config, LlamaConfig
from .convert import load_hf, read_llmc, save_hf, write_llmc
from .data import DataLoader, PrepareResult, ShardError, load_shard, prepare, write_shard
from .tokenizer import get_encoding

__all__ = [
    "EOT_TOKEN",
    "GPT2_VOCAB_SIZE",
    "Checkpoint",
    "CheckpointError",
    "DataLoader",
    "GPT2Config",
    "LlamaConfig",
    "PrepareResult",
    "ShardError",
    "get_encoding",
    "load_checkpoint",
    "load_hf",
    "load_shard",
    "prepare",
    "read_llmc",
    "save_checkpoint",
    "save_hf",
    "write_llmc",
    "write_shard",
]

# The model, optimizers and trainer need blutrain.tensor: imported on first use, so that
# `import blutrain.models` (tokenizer, data, checkpoints, CLI) works without the tensor library.
_LAZY = {
    "GPT2": ".gpt2",
    "Llama": ".llama",
    "AdamW": ".optim",
    "CosineSchedule": ".optim",
    "TrainConfig": ".train_config",
    "Trainer": ".trainer",
    "train": ".trainer",
}


def __getattr__(name: str):
    if name in _LAZY:
        try:
            module = importlib.import_module(_LAZY[name], __name__)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("blutrain.tensor"):
                raise ImportError(
                    f"blutrain.models.{name} needs blutrain-tensor, which is not installed "
                    "(pip install --no-build-isolation packages/blutrain-tensor)"
                ) from e
            raise
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
