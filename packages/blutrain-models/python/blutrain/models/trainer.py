"""The training loop: Trainer.fit, evaluation, logging and checkpoints.

    from blutrain.models.trainer import Trainer, train
    from blutrain.models.train_config import TrainConfig
    summary = train(TrainConfig(max_steps=200))            # what `blutrain train` runs
    summary = train(TrainConfig(model="gpt2", data="data/fineweb", batch_size=16, seq_len=1024,
                                grad_accum=32, device="cuda", step="cuda-graph"))

One optimizer step = `grad_accum` micro-batches of (batch_size, seq_len) tokens whose gradients
add up, then global-norm clipping, the cosine schedule's learning rate, and AdamW: how it is
taken is the Step's business (steps/: eager, CUDA graph; later distributed and compiled). The
loop owns the rest: the schedule, the data, evaluation every `eval_interval` steps (the first
`eval_batches` batches of the validation split, always the same ones), a text sample every
`sample_interval` steps, metrics in ``<out_dir>/metrics.jsonl``, the loss curves in
``<out_dir>/loss.png``, checkpoints in ``<out_dir>/checkpoint``. It talks to the run's processes
through a ProcessGroup only (tokens/s counts every rank's tokens, the validation loss is their
mean, rank 0 alone writes), so a distributed step needs no branch here.

Resume (`resume=True`, or "auto"): model, optimizer state, step, schedule and the data loader's
position come back from the checkpoint, so a run stopped at step N and resumed is bit for bit
the run that never stopped. With a larger `max_steps` (or another `min_lr`) a run is extended:
from the step it resumes at, the cosine decays from the learning rate it has reached to min_lr
at the new max_steps (a finished run, at min_lr, stays there); the learning rate never rises.

Everything that can be checked before a model is built is checked first (settings, the model's
block size, the output directory, the data, the whole checkpoint): a bad input changes nothing
on disk.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .config import (
    LLAMA_RECOMPUTE,
    GPT2Config,
    LlamaConfig,
    ModelConfig,
    is_llama_name,
    model_config,
)
from .device import (
    fmt_bytes,
    is_cuda,
    memory_bytes,
    peak_flops,
    peak_memory_bytes,
    resolve_device,
    resolve_precision,
    resolve_recompute,
    set_threads,
    threads_note,
)
from .process_group import ProcessGroup
from .run_dir import RunDir
from .run_state import RESUME_HINT, SavedRun, read_saved_run
from .schedule import CosineSchedule
from .steps import StepOutput, step_class
from .train_config import DEFAULT_DATA, ConfigError, TrainConfig


@dataclass
class History:
    train: list[tuple[int, float]] = field(default_factory=list)  # (step, loss)
    val: list[tuple[int, float]] = field(default_factory=list)


def _kind(c: ModelConfig) -> str:
    """The model kind's name in logs and plots."""
    return "LLaMA" if isinstance(c, LlamaConfig) else "GPT-2"


def run_model_config(cfg: TrainConfig) -> ModelConfig:
    """The model a TrainConfig trains: init_from's Hugging Face config, else `model` (a GPT-2
    or a LLaMA-style preset or JSON file)."""
    if cfg.init_from:
        if is_llama_name(cfg.model):
            raise ConfigError(
                f"[TrainConfig] init_from (--init-from) loads a Hugging Face GPT-2 directory; "
                f"model {cfg.model!r} starts from scratch (drop one of the two)"
            )
        return GPT2Config.from_hf_config(cfg.init_from, vocab_multiple=cfg.vocab_multiple)
    mc = model_config(cfg.model, cfg.vocab_multiple)
    if isinstance(mc, LlamaConfig) and cfg.recompute not in ("auto", *LLAMA_RECOMPUTE):
        raise ConfigError(
            f"[TrainConfig] recompute (--recompute) {cfg.recompute!r}: a LLaMA model takes "
            f"{', '.join(('auto', *LLAMA_RECOMPUTE))}"
        )
    # GPT-2's option: a LLaMA model's stream is always in the compute dtype, so the default
    # (float32) passes through unused and any other value is refused rather than ignored
    if isinstance(mc, LlamaConfig) and cfg.residual_dtype != TrainConfig.residual_dtype:
        raise ConfigError(
            f"[TrainConfig] residual_dtype (--residual-dtype) {cfg.residual_dtype!r}: GPT-2 "
            "models only (a LLaMA model keeps its residual stream in the compute dtype); drop "
            "it for a LLaMA model"
        )
    if isinstance(mc, LlamaConfig) and cfg.residual_grad_dtype != TrainConfig.residual_grad_dtype:
        raise ConfigError(
            f"[TrainConfig] residual_grad_dtype (--residual-grad-dtype) "
            f"{cfg.residual_grad_dtype!r}: GPT-2 models only; drop it for a LLaMA model"
        )
    return mc


def find_data(
    data: str | None, quiet: bool = False, main: bool = True, prepare_default: bool = True
) -> Path:
    """The shard directory; the default one is prepared from the shipped Tiny Shakespeare (by
    the main process, unless prepare_default is False)."""
    if data is not None:
        p = Path(data)
        if not p.exists():
            raise FileNotFoundError(
                f"[data] --data {p}: no such file or directory (make token shards with "
                f"`blutrain prepare FILES -o {p}`)"
            )
        return p
    p = Path(DEFAULT_DATA)
    missing = not any(p.glob("*_train_*.bin")) or not any(p.glob("*_val_*.bin"))
    if main and prepare_default and missing:
        from .data import prepare

        if not quiet:
            print(f"preparing the shipped Tiny Shakespeare into {p} ...", flush=True)
        prepare(None, p)
    return p


class Trainer:
    """Owns the model, the step, the schedule, the loaders and the logs of one run.

    group: the run's processes; default: what the configured step asks for (one process for
    eager and CUDA-graph steps).
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        console: Any = None,
        on_step: Callable[[dict], None] | None = None,
        group: ProcessGroup | None = None,
    ) -> None:
        cfg = self.cfg = config
        set_threads(cfg.threads)  # the one CPU budget: op loops and BLAS
        # -- checks: nothing is built or written before all of these pass
        if cfg.compile and cfg.step not in ("eager", "compiled"):
            raise ConfigError(
                f"[TrainConfig] compile (--compile) compiles the eager step; it cannot be combined "
                f"with step (--step) = {cfg.step!r}"
            )
        step_cls = step_class(cfg.step_name)
        self.group = group if group is not None else step_cls.process_group(cfg)
        self.device = self.group.device(resolve_device(cfg.device))
        self.precision = resolve_precision(cfg.precision, self.device)
        step_cls.check(cfg, self.device)
        self.model_config = run_model_config(cfg)
        if cfg.seq_len > self.model_config.block_size:
            raise ConfigError(
                f"[TrainConfig] seq_len (--seq-len) = {cfg.seq_len}: must be at most the model's "
                f"block size {self.model_config.block_size}"
            )
        self.run_dir = RunDir(cfg.out_dir, console, self.group.is_main)
        resume_from = self.run_dir.resume_point(cfg.resume)
        data = find_data(cfg.data, quiet=not cfg.progress, main=self.group.is_main)
        self.group.barrier()  # the main process may have prepared the default data
        self.train_loader, self.val_loader = self._loaders(data)
        saved = self._read(resume_from) if resume_from is not None else None
        self.schedule = self._schedule(saved)
        if saved is not None and saved.step >= cfg.max_steps:
            raise ConfigError(
                f"[resume] {saved.path}: the run is finished (step {saved.step} of max_steps "
                f"{cfg.max_steps}); pass a larger --max-steps to extend it"
            )
        # -- build
        from ._tensor import bt
        from .gpt2 import GPT2, set_matmul_precision
        from .tokenizer import get_encoding
        from .zoo import build_model

        self.console = console
        self.on_step = on_step
        self.enc = get_encoding()
        if cfg.deterministic:  # before anything runs: kernels and (with --dist) reductions
            bt.use_deterministic_algorithms(True)
        bt.manual_seed(cfg.seed)
        if cfg.init_from and saved is None:
            self.model = GPT2.from_pretrained(
                cfg.init_from, vocab_multiple=cfg.vocab_multiple, device=self.device
            )
        else:
            self.model = build_model(self.model_config, device=self.device, init=saved is None)
        if isinstance(self.model_config, LlamaConfig) and cfg.recompute == "auto":
            self.model.recompute = "none"  # "auto"'s "ln" is GPT-2's layer-norm rebuild
        else:
            self.model.recompute = resolve_recompute(cfg.recompute, self.device, self.precision)
        if isinstance(self.model, GPT2):
            self.model.residual_dtype = cfg.residual_dtype
            self.model.residual_grad_dtype = cfg.residual_grad_dtype
            was = saved.train_config.get("residual_dtype") if saved is not None else None
            if was not in (None, cfg.residual_dtype) and self.precision == "bf16":
                # the Python API resumes with the config it is given (the CLI keeps the run's)
                self.run_dir.print(
                    f"[resume] the run trained with residual_dtype {was!r}; it continues with "
                    f"{cfg.residual_dtype!r} (pass residual_dtype={was!r} to keep it)"
                )
        self.model.set_precision(self.precision)
        set_matmul_precision(self.precision)
        self.stepper = step_cls(self.model, cfg, self.device, self.group)
        self.step = 0
        self.history = History()
        world = self.group.world_size
        self.tokens_per_step = cfg.batch_size * cfg.seq_len * cfg.grad_accum * world
        from .device import flops_per_token

        self.flops_token = flops_per_token(self.model_config, cfg.seq_len)
        self.peak = peak_flops(self.device, self.precision)
        # A GPU runs ahead of Python: steps are queued and their losses read back (one host
        # sync) every log_interval steps; the CPU reads every step (it costs nothing there).
        self.sync_every = (cfg.log_interval or 10) if is_cuda(self.device) else 1
        self.prefetch = is_cuda(self.device)  # upload batches ahead, at sync points
        self._pending: list[tuple[int, float, StepOutput]] = []
        self._prefetched: list[tuple[Any, Any]] = []
        self._t_sync = time.perf_counter()
        if saved is not None:
            self._apply(saved)
        self._resumed_at = self.step if saved is not None else None

    # -- setup -------------------------------------------------------------------------------------
    def _loaders(self, data: Path) -> tuple[Any, Any]:
        from .data import DataLoader

        cfg, g = self.cfg, self.group
        V = self.model_config.vocab_size
        hint = f"(make shards with `blutrain prepare FILES -o {data}`)"
        try:
            train = DataLoader(
                data,
                cfg.batch_size,
                cfg.seq_len,
                split="train",
                seed=cfg.seed,
                vocab_size=V,
                rank=g.rank,
                world_size=g.world_size,
                step_rows=g.world_size * cfg.grad_accum * cfg.batch_size,  # one global batch
            )
        except (OSError, ValueError) as e:
            raise type(e)(f"[train] --data {data}: {e} {hint}") from None
        try:
            val = DataLoader(
                data,
                cfg.batch_size,
                cfg.seq_len,
                split="val",
                shuffle=False,
                vocab_size=V,
                rank=g.rank,
                world_size=g.world_size,
            )
        except FileNotFoundError:
            val = None  # no validation split: no validation loss
        except ValueError as e:
            raise ValueError(f"[train] --data {data}: validation split: {e} {hint}") from None
        return train, val

    def _read(self, path: Path) -> SavedRun:
        """The checkpoint at `path`, every part checked against this run."""
        saved = read_saved_run(path, self.model_config)
        try:
            self.train_loader.check_state_dict(saved.loader)
        except ValueError as e:
            raise ValueError(
                f"[resume] {path}: {e}; resume with the run's own --data, --seq-len and --seed, "
                "or start a new run in another --out-dir"
            ) from None
        return saved

    def _schedule(self, saved: SavedRun | None) -> CosineSchedule:
        """A fresh run's schedule, or the resumed run's (extended when max_steps or min_lr
        changed; see the module docstring)."""
        cfg = self.cfg
        if saved is None:
            return CosineSchedule(cfg.lr, cfg.warmup_steps, cfg.max_steps, cfg.min_lr)
        s = saved.schedule
        where = f"[resume] {saved.path}"
        for name, mine, theirs in (
            ("lr", cfg.lr, s.max_lr),
            ("warmup_steps", cfg.warmup_steps, s.warmup_steps),
        ):
            if mine != theirs:
                raise ConfigError(
                    f"{where}: {name} ({'--' + name.replace('_', '-')}) = {mine:g} differs from "
                    f"the run's {theirs:g}; a resumed run keeps its peak and warmup (start a "
                    "new run to change them)"
                )
        if (cfg.max_steps, cfg.final_lr) == (s.max_steps, s.min_lr) or saved.step >= cfg.max_steps:
            return s
        try:
            return s.extend(saved.step, cfg.max_steps, cfg.final_lr)
        except ValueError as e:
            raise ConfigError(f"{where}: {str(e).removeprefix('[CosineSchedule] ')}") from None

    def _apply(self, saved: SavedRun) -> None:
        """Load a checked checkpoint; the optimizer's state is checked (by the step) first."""
        try:
            self.stepper.load_state_dict(saved.optimizer)
        except ValueError as e:
            raise ValueError(f"[resume] {saved.path}: {e}; {RESUME_HINT}") from None
        self.model.load_state_dict(saved.weights, source=str(saved.path / "model.safetensors"))
        self.train_loader.load_state_dict(saved.loader)
        self.step = saved.step
        self.history = History(list(saved.history["train"]), list(saved.history["val"]))

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
        from ._tensor import bt

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
        """One optimizer step with no host sync: its losses and norm stay on the device."""
        lr = self.schedule(self.step)
        batches = [self._next_batch() for _ in range(self.cfg.grad_accum)]
        out = self.stepper(batches, lr)
        self.step += 1
        self._pending.append((self.step, lr, out))

    def _sync(self) -> list[dict[str, Any]]:
        """Read back the queued steps' losses and norms (one host sync); their metrics."""
        from ._tensor import bt

        pending, self._pending = self._pending, []
        if not pending:
            return []
        scalars = []
        for _, _, out in pending:
            scalars += out.losses
            if out.grad_norm is not None:
                scalars.append(out.grad_norm)
        vals = iter(bt.stack([s.float() for s in scalars]).cpu().numpy().tolist())
        now = time.perf_counter()
        dt = (now - self._t_sync) / len(pending)
        self._t_sync = now
        tps = self.tokens_per_step / dt if dt > 0 else float("inf")
        mem, peak = memory_bytes(self.device)
        metrics = []
        for step, lr, out in pending:
            loss = sum(float(next(vals)) for _ in out.losses) / len(out.losses)
            norm = float(next(vals)) if out.grad_norm is not None else 0.0
            self.history.train.append((step, loss))
            m = {
                "step": step,
                "loss": loss,
                "lr": lr,
                "grad_norm": norm,
                "dt_ms": dt * 1e3,
                "tokens_per_s": tps,
                "mem_bytes": mem,
                "peak_mem_bytes": peak,
                "tokens": step * self.tokens_per_step,
            }
            if self.peak:
                m["mfu"] = tps * self.flops_token / self.peak
            metrics.append(m)
        return metrics

    def train_step(self) -> dict[str, float]:
        """One optimizer step, synchronously: its metrics (loss, lr, grad_norm, tokens/s...)."""
        self._sync()  # earlier queued steps are accounted first
        self._t_sync = time.perf_counter()
        self._queue_step()
        return self._sync()[-1]

    # -- evaluation --------------------------------------------------------------------------------
    def evaluate(self, batches: int | None = None) -> float | None:
        """Mean loss over the first `batches` batches of the validation split (every rank's)."""
        if self.val_loader is None:
            return None
        n = min(batches or self.cfg.eval_batches, self.val_loader.batches_per_epoch)
        if n < 1:
            return None
        self.val_loader.reset()
        local = evaluate_loss(self.model, self.val_loader, n)
        return self.group.all_reduce(local, "mean")

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
    def state(self, optimizer_meta: Any) -> dict[str, Any]:
        """trainer.json's content (see run_state)."""
        return {
            "step": self.step,
            "train_config": self.cfg.to_dict(),
            "model_config": self.model_config.to_dict(),
            "schedule": self.schedule.state_dict(),
            "loader": self.train_loader.state_dict(),
            "optimizer": optimizer_meta,
            "history": {"train": self.history.train, "val": self.history.val},
        }

    def save(self) -> Path:
        """Write <out_dir>/checkpoint (rank 0; every rank takes part in gathering the state)."""
        opt = self.stepper.state_dict()
        path = self.run_dir.save_checkpoint(
            self.model.state_dict(), opt["tensors"], self.state(opt["meta"])
        )
        self.group.barrier()
        return path

    def load(self, path: str | os.PathLike) -> None:
        """Restore model, optimizer, step, schedule, loader position and history from a
        checkpoint. Every part is checked first: on an error nothing changes."""
        saved = self._read(Path(path))
        schedule = self._schedule(saved)
        self._apply(saved)
        self.schedule = schedule

    def _bf16_stream(self) -> bool:
        """Whether GPT-2's residual stream runs in bf16 (the opt-in --residual-dtype compute)."""
        stream = getattr(self.model, "residual_dtype", None)
        return self.precision == "bf16" and stream == "compute"

    def plot(self) -> Path | None:
        from .plot import plot_losses

        c = self.model_config
        title = f"{_kind(c)} L={c.n_layer} C={c.n_embd}: {self.tokens_per_step:,} tokens/step"
        return self.run_dir.plot(
            lambda p: plot_losses(p, self.history.train, self.history.val, title)
        )

    # -- the loop ----------------------------------------------------------------------------------
    def fit(self, until: int | None = None) -> dict[str, Any]:
        """Train until step `until` (default max_steps; the schedule always spans max_steps),
        then checkpoint; returns a summary (losses, tokens/s, paths)."""
        cfg = self.cfg
        stop = cfg.max_steps if until is None else min(int(until), cfg.max_steps)
        c = self.model_config
        self.run_dir.start_metrics(keep_until=self._resumed_at)
        self._resumed_at = self.step  # a second fit() continues the same file
        self.run_dir.print(
            f"{_kind(c)} L={c.n_layer} H={c.n_head} C={c.n_embd} T={cfg.seq_len} "
            f"({c.n_params() / 1e6:.2f}M params) on {self.device} ({self.precision}"
            + threads_note(self.device)
            + (f", recompute {self.model.recompute}" if self.model.recompute != "none" else "")
            + (", bf16 residual stream" if self._bf16_stream() else "")
            + f", {cfg.step_name} step"
            + (f", {self.group.world_size} processes" if self.group.world_size > 1 else "")
            + f"); {cfg.batch_size} x {cfg.seq_len} x {cfg.grad_accum}"
            + (f" x {self.group.world_size}" if self.group.world_size > 1 else "")
            + f" = {self.tokens_per_step:,} tokens/step; steps {self.step}..{stop} of "
            f"{cfg.max_steps}; logs in {self.run_dir.path}"
        )
        if self.step == 0:
            self.run_dir.log(
                {
                    "event": "start",
                    "train_config": cfg.to_dict(),
                    "model_config": c.to_dict(),
                    "device": self.device,
                    "n_params": c.n_params(),
                    "world_size": self.group.world_size,
                }
            )
            if cfg.eval_interval:
                self._eval_and_log()
        else:
            self.run_dir.log(
                {"event": "resume", "step": self.step, "schedule": self.schedule.state_dict()}
            )
        progress = self._progress_bar()
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
                    self.run_dir.log(m)
                    if not math.isfinite(m["loss"]):
                        raise FloatingPointError(
                            f"[train] the loss is {m['loss']} at step {m['step']} (lower --lr, "
                            "or --resume from the last checkpoint)"
                        )
                    if self.on_step is not None:
                        self.on_step(m)
                    step = m["step"]
                    if cfg.log_interval and (step % cfg.log_interval == 0 or step == 1):
                        if progress is None:
                            self.run_dir.print(
                                f"step {step:5d}/{cfg.max_steps}  {self._stats(m, tokens_s_ema)}"
                                f"  norm {m['grad_norm']:.3f}  {m['dt_ms']:.0f} ms"
                            )
                if progress is not None:
                    progress[0].update(
                        progress[1], completed=self.step, stats=self._stats(last, tokens_s_ema)
                    )
                if cfg.eval_interval and (s % cfg.eval_interval == 0 or s == stop):
                    self._eval_and_log()
                if cfg.sample_interval and (s % cfg.sample_interval == 0 or s == stop):
                    text = self.sample(seed=self.step)
                    self.run_dir.log({"step": self.step, "sample": text})
                    self.run_dir.print(f"--- sample at step {self.step} ---\n{text}\n---")
                if cfg.ckpt_interval and s % cfg.ckpt_interval == 0:
                    self.save()
                self._t_sync = time.perf_counter()  # evals and samples are not training time
        finally:
            if progress is not None:
                progress[0].stop()
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
            "metrics": str(self.run_dir.metrics),
            "plot": str(png) if png else None,
        }
        self.run_dir.log({"event": "end", **summary})
        self.run_dir.close()
        val = f"{summary['val_loss']:.4f}" if summary["val_loss"] is not None else "n/a"
        tps = f"{summary['tokens_per_s']:,.0f}" if summary["tokens_per_s"] else "n/a"
        final = summary["final_loss"]
        self.run_dir.print(
            f"done: step {self.step}, train loss {'n/a' if final is None else f'{final:.4f}'}, "
            f"val loss {val}, {tps} tokens/s, {elapsed:.1f} s; checkpoint {ckpt}"
            + (f", loss curve {png}" if png else "")
        )
        return summary

    def _progress_bar(self) -> tuple[Any, Any] | None:
        """(rich Progress, task) on a terminal with progress on, else None (plain log lines)."""
        console = self.run_dir.console
        if not (self.cfg.progress and self.run_dir.main and console is not None):
            return None
        if not console.is_terminal:
            return None
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        bar = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        bar.start()
        return bar, bar.add_task("train", total=self.cfg.max_steps, completed=self.step, stats="")

    def _stats(self, m: dict[str, Any], tokens_s: float | None) -> str:
        """The live bar's text: loss, lr, tokens/s, MFU, memory (peak on a GPU)."""
        mem = m["peak_mem_bytes"] if is_cuda(self.device) else m["mem_bytes"]
        return (
            f"loss {m['loss']:.4f}  lr {m['lr']:.2e}  {tokens_s or 0:,.0f} tok/s"
            + (f"  MFU {100 * m['mfu']:.1f}%" if "mfu" in m else "")
            + f"  mem {fmt_bytes(mem)}"
        )

    def _eval_and_log(self) -> None:
        v = self.evaluate()
        if v is None:
            return
        self.history.val.append((self.step, v))
        self.run_dir.log({"step": self.step, "val_loss": v})
        self.run_dir.print(f"step {self.step:5d}: val loss {v:.4f}")

    def close(self) -> None:
        self.stepper.close()
        self.run_dir.close()


def evaluate_loss(model: Any, loader: Any, batches: int) -> float:
    """Mean loss of `model` over the next `batches` batches of `loader` (summed on the device:
    one host sync)."""
    from ._tensor import bt

    model.eval()
    total: Any = 0.0
    try:
        with bt.no_grad():
            for _ in range(batches):
                x, y = loader.next_batch()
                _, loss = model(x, y, return_logits=False)
                total = total + loss.detach().float()
    finally:
        model.train()
    return float(total.item()) / batches


def train(config: TrainConfig | None = None, *, console: Any = None, **overrides: Any) -> dict:
    """Run a training job (see TrainConfig); returns the summary of Trainer.fit()."""
    import dataclasses

    cfg = config or TrainConfig()
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    trainer = Trainer(cfg, console=console)
    try:
        return trainer.fit()
    finally:
        trainer.close()
