"""Training GPT-2: the Trainer, and the `train`, `sample`, `eval` and `bench` commands.

    from blutrain.models.trainer import TrainConfig, Trainer, train
    summary = train(TrainConfig(max_steps=200))            # what `blutrain train` runs
    summary = train(TrainConfig(model="gpt2", data="data/fineweb", batch_size=16, seq_len=1024,
                                grad_accum=32, device="cuda"))

One optimizer step = `grad_accum` micro-batches of (batch_size, seq_len) tokens whose gradients
add up (each loss scaled by 1/grad_accum), then global-norm clipping, the cosine schedule's
learning rate, and AdamW. Every `eval_interval` steps the validation loss (the first `eval_batches`
batches of the validation split, always the same ones) and every `sample_interval` steps a text
sample are logged. Metrics go to ``<out_dir>/metrics.jsonl`` (one JSON object a line), the loss
curves to ``<out_dir>/loss.png`` at the end (when matplotlib is installed), checkpoints to
``<out_dir>/checkpoint`` (atomically; `resume=True` continues from there bit for bit: model,
AdamW moments, step, and the data loader's position are all restored).

The CLI wiring: `add_commands(subparsers)` registers the four subcommands on an argparse
subparsers object (each sets `_run` like `cli.COMMANDS` entries do); `COMMANDS` lists them as
`cli.Command` entries too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_DATA = "data/shakespeare"
DEFAULT_OUT = "runs/shakespeare"
CHECKPOINT_DIR = "checkpoint"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"

_PRECISION_NAMES = ("auto", "fp32", "float32", "tf32", "bf16", "bfloat16")
# precision mode -> the key of its peak in _PEAK_FLOPS
_PEAK_KEY = {"fp32": "float32", "tf32": "tf32", "bf16": "bfloat16"}

# Dense peak FLOP/s for MFU, by device name substring and precision (dense, no sparsity).
_PEAK_FLOPS = {
    "H200": {"float32": 67e12, "tf32": 494.5e12, "bfloat16": 989.5e12},
    "H100": {"float32": 67e12, "tf32": 494.5e12, "bfloat16": 989.5e12},
    "A100": {"float32": 19.5e12, "tf32": 156e12, "bfloat16": 312e12},
}


@dataclass
class TrainConfig:
    """Everything a training run needs; `blutrain train` flags map one to one onto these fields.

    The defaults train the "tiny" GPT-2 (4 layers, 4 heads, 128 wide, GPT-2's 50,257-token
    vocabulary) on the shipped Tiny Shakespeare, sized so the loss falls visibly in a few minutes
    on a 2-core CPU.
    """

    # model
    model: str = "tiny"  # a GPT2Config preset name or a JSON file of GPT2Config fields
    init_from: str | None = None  # a Hugging Face GPT-2 directory to start from
    vocab_multiple: int = 128
    # data
    data: str | None = None  # directory of llm.c shards (default: prepare Tiny Shakespeare)
    batch_size: int = 8
    seq_len: int = 128
    grad_accum: int = 1
    # optimization
    max_steps: int = 300
    lr: float = 2e-3
    min_lr: float | None = None  # default lr / 10
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # where and how
    device: str = "auto"  # auto: CUDA when this build can run on a GPU here, else CPU
    precision: str = "auto"  # auto (bf16 on a GPU, fp32 on the CPU), fp32, tf32 or bf16
    # activation recomputation: auto ("ln" for fp32 on a GPU, else none), none, gelu, ln,
    # attn, block or "ln+gelu"
    recompute: str = "auto"
    gemm_autotune: bool = True  # CUDA: time cuBLASLt's algorithms per GEMM shape once (cached)
    cuda_graph: bool = False  # CUDA: replay each step as one captured graph after 3 eager steps
    threads: int = 0  # CPU threads (op loops and BLAS); 0: OMP_NUM_THREADS, else all CPUs
    seed: int = 1337
    # logging, evaluation, checkpoints
    out_dir: str = DEFAULT_OUT
    log_interval: int = 10  # plain log lines (the live bar updates every step)
    eval_interval: int = 50
    eval_batches: int = 8
    sample_interval: int = 100
    sample_tokens: int = 48
    sample_prompt: str = "\n"
    ckpt_interval: int = 0  # 0: only at the end
    resume: bool = False
    progress: bool = True
    plot: bool = True

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len", "grad_accum", "max_steps", "vocab_multiple"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"[TrainConfig] {name} must be a positive int, got {v!r}")
        for name in (
            "threads",
            "warmup_steps",
            "eval_interval",
            "eval_batches",
            "sample_interval",
            "sample_tokens",
            "ckpt_interval",
            "log_interval",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"[TrainConfig] {name} must be an int >= 0, got {v!r}")
        if str(self.precision).lower() not in _PRECISION_NAMES:
            raise ValueError(
                f"[TrainConfig] precision {self.precision!r} is not one of auto, fp32, tf32, bf16"
            )
        from .config import parse_recompute

        if str(self.recompute).lower() != "auto":
            parse_recompute(self.recompute, "TrainConfig")
        if not self.lr > 0:
            raise ValueError(f"[TrainConfig] lr must be > 0, got {self.lr}")

    @classmethod
    def from_json(cls, path: str | os.PathLike, **overrides: Any) -> TrainConfig:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"[TrainConfig] {p}: no such file")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"[TrainConfig] {p}: not valid JSON ({e})") from None
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"[TrainConfig] {p}: unknown field(s) {unknown}; known: {sorted(known)}"
            )
        d.update(overrides)
        return cls(**d)


# ---------------------------------------------------------------------------------------------
# helpers


def set_threads(n: int = 0) -> int:
    """Set the process's CPU thread budget (bt.set_num_threads) and return it.

    One budget for everything: blutrain.tensor's op loops and the BLAS under blutrain-linalg
    run on one pool of n threads (a GEMM gets all n while the op loops are idle, and the
    reverse), so adding a thread never oversubscribes the cores. n = 0 means automatic:
    OMP_NUM_THREADS when the user set it, else every CPU this process may use
    (bt.available_cpus(): its affinity mask, capped by its cgroup CPU quota). Callable at any
    time, before or after blutrain.tensor is imported.
    """
    import blutrain.tensor as bt

    if n <= 0:
        env = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
        n = int(env) if env.isdigit() and int(env) > 0 else bt.available_cpus()
    bt.set_num_threads(n)
    return n


def threads_note(device: str) -> str:
    """The CPU run's first log line's ", 2 threads of 2 CPUs" ("" on a GPU)."""
    if str(device).startswith("cuda"):
        return ""
    import blutrain.tensor as bt

    n, cpus = bt.get_num_threads(), bt.available_cpus()
    return f", {n} thread{'s' if n != 1 else ''} of {cpus} CPU{'s' if cpus != 1 else ''}"


def resolve_device(device: str) -> str:
    """ "auto" -> "cuda" when this blutrain.tensor build runs ops on a GPU here, else "cpu"."""
    import blutrain.tensor as bt

    if device != "auto":
        if device.startswith("cuda") and (not bt.cuda_built() or bt.cuda_device_count() == 0):
            raise ValueError(
                f"[train] device {device!r}: "
                + (
                    "this blutrain.tensor build has no CUDA backend"
                    if not bt.cuda_built()
                    else "no CUDA device is visible"
                )
            )
        return device
    try:
        if bt.cuda_built() and bt.cuda_device_count() > 0:
            a = bt.ones(4, 4, device="cuda")
            (bt.gelu(a @ a, "tanh").sum()).item()  # every op the model uses must run there
            return "cuda"
    except Exception:  # noqa: BLE001 - CUDA kernels not there yet: train on the CPU
        pass
    return "cpu"


GRAPH_WARMUP_STEPS = 3  # eager steps before the capture (the first one tunes the GEMMs)


def resolve_recompute(recompute: str, device: str, precision: str) -> str:
    """ "auto" -> "ln" for fp32 on a GPU, else "none"; any other spec unchanged.

    fp32 activations take twice bf16's memory; rebuilding the two LayerNorm outputs of each
    block in backward (bitwise the same numbers) takes GPT-2 124M's fp32 peak from 11.17 to
    10.05 GiB at B=16, T=1024, within the noise of its GEMM-bound step (56,840 -> 56,822 tok/s,
    session 25). tf32 keeps them: the same recompute cost its faster step about 3% (237,442 ->
    229,187 tok/s as a graph, partly the machine) and its 11.17 GiB is already under its aim;
    bf16 keeps everything too (6.78 GiB)."""
    if str(recompute).lower() != "auto":
        return recompute
    from .gpt2 import precision_name

    fp32 = precision_name(precision) == "fp32"
    return "ln" if fp32 and str(device).startswith("cuda") else "none"


def resolve_precision(precision: str, device: str) -> str:
    """ "auto" -> bf16 on a GPU, fp32 on the CPU; else the canonical name (fp32, tf32, bf16)."""
    from .gpt2 import precision_name

    if str(precision).lower() == "auto":
        return "bf16" if device.startswith("cuda") else "fp32"
    p = precision_name(precision)
    if p == "bf16" and not device.startswith("cuda"):
        raise ValueError("[train] precision bf16 needs a CUDA device; use fp32 on the CPU")
    return p


def make_adamw(params: Any, **kw: Any):
    """blutrain.models.optim.AdamW, fused (multi-tensor) where that version has it."""
    import inspect

    from .optim import AdamW

    if "fused" in inspect.signature(AdamW).parameters:
        kw.setdefault("fused", None)
    return AdamW(params, **kw)


def clip_and_step(opt: Any, params: list, max_norm: float) -> Any:
    """Global-norm clipping and the AdamW step with no host sync; returns the norm tensor."""
    import blutrain.tensor as bt

    from . import optim

    if hasattr(optim, "grad_norm_and_clip_coef"):
        norm, coef = optim.grad_norm_and_clip_coef(params, max_norm)
        opt.step(grad_scale=coef)
        return norm
    norm = bt.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)
    opt.step()
    return norm


def capture_step(opt: Any, step: Callable[[], Any]) -> Callable[[], Any]:
    """Captures `step()` (a whole training step ending in `opt.step()`) as one CUDA graph and
    returns `run()`: each call replays it as the next optimizer step and returns the captured
    step's outputs (overwritten by the next replay). AdamW reads lr and the step count from
    device scalars (Note [AdamW in a CUDA graph] in optim.py): the capture counts the first
    replay's step on the host, and every later replay first advances the host counts and writes
    the new step to the device. For benchmarks; the trainer's _graph_step does the same with its
    batches copied in."""
    import blutrain.tensor as bt

    opt.use_device_scalars()  # writes this step's lr and count
    bt.cuda.empty_cache()  # the eager steps' cached blocks: the graph gets its own pool
    graph = bt.cuda.CUDAGraph()
    with bt.cuda.graph(graph):  # records the step; its host-side counts advance here
        outputs = step()
    replays = 0

    def run() -> Any:
        nonlocal replays
        if replays:
            opt.advance_steps()
            opt.write_device_scalars(opt.lr, opt.common_step())
        replays += 1
        graph.replay()
        return outputs

    return run


def peak_memory_bytes(device: str) -> int:
    """Peak bytes: blutrain.tensor's CUDA allocator stats when it has them, else memory_bytes."""
    if device.startswith("cuda"):
        import blutrain.tensor as bt

        cuda = getattr(bt, "cuda", None)
        fn = getattr(cuda, "max_memory_allocated", None)
        if fn is not None:
            try:
                return int(fn())
            except Exception:  # noqa: BLE001
                pass
    return memory_bytes(device)[1]


def model_config(name: str, vocab_multiple: int = 1):
    from .config import GPT2Config

    p = Path(name)
    if name.endswith(".json") or p.is_file():
        cfg = GPT2Config.from_json(p)
        if vocab_multiple != 1 and cfg.vocab_multiple == 1:
            cfg = dataclasses.replace(cfg, vocab_multiple=vocab_multiple)
        return cfg
    return GPT2Config.from_name(name, vocab_multiple=vocab_multiple)


def ensure_data(data: str | None, quiet: bool = False) -> Path:
    """The shard directory; the default one is prepared from the shipped Tiny Shakespeare."""
    from .data import prepare

    if data is not None:
        p = Path(data)
        if not p.exists():
            raise FileNotFoundError(
                f"[train] data {p}: no such file or directory (run "
                f"`blutrain prepare FILES -o {p}` first)"
            )
        return p
    p = Path(DEFAULT_DATA)
    if not any(p.glob("*_train_*.bin")) or not any(p.glob("*_val_*.bin")):
        if not quiet:
            print(f"preparing the shipped Tiny Shakespeare into {p} ...", file=sys.stderr)
        prepare(None, p)
    return p


def memory_bytes(device: str) -> tuple[int, int]:
    """(current, peak) bytes: blutrain.alloc's pool on a GPU, the process's RSS on the CPU."""
    if device.startswith("cuda"):
        try:
            import blutrain.alloc as ba

            s = ba.stats(device)
            return int(s["allocated_bytes"]), int(s["allocated_bytes_peak"])
        except Exception:  # noqa: BLE001
            pass
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        rss = 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return rss, max(peak, rss)


def flops_per_token(cfg, seq_len: int) -> float:
    """Training FLOPs per token: 6 N (N counts the tied head once) + attention's 12 L T C."""
    n = cfg.n_params()
    return 6.0 * n + 12.0 * cfg.n_layer * seq_len * cfg.n_embd


def peak_flops(device: str, precision: str) -> float | None:
    """Dense peak FLOP/s of this GPU at `precision` (fp32, tf32, bf16 or the _PEAK_FLOPS keys);
    None on the CPU or an unknown GPU. BLUTRAIN_PEAK_FLOPS overrides it."""
    env = os.environ.get("BLUTRAIN_PEAK_FLOPS")
    if env:
        return float(env)
    if not device.startswith("cuda"):
        return None
    precision = _PEAK_KEY.get(precision, precision)
    name = ""
    try:
        import blutrain.tensor as bt

        name = bt.cuda.get_device_name(device)
    except Exception:  # noqa: BLE001 - older builds: ask nvidia-smi
        try:
            import subprocess

            name = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout
        except Exception:  # noqa: BLE001
            return None
    for key, table in _PEAK_FLOPS.items():
        if key in name:
            return table.get(precision)
    return None


def _fmt_loss(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.4f}"


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def load_model(
    checkpoint: str | None = None,
    hf: str | None = None,
    model: str = "tiny",
    device: str = "cpu",
    vocab_multiple: int = 1,
):
    """A GPT2 from a training checkpoint directory (or a run directory holding one), a Hugging
    Face directory, or a fresh preset (random weights)."""
    from .checkpoint import load_checkpoint
    from .config import GPT2Config
    from .gpt2 import GPT2

    if checkpoint:
        path = Path(checkpoint)
        if (path / CHECKPOINT_DIR).is_dir() and not (path / "manifest.json").exists():
            path = path / CHECKPOINT_DIR
        ck = load_checkpoint(path)
        if not ck.trainer or "model_config" not in ck.trainer:
            raise ValueError(
                f"[load_model] {path}: the checkpoint has no model_config in trainer.json"
            )
        cfg = GPT2Config.from_dict(ck.trainer["model_config"])
        m = GPT2(cfg, device=device, init=False)
        m.load_state_dict(ck.weights, source=str(path / "model.safetensors"))
        return m
    if hf:
        return GPT2.from_pretrained(hf, vocab_multiple=vocab_multiple, device=device)
    return GPT2(model_config(model, vocab_multiple), device=device)


# ---------------------------------------------------------------------------------------------
# the trainer


@dataclass
class History:
    train: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    val: list[tuple[int, float]] = field(default_factory=list)


class Trainer:
    """Owns the model, optimizer, schedule, loaders and logs of one run (see TrainConfig)."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        console: Any = None,
        on_step: Callable[[dict], None] | None = None,
    ) -> None:
        if config.threads > 0:
            set_threads(config.threads)
        import blutrain.tensor as bt

        from .data import DataLoader
        from .gpt2 import GPT2, set_matmul_precision
        from .optim import CosineSchedule
        from .tokenizer import get_encoding

        self.cfg = config
        self.device = resolve_device(config.device)
        if config.cuda_graph and not self.device.startswith("cuda"):
            raise ValueError(
                f"[train] cuda_graph needs a CUDA device, not {self.device} (drop --cuda-graph)"
            )
        self.precision = resolve_precision(config.precision, self.device)
        self.out_dir = Path(config.out_dir)
        self.console = console
        self.on_step = on_step
        self.enc = get_encoding()
        bt.manual_seed(config.seed)
        if config.init_from:
            self.model = GPT2.from_pretrained(
                config.init_from, vocab_multiple=config.vocab_multiple, device=self.device
            )
        else:
            self.model = GPT2(model_config(config.model, config.vocab_multiple), device=self.device)
        self.model.recompute = resolve_recompute(config.recompute, self.device, self.precision)
        self.model.set_precision(self.precision)
        set_matmul_precision(self.precision)
        self.model_config = self.model.config
        if config.seq_len > self.model_config.block_size:
            raise ValueError(
                f"[train] seq_len {config.seq_len} is longer than the model's "
                f"block size {self.model_config.block_size}"
            )
        data = ensure_data(config.data, quiet=not config.progress)
        V = self.model_config.vocab_size
        self.train_loader = DataLoader(
            data, config.batch_size, config.seq_len, split="train", seed=config.seed, vocab_size=V
        )
        try:
            self.val_loader: DataLoader | None = DataLoader(
                data, config.batch_size, config.seq_len, split="val", shuffle=False, vocab_size=V
            )
        except (FileNotFoundError, ValueError):
            self.val_loader = None  # no (or too small a) validation split: no val loss
        self.optimizer = make_adamw(
            self.model.named_parameters(),
            lr=config.lr,
            betas=(config.beta1, config.beta2),
            weight_decay=config.weight_decay,
        )
        self.schedule = CosineSchedule(
            config.lr, config.warmup_steps, config.max_steps, config.min_lr
        )
        if config.cuda_graph and self.device.startswith("cuda"):
            # the warm-up's eager steps read the same float32 lr as the replays will
            self.optimizer.use_device_scalars(True)
        self.step = 0
        self.history = History()
        self.tokens_per_step = config.batch_size * config.seq_len * config.grad_accum
        self.flops_token = flops_per_token(self.model_config, config.seq_len)
        self.peak = peak_flops(self.device, self.precision)
        self._metrics_file = None
        # A GPU runs ahead of Python: steps are queued and their losses read back (one host
        # sync) every log_interval steps; the CPU reads every step (it costs nothing there).
        self.sync_every = (config.log_interval or 10) if self.device.startswith("cuda") else 1
        self._pending: list[dict[str, Any]] = []
        self._prefetched: list[tuple[Any, Any]] = []
        self._graph: Any = None  # the captured step (cuda_graph), see _graph_step
        self._graph_inputs: list[tuple[Any, Any]] = []
        self._graph_outputs: tuple[list[Any], Any] = ([], 0.0)
        self._eager_steps = 0
        self.prefetch = self.device.startswith("cuda")  # upload batches ahead, at sync points
        self._t_sync = time.perf_counter()
        if config.resume:
            ck = self.out_dir / CHECKPOINT_DIR
            if ck.exists():
                self.load(ck)

    # -- one step --------------------------------------------------------------------------------
    def _next_batch(self) -> tuple[Any, Any]:
        """The next training micro-batch: numpy from the loader, or a slice of the batches
        uploaded ahead (see _prefetch)."""
        if self._prefetched:
            return self._prefetched.pop(0)
        return self.train_loader.next_batch()

    def _prefetch(self, steps: int) -> None:
        """Upload the micro-batches of the next `steps` steps in one copy.

        A host-to-device copy from pageable memory synchronises the stream, so uploading each
        batch when it is used would stall the host every step; here the upload happens where the
        trainer syncs anyway (after reading back the losses). Only the steps up to the next sync
        point are fetched, so a checkpoint there saves the loader exactly at self.step."""
        import blutrain.tensor as bt

        n = steps * self.cfg.grad_accum
        if n < 1:
            return
        pairs = [self.train_loader.next_batch() for _ in range(n)]
        host = np.stack([np.stack([x, y]) for x, y in pairs]).astype(np.int64, copy=False)
        buf = bt.tensor(host, device=self.device)  # (n, 2, B, T): one copy
        self._prefetched = [(buf[i][0], buf[i][1]) for i in range(n)]

    def _steps_to_sync(self, stop: int) -> int:
        """How many steps fit's loop queues from here up to and including its next sync point."""
        s = self.step
        while s < stop:
            s += 1
            if self._is_sync_point(s, stop):
                break
        return s - self.step

    def _is_sync_point(self, s: int, stop: int) -> bool:
        cfg = self.cfg
        return bool(
            s % self.sync_every == 0
            or s in (1, stop)
            or (cfg.eval_interval and (s % cfg.eval_interval == 0 or s == stop))
            or (cfg.sample_interval and (s % cfg.sample_interval == 0 or s == stop))
            or (cfg.ckpt_interval and s % cfg.ckpt_interval == 0)
        )

    def _queue_step(self) -> None:
        """One optimizer step with no host sync: its loss and norm stay on the device."""
        lr = self.schedule(self.step)
        self.optimizer.set_lr(lr)
        batches = [self._next_batch() for _ in range(self.cfg.grad_accum)]
        if self.cfg.cuda_graph and self._eager_steps >= GRAPH_WARMUP_STEPS:
            losses, norm = self._graph_step(batches, lr)
        else:
            losses, norm = self._step_body(batches)
            self._eager_steps += 1
        self.step += 1
        self._pending.append({"step": self.step, "lr": lr, "losses": losses, "norm": norm})

    def _step_body(self, batches: list[tuple[Any, Any]]) -> tuple[list[Any], Any]:
        """Forward and backward of the micro-batches, clipping, AdamW: (losses, norm), device
        tensors (the norm 0.0 without clipping)."""
        from .gpt2 import gemm_autotune
        from .optim import grad_norm_and_clip_coef

        cfg = self.cfg
        losses = []
        with gemm_autotune(cfg.gemm_autotune, self.device):  # the first step times the GEMMs
            for x, y in batches:
                # the loss alone: on CUDA the head and loss run in chunks, the logits never whole
                loss = self.model(x, y, return_logits=False)[1]
                if cfg.grad_accum > 1:
                    (loss / cfg.grad_accum).backward()
                else:
                    loss.backward()
                losses.append(loss.detach())
        # The norm and the clip coefficient stay device tensors; the coefficient scales the
        # gradients inside the AdamW kernel (grad_scale), so the grads are not rewritten.
        norm: Any
        norm, coef = grad_norm_and_clip_coef(self.model.parameters(), cfg.grad_clip)
        if norm is None:
            norm = 0.0
        self.optimizer.step(grad_scale=coef)
        self.optimizer.zero_grad()
        return losses, norm

    def _graph_step(self, batches: list[tuple[Any, Any]], lr: float) -> tuple[list[Any], Any]:
        """The step as a CUDA graph replay (captured at its first call, after the eager warm-up
        steps): the batches are copied into the graph's input buffers and AdamW's lr and step
        count into its device scalars (Note [AdamW in a CUDA graph]). The losses and the norm are
        copied out of the graph's outputs, which the next replay overwrites."""
        import blutrain.tensor as bt

        opt = self.optimizer
        step = opt.common_step() + 1
        if self._graph is None:
            bt.cuda.synchronize()
            bt.cuda.empty_cache()  # the warm-up's cached blocks: the graph gets its own pool
            self._graph_inputs = [
                (
                    bt.zeros(tuple(x.shape), dtype=bt.int64, device=self.device),
                    bt.zeros(tuple(y.shape), dtype=bt.int64, device=self.device),
                )
                for x, y in batches
            ]
            opt.write_device_scalars(lr, step)
            self._copy_graph_inputs(batches)
            g = bt.cuda.CUDAGraph()
            with bt.cuda.graph(g):  # records; the step's counts advance here, on the host
                self._graph_outputs = self._step_body(self._graph_inputs)
            self._graph = g
        else:
            opt.advance_steps()
            opt.write_device_scalars(lr, step)
            self._copy_graph_inputs(batches)
        self._graph.replay()
        losses, norm = self._graph_outputs
        return [x.clone() for x in losses], (norm.clone() if isinstance(norm, bt.Tensor) else norm)

    def _copy_graph_inputs(self, batches: list[tuple[Any, Any]]) -> None:
        import blutrain.tensor as bt

        for (sx, sy), (x, y) in zip(self._graph_inputs, batches):
            for dst, src in ((sx, x), (sy, y)):
                if tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(
                        f"[train] cuda_graph: batch shape {tuple(src.shape)} differs from the "
                        f"captured {tuple(dst.shape)} (a graph replays fixed shapes)"
                    )
                dst.copy_(src if isinstance(src, bt.Tensor) else bt.tensor(src, device=self.device))

    def _drop_graph(self) -> None:
        """Forget the captured step (its buffers and pool); the next graph step captures anew."""
        if self._graph is not None:
            self._graph.reset()
        self._graph = None
        self._graph_inputs = []
        self._graph_outputs = ([], 0.0)
        self._eager_steps = 0

    def _sync(self) -> list[dict[str, Any]]:
        """Read back the queued steps' losses and norms (one host sync); their metrics."""
        import blutrain.tensor as bt

        pending, self._pending = self._pending, []
        if not pending:
            return []
        scalars = []
        for p in pending:
            scalars += p["losses"]
            if isinstance(p["norm"], bt.Tensor):
                scalars.append(p["norm"])
        vals = iter(bt.stack([s.float() for s in scalars]).cpu().numpy().tolist())
        now = time.perf_counter()
        dt = (now - self._t_sync) / len(pending)
        self._t_sync = now
        tps = self.tokens_per_step / dt if dt > 0 else float("inf")
        mem, _ = memory_bytes(self.device)
        peak = peak_memory_bytes(self.device)
        out = []
        for p in pending:
            total = 0.0
            for _ in p["losses"]:
                total += float(next(vals))
            norm = float(next(vals)) if isinstance(p["norm"], bt.Tensor) else float(p["norm"])
            loss_v = total / len(p["losses"])
            self.history.train.append((p["step"], loss_v))
            m = {
                "step": p["step"],
                "loss": loss_v,
                "lr": p["lr"],
                "grad_norm": norm,
                "dt_ms": dt * 1e3,
                "tokens_per_s": tps,
                "mem_bytes": mem,
                "peak_mem_bytes": peak,
                "tokens": p["step"] * self.tokens_per_step,
            }
            if self.peak:
                m["mfu"] = tps * self.flops_token / self.peak
            out.append(m)
        return out

    def train_step(self) -> dict[str, float]:
        """One optimizer step, synchronously: its metrics (loss, lr, grad_norm, tokens/s...)."""
        self._sync()  # earlier queued steps are accounted first
        self._t_sync = time.perf_counter()
        self._queue_step()
        return self._sync()[-1]

    def evaluate(self, batches: int | None = None) -> float | None:
        """Mean loss over the first `batches` batches of the validation split."""
        import blutrain.tensor as bt

        if self.val_loader is None:
            return None
        n = min(batches or self.cfg.eval_batches, self.val_loader.batches_per_epoch)
        if n < 1:
            return None
        self.val_loader.reset()
        self.model.eval()
        total: Any = 0.0
        with bt.no_grad():
            for _ in range(n):
                x, y = self.val_loader.next_batch()
                _, loss = self.model(x, y, return_logits=False)
                total = total + loss.detach().float()  # summed on the device: one sync
        self.model.train()
        return float(total.item()) / n

    def sample(
        self, prompt: str | None = None, max_new_tokens: int | None = None, seed: int = 0
    ) -> str:
        from .config import EOT_TOKEN

        prompt = self.cfg.sample_prompt if prompt is None else prompt
        ids = self.enc.encode_ordinary(prompt) or [EOT_TOKEN]
        n = self.cfg.sample_tokens if max_new_tokens is None else max_new_tokens
        out = self.model.generate(np.array(ids), n, temperature=0.8, top_k=40, seed=seed)
        return self.enc.decode([int(t) for t in out[len(ids) :]])

    # -- checkpoints -------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        opt = self.optimizer.state_dict()
        return {
            "step": self.step,
            "train_config": dataclasses.asdict(self.cfg),
            "model_config": self.model_config.to_dict(),
            "loader": self.train_loader.state_dict(),
            "optimizer": opt["meta"],
            "history": {"train": self.history.train, "val": self.history.val},
        }

    def save(self, path: str | os.PathLike | None = None) -> Path:
        from .checkpoint import save_checkpoint

        path = Path(path) if path is not None else self.out_dir / CHECKPOINT_DIR
        opt = self.optimizer.state_dict()
        return save_checkpoint(path, self.model.state_dict(), opt["tensors"], self.state())

    def load(self, path: str | os.PathLike) -> None:
        """Restore model, optimizer, step, loader position and history from a checkpoint."""
        from .checkpoint import CheckpointError, load_checkpoint
        from .config import GPT2Config

        path = Path(path)
        ck = load_checkpoint(path)
        tr = ck.trainer or {}
        if self._graph is not None:  # the optimizer's state tensors are about to be replaced
            self._drop_graph()
        for key in ("step", "model_config", "loader", "optimizer"):
            if key not in tr:
                raise CheckpointError(
                    f"[train] {path}/trainer.json: missing {key!r}: not a "
                    "checkpoint written by the trainer"
                )
        saved_cfg = GPT2Config.from_dict(tr["model_config"])
        if saved_cfg != self.model_config:
            raise CheckpointError(
                f"[train] {path}: the checkpoint's model {saved_cfg} differs from this run's "
                f"{self.model_config}"
            )
        self.model.load_state_dict(ck.weights, source=str(path / "model.safetensors"))
        self.optimizer.load_state_dict({"meta": tr["optimizer"], "tensors": ck.optimizer or {}})
        self.train_loader.load_state_dict(tr["loader"])
        self.step = int(tr["step"])
        h = tr.get("history", {})
        self.history = History(
            [tuple(x) for x in h.get("train", [])], [tuple(x) for x in h.get("val", [])]
        )

    # -- logging -----------------------------------------------------------------------------------
    def _log(self, record: dict) -> None:
        if self._metrics_file is None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._metrics_file = open(self.out_dir / METRICS_FILE, "a")  # noqa: SIM115
        self._metrics_file.write(json.dumps(record) + "\n")
        self._metrics_file.flush()

    def _print(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text, highlight=False, markup=False, soft_wrap=True)
        else:
            print(text, flush=True)

    def plot(self, path: str | os.PathLike | None = None) -> Path | None:
        """loss.png: training loss (raw and smoothed) and validation loss against step."""
        try:
            from matplotlib.figure import Figure  # no pyplot: leaves the user's backend alone
        except ImportError:
            return None
        if not self.history.train:
            return None
        path = Path(path) if path is not None else self.out_dir / PLOT_FILE
        steps, losses = zip(*self.history.train, strict=True)
        fig = Figure(figsize=(7, 4), dpi=110)
        ax = fig.subplots()
        ax.plot(steps, losses, color="tab:blue", alpha=0.3, lw=1, label="train")
        k = max(1, len(losses) // 25)
        if k > 1:
            smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
            ax.plot(steps[k - 1 :], smooth, color="tab:blue", lw=2, label=f"train (mean of {k})")
        if self.history.val:
            vs, vl = zip(*self.history.val, strict=True)
            ax.plot(vs, vl, "o-", color="tab:orange", lw=2, label="validation")
        c = self.model_config
        ax.set_title(f"GPT-2 L={c.n_layer} C={c.n_embd}: {self.tokens_per_step:,} tokens/step")
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy loss")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
        return path

    # -- the loop ----------------------------------------------------------------------------------
    def fit(self, until: int | None = None) -> dict[str, Any]:
        """Train until step `until` (default max_steps; the schedule always spans max_steps),
        then checkpoint; returns a summary (losses, tokens/s, paths)."""
        cfg = self.cfg
        stop = cfg.max_steps if until is None else min(int(until), cfg.max_steps)
        c = self.model_config
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._print(
            f"GPT-2 L={c.n_layer} H={c.n_head} C={c.n_embd} T={cfg.seq_len} "
            f"({c.n_params() / 1e6:.2f}M params) on {self.device} ({self.precision}"
            + threads_note(self.device)
            + (f", recompute {self.model.recompute}" if self.model.recompute != "none" else "")
            + f"); {cfg.batch_size} x "
            f"{cfg.seq_len} x {cfg.grad_accum} = {self.tokens_per_step:,} tokens/step; "
            f"steps {self.step}..{stop} of {cfg.max_steps}; logs in {self.out_dir}"
        )
        if self.step == 0:
            self._log(
                {
                    "event": "start",
                    "train_config": dataclasses.asdict(cfg),
                    "model_config": c.to_dict(),
                    "device": self.device,
                    "n_params": c.n_params(),
                }
            )
            if cfg.eval_interval:
                self._eval_and_log()
        else:
            self._log({"event": "resume", "step": self.step})
        live = None
        progress_ctx = None
        if cfg.progress and self.console is not None and self.console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            progress_ctx = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            progress_ctx.start()
            live = progress_ctx.add_task(
                "train", total=cfg.max_steps, completed=self.step, stats=""
            )
        t_start = time.perf_counter()
        steps_done = 0
        tokens_s_ema = None
        last: dict[str, Any] = {}
        try:
            self._t_sync = time.perf_counter()
            while self.step < stop:
                if self.prefetch and not self._prefetched:
                    self._prefetch(self._steps_to_sync(stop))
                self._queue_step()
                s = self.step
                due_eval = bool(cfg.eval_interval) and (s % cfg.eval_interval == 0 or s == stop)
                due_sample = bool(cfg.sample_interval) and (
                    s % cfg.sample_interval == 0 or s == stop
                )
                due_ckpt = bool(cfg.ckpt_interval) and s % cfg.ckpt_interval == 0
                if not self._is_sync_point(s, stop):
                    continue  # no host sync: the GPU keeps its queue full
                for m in self._sync():
                    steps_done += 1
                    last = m
                    # the first step or two pay one-off costs: smooth tokens/s for the display
                    tokens_s_ema = (
                        m["tokens_per_s"]
                        if tokens_s_ema is None
                        else (0.9 * tokens_s_ema + 0.1 * m["tokens_per_s"])
                    )
                    self._log(m)
                    if not math.isfinite(m["loss"]):
                        raise FloatingPointError(f"[train] loss is {m['loss']} at step {m['step']}")
                    if self.on_step is not None:
                        self.on_step(m)
                    step = m["step"]
                    if cfg.log_interval and (step % cfg.log_interval == 0 or step == 1):
                        if live is None:
                            self._print(
                                f"step {step:5d}/{cfg.max_steps}  {self._stats(m, tokens_s_ema)}"
                                f"  norm {m['grad_norm']:.3f}  {m['dt_ms']:.0f} ms"
                            )
                if live is not None:
                    progress_ctx.update(
                        live, completed=self.step, stats=self._stats(last, tokens_s_ema)
                    )
                if due_eval:
                    self._eval_and_log()
                if due_sample:
                    text = self.sample(seed=self.step)
                    self._log({"step": self.step, "sample": text})
                    self._print(f"--- sample at step {self.step} ---\n{text}\n---")
                if due_ckpt:
                    self.save()
                self._t_sync = time.perf_counter()  # evals and samples are not training time
        finally:
            if progress_ctx is not None:
                progress_ctx.stop()
        elapsed = time.perf_counter() - t_start
        ckpt = self.save()
        png = self.plot() if cfg.plot else None
        summary = {
            "steps": self.step,
            "first_loss": self.history.train[0][1] if self.history.train else None,
            "final_loss": last.get("loss"),
            "val_loss": self.history.val[-1][1] if self.history.val else None,
            "tokens_per_s": (steps_done * self.tokens_per_step / elapsed) if steps_done else None,
            "elapsed_s": elapsed,
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "precision": self.precision,
            "checkpoint": str(ckpt),
            "metrics": str(self.out_dir / METRICS_FILE),
            "plot": str(png) if png else None,
        }
        self._log({"event": "end", **summary})
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None
        val = f"{summary['val_loss']:.4f}" if summary["val_loss"] is not None else "n/a"
        tps = f"{summary['tokens_per_s']:,.0f}" if summary["tokens_per_s"] else "n/a"
        self._print(
            f"done: step {self.step}, train loss {_fmt_loss(summary['final_loss'])}, "
            f"val loss {val}, "
            f"{tps} tokens/s, {elapsed:.1f} s; checkpoint {ckpt}"
            + (f", loss curve {png}" if png else "")
        )
        return summary

    def _stats(self, m: dict[str, Any], tokens_s: float | None) -> str:
        """The live bar's text: loss, lr, tokens/s, MFU, memory (peak on a GPU)."""
        mem = m["peak_mem_bytes"] if self.device.startswith("cuda") else m["mem_bytes"]
        return (
            f"loss {m['loss']:.4f}  lr {m['lr']:.2e}  {tokens_s or 0:,.0f} tok/s"
            + (f"  MFU {100 * m['mfu']:.1f}%" if "mfu" in m else "")
            + f"  mem {_fmt_bytes(mem)}"
        )

    def _eval_and_log(self) -> None:
        v = self.evaluate()
        if v is None:
            return
        self.history.val.append((self.step, v))
        self._log({"step": self.step, "val_loss": v})
        self._print(f"step {self.step:5d}: val loss {v:.4f}")


def train(config: TrainConfig | None = None, *, console: Any = None, **overrides: Any) -> dict:
    """Run a training job (see TrainConfig); returns the summary of Trainer.fit()."""
    cfg = config or TrainConfig()
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    return Trainer(cfg, console=console).fit()


# ---------------------------------------------------------------------------------------------
# CLI: train, sample, eval, bench


def _bool_flag(p: argparse.ArgumentParser, name: str, default: bool, help: str) -> None:
    p.add_argument(
        f"--{name}",
        dest=name.replace("-", "_"),
        action=argparse.BooleanOptionalAction,
        default=None,
        help=f"{help} (default: {'on' if default else 'off'})",
    )


def _train_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument(
        "--config", default=None, help="a JSON file of TrainConfig fields (flags override it)"
    )
    flags = [
        ("model", str, "GPT2Config preset (tiny, gpt2, gpt2-medium, gpt2-large, gpt2-xl) or JSON"),
        ("init-from", str, "start from a Hugging Face GPT-2 directory"),
        ("vocab-multiple", int, "pad the vocabulary to a multiple of this"),
        (
            "data",
            str,
            f"directory of llm.c token shards (default: {DEFAULT_DATA}, prepared "
            "from the shipped Tiny Shakespeare)",
        ),
        ("batch-size", int, "sequences per micro-batch (B)"),
        ("seq-len", int, "tokens per sequence (T)"),
        ("grad-accum", int, "micro-batches per optimizer step"),
        ("max-steps", int, "optimizer steps"),
        ("lr", float, "peak learning rate"),
        ("min-lr", float, "final learning rate (default lr/10)"),
        ("warmup-steps", int, "linear warmup steps"),
        ("weight-decay", float, "AdamW weight decay (on dim >= 2 tensors only)"),
        ("beta1", float, "AdamW beta1"),
        ("beta2", float, "AdamW beta2"),
        ("grad-clip", float, "global gradient-norm clip (0: off)"),
        ("device", str, "auto, cpu, cuda or cuda:N"),
        ("precision", str, "auto (bf16 on a GPU, fp32 on the CPU), fp32, tf32 or bf16"),
        (
            "recompute",
            str,
            "activation recomputation: auto (ln for fp32 on a GPU, else none), none, gelu, "
            "ln, attn, block or ln+gelu",
        ),
        ("threads", int, "CPU threads (0: $OMP_NUM_THREADS, else all usable CPUs)"),
        ("seed", int, "random seed (init and data order)"),
        ("out-dir", str, "directory for metrics.jsonl, loss.png and checkpoint/"),
        ("log-interval", int, "steps between log lines without a live bar"),
        ("eval-interval", int, "steps between validation losses (0: never)"),
        ("eval-batches", int, "validation batches per evaluation"),
        ("sample-interval", int, "steps between text samples (0: never)"),
        ("sample-tokens", int, "tokens per sample"),
        ("sample-prompt", str, "prompt of the samples"),
        ("ckpt-interval", int, "steps between checkpoints (0: only at the end)"),
    ]
    for name, typ, help_ in flags:
        default = getattr(d, name.replace("-", "_"))
        p.add_argument(f"--{name}", type=typ, default=None, help=f"{help_} (default: {default})")
    _bool_flag(p, "resume", d.resume, "continue from <out-dir>/checkpoint when it exists")
    _bool_flag(
        p,
        "gemm-autotune",
        d.gemm_autotune,
        "on a GPU, time cuBLASLt's algorithms for each GEMM shape once and keep the fastest "
        "(cached in ~/.cache/blutrain)",
    )
    _bool_flag(
        p,
        "cuda-graph",
        d.cuda_graph,
        "on a GPU, capture the training step (forward, backward, clipping, AdamW) once as a CUDA "
        "graph after 3 eager steps and replay it: no per-kernel launch cost",
    )
    _bool_flag(p, "progress", d.progress, "live progress bar")
    _bool_flag(p, "plot", d.plot, "write loss.png at the end")


def _train_config_from_args(args: argparse.Namespace) -> TrainConfig:
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    overrides = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    if args.config:
        return TrainConfig.from_json(args.config, **overrides)
    return TrainConfig(**overrides)


def _console():
    from rich.console import Console

    return Console()


def _train_run(args: argparse.Namespace) -> int:
    cfg = _train_config_from_args(args)
    set_threads(cfg.threads)
    train(cfg, console=_console())
    return 0


def _model_source_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        default=None,
        help="a training checkpoint directory (or the run directory holding one)",
    )
    p.add_argument("--hf", default=None, help="a Hugging Face GPT-2 directory")
    p.add_argument(
        "--model",
        default=None,
        help="a preset with random weights (default: the run in runs/shakespeare)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda")
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads (0: $OMP_NUM_THREADS, else all usable CPUs)",
    )


def _model_from_args(args: argparse.Namespace):
    set_threads(args.threads)
    device = resolve_device(args.device)
    if not args.checkpoint and not args.hf and not args.model:
        default = Path(DEFAULT_OUT) / CHECKPOINT_DIR
        if not default.exists():
            raise FileNotFoundError(
                f"[{args.command}] no --checkpoint, --hf or --model given and {default} does not "
                "exist (run `blutrain train` first)"
            )
        args.checkpoint = str(default)
    return load_model(args.checkpoint, args.hf, args.model or "tiny", device)


def _sample_arguments(p: argparse.ArgumentParser) -> None:
    _model_source_arguments(p)
    p.add_argument("--prompt", default="\n", help="text to continue")
    p.add_argument("-n", "--max-new-tokens", type=int, default=200)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)


def _sample_run(args: argparse.Namespace) -> int:
    from .config import EOT_TOKEN
    from .tokenizer import get_encoding

    model = _model_from_args(args)
    enc = get_encoding()
    ids = enc.encode_ordinary(args.prompt) or [EOT_TOKEN]
    for i in range(args.num_samples):
        out = model.generate(
            np.array(ids),
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed + i,
        )
        if i:
            print("---")
        print(args.prompt + enc.decode([int(t) for t in out[len(ids) :]]))
    return 0


def evaluate_loss(
    model,
    data: str | os.PathLike,
    batch_size: int,
    seq_len: int,
    batches: int | None = None,
    split: str = "val",
) -> tuple[float, int]:
    """Mean loss of `model` over the first `batches` batches (default: all) of a split."""
    import blutrain.tensor as bt

    from .data import DataLoader

    loader = DataLoader(
        data, batch_size, seq_len, split=split, shuffle=False, vocab_size=model.config.vocab_size
    )
    n = loader.batches_per_epoch if not batches else min(batches, loader.batches_per_epoch)
    total = 0.0
    model.eval()
    with bt.no_grad():
        for _ in range(n):
            x, y = loader.next_batch()
            total += float(model(x, y, return_logits=False)[1].item())
    return total / n, n


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    _model_source_arguments(p)
    p.add_argument("--data", default=None, help=f"shard directory (default {DEFAULT_DATA})")
    p.add_argument("--split", default="val")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=None, help="default: min(block size, 1024)")
    p.add_argument("--batches", type=int, default=0, help="batches to average (0: all)")


def _eval_run(args: argparse.Namespace) -> int:
    model = _model_from_args(args)
    data = ensure_data(args.data)
    T = args.seq_len or min(model.config.block_size, 1024)
    t0 = time.perf_counter()
    loss, n = evaluate_loss(model, data, args.batch_size, T, args.batches or None, args.split)
    dt = time.perf_counter() - t0
    print(
        json.dumps(
            {
                "split": args.split,
                "loss": loss,
                "perplexity": math.exp(loss),
                "batches": n,
                "tokens": n * args.batch_size * T,
                "seconds": dt,
            }
        )
    )
    return 0


def _cuda_sync(device: str) -> None:
    if device.startswith("cuda"):
        import blutrain.tensor as bt

        cuda = getattr(bt, "cuda", None)
        if cuda is not None and hasattr(cuda, "synchronize"):
            cuda.synchronize()
        else:
            bt._tensor._cuda_synchronize()


def bench(
    model: str = "tiny",
    batch_size: int = 8,
    seq_len: int = 128,
    steps: int = 10,
    warmup: int = 2,
    device: str = "auto",
    vocab_multiple: int = 128,
    seed: int = 0,
    precision: str = "auto",
    recompute: str = "auto",
    gemm_autotune: bool = True,
    cuda_graph: bool = False,
) -> dict:
    """tokens/s and peak memory of `steps` training steps (forward, backward, clipping, AdamW)
    on one fixed batch of random tokens, after `warmup` untimed steps. On a GPU the timed steps
    run without host syncs (one at the end), as the trainer's; the peak memory is
    blutrain.alloc's (bt.cuda.max_memory_allocated) over warm-up and timed steps. cuda_graph
    (CUDA only): the whole step is captured once after the warm-up and the timed steps replay it,
    as the trainer's cuda_graph option does."""
    import blutrain.tensor as bt

    from .gpt2 import GPT2, set_matmul_precision
    from .gpt2 import gemm_autotune as tuned_gemms

    dev = resolve_device(device)
    prec = resolve_precision(precision, dev)
    bt.manual_seed(seed)
    cfg = model_config(model, vocab_multiple)
    if seq_len > cfg.block_size:
        raise ValueError(f"[bench] seq_len {seq_len} > block size {cfg.block_size}")
    if cuda_graph and not dev.startswith("cuda"):
        raise ValueError(f"[bench] cuda_graph needs a CUDA device, not {dev} (drop --cuda-graph)")
    cuda = getattr(bt, "cuda", None)
    if dev.startswith("cuda") and hasattr(cuda, "reset_peak_memory_stats"):
        cuda.reset_peak_memory_stats()
    recompute = resolve_recompute(recompute, dev, prec)
    m = GPT2(cfg, device=dev, precision=prec, recompute=recompute)
    set_matmul_precision(prec)
    opt = make_adamw(m.named_parameters(), lr=1e-4)
    rng = np.random.default_rng(seed)
    data = rng.integers(0, cfg.vocab_size, (batch_size, seq_len + 1))
    x = bt.tensor(data[:, :-1], device=dev)
    y = bt.tensor(data[:, 1:], device=dev)
    params = list(m.parameters())

    def step() -> Any:
        with tuned_gemms(gemm_autotune, dev):  # as the trainer: the first warm-up step tunes
            loss = m(x, y, return_logits=False)[1]  # the head + loss in chunks (no whole logits)
            loss.backward()
        clip_and_step(opt, params, 1.0)
        opt.zero_grad()
        return loss

    for _ in range(warmup):
        float(step().item())
    _cuda_sync(dev)
    run = step
    if cuda_graph:
        run = capture_step(opt, step)
        float(run().item())  # the first replay (untimed), checked for errors
    times = []
    t_all = time.perf_counter()
    loss = None
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = run()
        if not dev.startswith("cuda"):
            times.append(time.perf_counter() - t0)
    last_loss = float(loss.item()) if loss is not None else math.nan  # the one sync
    _cuda_sync(dev)
    total = time.perf_counter() - t_all
    if dev.startswith("cuda") or not times:
        times = [total / max(1, steps)] * steps
    tok = batch_size * seq_len
    tps = tok * steps / total if total > 0 else float("inf")
    peak = peak_flops(dev, prec)
    return {
        "model": model,
        "n_params": cfg.n_params(),
        "device": dev,
        "precision": prec,
        "recompute": recompute,
        "cuda_graph": cuda_graph,
        "batch_size": batch_size,
        "seq_len": seq_len,
        "steps": steps,
        "step_ms_median": 1e3 * float(np.median(times)),
        "tokens_per_s": tps,
        "peak_mem_bytes": peak_memory_bytes(dev),
        "mfu": (tps * flops_per_token(cfg, seq_len) / peak) if peak else None,
        "loss": last_loss,
    }


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--precision",
        default="auto",
        help="comma-separated modes to run: fp32, tf32, bf16 (auto: bf16 on a GPU, fp32 on the "
        "CPU)",
    )
    p.add_argument(
        "--recompute",
        default="auto",
        help="auto (ln for fp32 on a GPU, else none), none, gelu, ln, attn, block, or ln+gelu",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads (0: $OMP_NUM_THREADS, else all usable CPUs)",
    )
    _bool_flag(p, "gemm-autotune", True, "on a GPU, time cuBLASLt's algorithms per GEMM shape once")
    _bool_flag(
        p,
        "cuda-graph",
        False,
        "on a GPU, replay the whole step as one captured CUDA graph (no launch overhead)",
    )
    p.add_argument("--json", default=None, help="also write the result to this JSON file")


def _bench_run(args: argparse.Namespace) -> int:
    from rich.table import Table

    set_threads(args.threads)
    modes = [s.strip() for s in str(args.precision).split(",") if s.strip()] or ["auto"]
    rows = [
        bench(
            args.model,
            args.batch_size,
            args.seq_len,
            args.steps,
            args.warmup,
            args.device,
            precision=mode,
            recompute=args.recompute,
            gemm_autotune=args.gemm_autotune is not False,
            cuda_graph=args.cuda_graph is True,
        )
        for mode in modes
    ]
    r = rows[0]
    table = Table(
        title=f"blutrain bench: GPT-2 {r['model']} ({r['n_params'] / 1e6:.1f}M), "
        f"B={r['batch_size']} T={r['seq_len']}, {r['device']}"
        + (", CUDA graph" if r["cuda_graph"] else ""),
        show_edge=False,
    )
    for col in ("precision", "tokens/s", "step (mean)", "peak memory", "MFU"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r["precision"] + ("" if r["recompute"] == "none" else f" +{r['recompute']}"),
            f"{r['tokens_per_s']:,.0f}",
            f"{r['step_ms_median']:.1f} ms",
            _fmt_bytes(r["peak_mem_bytes"]),
            f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a",
        )
    _console().print(table)
    if args.json:
        out = rows[0] if len(rows) == 1 else rows
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


_SPECS = [
    (
        "train",
        "train GPT-2 (default: a small one on the shipped Tiny Shakespeare)",
        _train_arguments,
        _train_run,
    ),
    (
        "sample",
        "generate text from a checkpoint, a Hugging Face directory or a preset",
        _sample_arguments,
        _sample_run,
    ),
    ("eval", "validation loss of a model on token shards", _eval_arguments, _eval_run),
    ("bench", "tokens/s and peak memory of N training steps", _bench_arguments, _bench_run),
]


def add_commands(subparsers: Any) -> None:
    """Register train, sample, eval and bench on an argparse subparsers object.

    Each parser sets ``_run`` (a function of the parsed namespace returning an exit code), as
    blutrain.models.cli.main expects."""
    for name, help_, add_args, run in _SPECS:
        p = subparsers.add_parser(name, help=help_, description=help_)
        add_args(p)
        p.set_defaults(_run=run)


def commands() -> list:
    """The four subcommands as cli.Command entries (for cli.COMMANDS)."""
    from .cli import Command

    return [Command(name, help_, add_args, run) for name, help_, add_args, run in _SPECS]
