"""bench/conv_seeds.sh on the CPU (a 2-layer GPT-2, 8 steps): each seed's runs come from one
state and one batch stream, and --baseline-dir reruns only the runs a seed's earlier JSON lacks,
keeping the others as they were."""

from __future__ import annotations

import json
import os
import re
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


# convergence.py's stand-in: sleeps $FAKE_SLEEP s (seed S: word S of $FAKE_SLEEPS, when given) and
# writes an unfinished JSON (no summary, so no table follows); every other command runs on the
# real interpreter
FAKE_PYTHON = """#!/usr/bin/env bash
case "$1" in
  *convergence.py)
    json="" seed=0
    while [ $# -gt 0 ]; do
      [ "$1" = --json ] && json=$2
      [ "$1" = --seed ] && seed=$2
      shift
    done
    read -ra sleeps <<<"${FAKE_SLEEPS:-}"
    sleep "${sleeps[$((seed - 1))]:-$FAKE_SLEEP}"
    echo '{"args": {}, "runs": {}}' >"$json" ;;
  *) exec "$REAL_PYTHON" "$@" ;;
esac
"""


def fake_conv_seeds(tmp_path: Path, seeds: str, jobs: int, budget: int, **env: str) -> str:
    """conv_seeds.sh over the stand-in above (its sleeps from env); its stdout."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "PYTHON": str(fake),
        "REAL_PYTHON": sys.executable,
        "CONV_SEEDS_MIN_LEFT": "1",  # (the 60 s floor would start nothing in these budgets)
        **env,
    }
    cmd = ["bash", str(SCRIPT), "--seeds", seeds, "--jobs", str(jobs), "--budget", str(budget)]
    r = subprocess.run([*cmd, "--runs", "torch:fp32"], env=env, capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    return r.stdout + r.stderr


def test_a_seed_that_cannot_finish_by_the_deadline_is_not_started(tmp_path):
    """Budget 25 s (deadline at 10 s), two jobs, seeds of 6 s: seeds 1 and 2 run; at 6 s seed 3
    has 4 s left, less than the median seed took, so it is not started (stopped at the deadline
    its runs would be lost, holding the GPU until then)."""
    out = fake_conv_seeds(tmp_path, "1 2 3", jobs=2, budget=25, FAKE_SLEEP="6")
    assert "seed 1: rc 0," in out and "seed 2: rc 0," in out, out
    m = re.search(r"seed 3: not started \((\d+) s left; the median seed took (\d+) s\)", out)
    assert m and int(m[1]) < int(m[2]) and int(m[2]) >= 6, out


def test_the_estimate_is_the_median_seed_not_the_quickest(tmp_path):
    """One job, seeds of 2, 8 and 8 s, deadline at 23 s: at about 18 s seed 4 has about 5 s left,
    more than the quickest seed took (2 s) but less than the median (8 s), so it is not started
    (session 62: seeds started on the quickest's estimate were stopped at the deadline)."""
    out = fake_conv_seeds(
        tmp_path, "1 2 3 4", jobs=1, budget=38, FAKE_SLEEP="8", FAKE_SLEEPS="2 8 8 8"
    )
    assert all(f"seed {s}: rc 0," in out for s in (1, 2, 3)), out
    m = re.search(r"seed 4: not started \((\d+) s left; the median seed took (\d+) s\)", out)
    assert m and 2 < int(m[1]) < int(m[2]) and int(m[2]) >= 8, out
