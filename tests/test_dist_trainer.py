"""`blutrain train --dist ddp|zero1|zero2` on the CPU under mpiexec (the mpich wheel), through
the command line a user types:

- 2 ranks give one process's losses (same global batch, gradient accumulation) in every mode;
- 200 steps of ZeRO-2 on 4 ranks match 1 rank bit for bit in deterministic mode (losses, grad
  norms with clipping on, final weights), and DDP on 4 ranks without it within 1e-5;
- a ZeRO run stopped and resumed on as many ranks ends bit for bit as the one that never
  stopped; one saved on 2 ranks resumes on 1;
- a rank killed mid-run ends the job within the timeout with a message naming it, no process
  left; the run resumes from its last checkpoint on 1 rank and continues bit for bit as the
  uninterrupted run (deterministic mode).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
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


def mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    assert found, "mpiexec not found (pip install mpich)"
    return found


def blutrain() -> list[str]:
    """The `blutrain` console script next to this Python (else `python -m blutrain.models`)."""
    script = Path(sys.executable).parent / "blutrain"
    return [str(script)] if script.exists() else [sys.executable, "-m", "blutrain.models"]


def command(
    setup: Path, out: str, n: int, *flags: str, launcher: tuple[str, ...] = (), shell: bool = False
) -> list:
    args = [
        "train",
        "--model", str(setup / "small.json"),
        "--data", str(setup / "shards"),
        "--batch-size", "2",
        "--seq-len", "16",
        "--lr", "3e-3",
        "--sample-interval", "0",
        "--eval-batches", "2",
        "--no-progress",
        "--no-plot",
        "--log-interval", "0",
        "--device", "cpu",
        "--out-dir", str(setup / out),
        *flags,
    ]  # fmt: skip
    if n == 1:
        return [*blutrain(), *args]
    # shell: each rank is `sh -c 'blutrain ...; exit $?'`, so a rank killed by a signal reaches
    # MPICH's launcher as an exit status: told of a child killed by a signal, hydra sometimes
    # kills every process at once even with -disable-auto-cleanup (about half the time here),
    # before the survivors can report; with an exit status it lets them run and report
    wrap = ["sh", "-c", '"$0" "$@"; exit $?'] if shell else []
    return [mpiexec(), *launcher, "-n", str(n), *wrap, *blutrain(), *args]


def env(timeout: float = 120) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "BLUTRAIN_DIST_TIMEOUT": str(timeout)}


def run(setup: Path, out: str, n: int, *flags: str) -> Path:
    cmd = command(setup, out, n, *flags)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env())
    assert p.returncode == 0, f"{' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return setup / out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in open(run_dir / "metrics.jsonl")]


def losses(run_dir: Path, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in metrics(run_dir) if key in r and "event" not in r}


SHORT = ("--max-steps", "4", "--warmup-steps", "2", "--eval-interval", "2")
LONG = ("--max-steps", "200", "--warmup-steps", "10", "--eval-interval", "50")


def test_distributed_steps_match_one_process(setup):
    ref = losses(run(setup, "eager", 1, *SHORT, "--grad-accum", "2"))
    assert sorted(ref) == [1, 2, 3, 4]
    for mode in ("ddp", "zero1", "zero2"):
        got = losses(run(setup, mode, 2, *SHORT, "--dist", mode))
        for s in ref:
            assert abs(got[s] - ref[s]) <= 1e-6 * abs(ref[s]), (mode, s, got[s], ref[s])


def job(setup: Path, out: str, mode: str, n: int, accum: int, until: int = 0, resume: bool = False):
    """dist_trainer_job.py: the Trainer API, for runs stopped part-way (fit(until=...))."""
    args = [str(JOB), str(setup / out), str(setup / "shards"), str(setup / "small.json"), mode,
            str(accum), str(until), "1" if resume else "0"]  # fmt: skip
    cmd = [mpiexec(), "-n", str(n), sys.executable, *args] if n > 1 else [sys.executable, *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env())
    assert p.returncode == 0, f"{' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return setup / out


def test_only_rank_0_writes_and_counts_every_rank(setup):
    """Two ranks, one run: rank 0 alone prints the run's lines and writes metrics.jsonl (one
    record per step, not one per rank), and the token counts are global (both ranks' batches)."""
    cmd = command(setup, "rank0", 2, *SHORT, "--dist", "ddp", "--plot")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env())
    assert p.returncode == 0, f"{' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    assert p.stdout.count("tokens/step") == 1, p.stdout[-3000:]  # the first log line, once
    train = [r for r in metrics(setup / "rank0") if "loss" in r and "event" not in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    per_step = 2 * 16 * 2  # batch 2 x seq 16 on each of 2 ranks
    assert [r["tokens"] for r in train] == [per_step * s for s in (1, 2, 3, 4)]
    vals = [r for r in metrics(setup / "rank0") if "val_loss" in r and "step" in r]
    assert [r["step"] for r in vals] == [0, 2, 4]  # evaluated across the ranks, logged once
    assert (setup / "rank0" / "loss.png").exists()


def test_zero_resume_is_bit_exact_at_the_same_world_size(setup):
    a = job(setup, "z_straight", "zero2", 2, accum=1)
    job(setup, "z_split", "zero2", 2, accum=1, until=2)
    b = job(setup, "z_split", "zero2", 2, accum=1, resume=True)
    assert losses(a) == losses(b)
    ca, cb = load_checkpoint(a / "checkpoint"), load_checkpoint(b / "checkpoint")
    for part in ("weights", "optimizer"):
        ta, tb = getattr(ca, part), getattr(cb, part)
        assert ta.keys() == tb.keys()
        for k in ta:
            assert np.array_equal(ta[k], tb[k]), f"{part} {k} differs after resume"


def test_zero_state_saved_on_2_ranks_resumes_on_1(setup):
    a = job(setup, "m_straight", "zero1", 2, accum=1)
    job(setup, "m_split", "zero1", 2, accum=1, until=2)
    b = job(setup, "m_split", "zero1", 1, accum=2, resume=True)
    la, lb = losses(a), losses(b)
    for s in (3, 4):
        assert abs(la[s] - lb[s]) <= 1e-6 * abs(la[s]), (s, la[s], lb[s])


@pytest.fixture(scope="module")
def reference_200(setup) -> Path:
    """ZeRO-2, deterministic, 1 rank accumulating 4 micro-batches: 200 steps, clipping on."""
    return run(setup, "det1", 1, *LONG, "--dist", "zero2", "--deterministic", "--grad-accum", "4")


def weights_equal(a: Path, b: Path) -> list[str]:
    wa, wb = load_checkpoint(a / "checkpoint").weights, load_checkpoint(b / "checkpoint").weights
    return [k for k in wa if not np.array_equal(wa[k], wb[k])]


def test_loss_parity_200_steps_4_ranks_vs_1(setup, reference_200):
    ref = losses(reference_200)
    assert sorted(ref) == list(range(1, 201))
    # deterministic mode: bit for bit (loss, gradient norm, final weights)
    det = run(setup, "det4", 4, *LONG, "--dist", "zero2", "--deterministic")
    assert losses(det) == ref
    assert losses(det, "grad_norm") == losses(reference_200, "grad_norm")
    assert max(losses(det, "grad_norm").values()) > 1.0  # clipping was active
    assert weights_equal(det, reference_200) == []
    # without it the sums may take another order (MPICH sums 4 ranks as the same tree: measured
    # 0 here; 5e-8 against a non-deterministic one-rank run)
    fast = losses(run(setup, "ddp4", 4, *LONG, "--dist", "ddp"))
    err = max(abs(fast[s] - ref[s]) / abs(ref[s]) for s in ref)
    print(f"DDP 4 ranks vs 1 rank, fp32, 200 steps: max relative loss difference {err:.3g}")
    assert err <= 1e-5, err


def _rank_pids(root: int) -> dict[int, int]:
    """{MPI rank: pid} of the processes under `root` (MPICH's hydra sets PMI_RANK)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            env_ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for kv in env_:
            if kv.startswith(b"PMI_RANK="):
                out[int(kv.split(b"=")[1])] = pid
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_killed_rank_ends_the_job_then_the_run_resumes_on_1_rank(setup, reference_200):
    out = setup / "fault"
    cmd = command(
        setup, "fault", 4, *LONG, "--dist", "zero2", "--deterministic", "--ckpt-interval", "10",
        launcher=("-disable-auto-cleanup",), shell=True,
    )  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env(20))
    try:
        trainer_json = out / "checkpoint" / "trainer.json"
        deadline = time.monotonic() + 300
        while not trainer_json.exists() and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.poll() is None, "the run ended before a checkpoint was written"
        pids = _rank_pids(p.pid)
        assert sorted(pids) == [0, 1, 2, 3], pids
        os.kill(pids[2], signal.SIGKILL)
        t_kill = time.monotonic()
        text = p.communicate(timeout=120)[0].decode(errors="replace")
        dt = time.monotonic() - t_kill
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode != 0, text[-3000:]
    assert dt < 60, f"the job took {dt:.0f} s to end after the kill (timeout 20 s)"
    # the ranks that did not answer the survivors within the grace: the dead one (and, on a
    # loaded machine, maybe a live one that was slow to answer)
    silent = re.findall(r"rank\(s\) ([\d, ]+) did not answer", text)
    # the launcher's exit status too: CI twice saw the survivors end without a word, their report
    # overtaken by MPI_Abort (blutrain.dist now waits for it to leave the pipe: Note [report
    # before abort])
    assert any("2" in m.split(", ") for m in silent), f"exit status {p.returncode}\n{text[-3000:]}"
    time.sleep(1)
    assert not [q for q in pids.values() if _alive(q)], "processes left behind"
    saved = json.loads(trainer_json.read_text())["step"]
    assert 10 <= saved < 200 and saved % 10 == 0, saved
    # resume on another world size with the same global batch (4 ranks x 1 = 1 rank x 4)
    resumed = run(setup, "fault", 1, *LONG, "--dist", "zero2", "--grad-accum", "4", "--resume")
    got, ref = losses(resumed), losses(reference_200)
    assert [s for s in range(saved + 1, 201) if got[s] != ref[s]] == []
    assert weights_equal(resumed, reference_200) == []
