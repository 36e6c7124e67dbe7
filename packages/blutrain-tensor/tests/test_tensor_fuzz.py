"""Random, mostly wrong calls of the public API (tensor_fuzz.py) in a child process: none may
crash the interpreter, and each error must be an exception that names the op.  Fresh seeds each
run (printed); the call running at a crash is reported."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

FUZZ = pathlib.Path(__file__).with_name("tensor_fuzz.py")
CALLS = 4000


@pytest.mark.parametrize("run", range(3))
def test_random_calls_raise_named_errors_and_never_crash(rng, tmp_path, run):
    seed = int(rng.integers(1 << 31))
    last = tmp_path / "last_call.txt"
    p = subprocess.run(
        [sys.executable, str(FUZZ), str(seed), str(CALLS), str(last)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    where = last.read_text() if last.exists() else "(none)"
    assert p.returncode == 0, (
        f"fuzz seed {seed}: exit code {p.returncode} during {where}\n{p.stderr[-3000:]}"
    )
    assert "UNEXPECTED" not in p.stdout, f"fuzz seed {seed}:\n{p.stdout[-3000:]}"
