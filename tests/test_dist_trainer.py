"""The trainer's distributed steps (blutrain-dist under blutrain.models' step seam), on the CPU
under mpiexec: `--step ddp|zero1|zero2` on 2 ranks give one process's losses (same global
batch, gradient accumulation); a ZeRO run stopped and resumed on as many ranks ends bit for bit
as the one that never stopped; one saved on 2 ranks resumes on 1."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from blutrain.models import GPT2Config, load_checkpoint, prepare
from blutrain.models.tokenizer import SHAKESPEARE_FILE

HERE = Path(__file__).resolve().parent
JOB = HERE / "dist_trainer_job.py"
SMALL = GPT2Config(block_size=32, n_layer=1, n_head=2, n_embd=16)
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist_trainer")
    text = d / "shakespeare.txt"
    text.write_text(SHAKESPEARE_FILE.read_text()[:60_000])
    prepare([text], d / "shards", val_fraction=0.1, doc_split="paragraph")
    SMALL.to_json(d / "small.json")
    return d


def run(setup: Path, out: str, step: str, n: int, accum: int, until: int = 0, resume: bool = False):
    local = Path(sys.executable).parent / "mpiexec"
    mpiexec = str(local) if local.exists() else shutil.which("mpiexec")
    assert mpiexec, "mpiexec not found (pip install mpich)"
    args = [
        str(JOB),
        str(setup / out),
        str(setup / "shards"),
        str(setup / "small.json"),
        step,
        str(accum),
        str(until),
        "1" if resume else "0",
    ]
    cmd = [mpiexec, "-n", str(n), sys.executable, *args] if n > 1 else [sys.executable, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BLUTRAIN_DIST_TIMEOUT": "120"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, f"{' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return setup / out


def losses(run_dir: Path) -> dict[int, float]:
    recs = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    return {r["step"]: r["loss"] for r in recs if "loss" in r and "event" not in r}


def test_distributed_steps_match_one_process(setup):
    ref = losses(run(setup, "eager", "eager", 1, accum=2))
    assert sorted(ref) == [1, 2, 3, 4]
    for step in ("ddp", "zero1", "zero2"):
        got = losses(run(setup, step, step, 2, accum=1))
        for s in ref:
            assert abs(got[s] - ref[s]) <= 1e-6 * abs(ref[s]), (step, s, got[s], ref[s])


def test_zero_resume_is_bit_exact_at_the_same_world_size(setup):
    a = run(setup, "z_straight", "zero2", 2, accum=1)
    run(setup, "z_split", "zero2", 2, accum=1, until=2)
    b = run(setup, "z_split", "zero2", 2, accum=1, resume=True)
    assert losses(a) == losses(b)
    ca, cb = load_checkpoint(a / "checkpoint"), load_checkpoint(b / "checkpoint")
    for part in ("weights", "optimizer"):
        ta, tb = getattr(ca, part), getattr(cb, part)
        assert ta.keys() == tb.keys()
        for k in ta:
            assert np.array_equal(ta[k], tb[k]), f"{part} {k} differs after resume"


def test_zero_state_saved_on_2_ranks_resumes_on_1(setup):
    a = run(setup, "m_straight", "zero1", 2, accum=1)
    run(setup, "m_split", "zero1", 2, accum=1, until=2)
    b = run(setup, "m_split", "zero1", 1, accum=2, resume=True)
    la, lb = losses(a), losses(b)
    for s in (3, 4):
        assert abs(la[s] - lb[s]) <= 1e-6 * abs(la[s]), (s, la[s], lb[s])
