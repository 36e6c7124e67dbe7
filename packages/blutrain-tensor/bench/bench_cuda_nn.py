"""CUDA norm / loss kernels at GPT-2 124M shapes (B=16, T=1024, C=768, H=12, V=50257): ours next
to PyTorch's (torch CUDA, same GPU, same run) for layer_norm, residual add + layer_norm, softmax
(attention scores) and cross_entropy (the classifier), forward and forward + backward, in bf16 and
fp32.  Median of several batches of reps after warm-up, achieved GB/s against the memory floor
(bytes moved / 4.3 TB/s measured copy bandwidth).  Prints a table; --json OUT writes the rows.
The layer-norm rows are also timed per kernel version (--versions 2,3,4: BT_CUDA_NN_VERSION,
appended to the row as "vN ms %floor %copy", graph timings).  ce_padded: GPT-2's loss on the
first V columns of padded (R, 50304) logits (read in place, padded gradient); ce_padded_plain:
the same with the plain path (dense gradient, then the narrow's scatter).

Two timings of ours: "ours" (eager, CUDA events around reps batched calls: includes any host
launch gaps) and "graph" (the same reps calls captured once in a CUDA graph and replayed: device
time only, no host overhead; the version columns use it).  Next to each, %copy = ours GB/s over
the GB/s of a measured device-to-device copy (torch) moving the same bytes, the practical ceiling
(small copies do not reach 4.3 TB/s); the target is %copy >= 80 (--target).  --ops selects rows.
Not a test."""

from __future__ import annotations

import argparse
import json
import os

from cuda_timing import time_events, time_graph

import blutrain.tensor as bt

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover
    torch = None

BW = 4.3e12  # bytes/s, measured H200 copy bandwidth
B, T, C, H, V = 16, 1024, 768, 12, 50257
VP = 50304  # GPT-2's padded vocabulary


_COPY: dict[int, float] = {}


def _copy_ms(nbytes: int, reps: int) -> float:
    """A torch device-to-device copy moving nbytes (half read, half written); nan without torch."""
    if torch is None or not torch.cuda.is_available():
        return float("nan")
    if nbytes not in _COPY:
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        _COPY[nbytes] = time_events(lambda: dst.copy_(src), reps, torch_events=True)
        del src, dst
    return _COPY[nbytes]


def _bt_dtype(name):
    return {"bf16": bt.bfloat16, "fp32": bt.float32}[name]


def _torch_dtype(name):
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[name]


def cases(dt: str):
    """name -> (bytes fwd, bytes fwd+bwd, ours fwd, ours fwd+bwd, torch fwd, torch fwd+bwd)."""
    e = 2 if dt == "bf16" else 4
    R = B * T
    bdt = _bt_dtype(dt)
    res = {}

    # layer norm (R, C)
    x = bt.randn(R, C, dtype=bdt, device="cuda").requires_grad_(True)
    w = bt.randn(C, dtype=bdt, device="cuda").requires_grad_(True)
    b = bt.randn(C, dtype=bdt, device="cuda").requires_grad_(True)
    g = bt.randn(R, C, dtype=bdt, device="cuda")
    r = bt.randn(R, C, dtype=bdt, device="cuda").requires_grad_(True)

    def ln_f():
        with bt.no_grad():
            bt.layer_norm(x, C, w, b)

    def ln_fb():
        x.grad = w.grad = b.grad = None
        bt.layer_norm(x, C, w, b).backward(g)

    def aln_f():
        with bt.no_grad():
            bt.add_layer_norm(x, r, w, b)

    def aln_fb():
        x.grad = r.grad = w.grad = b.grad = None
        _, y = bt.add_layer_norm(x, r, w, b)
        y.backward(g)  # the residual stream's own gradient is the same tensor

    # layer norm over 3072-wide rows (the MLP's hidden width), R / 4 rows: same bytes as (R, 768)
    C4 = 4 * C
    x4 = bt.randn(R // 4, C4, dtype=bdt, device="cuda").requires_grad_(True)
    w4 = bt.randn(C4, dtype=bdt, device="cuda").requires_grad_(True)
    b4 = bt.randn(C4, dtype=bdt, device="cuda").requires_grad_(True)
    g4 = bt.randn(R // 4, C4, dtype=bdt, device="cuda")

    def ln4_f():
        with bt.no_grad():
            bt.layer_norm(x4, C4, w4, b4)

    def ln4_fb():
        x4.grad = w4.grad = b4.grad = None
        bt.layer_norm(x4, C4, w4, b4).backward(g4)

    # softmax over attention scores (B*H*T, T)
    S = bt.randn(B * H * T, T, dtype=bdt, device="cuda").requires_grad_(True)
    gS = bt.randn(B * H * T, T, dtype=bdt, device="cuda")

    def sm_f():
        with bt.no_grad():
            bt.softmax(S, -1)

    def sm_fb():
        S.grad = None
        bt.softmax(S, -1).backward(gS)

    # cross-entropy (R, V)
    L = bt.randn(R, V, dtype=bdt, device="cuda").requires_grad_(True)
    tg = bt.randint(0, V, R, device="cuda")

    def ce_f():
        with bt.no_grad():
            bt.cross_entropy(L, tg)

    def ce_fb():
        L.grad = None
        bt.cross_entropy(L, tg).backward()

    # GPT-2's head: the loss on the first V columns of padded (R, Vp) logits, read in place; the
    # padded path writes the (R, Vp) gradient in one pass.  "_plain": a hook on the narrowed
    # logits keeps the plain path (dense (R, V) gradient, then the narrow's scatter), for scale.
    Lp = bt.randn(R, VP, dtype=bdt, device="cuda").requires_grad_(True)
    tgi = bt.randint(0, V, R, device="cuda")
    lossdt = bt.float32 if dt == "bf16" else None

    def cep_f():
        with bt.no_grad():
            bt.cross_entropy(Lp.narrow(1, 0, V), tgi, ignore_index=-1, loss_dtype=lossdt)

    def cep_fb(plain=False):
        Lp.grad = None
        lg = Lp.narrow(1, 0, V)
        if plain:
            lg.register_hook(lambda g: None)
        bt.cross_entropy(lg, tgi, ignore_index=-1, loss_dtype=lossdt).backward()

    res["layer_norm"] = [2 * R * C * e, 5 * R * C * e, ln_f, ln_fb]
    res["layer_norm_3072"] = [2 * R * C * e, 5 * R * C * e, ln4_f, ln4_fb]
    res["add_layer_norm"] = [4 * R * C * e, 8 * R * C * e, aln_f, aln_fb]
    res["softmax"] = [2 * B * H * T * T * e, 5 * B * H * T * T * e, sm_f, sm_fb]
    res["cross_entropy"] = [R * V * e, 3 * R * V * e, ce_f, ce_fb]
    res["ce_padded"] = [R * V * e, 2 * R * V * e + R * VP * e, cep_f, cep_fb]
    res["ce_padded_plain"] = [R * V * e, 2 * R * V * e + R * VP * e, cep_f, lambda: cep_fb(True)]

    if torch is not None and torch.cuda.is_available():
        tdt = _torch_dtype(dt)
        dev = "cuda"
        tx = torch.randn(R, C, dtype=tdt, device=dev, requires_grad=True)
        tw = torch.randn(C, dtype=tdt, device=dev, requires_grad=True)
        tb = torch.randn(C, dtype=tdt, device=dev, requires_grad=True)
        tr = torch.randn(R, C, dtype=tdt, device=dev, requires_grad=True)
        tgg = torch.randn(R, C, dtype=tdt, device=dev)
        tx4 = torch.randn(R // 4, 4 * C, dtype=tdt, device=dev, requires_grad=True)
        tw4 = torch.randn(4 * C, dtype=tdt, device=dev, requires_grad=True)
        tb4 = torch.randn(4 * C, dtype=tdt, device=dev, requires_grad=True)
        tg4 = torch.randn(R // 4, 4 * C, dtype=tdt, device=dev)
        tS = torch.randn(B * H * T, T, dtype=tdt, device=dev, requires_grad=True)
        tgS = torch.randn(B * H * T, T, dtype=tdt, device=dev)
        tL = torch.randn(R, V, dtype=tdt, device=dev, requires_grad=True)
        ttg = torch.randint(0, V, (R,), device=dev)
        tLp = torch.randn(R, VP, dtype=tdt, device=dev, requires_grad=True)

        def t_ln_f():
            with torch.no_grad():
                F.layer_norm(tx, (C,), tw, tb)

        def t_ln_fb():
            tx.grad = tw.grad = tb.grad = None
            F.layer_norm(tx, (C,), tw, tb).backward(tgg)

        def t_ln4_f():
            with torch.no_grad():
                F.layer_norm(tx4, (4 * C,), tw4, tb4)

        def t_ln4_fb():
            tx4.grad = tw4.grad = tb4.grad = None
            F.layer_norm(tx4, (4 * C,), tw4, tb4).backward(tg4)

        def t_aln_f():
            with torch.no_grad():
                F.layer_norm(tx + tr, (C,), tw, tb)

        def t_aln_fb():
            tx.grad = tr.grad = tw.grad = tb.grad = None
            F.layer_norm(tx + tr, (C,), tw, tb).backward(tgg)

        def t_sm_f():
            with torch.no_grad():
                torch.softmax(tS, -1)

        def t_sm_fb():
            tS.grad = None
            torch.softmax(tS, -1).backward(tgS)

        def t_ce_f():
            with torch.no_grad():
                F.cross_entropy(tL, ttg)

        def t_ce_fb():
            tL.grad = None
            F.cross_entropy(tL, ttg).backward()

        res["layer_norm"] += [t_ln_f, t_ln_fb]
        res["layer_norm_3072"] += [t_ln4_f, t_ln4_fb]
        res["add_layer_norm"] += [t_aln_f, t_aln_fb]
        res["softmax"] += [t_sm_f, t_sm_fb]

        def t_cep_f():
            with torch.no_grad():
                F.cross_entropy(tLp[:, :V], ttg, ignore_index=-1)

        def t_cep_fb():
            tLp.grad = None
            F.cross_entropy(tLp[:, :V], ttg, ignore_index=-1).backward()

        res["cross_entropy"] += [t_ce_f, t_ce_fb]
        res["ce_padded"] += [t_cep_f, t_cep_fb]
        res["ce_padded_plain"] += [t_cep_f, t_cep_fb]
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", dest="out", default=None)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--ops", default="", help="comma-separated row names (default: all)")
    ap.add_argument(
        "--versions",
        default="2,3,4",
        help="kernel versions (BT_CUDA_NN_VERSION) also timed (graph) for the layer-norm rows",
    )
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timings")
    ap.add_argument("--target", type=float, default=80.0, help="%%copy target")
    args = ap.parse_args()
    versions = [v for v in args.versions.split(",") if v]
    ops = {o for o in args.ops.split(",") if o}
    if bt.cuda_device_count() == 0:
        raise SystemExit("no CUDA device")
    rows = []
    hdr = f"{'op':16} {'dtype':5} {'pass':7} {'floor ms':>8} {'ours ms':>8} {'GB/s':>6} "
    hdr += f"{'%floor':>6} {'%copy':>6} {'graph ms':>8} {'%copy':>6} {'copy GB/s':>9} "
    hdr += f"{'torch ms':>8} {'ours/torch':>10}"
    print(hdr)
    pct = lambda a, b: 100 * a / b  # noqa: E731

    for dt in args.dtypes.split(","):
        for name, v in cases(dt).items():
            if ops and name not in ops:
                continue
            for k, pas in enumerate(["fwd", "fwd+bwd"]):
                nbytes = v[k]
                reps = 20 if name.startswith("ce") or name in ("cross_entropy", "softmax") else 50
                ours = time_events(v[2 + k], reps)  # the default version
                is_ce = name.startswith("ce") or name == "cross_entropy"
                no_graph = args.no_graph or is_ce  # ce: eager only (keeps the bench short)
                graph = float("nan") if no_graph else time_graph(v[2 + k], reps)
                per_ver = {}
                if "layer_norm" in name:
                    saved = os.environ.get("BT_CUDA_NN_VERSION")
                    for ver in versions:
                        os.environ["BT_CUDA_NN_VERSION"] = ver
                        t = float("nan") if no_graph else time_graph(v[2 + k], reps)
                        per_ver[ver] = t if t == t else time_events(v[2 + k], reps)
                    if saved is None:
                        os.environ.pop("BT_CUDA_NN_VERSION", None)
                    else:
                        os.environ["BT_CUDA_NN_VERSION"] = saved
                theirs = (
                    time_events(v[4 + k], reps, torch_events=True) if len(v) > 4 else float("nan")
                )
                cp = _copy_ms(nbytes, reps)
                floor = nbytes / BW * 1e3
                best = graph if graph == graph else ours
                row = {
                    "op": name,
                    "dtype": dt,
                    "pass": pas,
                    "bytes": nbytes,
                    "floor_ms": floor,
                    "ours_ms": ours,
                    "ours_gbps": nbytes / ours / 1e6,
                    "pct_floor": pct(floor, ours),
                    "pct_copy": pct(cp, ours),
                    "graph_ms": graph,
                    "graph_gbps": nbytes / graph / 1e6,
                    "pct_floor_graph": pct(floor, graph),
                    "pct_copy_graph": pct(cp, graph),
                    "copy_ms": cp,
                    "copy_gbps": nbytes / cp / 1e6,
                    "torch_ms": theirs,
                    "torch_gbps": nbytes / theirs / 1e6,
                    "meets_target": bool(pct(cp, best) >= args.target),
                }
                for ver, ms in per_ver.items():
                    row[f"v{ver}_ms"] = ms
                    row[f"v{ver}_pct_copy"] = pct(cp, ms)
                rows.append(row)
                vers = "".join(
                    f"  v{ver} {ms:.4f} {pct(floor, ms):5.1f}%f {pct(cp, ms):5.1f}%c"
                    for ver, ms in per_ver.items()
                )
                print(
                    f"{name:16} {dt:5} {pas:7} {floor:8.4f} {ours:8.4f} {row['ours_gbps']:6.0f} "
                    f"{row['pct_floor']:5.1f}% {row['pct_copy']:5.1f}% {graph:8.4f} "
                    f"{row['pct_copy_graph']:5.1f}% {row['copy_gbps']:9.0f} {theirs:8.4f} "
                    f"{theirs / ours:10.2f}{vers}",
                    flush=True,
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"bench": "cuda_nn", "copy_floor_Bps": BW, "target_pct_copy": args.target,
                 "rows": rows},
                f,
                indent=1,
            )  # fmt: skip


if __name__ == "__main__":
    main()
