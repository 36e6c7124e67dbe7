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


def test_stop_at_runs_the_first_steps_of_the_full_schedule(tmp_path):
    """--stop-at N: the first N steps of the --steps run, the same losses and checkpoint weights
    (the schedule's length stays --steps), so a probe at early steps need not train the rest."""
    args = ["--runs", "ours:fp32", "--checkpoints", "2,4"]
    full = run(tmp_path, *args)
    assert full.returncode == 0, full.stderr[-2000:]
    f = json.loads((tmp_path / "p.json").read_text())["runs"]["ours:fp32"]
    cut = run(tmp_path, *args, "--stop-at", "4")
    assert cut.returncode == 0, cut.stderr[-2000:]
    c = json.loads((tmp_path / "p.json").read_text())["runs"]["ours:fp32"]
    assert len(f["loss"]) == 6 and c["loss"] == f["loss"][:4]
    assert c["checkpoints"] == f["checkpoints"]  # weights, updates, gradients at steps 2 and 4
    assert [s for s, _ in c["val"]] == [0, 3, 4]  # the last val loss where the run stops
    # a baseline is a run of the same length: a full run is not one for --stop-at 4
    base = tmp_path / "base.json"
    (tmp_path / "p.json").rename(base)
    r = run(tmp_path, "--runs", "torch:fp32", "--checkpoints", "", "--baseline", str(base))
    assert r.returncode != 0 and "stop_at 4" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--stop-at", "7"], "--stop-at 7: must be in 0..--steps (6)"),
        (["--stop-at", "-1"], "--stop-at -1: must be in 0..--steps"),
        (["--stop-at", "3", "--checkpoints", "2,4"], "past --stop-at 3"),
    ],
)
def test_stop_at_refuses_what_it_cannot_do(tmp_path, args, message):
    r = run(tmp_path, "--runs", "ours:fp32", *args)
    assert r.returncode != 0 and message in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "p.json").exists()


def test_deterministic_reproduces_ours_bit_for_bit(tmp_path):
    """--deterministic turns on blutrain's deterministic algorithms for ours' runs (the JSON says
    whether they were on); two such runs give the same losses bit for bit."""
    losses = []
    for flag in ([], ["--deterministic"], ["--deterministic"]):
        r = run(tmp_path, "--runs", "ours:fp32,ours:tf32", "--checkpoints", "", *flag)
        assert r.returncode == 0, r.stderr[-2000:]
        d = json.loads((tmp_path / "p.json").read_text())
        assert d["deterministic_algorithms"] is bool(flag)
        losses.append({k: v["loss"] for k, v in d["runs"].items()})
    assert losses[1] == losses[2]


def test_exactattn_is_accepted_and_changes_nothing_on_the_cpu(tmp_path):
    """ours:tf32/exactattn and /exactscores set the float32 attention precision "highest" and
    "scores" for their runs only: on the CPU (float32 attention either way) their losses are
    ours:tf32's bit for bit."""
    runs = "ours:fp32,ours:tf32/exactattn,ours:tf32/exactscores,ours:tf32"
    r = run(tmp_path, "--runs", runs, "--checkpoints", "")
    assert r.returncode == 0, r.stderr[-2000:]
    d = json.loads((tmp_path / "p.json").read_text())["runs"]
    assert d["ours:tf32/exactattn"]["loss"] == d["ours:tf32"]["loss"]
    assert d["ours:tf32/exactscores"]["loss"] == d["ours:tf32"]["loss"]
    assert d["ours:tf32"]["loss"] != d["ours:fp32"]["loss"]  # tf32's GEMMs do round
