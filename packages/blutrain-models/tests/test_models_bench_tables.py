"""bench/gpu_bf16_table.py --across, issue 38's verdict over seeds: on runs with known losses,
the paired differences, the windowed distances and the verdict come out as they must."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

STEPS = 100


BENCH_MODULE = "gpu_bf16_table"


@pytest.fixture(scope="module")
def table(bench_module):
    return bench_module


def seed_json(tmp_path: Path, seed: int, offsets: dict[str, float], rng) -> str:
    """A convergence.py JSON of one seed: torch:fp32 a noisy descending curve, each other run
    that curve plus a constant (train and val alike)."""
    ref = np.linspace(10, 5, STEPS) + 0.05 * rng.standard_normal(STEPS)
    val = [[s, float(6 - s / 50)] for s in (0, 50, 99)]
    runs = {}
    for name, off in {"torch:fp32": 0.0, **offsets}.items():
        runs[name] = {
            "run": name,
            "loss": (ref + off).tolist(),
            "grad_norm": [1.0] * STEPS,
            "val": [[s, v + off] for s, v in val],
            "tokens_per_s": 1.0,
            "train_s": 1.0,
            "checkpoints": {},
        }
    args = {"B": 2, "T": 256, "steps": STEPS, "seed": seed, "init_seed": seed, "eval_every": 50}
    path = tmp_path / f"conv_b_seed{seed}.json"
    path.write_text(json.dumps({"args": args, "reference": "torch:fp32", "runs": runs}))
    return str(path)


def test_across_pairs_each_seed_and_reads_the_windows(table, tmp_path, rng, capsys):
    offs = [
        {"torch:bf16": 0.010, "ours:bf16": -0.002 - 0.001 * i, "ours:fp32": -0.0005 * i}
        for i in range(3)
    ]
    paths = [seed_json(tmp_path, i + 1, o, rng) for i, o in enumerate(offs)]
    assert table.across(paths)  # ours:bf16 nearer torch:fp32 and lower than torch:bf16
    out = capsys.readouterr().out
    # ours:bf16's |d| is 0.002, 0.003, 0.004: mean 0.003, standard error 0.001/sqrt(3)
    assert "d_train_tail  ours:bf16 - torch:bf16: -0.0070 +- 0.0006 (3 of 3 seeds <= 0) ok" in out
    assert "(3 of 3 seeds <= 0) ok  [2 SE: -0.0082 to -0.0058]" in out  # -0.007 +- 2 x 0.00058
    rows = {ln[:24].strip(): ln for ln in out.splitlines() if " - " in ln[:24]}
    assert rows["ours:bf16 - torch:fp32"].split()[4] == "0.0030+-0.0006"  # window 1-10
    assert rows["ours:bf16 - torch:fp32"].split()[-1] == "-3.0e-03+-5.8e-04"  # the early bias
    # against its own fp32: |(-0.002 - 0.001 i) + 0.0005 i| = 0.002, 0.0025, 0.003
    assert rows["ours:bf16 - ours:fp32"].split()[4] == "0.0025+-0.0003"
    assert rows["ours - torch"].split()[4] == "-0.0070+-0.0006"  # paired, seed by seed
    # paired against each framework's own fp32: ours 0.002 + 0.0005 i (signed -(that)), torch
    # 0.010, so -0.0080, -0.0075, -0.0070 (signed -0.0120, -0.0125, -0.0130)
    assert "each bf16 run against its own fp32, paired over 3 seeds" in out
    assert "  |d train| tail    -0.0075 +- 0.0003 (3 of 3 seeds <= 0)" in out
    assert "  |d val| final     -0.0075 +- 0.0003 (3 of 3 seeds <= 0)" in out
    assert "  val final, signed -0.0125 +- 0.0003 (3 of 3 seeds <= 0)" in out


def test_across_pairs_tf32_distances_seed_by_seed(table, tmp_path, rng, capsys):
    """ours:tf32's distance from torch:fp32 minus torch:tf32's, paired by seed, by window."""
    offs = [{"torch:tf32": 0.001 * (i + 1), "ours:tf32": -0.003 * (i + 1)} for i in range(3)]
    paths = [seed_json(tmp_path, i + 1, o, rng) for i, o in enumerate(offs)]
    table.across(paths)
    rows = {ln[:24].strip(): ln for ln in capsys.readouterr().out.splitlines()}
    # |-0.003 k| - |0.001 k| = 0.002 k for k = 1, 2, 3: mean 0.004, standard error 0.002/sqrt(3)
    assert rows["ours:tf32 - torch:tf32"].split()[4:6] == ["+0.0040+-0.0012", "+0.0040+-0.0012"]


def test_across_is_not_met_when_ours_is_farther_or_nothing_is_judged(table, tmp_path, rng):
    far = [seed_json(tmp_path, s, {"torch:bf16": 0.01, "ours:bf16": 0.02}, rng) for s in (1, 2)]
    assert not table.across(far)
    nothing = [seed_json(tmp_path, s, {"ours:fp32": -0.01}, rng) for s in (3, 4)]
    assert not table.across(nothing)  # no bf16 pair: the aim is not shown


def test_across_judges_a_variant_as_ours(table, tmp_path, rng, capsys):
    """--ours RUN: a variant of ours stands for our bf16 (ours:bf16 itself absent or farther)."""
    offs = {"torch:bf16": 0.01, "ours:bf16": 0.03, "ours:bf16/f32grad": -0.004}
    paths = [seed_json(tmp_path, s, offs, rng) for s in (1, 2)]
    assert not table.across(paths)
    assert table.across(paths, "ours:bf16/f32grad")
    out = capsys.readouterr().out
    assert "d_train_tail  ours:bf16/f32grad - torch:bf16: -0.0060 +- 0.0000 (2 of 2" in out


def _split(path: str, parts: dict[str, list[str]]) -> list[str]:
    """One seed's JSON written again as several files, each with some of its runs."""
    d = json.loads(Path(path).read_text())
    out = []
    for name, runs in parts.items():
        p = Path(path).with_name(name)
        p.write_text(json.dumps({**d, "runs": {r: d["runs"][r] for r in runs}}))
        out.append(str(p))
    return out


def test_across_merges_a_seeds_runs_from_several_files(table, tmp_path, rng, capsys):
    """PyTorch's kept runs in one file, ours from a later call in another: the table of the
    merged seeds is the table of the whole files, and the seeds count once."""
    offs = [{"torch:bf16": 0.01, "ours:bf16": 0.002 * i, "ours:fp32": -0.001} for i in range(3)]
    whole = [seed_json(tmp_path, i + 1, o, rng) for i, o in enumerate(offs)]
    assert table.across(whole)
    expect = capsys.readouterr().out
    split = []
    for i, p in enumerate(whole):
        split += _split(
            p,
            {f"t{i}.json": ["torch:fp32", "torch:bf16"], f"o{i}.json": ["ours:bf16", "ours:fp32"]},
        )
    ours_first = sorted(split, key=lambda p: not Path(p).name.startswith("o"))
    assert table.across(ours_first)
    assert capsys.readouterr().out == expect  # one row order whichever file came first
    assert "3 seeds (batch/init): 1/1, 2/2, 3/3;" in expect


def test_across_refuses_a_run_given_twice_or_a_seed_with_nothing_to_pair(table, tmp_path, rng):
    p = seed_json(tmp_path, 1, {"torch:bf16": 0.01, "ours:bf16": 0.0}, rng)
    a, b = _split(p, {"a.json": ["torch:fp32", "ours:bf16"], "b.json": ["torch:bf16", "ours:bf16"]})
    with pytest.raises(
        SystemExit, match=r"seed 1's ours:bf16 is in .*a\.json.* again in .*b\.json"
    ):
        table.across([a, b])
    d = json.loads(Path(p).read_text())
    for r in d["runs"].values():
        r["val"] = []  # (a run with --eval-every 0)
    c = tmp_path / "c.json"
    c.write_text(json.dumps({**d, "runs": {k: d["runs"][k] for k in ("torch:bf16", "ours:bf16")}}))
    with pytest.raises(
        SystemExit, match=r"seed 1 \(.*c\.json\) has no torch:fp32 run .* and no val"
    ):
        table.across([str(c)])


def test_seeds_without_the_reference_join_the_final_val_pair_only(table, tmp_path, rng, capsys):
    """Seeds 3-4 ran only the bf16 pair (no torch:fp32): their final val losses join the paired
    final val (n = 4), the distances stay over seeds 2 and 10, and alone they judge nothing."""
    offs = {"torch:bf16": 0.010, "ours:bf16": 0.004}
    whole = [seed_json(tmp_path, s, offs, rng) for s in (10, 2)]
    bf16 = [
        _split(
            seed_json(tmp_path, s, {"torch:bf16": 0.0, "ours:bf16": -0.002}, rng),
            {f"bf16_{s}.json": ["torch:bf16", "ours:bf16"]},
        )[0]
        for s in (3, 4)
    ]
    assert table.across(whole + bf16)
    out = capsys.readouterr().out
    assert "2 seeds (batch/init): 2/2, 10/10;" in out  # in the seeds' order, not the files'
    assert "and 2 seeds without torch:fp32 (3/3, 4/4): in the paired final val only" in out
    # final val: -0.006, -0.006, -0.002, -0.002 (mean -0.004); distances over seeds 1-2 only
    assert "val_final     ours:bf16 - torch:bf16: -0.0040 +- 0.0012 (4 of 4 seeds <= 0) ok" in out
    assert "d_train_tail  ours:bf16 - torch:bf16: -0.0060 +- 0.0000 (2 of 2 seeds <= 0) ok" in out
    assert not table.across(bf16)  # the distances not shown: the aim is not judged met
    assert "val_final     ours:bf16 - torch:bf16: -0.0020" in capsys.readouterr().out
    # seed 5 has torch:bf16 alone (its ours:bf16 still to run): named apart, in no pair
    lone = _split(
        seed_json(tmp_path, 5, {"torch:bf16": 0.0, "ours:bf16": 0.5}, rng),
        {"bf16_5.json": ["torch:bf16"]},
    )[0]
    assert table.across(whole + bf16 + [lone])
    out = capsys.readouterr().out
    assert "and 2 seeds without torch:fp32 (3/3, 4/4): in the paired final val only" in out
    lone_line = "and 1 seed without torch:fp32 and without both runs of a pair (5/5): in no figure"
    assert lone_line in out
    assert "val_final     ours:bf16 - torch:bf16: -0.0040 +- 0.0012 (4 of 4 seeds <= 0) ok" in out


def test_across_names_a_file_it_cannot_read(table, tmp_path, rng):
    good = seed_json(tmp_path, 1, {"torch:bf16": 0.01, "ours:bf16": 0.0}, rng)
    bad = tmp_path / "cut.json"
    bad.write_text('{"args": {"B": 2')  # a file cut short
    for path in (str(bad), str(tmp_path / "missing.json")):
        with pytest.raises(SystemExit, match=r"cannot read .*(cut|missing)\.json as a convergence"):
            table.across([good, path])


def probe_json(tmp_path: Path, seed: int, err: dict[str, float]) -> str:
    """A convergence.py --probe JSON of one seed at step 60: each run's gradient error err[run],
    its loss bias and scale bias err[run] / 10, its val loss 5 + err[run]."""
    res = {
        run: {
            "loss_bias": e / 10,
            "val": 5.0 + e,
            "grad_rel": {"*": e},
            "grad_scale": {"*": e / 10},
        }
        for run, e in {"torch:fp32": 0.0, **err}.items()
    }
    path = tmp_path / f"probe_seed{seed}.json"
    path.write_text(json.dumps({"args": {"probe_ref": "torch:fp32"}, "probe": {"60": res}}))
    return str(path)


def test_probes_average_each_run_over_the_seeds(table, tmp_path, capsys):
    paths = [
        probe_json(tmp_path, 1, {"ours:bf16": 0.004, "torch:bf16": 0.005}),
        probe_json(tmp_path, 2, {"ours:bf16": 0.006, "torch:bf16": 0.005}),
    ]
    table.probes(paths)
    rows = {ln.split()[1]: ln.split() for ln in capsys.readouterr().out.splitlines()[3:]}
    # ours:bf16: errors 0.004 and 0.006 (mean 0.005, standard error 0.001)
    assert rows["ours:bf16"][:4] == ["60", "ours:bf16", "2", "+5.00e-04+-1.0e-04"]
    assert rows["ours:bf16"][4:] == ["+5.00e-03+-1.0e-03", "5.00e-03", "+5.00e-04+-1.0e-04"]
    assert rows["torch:bf16"][3] == "+5.00e-04+-0.0e+00"
    assert rows["torch:fp32"][5] == "0.00e+00"  # the reference against itself
    with pytest.raises(SystemExit, match=r"conv_b_seed1\.json is not a convergence.py --probe"):
        table.probes([seed_json(tmp_path, 1, {}, np.random.default_rng(0))])


def test_across_reads_a_margin_as_non_inferiority_beside_the_strict_aim(
    table, tmp_path, rng, capsys
):
    """--margin: ours a little above torch is NOT MET strictly but within a margin its 2-SE band
    clears, and not within one it does not; the strict verdict is unchanged either way."""
    offs = [
        {"torch:bf16": 0.010, "ours:bf16": 0.011 + 0.0005 * i, "ours:fp32": -0.0005 * i}
        for i in range(3)
    ]
    paths = [seed_json(tmp_path, i + 1, o, rng) for i, o in enumerate(offs)]
    assert not table.across(paths, margin=0.005)
    out = capsys.readouterr().out
    # +0.001, +0.0015, +0.002: mean +0.0015, standard error 0.0005/sqrt(3), upper end +0.0021
    line = "val_final     ours:bf16 - torch:bf16: +0.0015 +- 0.0003 (0 of 3 seeds <= 0) NOT MET"
    assert line + "  [2 SE: +0.0009 to +0.0021] < 0.005" in out
    assert (
        "non-inferiority at margin 0.005 (every pair's upper 2-SE end below it, 4 of 4): met" in out
    )
    assert not table.across(paths, margin=0.002)
    out = capsys.readouterr().out
    assert line + "  [2 SE: +0.0009 to +0.0021] not < 0.002" in out
    assert "(every pair's upper 2-SE end below it, 1 of 4): NOT met" in out  # fp32's alone
    table.across(paths)
    assert "non-inferiority" not in capsys.readouterr().out  # only when asked for


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--margin", "0.005", "a.json"], r"--margin: only with --across"),
        (["--across", "--margin", "0", "a.json"], r"--margin: 0.0 is not a positive loss"),
        (["--across", "--margin", "nan", "a.json"], r"--margin: nan is not a positive loss"),
    ],
)
def test_a_margin_must_be_positive_and_with_across(table, monkeypatch, argv, msg):
    monkeypatch.setattr("sys.argv", ["gpu_bf16_table.py", *argv])
    with pytest.raises(SystemExit, match=msg):
        table.main()


@pytest.mark.parametrize("argv", [["--probes"], ["--across"], ["--across", "--ours", "ours:x"]])
def test_a_mode_without_files_says_so(table, monkeypatch, argv):
    monkeypatch.setattr("sys.argv", ["gpu_bf16_table.py", *argv])
    with pytest.raises(SystemExit, match=rf"{argv[0]}: no JSON files given"):
        table.main()


def test_help_describes_the_modes_and_ours_needs_across(table, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["gpu_bf16_table.py", "--help"])
    with pytest.raises(SystemExit) as e:
        table.main()
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--across" in out and "--probes" in out and "--ours" in out
    monkeypatch.setattr("sys.argv", ["gpu_bf16_table.py", "--ours", "ours:x", "a.json"])
    with pytest.raises(SystemExit, match=r"--ours: only with --across"):
        table.main()


def test_probes_name_a_file_missing_its_reference(table, tmp_path):
    p = Path(probe_json(tmp_path, 1, {"ours:bf16": 0.004}))
    d = json.loads(p.read_text())
    del d["probe"]["60"]["torch:fp32"]
    p.write_text(json.dumps(d))
    with pytest.raises(SystemExit, match=r"probe_seed1\.json is not a convergence.py --probe"):
        table.probes([str(p)])


def test_across_pairs_each_tf32_variant_with_torch_tf32(table, tmp_path, rng, capsys):
    """An ours:tf32 variant (ours:tf32/exactattn) gets its own distance row and its own paired row
    against torch:tf32, beside ours:tf32's."""
    offs = [
        {"torch:tf32": 0.001 * k, "ours:tf32": -0.003 * k, "ours:tf32/exactattn": 0.002 * k}
        for k in (1, 2, 3)
    ]
    paths = [seed_json(tmp_path, k, o, rng) for k, o in enumerate(offs, 1)]
    table.across(paths)
    out = capsys.readouterr().out.splitlines()

    def cells(name: str) -> list[str]:
        row = next(ln for ln in out if ln.startswith(name + " "))
        return row[len(name) :].split()

    # |0.002 k| = 0.002, 0.004, 0.006: mean 0.004, standard error 0.002/sqrt(3)
    assert cells("ours:tf32/exactattn - torch:fp32")[1] == "0.0040+-0.0012"
    # |0.002 k| - |0.001 k| = 0.001 k: mean 0.002, standard error 0.001/sqrt(3)
    assert cells("ours:tf32/exactattn - torch:tf32")[1:3] == ["+0.0020+-0.0006"] * 2
    assert cells("ours:tf32 - torch:tf32")[1] == "+0.0040+-0.0012"
