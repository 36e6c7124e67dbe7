"""TrainConfig: every setting of a training run, in one typed dataclass.

Each field is declared once, with its type, default and help text (the `blutrain train` flags
are generated from these fields, see cli.add_config_flags) and what values it allows; a value
outside them is a ConfigError naming the field, its flag, the value and what is allowed:

    [TrainConfig] batch_size (--batch-size) = 0: must be an int >= 1

Checks that need more than the config (the model's block size, the data, the checkpoint) are
made by the trainer before it builds anything. This module needs no tensor library.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_DATA = "data/shakespeare"
DEFAULT_OUT = "runs/shakespeare"

PRECISIONS = ("auto", "fp32", "float32", "tf32", "bf16", "bfloat16")
DIST_MODES = ("none", "ddp", "zero1", "zero2")
RESIDUAL_DTYPES = ("float32", "compute")  # gpt2.RESIDUAL_DTYPES (this module needs no tensors)
RESIDUAL_GRAD_DTYPES = ("compute", "float32")  # gpt2.RESIDUAL_GRAD_DTYPES
RESUME_VALUES = (False, True, "auto")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class ConfigError(ValueError):
    """A training setting with a value it does not allow (the message names field and value)."""


def _opt(default: Any, help: str, **meta: Any) -> Any:
    """A field: its default, help text and checks (min, max, gt, lt, choices, check)."""
    return field(default=default, metadata={"help": help, **meta})


def _recompute(v: str) -> None:
    from .config import parse_recompute

    if v.lower() != "auto":
        try:
            parse_recompute(v, "TrainConfig")
        except ValueError:
            raise ConfigError(
                "must be auto, none, gelu, ln, attn, block or parts joined by '+' (ln+gelu)"
            ) from None


def _device(v: str) -> None:
    if not _DEVICE.match(v):
        raise ConfigError("must be auto, cpu, cuda or cuda:N")


def _step(v: str) -> None:
    from .steps import step_names

    if v not in step_names():
        raise ConfigError(f"must be one of {', '.join(step_names())}")


def _nonempty(v: str) -> None:
    if not v.strip():
        raise ConfigError("must not be empty")


@dataclass
class TrainConfig:
    """Everything a training run needs; `blutrain train` flags map one to one onto these fields.

    The defaults train the "tiny" GPT-2 (4 layers, 4 heads, 128 wide, GPT-2's 50,257-token
    vocabulary) on the shipped Tiny Shakespeare, sized so the loss falls visibly in a few minutes
    on a 2-core CPU.
    """

    # model
    model: str = _opt(
        "tiny",
        "a GPT-2 preset (tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl), a LLaMA-style one "
        "(llama-tiny, llama-small, llama-medium), or a JSON file of GPT2Config / LlamaConfig "
        "fields",
        check=_nonempty,
        metavar="NAME|FILE",
    )
    init_from: str | None = _opt(None, "start from a Hugging Face GPT-2 directory", metavar="DIR")
    vocab_multiple: int = _opt(128, "pad the vocabulary to a multiple of this", min=1)
    # data
    data: str | None = _opt(
        None,
        f"directory of llm.c token shards (default: {DEFAULT_DATA}, prepared from the shipped "
        "Tiny Shakespeare)",
        metavar="DIR",
    )
    batch_size: int = _opt(8, "sequences per micro-batch (B)", min=1)
    seq_len: int = _opt(128, "tokens per sequence (T), at most the model's block size", min=1)
    grad_accum: int = _opt(1, "micro-batches per optimizer step", min=1)
    # optimization
    max_steps: int = _opt(300, "optimizer steps; the lr schedule ends there", min=1)
    lr: float = _opt(2e-3, "peak learning rate", gt=0.0)
    min_lr: float | None = _opt(None, "final learning rate (default: lr / 10)", min=0.0)
    warmup_steps: int = _opt(20, "linear warmup steps (at most max-steps)", min=0)
    weight_decay: float = _opt(0.1, "AdamW weight decay (on dim >= 2 tensors only)", min=0.0)
    beta1: float = _opt(0.9, "AdamW beta1", min=0.0, lt=1.0)
    beta2: float = _opt(0.95, "AdamW beta2", min=0.0, lt=1.0)
    grad_clip: float = _opt(1.0, "global gradient-norm clip (0: off)", min=0.0)
    # where and how
    device: str = _opt(
        "auto", "auto (CUDA when this build runs on a GPU here), cpu, cuda or cuda:N", check=_device
    )
    precision: str = _opt(
        "auto", "auto (bf16 on a GPU, fp32 on the CPU), fp32, tf32 or bf16", choices=PRECISIONS
    )
    residual_dtype: str = _opt(
        "float32",
        "GPT-2's residual stream dtype under bf16: float32 (autocast's; trains like fp32; costs "
        "GPT-2 124M 1.7% tokens/s and 0.6 GiB of peak memory on an H200) or compute (bf16, "
        "rounded at every add: faster and lighter, but it drifts off the fp32 trajectory over "
        "long runs); no effect in fp32 / tf32; a LLaMA model keeps its stream in the compute "
        "dtype and takes the default only",
        choices=RESIDUAL_DTYPES,
    )
    residual_grad_dtype: str = _opt(
        "compute",
        "the float32 residual stream's gradient on GPT-2's fused path under bf16: compute (bf16, "
        "one gradient for the stream and each branch) or float32 (autocast's: more precise in "
        "narrow deep models, about 2.9 GB more memory traffic a step at GPT-2 124M B16 x T1024); "
        "no effect with --residual-dtype compute, unfused, or in fp32 / tf32",
        choices=RESIDUAL_GRAD_DTYPES,
    )
    recompute: str = _opt(
        "auto",
        "activation recomputation: auto (ln for fp32 on a GPU, else none), none, gelu, ln, "
        "attn, block or ln+gelu",
        check=_recompute,
    )
    step: str = _opt(
        "eager",
        "how a step is taken: eager, cuda-graph (on a GPU: 3 eager steps, then the whole step "
        "captured once as a CUDA graph and replayed), or compiled (blutrain-compiler); "
        "distributed steps: see --dist",
        check=_step,
    )
    compile: bool = _opt(
        False,
        "compile the training step with blutrain-compiler (fused kernels, a static memory "
        "plan): the same as --step compiled",
    )
    dist: str = _opt(
        "none",
        "data parallel over the ranks of an MPI launch (mpirun -n 4 blutrain train --dist ddp; "
        "mpiexec, srun): ddp (gradients averaged while backward runs), zero1 (AdamW state "
        "sharded over ranks), zero2 (gradients sharded too); needs blutrain-dist. Without a "
        "launcher it runs as one rank",
        choices=DIST_MODES,
        metavar="none|ddp|zero1|zero2",
    )
    deterministic: bool = _opt(
        False,
        "bitwise-reproducible kernels; with --dist, fixed-order reductions too: the same bits "
        "for 1, 2 or 4 ranks at the same global batch (world size x grad-accum x batch-size; "
        "--grad-accum 1 on the ranks of the larger run)",
    )
    gemm_autotune: bool = _opt(
        True,
        "on a GPU, time cuBLASLt's algorithms for each GEMM shape once and keep the fastest "
        "(cached in ~/.cache/blutrain)",
    )
    threads: int = _opt(0, "CPU threads (0: $OMP_NUM_THREADS, else all usable CPUs)", min=0)
    seed: int = _opt(1337, "random seed (initialization and data order)", min=0)
    # logging, evaluation, checkpoints
    out_dir: str = _opt(
        DEFAULT_OUT,
        "directory for metrics.jsonl, loss.png and checkpoint/",
        check=_nonempty,
        metavar="DIR",
    )
    log_interval: int = _opt(10, "steps between log lines without a live bar (0: none)", min=0)
    eval_interval: int = _opt(50, "steps between validation losses (0: never)", min=0)
    eval_batches: int = _opt(8, "validation batches per evaluation", min=1)
    sample_interval: int = _opt(100, "steps between text samples (0: never)", min=0)
    sample_tokens: int = _opt(48, "tokens per sample", min=1)
    sample_prompt: str = _opt("\n", "prompt of the samples", metavar="TEXT")
    ckpt_interval: int = _opt(0, "steps between checkpoints (0: only at the end)", min=0)
    resume: bool | str = _opt(
        False,
        "continue the run in --out-dir from its checkpoint (an error when there is none); "
        "'--resume auto': continue when there is one, else start",
        choices=RESUME_VALUES,
        cli_value="auto",
    )
    progress: bool = _opt(True, "live progress bar")
    plot: bool = _opt(True, "write loss.png at the end")

    def __post_init__(self) -> None:
        hints = _hints()
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            check_field(f, hints[f.name], v)
            if isinstance(v, str) and "choices" in f.metadata:
                setattr(self, f.name, v.lower())  # "BF16" -> "bf16", "Auto" -> "auto"
        if self.min_lr is not None and self.min_lr > self.lr:
            raise ConfigError(
                f"[TrainConfig] min_lr (--min-lr) = {self.min_lr:g}: must be at most lr "
                f"({self.lr:g})"
            )
        if self.dist != "none" and (self.step not in ("eager", self.dist) or self.compile):
            other = "compile (--compile)" if self.compile else f"step (--step) = {self.step!r}"
            raise ConfigError(
                f"[TrainConfig] dist (--dist) = {self.dist!r} cannot be combined with {other}: "
                "--dist picks the step, which runs eagerly (a captured or compiled distributed "
                "step is not supported yet); drop it"
            )
        if self.warmup_steps > self.max_steps:
            raise ConfigError(
                f"[TrainConfig] warmup_steps (--warmup-steps) = {self.warmup_steps}: must be at "
                f"most max_steps ({self.max_steps}); the warmup cannot be longer than the run"
            )

    @property
    def step_name(self) -> str:
        """The Step class the run uses (steps.step_class): --dist's mode, else "compiled" with
        --compile, else --step."""
        if self.dist != "none":
            return self.dist
        return "compiled" if self.compile else self.step

    @property
    def final_lr(self) -> float:
        """The learning rate the schedule ends at: min_lr, or lr / 10."""
        return self.lr * 0.1 if self.min_lr is None else self.min_lr

    # -- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "config") -> TrainConfig:
        if not isinstance(d, Mapping):
            raise ConfigError(
                f"[TrainConfig] {where}: expected a JSON object of TrainConfig fields, "
                f"got {type(d).__name__}"
            )
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ConfigError(
                f"[TrainConfig] {where}: unknown field(s) {unknown}; known: {', '.join(known)}"
            )
        return cls(**d)

    @classmethod
    def from_json(cls, path: str | os.PathLike, **overrides: Any) -> TrainConfig:
        """From a JSON file of fields; keyword overrides win over the file."""
        return cls.from_dict({**read_config_file(path), **overrides}, where=str(path))


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """The fields of a JSON config file, as written (unknown fields are a ConfigError)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"[TrainConfig] --config {p}: no such file")
    try:
        d = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"[TrainConfig] --config {p}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(
            f"[TrainConfig] --config {p}: expected a JSON object of TrainConfig fields, "
            f"got {type(d).__name__}"
        )
    known = [f.name for f in dataclasses.fields(TrainConfig)]
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ConfigError(
            f"[TrainConfig] --config {p}: unknown field(s) {unknown}; known: {', '.join(known)}"
        )
    return d


# -- field checks ------------------------------------------------------------------------------


def _hints() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def field_types(hint: Any) -> tuple[type, ...]:
    """The concrete types a field's annotation allows (NoneType included for `X | None`)."""
    args = typing.get_args(hint)
    return tuple(args) if args else (hint,)


def _type_ok(v: Any, types: tuple[type, ...]) -> bool:
    for t in types:
        if t is type(None) and v is None:
            return True
        if t is bool and isinstance(v, bool):
            return True
        if t is int and isinstance(v, int) and not isinstance(v, bool):
            return True
        if t is float and isinstance(v, (int, float)) and not isinstance(v, bool):
            return True
        if t is str and isinstance(v, str):
            return True
    return False


def _type_words(types: tuple[type, ...]) -> str:
    words = {bool: "true or false", int: "an int", float: "a number", str: "a string"}
    names = [words.get(t, "null") if t is not type(None) else "null" for t in types]
    return " or ".join(names)


def check_field(f: dataclasses.Field, hint: Any, v: Any) -> None:
    """Raise ConfigError unless `v` is a value field `f` allows."""
    meta = f.metadata
    where = f"[TrainConfig] {f.name} ({flag_name(f.name)}) = {v!r}"
    types = field_types(hint)
    choices = meta.get("choices")
    if choices is not None:
        if (v in choices and type(v) in {type(c) for c in choices}) or (
            isinstance(v, str) and v.lower() in [str(c).lower() for c in choices]
        ):
            return
        shown = ", ".join(json.dumps(c) if not isinstance(c, str) else c for c in choices)
        raise ConfigError(f"{where}: must be one of {shown}")
    if not _type_ok(v, types):
        raise ConfigError(f"{where}: must be {_type_words(types)}, not {type(v).__name__}")
    if v is None:
        return
    if isinstance(v, float) and not math.isfinite(v):
        raise ConfigError(f"{where}: must be a finite number")
    kind = "an int" if int in types and float not in types else "a number"
    for key, ok in (
        ("min", lambda a, b: a >= b),
        ("gt", lambda a, b: a > b),
        ("lt", lambda a, b: a < b),
        ("max", lambda a, b: a <= b),
    ):
        if key in meta and not ok(v, meta[key]):
            bounds = [f"{w} {meta[k]:g}" for k, w in _BOUNDS if k in meta]
            raise ConfigError(f"{where}: must be {kind} {' and '.join(bounds)}")
    check: Callable[[Any], None] | None = meta.get("check")
    if check is not None:
        try:
            check(v)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None


_BOUNDS = (("min", ">="), ("gt", ">"), ("lt", "<"), ("max", "<="))
