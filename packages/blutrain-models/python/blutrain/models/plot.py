"""loss.png: the training loss (raw and smoothed) and the validation loss against the step."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ._io import atomic_path


def plot_losses(
    path: str | os.PathLike,
    train: Sequence[tuple[int, float]],
    val: Sequence[tuple[int, float]] = (),
    title: str = "",
) -> Path | None:
    """Write the loss curves to `path` (PNG); None when there is nothing to plot or matplotlib
    is not installed (it is an optional dependency: `pip install blutrain-models[train]`)."""
    try:
        from matplotlib.figure import Figure  # no pyplot: leaves the user's backend alone
    except ImportError:
        return None
    if not train:
        return None
    path = Path(path)
    steps, losses = zip(*train, strict=True)
    fig = Figure(figsize=(7, 4), dpi=110)
    ax = fig.subplots()
    ax.plot(steps, losses, color="tab:blue", alpha=0.3, lw=1, label="train")
    k = max(1, len(losses) // 25)
    if k > 1:
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1 :], smooth, color="tab:blue", lw=2, label=f"train (mean of {k})")
    if val:
        vs, vl = zip(*val, strict=True)
        ax.plot(vs, vl, "o-", color="tab:orange", lw=2, label="validation")
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path
