"""Multi-rank tests: mpiexec -n 1, 2, 4 (and 3 for checkpoint resharding) with the mpich wheel,
one job per world size running every case (dist_worker.py); each case is a pytest test here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dist_runs import run_cases

GROUP_CASES = [
    "collectives_vs_numpy",
    "uneven_chunks_and_async",
    "bad_arguments",
    "fingerprint_mismatch",
    "training_matches_one_rank",
    "deterministic_bitwise",
    "zero_memory_vs_formula",
    "zero2_gradient_peak",
    "disagreeing_models",
]
# the first test starts every job of the module (its fixture): more than pytest.ini's 300 s
# per test on a loaded 2-core machine
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    """Every world size's job, 4 first (it saves the checkpoint the others load)."""
    base = tmp_path_factory.mktemp("dist")
    env = {"BLUTRAIN_TEST_CKPT": str(base / "ckpt")}
    out: dict[int, dict[str, Any]] = {}
    out[4] = run_cases(4, [*GROUP_CASES, "checkpoint_save"], base / "n4", env)
    out[2] = run_cases(2, [*GROUP_CASES, "checkpoint_load"], base / "n2", env)
    # one rank: no MPI traffic, the training comparison is trivial there
    one = [c for c in GROUP_CASES if c != "training_matches_one_rank"]
    out[1] = run_cases(1, [*one, "checkpoint_load"], base / "n1", env)
    out[3] = run_cases(3, ["checkpoint_load", "uneven_chunks_and_async"], base / "n3", env)
    summary = {
        n: {"seconds": round(r["seconds"], 1), "figures": r["ranks"][0]["figures"]}
        for n, r in out.items()
    }
    print(json.dumps(summary, indent=1, default=str))
    Path(base / "figures.json").write_text(json.dumps(summary, indent=1, default=str))
    return out


def _assert_ok(run: dict[str, Any], name: str) -> None:
    for r, rank in enumerate(run["ranks"]):
        res = rank["results"].get(name)
        assert res == "ok", f"rank {r} of {len(run['ranks'])}: {name}:\n{res}"


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("name", GROUP_CASES)
def test_case(runs: dict[int, dict[str, Any]], n: int, name: str) -> None:
    if n == 1 and name == "training_matches_one_rank":
        pytest.skip("one rank: the same computation as the reference")
    _assert_ok(runs[n], name)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_checkpoint_from_4_ranks(runs: dict[int, dict[str, Any]], n: int) -> None:
    _assert_ok(runs[4], "checkpoint_save")
    _assert_ok(runs[n], "checkpoint_load")


@pytest.mark.parametrize("mode", ["ddp", "zero1", "zero2"])
def test_deterministic_bitwise_across_world_sizes(
    runs: dict[int, dict[str, Any]], mode: str
) -> None:
    key = f"deterministic {mode} digest"
    digests = {n: runs[n]["ranks"][0]["figures"][key] for n in (1, 2, 4)}
    assert len(set(digests.values())) == 1, f"{mode}: parameter digests differ: {digests}"
    # and every rank of a job holds the same parameters
    for n in (2, 4):
        per_rank = {r["figures"][key] for r in runs[n]["ranks"]}
        assert len(per_rank) == 1, f"{mode} at world size {n}: ranks differ {per_rank}"


def test_modes_agree_bitwise_in_deterministic_mode(runs: dict[int, dict[str, Any]]) -> None:
    f = runs[2]["ranks"][0]["figures"]
    assert (
        f["deterministic ddp digest"]
        == f["deterministic zero1 digest"]
        == f["deterministic zero2 digest"]
    )
