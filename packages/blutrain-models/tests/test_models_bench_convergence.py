"""bench/convergence.py's probes on the CPU (a tiny GPT-2, a few steps): --probe-runs probes run
kinds that were never trained, at the trained reference's weights, and refuses what it cannot do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")  # the PyTorch side of the benchmark (the tests session has it)

BENCH = Path(__file__).resolve().parents[1] / "bench" / "convergence.py"
TINY = [
    "--device", "cpu", "--model", "2x4x64", "-B", "2", "-T", "32", "--steps", "6",
    "--warmup", "2", "--compact-vocab", "--eval-batches", "1", "--eval-every", "3",
]  # fmt: skip


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH), *TINY, "--json", str(tmp_path / "p.json"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_probe_runs_probe_untrained_kinds_at_the_references_weights(tmp_path):
    r = run(
        tmp_path,
        "--runs", "torch:fp32", "--probe", "--probe-runs", "torch:fp32,ours:fp32,ours:bf16",
        "--checkpoints", "4", "--probe-batches", "2",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads((tmp_path / "p.json").read_text())
    assert list(d["runs"]) == ["torch:fp32"]  # only the reference trained
    pr = d["probe"]["4"]
    assert list(pr) == ["torch:fp32", "ours:fp32", "ours:bf16"]
    assert pr["torch:fp32"]["grad_rel"]["*"] == 0.0  # the reference against itself
    # ours:fp32 differs from torch:fp32 by summation order only; bf16 by its rounding
    assert pr["ours:fp32"]["grad_rel"]["*"] < 1e-5
    assert 1e-4 < pr["ours:bf16"]["grad_rel"]["*"] < 5e-2
    assert abs(pr["ours:fp32"]["loss_bias"]) < 1e-5


@pytest.mark.parametrize(
    "args, message",
    [
        (["--runs", "torch:fp32", "--probe-runs", "ours:bf16"], "needs --probe"),
        (["--runs", "torch:fp32", "--probe", "--probe-runs", "ours:bf16,ours:bf16"], "distinct"),
        (["--runs", "torch:fp32", "--probe", "--probe-runs", "ours:fp16"], "--probe-runs: "),
        (["--runs", "torch:fp32", "--probe", "--probe-runs", "ours:bf16/x"], "--probe-runs: "),
    ],
)
def test_probe_runs_refuses_what_it_cannot_probe(tmp_path, args, message):
    r = run(tmp_path, *args)
    assert r.returncode != 0 and message in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "p.json").exists()


def test_the_reference_is_in_the_probes_even_when_probe_runs_omits_it(tmp_path):
    args = ["--runs", "torch:fp32", "--probe", "--probe-runs", "ours:fp32", "--checkpoints", "4"]
    r = run(tmp_path, *args, "--probe-batches", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    pr = json.loads((tmp_path / "p.json").read_text())["probe"]["4"]
    assert list(pr) == ["torch:fp32", "ours:fp32"]  # what ours:fp32 is measured against
