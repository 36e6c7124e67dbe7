r"""The table of bench/gpu_bf16.sh: each convergence JSON's runs against its fp32 reference
(torch:fp32 of call 1), ours bf16 beside torch bf16, and issue 38's aim checked on each:
ours bf16's |train loss - fp32's| over the last tenth and final |val loss - fp32's| no larger
than torch bf16's, and ours' final val loss at or below torch bf16's.

    python bench/gpu_bf16_table.py out/conv_a.json out/conv_b.json
    python bench/gpu_bf16_table.py --across out/conv_b_seed*.json   # one setting, several seeds
    python bench/gpu_bf16_table.py --across --ours ours:bf16/f32grad out/conv_b_seed*.json
    python bench/gpu_bf16_table.py --across bench/baselines/conv_b_seeds/*.json \
        bench/baselines/conv_b_seeds_ours/*.json   # kept runs: PyTorch's and ours (sessions 49-63)
    python bench/gpu_bf16_table.py --across --margin 0.005 ...   # also as non-inferiority
    python bench/gpu_bf16_table.py --probes bench/baselines/probe_b/*.json  # probes over seeds

--across: one seed ranks nothing (ours fp32 sits as far from torch fp32 as any bf16 run, from
summation order alone), so the aim is judged on the mean over seeds of each paired difference,
ours minus torch, printed with its standard error. Then the distances by window of steps: before
about step 60 the runs of a seed still share one trajectory and |d train| measures the precision;
after it every pair decorrelates to one floor (chaos), fp32 against fp32 included. Each bf16 run
is also set against its own framework's fp32 (ours:bf16 - ours:fp32 beside torch:bf16 -
torch:fp32, when ours:fp32 ran), and the signed loss difference of the first steps, a bias, is
printed with its standard error. A seed's runs may come from several JSONs, given together
(the files of one seed merge: PyTorch's kept runs beside ours from another call), or from one
that conv_seeds.sh --baseline-dir merged. A seed without torch:fp32 counts in the paired final
val losses only (distances need the reference): torch:fp32 is the slow run, so the final val
pair can take more seeds than the distances (session 54: 48 against 40).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# ours' three bf16 figures the aim needs shown (train and val distance, final val)
BF16_FIGURES = frozenset({"d_train_tail", "d_val_final", "val_final"})
SETTINGS = {(16, 1024, 300): "A (B16 T1024, 300 steps)", (2, 256, 1000): "B (B2 T256, 1000 steps)"}


def table(path: str) -> bool:
    """Prints one JSON's table; True when ours:bf16 meets the aim (variants
    such as ours:bf16/bf16res are controls)."""
    if not os.path.exists(path):
        print(f"\n{path}: missing (the run was skipped or cut)")
        return False
    with open(path) as f:
        d = json.load(f)
    a = d["args"]
    from convergence import reference, summarize

    if "summary" not in d:  # a call cut by its time limit: the runs that finished
        print(f"\n{path}: cut before the end; the finished runs: {', '.join(d['runs'])}")
    # recomputed from the runs (older JSONs' summaries lack the split step and the spikes)
    d["summary"] = summarize(d["runs"], argparse.Namespace(**a))
    d["reference"] = reference(list(d["runs"]))
    name = SETTINGS.get((a["B"], a["T"], a["steps"]), f"B{a['B']} T{a['T']}, {a['steps']} steps")
    print(
        f"\nsetting {name}, batch seed {a['seed']}; reference {d['reference']}; tail = the last "
        f"{a['steps'] // 10} steps; split: the first step with |d train| > 0.02; spikes: steps "
        "whose gradient norm is over 3x its neighbours' median"
    )
    print(
        f"{'run':<22} {'tok/s':>9} {'train':>8} {'val':>8} {'|dtrain| tail':>13} "
        f"{'|dval|':>8} {'signed dval':>11} {'split':>5}  aim / spikes"
    )
    s = d["summary"]
    torch_bf16 = s.get("torch:bf16")
    ok_all = "ours:bf16" in s and torch_bf16 is not None  # nothing to judge: not met
    for run, r in s.items():
        verdict = ""
        if run.startswith("ours:bf16/"):
            verdict = "(control)"
        elif run == "ours:bf16" and torch_bf16 is not None:
            checks = {
                "dtrain": r["d_train_tail"] <= torch_bf16["d_train_tail"],
                "dval": r["d_val_final"] <= torch_bf16["d_val_final"],
                "val": r["val_final"] <= torch_bf16["val_final"],
            }
            ok = all(checks.values())
            ok_all &= ok
            verdict = "ok" if ok else "NOT MET: " + ", ".join(k for k, v in checks.items() if not v)
        sp = " ".join(f"{int(k)}({g:.1f})" for k, g in r.get("spikes", [])[:5])
        split = r.get("split_step") or "-"
        print(
            f"{run:<22} {r['tokens_per_s']:9.0f} {r['train_tail']:8.4f} {r['val_final']:8.4f} "
            f"{r['d_train_tail']:13.4f} {r['d_val_final']:8.4f} {r['bias_val_final']:+11.4f} "
            f"{split!s:>5}  {verdict}{' / ' if verdict and sp else ''}{sp}"
        )
    floor = s.get("ours:fp32") if d["reference"] == "torch:fp32" else None
    if floor is not None:
        print(
            f"fp32 floor: ours:fp32 against torch:fp32 (summation order only) |dtrain| tail "
            f"{floor['d_train_tail']:.4f}, |dval| {floor['d_val_final']:.4f}: bf16 distances "
            "under these are chaos, not precision"
        )
    return ok_all


def _mean_se(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, math.nan
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, math.sqrt(var / n)


def merge_seeds(paths: list[str]) -> tuple[dict, tuple]:
    """The runs of each (seed, init seed) over every file that has some (e.g. PyTorch's kept in
    bench/baselines/conv_b_seeds beside ours from a later call), in the order first seen, with the
    first file's args and each run's file; and the setting (B, T, steps).  A run found in two
    files of one seed, or files of another setting: SystemExit naming them."""
    merged: dict[tuple, tuple] = {}
    setting = None
    for p in paths:
        try:
            with open(p) as f:
                d = json.load(f)
            a = d["args"]
            key = (a["B"], a["T"], a["steps"])
            sid = (a["seed"], a.get("init_seed", 0))
            file_runs = dict(d["runs"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise SystemExit(
                f"gpu_bf16_table.py --across: cannot read {p} as a convergence.py JSON "
                f"({type(e).__name__}: {e})"
            ) from None
        if setting is not None and key != setting:
            raise SystemExit(
                f"gpu_bf16_table.py --across: {p} is B{key[0]} T{key[1]} "
                f"{key[2]} steps, the others B{setting[0]} T{setting[1]} {setting[2]}"
            )
        setting = key
        _, runs, src = merged.setdefault(sid, (a, {}, {}))
        for name, r in file_runs.items():
            if name in runs:
                raise SystemExit(
                    f"gpu_bf16_table.py --across: seed {sid[0]}'s {name} is in {src[name]} and "
                    f"again in {p}: give each run of a seed once"
                )
            runs[name], src[name] = r, p
    return merged, setting


def across(paths: list[str], ours: str = "ours:bf16", margin: float | None = None) -> bool:
    """One setting over several seeds: each run's mean distances from its seed's reference, and
    the aim's paired differences (ours - torch:bf16, `ours` the run judged as our bf16, e.g. a
    variant ours:bf16/f32grad; ours:P - torch:P final val for fp32 and tf32) as mean +- standard
    error. A seed without torch:fp32 (e.g. only torch:bf16 and ours:bf16 ran, the cheap runs)
    joins the paired final val only. True when every mean difference is <= 0 and ours' three
    (train and val distance, final val) were shown.

    margin: also read each pair as non-inferiority (a reading for whoever sets the aim, not the
    issue's own): ours is not worse by `margin` or more when the upper end of its 2-SE band is
    below it; printed per pair and in a closing line. The return value stays the strict aim."""
    from convergence import reference, summarize

    sums: dict[str, list[dict]] = {}
    seeds, runs_of, per_seed, val_only, unpaired = [], [], [], [], []
    merged, setting = merge_seeds(paths)
    for (seed, init), (a, runs, src) in sorted(merged.items()):  # seed 2 before 10
        if "torch:fp32" not in runs:  # no reference: its runs' final val losses alone count
            if not any(r.get("val") for r in runs.values()):
                raise SystemExit(
                    f"gpu_bf16_table.py --across: seed {seed} "
                    f"({', '.join(sorted(set(src.values())))}) has no torch:fp32 run (the "
                    "reference) and no validation loss in any file"
                )
            vals = {n: {"val_final": r["val"][-1][1]} for n, r in runs.items() if r.get("val")}
            # one side of a pair alone (e.g. torch:bf16 kept for an ours:bf16 still to run) is in
            # no pair: named apart, not as counted
            pairs = ((ours, "torch:bf16"), ("ours:tf32", "torch:tf32"))
            if any(o in vals and t in vals for o, t in pairs):
                val_only.append(f"{seed}/{init}")
                per_seed.append(vals)
            else:
                unpaired.append(f"{seed}/{init}")
            continue
        # the reference first, then PyTorch's runs, then ours, each in the order given
        order = sorted(runs, key=lambda n: (n != "torch:fp32", not n.startswith("torch:")))
        runs = {n: runs[n] for n in order}
        s = summarize(runs, argparse.Namespace(**a))
        assert reference(list(runs)) == "torch:fp32"
        seeds.append(f"{seed}/{init}")
        runs_of.append(runs)
        per_seed.append(s)
        for run, r in s.items():
            sums.setdefault(run, []).append(r)
    print(
        f"\nsetting {SETTINGS.get(setting, setting)}, {len(seeds)} seeds (batch/init): "
        f"{', '.join(seeds)}; reference torch:fp32 of each seed; mean +- standard error"
    )
    if val_only:
        print(
            f"and {len(val_only)} seeds without torch:fp32 ({', '.join(val_only)}): in the paired "
            "final val only"
        )
    if unpaired:
        print(
            f"and {len(unpaired)} seed{'s' * (len(unpaired) != 1)} without torch:fp32 and "
            "without both runs of a pair "
            f"({', '.join(unpaired)}): in no figure yet"
        )
    print(f"{'run':<20} {'n':>2} {'|dtrain| tail':>17} {'|dval| final':>17} {'val final':>17}")
    for run, rs in sums.items():
        cols = [_mean_se([r[k] for r in rs]) for k in ("d_train_tail", "d_val_final", "val_final")]
        print(f"{run:<20} {len(rs):>2} " + " ".join(f"{m:9.4f} +-{e:6.4f}" for m, e in cols))
    ok = True
    print("paired over seeds (ours - torch; the aim: <= 0):")
    pairs = [(ours, "torch:bf16", k) for k in ("d_train_tail", "d_val_final")]
    pairs += [(f"ours:{p}", f"torch:{p}", "val_final") for p in ("fp32", "tf32")]
    pairs += [(ours, "torch:bf16", "val_final")]
    judged = set()
    within = []  # with a margin: each pair's upper 2-SE end below it
    for o, t, k in pairs:
        # seed by seed, over the seeds that ran both (a stopped seed may lack a run; a seed
        # without the reference has final val losses only)
        diffs = [x[o][k] - x[t][k] for x in per_seed if k in x.get(o, {}) and k in x.get(t, {})]
        if len(diffs) < 1:
            continue
        if o == ours:
            judged.add(k)
        m, e = _mean_se(diffs)
        met = m <= 0
        ok &= met
        below = sum(d <= 0 for d in diffs)
        # the interval says whether the mean's sign is told apart from 0 at all
        band = f"  [2 SE: {m - 2 * e:+.4f} to {m + 2 * e:+.4f}]" if not math.isnan(e) else ""
        if margin is not None:  # one seed has no band: not within
            within.append(not math.isnan(e) and m + 2 * e < margin)
            band += f" {'<' if within[-1] else 'not <'} {margin:g}"
        print(
            f"  {k:<13} {o} - {t}: {m:+.4f} +- {e:.4f} "
            f"({below} of {len(diffs)} seeds <= 0) {'ok' if met else 'NOT MET'}{band}"
        )
    if margin is not None:
        verdict = "met" if within and all(within) and judged == BF16_FIGURES else "NOT met"
        print(
            f"non-inferiority at margin {margin:g} (every pair's upper 2-SE end below it, "
            f"{sum(within)} of {len(within)}): {verdict}"
        )
    if runs_of:
        own_fp32(runs_of, ours)
        windows(runs_of, ours)
    return ok and judged == BF16_FIGURES  # every part shown


def own_fp32(runs_of: list[dict], ours: str = "ours:bf16") -> None:
    """Each bf16 run against its own framework's fp32 (ours against ours:fp32, torch:bf16 against
    torch:fp32), paired ours - torch over the seeds that ran all four: |d train| over the last
    tenth, final |d val| and the signed final val (bf16 minus its fp32). Not the aim, whose
    reference is torch:fp32 for both: this takes the two fp32 runs' own distance (summation
    order) out of the comparison, and the signed row says whether bf16 lands above or below its
    own fp32 in each framework."""
    import numpy as np

    four = (ours, "ours:fp32", "torch:bf16", "torch:fp32")
    cols: dict[str, list[float]] = {"d_train_tail": [], "d_val_final": [], "val_final": []}
    for runs in runs_of:
        if not all(k in runs and runs[k].get("val") for k in four):
            continue
        loss = {k: np.asarray(runs[k]["loss"], dtype=np.float64) for k in four}
        val = {k: runs[k]["val"][-1][1] for k in four}
        tail = max(1, min(len(v) for v in loss.values()) // 10)
        dt = [np.abs(loss[b][-tail:] - loss[f][-tail:]).mean() for b, f in (four[:2], four[2:])]
        dv = [val[b] - val[f] for b, f in (four[:2], four[2:])]
        cols["d_train_tail"].append(float(dt[0] - dt[1]))
        cols["d_val_final"].append(abs(dv[0]) - abs(dv[1]))
        cols["val_final"].append(dv[0] - dv[1])
    n = len(cols["val_final"])
    if n < 2:
        return
    print(f"each bf16 run against its own fp32, paired over {n} seeds ({ours} - torch:bf16):")
    for k, what in (
        ("d_train_tail", "|d train| tail"),
        ("d_val_final", "|d val| final"),
        ("val_final", "val final, signed"),
    ):
        m, e = _mean_se(cols[k])
        below = sum(d <= 0 for d in cols[k])
        print(f"  {what:<17} {m:+.4f} +- {e:.4f} ({below} of {n} seeds <= 0)")


# steps [a, b): before ~60 the runs of a seed share a trajectory; later windows show the floor
WINDOWS = ((0, 10), (10, 30), (30, 60), (60, 100), (100, 200), (200, 400), (400, 700), (700, 1000))
EARLY = 5  # steps whose signed loss difference is read as a bias (still one trajectory)


def windows(runs_of: list[dict], ours: str = "ours:bf16") -> None:
    """|train loss difference| by window of steps, mean +- standard error over seeds: each run
    against torch:fp32, each bf16 run against its own framework's fp32, and ours - torch paired
    (bf16, and ours:tf32 - torch:tf32, each ours:tf32 variant such as ours:tf32/exactattn too)."""
    import numpy as np

    steps = min(len(r["torch:fp32"]["loss"]) for r in runs_of)
    wins = [(a, min(b, steps)) for a, b in WINDOWS if a < steps]
    pairs = [
        ("torch:bf16", "torch:fp32"),
        (ours, "torch:fp32"),
        ("ours:fp32", "torch:fp32"),
        (ours, "ours:fp32"),
        ("torch:tf32", "torch:fp32"),
        ("ours:tf32", "torch:fp32"),
    ]
    tf32_variants = sorted({k for r in runs_of for k in r if k.startswith("ours:tf32/")})
    pairs += [(v, "torch:fp32") for v in tf32_variants]
    per: dict[tuple[str, str], list] = {}
    bias: dict[tuple[str, str], list] = {}
    for runs in runs_of:
        loss = {k: np.asarray(v["loss"][:steps], dtype=np.float64) for k, v in runs.items()}
        for a, b in pairs:
            if a in loss and b in loss:
                d = loss[a] - loss[b]
                per.setdefault((a, b), []).append([np.abs(d[x:y]).mean() for x, y in wins])
                bias.setdefault((a, b), []).append(d[:EARLY].mean())
    head = " ".join(f"{f'{x + 1}-{y}':>15}" for x, y in wins)
    print(
        f"\n|d train| by window of steps (mean +- standard error over seeds); bias = the signed "
        f"difference over steps 1-{EARLY}"
    )
    w = max([24, *(len(v) + 14 for v in tf32_variants)])  # the name column: "{v} - torch:fp32"
    print(f"{'run - reference':<{w}} {'n':>2} {head} {'bias 1-' + str(EARLY):>19}")

    def row(name: str, xs: list, bs: list | None) -> None:
        a = np.asarray(xs)
        se = a.std(0, ddof=1) / np.sqrt(len(a)) if len(a) > 1 else np.full(a.shape[1], np.nan)
        sign = "+" if bs is None else ""  # paired differences carry their sign
        cells = " ".join(f"{m:{sign}7.4f}+-{e:6.4f}" for m, e in zip(a.mean(0), se))
        if bs is None:
            print(f"{name:<{w}} {len(a):>2} {cells}")
            return
        bm, be = _mean_se(list(bs))
        print(f"{name:<{w}} {len(a):>2} {cells} {bm:+9.1e}+-{be:7.1e}")

    for (a, b), xs in per.items():
        row(f"{a} - {b}", xs, bias[(a, b)])
    # paired over the seeds that ran both: ours:bf16 against torch:bf16, each from one reference;
    # ours:tf32 against torch:tf32 the same way (not part of the aim: a fidelity check)
    paired = [
        ("ours - torch", (ours, "torch:fp32"), ("torch:bf16", "torch:fp32")),
        ("ours - torch (own fp32)", (ours, "ours:fp32"), ("torch:bf16", "torch:fp32")),
    ]
    paired += [
        (f"{v} - torch:tf32", (v, "torch:fp32"), ("torch:tf32", "torch:fp32"))
        for v in ["ours:tf32", *tf32_variants]
    ]
    for name, (oa, ob), (ta, tb) in paired:
        both = [
            (
                np.abs(np.asarray(r[oa]["loss"][:steps]) - np.asarray(r[ob]["loss"][:steps])),
                np.abs(np.asarray(r[ta]["loss"][:steps]) - np.asarray(r[tb]["loss"][:steps])),
            )
            for r in runs_of
            if all(k in r for k in (oa, ob, ta, tb))
        ]
        if len(both) < 2:
            continue
        diffs = [[o[x:y].mean() - t[x:y].mean() for x, y in wins] for o, t in both]
        row(name, diffs, None)


def probes(paths: list[str]) -> None:
    """--probes: convergence.py --probe JSONs of several seeds. Per checkpoint and run kind, the
    mean +- standard error over the seeds of what each probe measured at its reference's weights
    (the model-wide figures): the loss bias, the val loss difference, the gradient error and the
    scale bias against the reference kind's. A file without probes: SystemExit naming it."""
    per: dict[tuple[int, str], list[tuple[float, float, float, float]]] = {}
    refs = set()
    for p in paths:
        try:
            with open(p) as f:
                d = json.load(f)
            ref = d["args"]["probe_ref"]
            rows = {
                (int(step), run): (
                    r["loss_bias"],
                    r["val"] - res[ref]["val"],
                    r["grad_rel"]["*"],
                    r["grad_scale"]["*"],
                )
                for step, res in d["probe"].items()
                for run, r in res.items()
            }
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise SystemExit(
                f"gpu_bf16_table.py --probes: {p} is not a convergence.py --probe JSON "
                f"({type(e).__name__}: {e})"
            ) from None
        refs.add(ref)
        for key, row in rows.items():
            per.setdefault(key, []).append(row)
    print(
        f"\nprobes of {len(paths)} seeds at {' / '.join(sorted(refs))}'s weights, mean +- "
        "standard error over the seeds: loss bias, val difference, gradient error "
        "||g - r|| / ||r|| and scale bias <g - r, r> / ||r||^2 (model-wide)"
    )
    print(f"{'step':>5} {'run':<20} {'n':>2} {'loss bias':>19} {'val diff':>19} {'grad err':>9} "
          f"{'scale bias':>19}")  # fmt: skip
    for (step, run), rows in sorted(per.items()):
        cols = [_mean_se([r[i] for r in rows]) for i in range(4)]
        (lb, lbe), (dv, dve), (ge, _), (sb, sbe) = cols
        print(
            f"{step:>5} {run:<20} {len(rows):>2} {lb:+10.2e}+-{lbe:7.1e} {dv:+10.2e}+-{dve:7.1e} "
            f"{ge:9.2e} {sb:+10.2e}+-{sbe:7.1e}"
        )


def main() -> int:
    ap = argparse.ArgumentParser(
        prog="gpu_bf16_table.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group = ap.add_mutually_exclusive_group()
    group.add_argument(
        "--across",
        action="store_const",
        const="--across",
        dest="mode",
        help="one setting over several seeds: the aim on the means over seeds",
    )
    group.add_argument(
        "--probes",
        action="store_const",
        const="--probes",
        dest="mode",
        help="probe JSONs (per-tensor comparisons) over seeds",
    )
    ap.add_argument(
        "--ours",
        default="ours:bf16",
        help="with --across: the run that stands for our bf16 (default ours:bf16)",
    )
    ap.add_argument(
        "--margin",
        type=float,
        help="with --across: also read each pair as non-inferiority, ours - torch's upper 2-SE "
        "end below this loss difference (e.g. 0.005); the strict aim is printed as before",
    )
    ap.add_argument("paths", nargs="*", metavar="JSON", help="convergence.py / probe JSON files")
    args = ap.parse_args()
    mode, ours, paths = args.mode, args.ours, args.paths
    for flag, given in (("--ours", ours != "ours:bf16"), ("--margin", args.margin is not None)):
        if given and mode != "--across":
            raise SystemExit(f"gpu_bf16_table.py {flag}: only with --across")
    if args.margin is not None and not (0 < args.margin < math.inf):
        raise SystemExit(
            f"gpu_bf16_table.py --margin: {args.margin} is not a positive loss difference"
        )
    if mode and not paths:
        raise SystemExit(f"gpu_bf16_table.py {mode}: no JSON files given")
    if mode == "--probes":
        probes(paths)
        return 0
    if mode == "--across":
        ok = across(paths, ours, args.margin)
        print(f"\naim (issue 38) on the means over seeds: {'met' if ok else 'NOT met'}")
        return 0
    if not paths:
        print(__doc__)
        return 2
    results = [table(p) for p in paths]
    print(
        "\naim (issue 38): ours bf16 no farther from fp32 than torch bf16 (train tail, final val) "
        f"and final val <= torch bf16's: {'met' if all(results) else 'NOT met'} in "
        f"{sum(results)} of {len(results)} settings"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
