"""bench/check_steps.py, the per-step checker of compiled programs against eager replays (the
tool for the CUDA steps' NaN, issue 34): silent on a step that matches, and names the step of a
kernel whose output is wrong."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import check_steps as CS  # noqa: E402


def test_a_correct_program_reports_nothing() -> None:
    r = CS.run_spec("llama32:check", "cpu")
    (le, _), (lc, _) = r["runs"]["eager"], r["runs"]["compiled"]
    assert r["groups"] > 50 and r["bad"] == []
    assert lc == le  # (on the CPU the compiled step keeps eager's bits, checked or not)


def test_a_wrong_kernel_output_is_named(monkeypatch) -> None:
    monkeypatch.setattr(CS, "CORRUPT", set(range(10_000)))  # every group's first output doubled
    r = CS.run_spec("llama32:check", "cpu")
    assert r["bad"], "the checker missed doubled kernel outputs"
    assert r["bad"][0].startswith("step ") and "rel err" in r["bad"][0], r["bad"][0]
    # the plain run afterwards is restored (no checking copy, no corruption hook left)
    assert CS.P.Program.run is CS._orig["run"]
