"""A run's output directory and its console: metrics.jsonl, loss.png, checkpoint/, log lines.

Only the main process (rank 0) writes or prints: on other ranks every method that would is a
no-op, so the training loop calls them without asking which rank it is.

A directory holds at most one run. A fresh run refuses a directory that already holds one
(its metrics or a checkpoint); a resumed run keeps the metrics up to its checkpoint's step and
appends after them (records of steps after the checkpoint, from a run that went on and died
before its next checkpoint, are dropped: those steps are about to be run again).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ._io import atomic_write_bytes, glob_escape

CHECKPOINT_DIR = "checkpoint"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


class RunDir:
    """The files of one run under `path`; `main`: whether this process writes them."""

    def __init__(self, path: str | os.PathLike, console: Any = None, main: bool = True) -> None:
        self.path = Path(path)
        self.console = console
        self.main = main
        self._metrics: Any = None

    @property
    def checkpoint(self) -> Path:
        return self.path / CHECKPOINT_DIR

    @property
    def metrics(self) -> Path:
        return self.path / METRICS_FILE

    # -- what is there -------------------------------------------------------------------------
    def holds_run(self) -> str | None:
        """What says a run was here (a checkpoint, metrics), or None."""
        if self.checkpoint.exists() or any(self.path.glob(f"{glob_escape(CHECKPOINT_DIR)}.old-*")):
            return f"a checkpoint ({self.checkpoint})"
        if self.metrics.exists():
            return f"the metrics of a run ({self.metrics})"
        return None

    def resume_point(self, resume: bool | str) -> Path | None:
        """The checkpoint a run with this `resume` setting continues from, or None to start
        fresh; raises ValueError when the directory's state does not allow it."""
        held = self.holds_run()
        if resume is False:
            if held:
                raise ValueError(
                    f"[train] {self.path} already holds a run: {held}; pass --resume to "
                    "continue it, or choose another --out-dir"
                )
            return None
        if self.checkpoint.exists() or held and held.startswith("a checkpoint"):
            return self.checkpoint
        if held:
            raise ValueError(
                f"[train] {self.path} holds {held.removeprefix('the ')} but no checkpoint to "
                "resume from; remove it or choose another --out-dir"
            )
        if resume == "auto":
            return None
        raise ValueError(
            f"[train] --resume: no checkpoint in {self.checkpoint} to resume from; drop --resume "
            "to start a run, or pass --resume auto to start one when there is none"
        )

    # -- writing -------------------------------------------------------------------------------
    def start_metrics(self, keep_until: int | None) -> None:
        """Open metrics.jsonl: a new file (keep_until None), or the old one cut after the
        records of step `keep_until` (a resumed run)."""
        if not self.main:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        if keep_until is not None and self.metrics.exists():
            kept = []
            for line in self.metrics.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a crash
                if isinstance(rec, dict) and int(rec.get("step", 0)) <= keep_until:
                    kept.append(line + "\n")
            atomic_write_bytes(self.metrics, "".join(kept).encode())
        self._metrics = open(self.metrics, "a" if keep_until is not None else "x")  # noqa: SIM115

    def log(self, record: Mapping[str, Any]) -> None:
        """Append one JSON record to metrics.jsonl."""
        if self._metrics is not None:
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()

    def print(self, text: str) -> None:
        if not self.main:
            return
        if self.console is not None:
            self.console.print(text, highlight=False, markup=False, soft_wrap=True)
        else:
            print(text, flush=True)

    def save_checkpoint(
        self, weights: Mapping[str, Any], optimizer: Mapping[str, Any], trainer: dict
    ) -> Path:
        """Write checkpoint/ atomically (see checkpoint.save_checkpoint); returns its path."""
        if self.main:
            from .checkpoint import save_checkpoint

            save_checkpoint(self.checkpoint, weights, optimizer, trainer)
        return self.checkpoint

    def plot(self, draw: Callable[[Path], Path | None]) -> Path | None:
        """`draw(path)` writes loss.png; returns the path it wrote (None: nothing)."""
        return draw(self.path / PLOT_FILE) if self.main else None

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
