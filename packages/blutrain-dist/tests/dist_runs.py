"""Launching mpiexec from pytest: one job per world size runs many cases (dist_worker.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "dist_worker.py"


def mpiexec() -> str:
    """The mpiexec next to this Python (the mpich wheel's), else the one on PATH."""
    local = Path(sys.executable).parent / "mpiexec"
    found = str(local) if local.exists() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError(
            "mpiexec not found: blutrain-dist's tests need an MPI launcher (pip install mpich)"
        )
    return found


def env(**extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e.setdefault("OMP_NUM_THREADS", "1")  # 4 ranks on a 2-core CI machine
    e["PYTHONUNBUFFERED"] = "1"
    e.update(extra)
    return e


def launch(
    n: int,
    args: list[str],
    timeout: float,
    extra_env: dict[str, str] | None = None,
    launcher_args: list[str] | None = None,
    shell: bool = False,
) -> tuple[int, str, str, float]:
    # shell: each rank runs as `sh -c 'python ...; exit $?'`, so a rank killed by a signal
    # reaches MPICH's launcher as an exit status: told of a signal instead, hydra sometimes
    # kills every rank at once even under -disable-auto-cleanup, before the survivors report
    wrap = ["sh", "-c", '"$0" "$@"; exit $?'] if shell else []
    cmd = [mpiexec(), *(launcher_args or []), "-n", str(n), *wrap, sys.executable, *args]
    t0 = time.monotonic()
    p = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=env(**(extra_env or {})), cwd=HERE
    )
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


def run_cases(
    n: int, cases: list[str], out: Path, extra_env: dict[str, str], timeout: float = 600
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    rc, so, se, dt = launch(n, [str(WORKER), str(out), *cases], timeout, extra_env)
    ranks = []
    for r in range(n):
        f = out / f"rank{r}.json"
        if not f.exists():
            raise AssertionError(
                f"mpiexec -n {n} ({dt:.0f} s, rc {rc}) wrote no results for rank {r}\n"
                f"stdout:\n{so[-3000:]}\nstderr:\n{se[-5000:]}"
            )
        ranks.append(json.loads(f.read_text()))
    return {"rc": rc, "ranks": ranks, "seconds": dt, "stderr": se}
