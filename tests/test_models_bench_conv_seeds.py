"""bench/conv_seeds.sh on the CPU (a 2-layer GPT-2, 8 steps): each seed's runs come from one
state and one batch stream, and --baseline-dir reruns only the runs a seed's earlier JSON lacks,
keeping the others as they were."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "packages/blutrain-models/bench/conv_seeds.sh"
EXTRA = "--device cpu --model 2x2x64 --compact-vocab --eval-every 4 --eval-batches 2 --threads 1"


def conv_seeds(out: Path, runs: str, *more: str) -> str:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    cmd = ["bash", str(SCRIPT), "--seeds", "1 2", "--jobs", "2", "--steps", "8", "--runs", runs]
    r = subprocess.run(
        [*cmd, "--budget", "240", "--extra", EXTRA, *more],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def runs_of(out: Path, seed: int) -> dict:
    return json.loads((out / "seeds" / f"conv_b_seed{seed}.json").read_text())["runs"]


def test_conv_seeds_reruns_only_what_a_seed_lacks(tmp_path):
    first = conv_seeds(tmp_path / "a", "torch:fp32,ours:bf16")
    assert "2 seeds finished" in first and "2 seeds (batch/init): 1/1, 2/2" in first
    a1, a2 = runs_of(tmp_path / "a", 1), runs_of(tmp_path / "a", 2)
    assert a1["torch:fp32"]["loss"] != a2["torch:fp32"]["loss"]  # seeds differ
    # one state and one batch stream per seed: ours bf16 starts where torch fp32 does
    assert abs(a1["ours:bf16"]["loss"][0] - a1["torch:fp32"]["loss"][0]) < 2e-2

    base = ["--baseline-dir", str(tmp_path / "a/seeds")]
    second = conv_seeds(tmp_path / "b", "torch:fp32,ours:bf16,ours:fp32", *base)
    assert "ours:fp32 - torch:fp32" in second
    for seed, before in ((1, a1), (2, a2)):
        after = runs_of(tmp_path / "b", seed)
        assert set(after) == {"torch:fp32", "ours:bf16", "ours:fp32"}
        for name in ("torch:fp32", "ours:bf16"):  # kept from the first call, not rerun
            assert after[name]["loss"] == before[name]["loss"]
            assert after[name]["train_s"] == before[name]["train_s"]
        log = (tmp_path / "b" / "seeds" / f"conv_b_seed{seed}.log").read_text()
        assert "baseline runs (not rerun" in log and "torch:fp32, ours:bf16" in log
