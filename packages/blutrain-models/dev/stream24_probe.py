"""Experiment (issue 38): would a 24-bit residual stream train like the float32 one?

The float32 stream costs 2.5-2.9% of the bf16 step on an H100 (bench/RESULTS.md of
blutrain-tensor, sessions 53-67), nearly all of it bytes: the fused add + LayerNorm reads and
writes 4 bytes a value of the stream where the bf16 stream moves 2.  A stream of 3 bytes (a bf16
plane, the value rounded to nearest, and an int8 plane with the next 8 bits of the significand:
16 significant bits, relative error up to about 2^-16) would move half those extra bytes.  Before
anyone writes its kernels, this measures its fidelity, on the CPU, with bench/convergence.py's
chaos-free probe: every kind's gradients at one reference run's weights against the reference's.

The stream is emulated: after each residual add (and at the embedding sum, the first add's input),
x becomes hi + bf16(x - hi) with hi = bf16(x), which holds the same 16 bits; the backward passes
the gradient through unchanged (a bt.Function), as the real stream's would.  The norm's output
is still computed from the float32 sum (a kernel may normalise the sum it holds in registers or
the stored one, 2^-15 apart at most: blutrain-tensor's bench/stream24_check.cu on branch
s67-stream24 does the latter).  The run kind is ours:bf16/res24, beside convergence.py's own:

    python dev/stream24_probe.py --device cpu --model tiny --compact-vocab --ours-fused on \
        -B 4 -T 64 --steps 800 --stop-at 300 --eval-every 0 --checkpoints 60,100,300 \
        --seed 5 --init-seed 5 --runs torch:fp32 --probe --probe-batches 8 \
        --probe-runs torch:fp32,torch:bf16,ours:fp32,ours:bf16/flash,ours:bf16/bf16res+flash,\
ours:bf16/res24+flash --json p24_seed5.json
    python bench/gpu_bf16_table.py --probes p24_seed*.json   # the seeds' means

(session 67: seeds 1-8 so, their JSONs in bench/baselines/probe_s24; the table is in the
README's issue-38 section.)

Every argument is convergence.py's.  Not a test and not shipped: an experiment (dev/).
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

import convergence as cv  # noqa: E402  (bench/ is not a package)


def _round24_function() -> Any:
    import blutrain.tensor as bt

    class Round24(bt.Function):
        """x with 16 significant bits (a bf16 plus the next 8 bits); the gradient passes as is."""

        @staticmethod
        def forward(ctx: Any, x: Any) -> Any:
            hi = x.to(bt.bfloat16).to(bt.float32)
            return hi + (x - hi).to(bt.bfloat16).to(bt.float32)

        @staticmethod
        def backward(ctx: Any, g: Any) -> Any:
            return g

    return Round24


class Ours24(cv.Ours):
    """ours:bf16 whose float32 residual stream is rounded to 16 significant bits at every add."""

    def __init__(self, cfg: Any, state: dict, precision: str, a: Any, variant: str = "") -> None:
        if precision != "bf16":
            raise SystemExit(f"res24 is a bf16 variant (fp32 / tf32 keep float32): {precision}")
        rest = "+".join(f for f in variant.split("+") if f not in ("", "res24"))
        if "bf16res" in rest.split("+"):
            raise SystemExit("res24 and bf16res are two streams: pick one")
        super().__init__(cfg, state, precision, a, rest)
        self.round = _round24_function().apply

    @contextlib.contextmanager
    def _stream24(self) -> Any:
        """The model's norms with the stream rounded (process-wide: set around each call)."""
        from blutrain.models import gpt2

        add_ln, ln, rnd = gpt2._add_ln, gpt2._ln, self.round

        def stream(x: Any) -> Any:
            return rnd(x) if x.dtype == self.bt.float32 else x

        def add_ln24(x: Any, r: Any, *args: Any, **kw: Any) -> Any:
            s, h = add_ln(stream(x), r, *args, **kw)
            return stream(s), h

        def ln24(x: Any, *args: Any, **kw: Any) -> Any:
            return ln(stream(x), *args, **kw)

        gpt2._add_ln, gpt2._ln = add_ln24, ln24
        try:
            yield
        finally:
            gpt2._add_ln, gpt2._ln = add_ln, ln

    def forward_backward(self, x: Any, y: Any) -> Any:
        with self._stream24():
            return super().forward_backward(x, y)

    def val_loss(self, batches: list) -> float:
        with self._stream24():
            return super().val_loss(batches)

    def hidden(self, x: Any) -> Any:
        with self._stream24():
            return super().hidden(x)


def _ours(cfg: Any, state: dict, precision: str, a: Any, variant: str = "") -> Any:
    kind = Ours24 if "res24" in variant.split("+") else cv.Ours
    return kind(cfg, state, precision, a, variant)


if __name__ == "__main__":
    cv.FRAMEWORKS["ours"] = _ours  # type: ignore[assignment]
    cv.VARIANTS["ours"] = (*cv.VARIANTS["ours"], "res24")
    sys.exit(cv.main())
