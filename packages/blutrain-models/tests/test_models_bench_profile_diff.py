"""bench/profile_diff.py and bench/ab_step.sh's kept results: on worker results with known
kernel times, the groups pair up across dtypes, arms average over rounds, and the differences
come out as they must."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
LN_F32 = "void bt::cuda::add_layer_norm_fwd<float, __nv_bfloat16, 4>(bt::cuda::AddLnArgs)"
LN_BF16 = "void bt::cuda::add_layer_norm_fwd<__nv_bfloat16, __nv_bfloat16, 4>(bt::cuda::AddLnA"
GEMM = "nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNN"


BENCH_MODULE = "profile_diff"


@pytest.fixture(scope="module")
def pd(bench_module):
    return bench_module


def result(tmp_path: Path, name: str, kernels: list, step_ms: float) -> str:
    p = tmp_path / name
    r = {"tokens_per_s": 16384 / step_ms * 1e3, "step_ms": step_ms, "kernels": kernels}
    p.write_text(json.dumps(r))
    return str(p)


def test_float32_and_bf16_instances_pair_up_and_rounds_average(pd, tmp_path, capsys):
    a = [
        result(tmp_path, "a1.json", [[GEMM, 20.0, 100], [LN_BF16, 1.0, 24]], 30.0),
        result(tmp_path, "a2.json", [[GEMM, 22.0, 100], [LN_BF16, 1.2, 24]], 32.0),
    ]
    b = [result(tmp_path, "b1.json", [[GEMM, 21.0, 100], [LN_F32, 1.9, 24]], 32.0)]
    out = tmp_path / "rows.json"
    assert pd.main([*a, "--json", str(out), "--", *b]) == 0
    rows = {r["kernel"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {GEMM, "add_layer_norm_fwd"}  # the two instances are one group
    ln = rows["add_layer_norm_fwd"]
    assert ln["a_ms"] == pytest.approx(1.1) and ln["b_ms"] == pytest.approx(1.9)
    assert ln["delta_ms"] == pytest.approx(0.8) and ln["b_per_step"] == 24
    assert rows[GEMM]["delta_ms"] == pytest.approx(0.0)
    text = capsys.readouterr().out
    assert "step +1.000 ms" in text and "GPU busy +0.800 ms" in text, text
    assert text.index("add_layer_norm_fwd") < text.index(GEMM)  # largest |difference| first


def test_full_names_keep_the_instances_apart(pd, tmp_path):
    a = [result(tmp_path, "a.json", [[LN_BF16, 1.0, 24]], 30.0)]
    b = [result(tmp_path, "b.json", [[LN_F32, 1.5, 24]], 30.0)]
    out = tmp_path / "rows.json"
    assert pd.main(["--full", *a, "--json", str(out), "--", *b]) == 0
    rows = {r["kernel"]: r["delta_ms"] for r in json.loads(out.read_text())["rows"]}
    assert rows == {LN_BF16: -1.0, LN_F32: 1.5}


def test_a_result_without_a_profile_is_refused_by_name(pd, tmp_path):
    a = [result(tmp_path, "a.json", [[GEMM, 20.0, 100]], 30.0)]
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps({"error": "CUDA out of memory"}))
    with pytest.raises(SystemExit, match=r"b\.json has no kernel profile.*out of memory"):
        pd.main([*a, "--", str(bad)])
    assert pd.main(a) == 2  # no "--": usage


def test_a_reader_that_stops_early_is_no_error(tmp_path):
    """`profile_diff.py ... | head`: the pipe's reader is gone before the table is written; the
    script still writes --json and exits 0 without a traceback (it printed one on the GPU
    machine in session 53)."""
    a = [result(tmp_path, "a.json", [[GEMM, 20.0, 100], [LN_BF16, 1.0, 24]], 30.0)]
    b = [result(tmp_path, "b.json", [[GEMM, 21.0, 100], [LN_F32, 1.5, 24]], 31.0)]
    out = tmp_path / "rows.json"
    r_end, w_end = os.pipe()
    os.close(r_end)  # the reader left: every write to the pipe fails (EPIPE)
    try:
        proc = subprocess.run(
            [sys.executable, str(BENCH / "profile_diff.py"), *a, "--json", str(out), "--", *b],
            stdout=w_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )
    finally:
        os.close(w_end)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr == "", proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {r["kernel"] for r in rows} == {GEMM, "add_layer_norm_fwd"}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_ab_step_keeps_each_arms_result(tmp_path):
    """ab_step.sh with a stand-in worker: each arm and round leaves its RESULT as JSON."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text(
        "#!/usr/bin/env bash\n"
        'case " $* " in *" --worker "*)\n'
        '  arm=$(echo "$*" | grep -o "tag-[a-z0-9]*")\n'
        '  echo "RESULT {\\"tokens_per_s\\": 1000, \\"step_ms\\": 16.0, \\"arm\\": \\"$arm\\"}";;\n'
        f'*) exec {sys.executable} "$@";;\nesac\n'
    )
    (fake / "python3").chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "OUT": str(out)}
    script = BENCH / "ab_step.sh"
    subprocess.run(
        ["bash", str(script), "bf16", "ours+graph", "2", "2", "x||--tag tag-x", "y||--tag tag-y"],
        env=env,
        check=True,
        capture_output=True,
    )
    for label in ("x", "y"):
        for r in (1, 2):
            got = json.loads((out / f"ab_bf16_{label}_r{r}.json").read_text())
            assert got["arm"] == f"tag-{label}"
    assert len((out / "ab_bf16.txt").read_text().splitlines()) == 4
