"""Issue 35's multi-GPU runs in one call: blutrain.dist on every GPU of one machine next to
PyTorch's DistributedDataParallel, with the one-GPU figure of each from the same run.

    python packages/blutrain-dist/bench/multi_gpu.py --out $OUT            # every GPU here
    python packages/blutrain-dist/bench/multi_gpu.py --cpu --ranks 4 --out /tmp/mg  # the same
        parts on the CPU (MPICH), with a tiny GPT-2: what can be checked without GPUs

Parts (run in the order check, headline, collectives, parity, fault, gpt2: the pass/fail ones
first, the headline as soon as the collectives are known to be right, the throughput with what
is left); each is skipped, with a message, when the budget (--budget-s, default 540 s) does not
leave it the time it needs, and gpt2 stops starting configs at its share of the budget:

  check        blutrain.dist's collectives against numpy on every rank (NCCL: the fused average
               of power-of-two world sizes included), DDP / ZeRO-1 / ZeRO-2 gradients and losses
               against one rank (tests/dist_worker.py)
  headline     the seed's headline: GPT-2 124M in fp32 on N GPUs, B16 x T1024 per GPU, 50 steps
               (--headline-steps), lr 6e-4, warmup 10, cosine to 6e-5, AdamW (0.9, 0.95),
               wd 0.1 on matrices, clip 1.0: `blutrain train --dist ddp --precision fp32`
               against PyTorch DDP (headline.py: bench/torch_gpt2.py, fused AdamW) from the
               same initial weights (one Hugging Face directory both load), reading the same
               rows of the same shards (--data; default the shipped Tiny Shakespeare) through
               our DataLoader with the trainer's rank slicing; tokens/s, per-GPU peak memory
               (our allocator's statistics; torch.cuda.max_memory_allocated) and the loss over
               the whole val split after the last step. Fails when a side fails (the rank that
               died named, or the timeout), when the first step's losses or the initial
               weights' val losses differ by more than 1e-5, or the final val losses by more
               than 1% (relative)
  collectives  all_reduce, reduce_scatter, all_gather bus bandwidth, 1 KiB .. 1 GiB, ours next
               to torch.distributed's NCCL on the same GPUs (bench_dist.py)
  gpt2         GPT-2 124M, B16 x T1024 per GPU, AdamW, clip 1.0, random tokens: tokens/s and
               per-GPU peak memory of ours (DDP, ZeRO-1, ZeRO-2) and PyTorch DDP (eager;
               torch.compile in bf16) in bf16, fp32 and tf32 on N GPUs, then every config on one
               GPU (the N one-GPU jobs run side by side, one per GPU), and
               scaling = N-GPU tok/s / (N x one-GPU tok/s)
  parity       `blutrain train --dist` for 200 steps on N GPUs against 1 GPU with the same global
               batch (--grad-accum N) on the shipped Tiny Shakespeare: DDP in bf16 (the curves
               must overlap) and ZeRO-2 in deterministic mode (losses, gradient norms and final
               weights bitwise equal)
  fault        a deterministic ZeRO-2 run on N GPUs checkpointing every 10 steps; rank 1 is
               killed after the first checkpoint: the job must end within the timeout with a
               message naming rank 1 and no process left; the run then resumes on 1 GPU
               (--grad-accum N) and must match an uninterrupted 1-GPU run bit for bit

NVLink multicast is kept off for every job (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1,
NVSHMEM_DISABLE_NVLS=1).  Writes OUT/multi_gpu.json (every figure) and OUT/summary.txt (the
table, also printed); each job's log is OUT/<part>-*.log.
Exit status 1 when a check fails (a collective, the headline's agreement, parity, the fault
run), 0 otherwise: slowness never fails.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
WORKER = HERE.parent / "tests" / "dist_worker.py"
BENCH = HERE / "bench_dist.py"
START = time.time()


# ---- launching -------------------------------------------------------------------------------
class Launcher:
    """mpirun (Open MPI, the GPU machine) or the mpich wheel's mpiexec (CPU machines)."""

    FORWARD = (
        "PYTHONPATH",
        "NCCL_NVLS_ENABLE",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST",
        "NVSHMEM_DISABLE_NVLS",
        "OMP_NUM_THREADS",
        "LD_LIBRARY_PATH",
        "PYTHONUNBUFFERED",
        "BLUTRAIN_DIST_TIMEOUT",
        "BLUTRAIN_TEST_DEVICE",
        "BLUTRAIN_TEST_MICRO",
        "BLUTRAIN_TEST_TIMEOUT",
        "CUDA_VISIBLE_DEVICES",
    )

    def __init__(self) -> None:
        local = Path(sys.executable).parent / "mpiexec"
        exe = shutil.which("mpirun") or (str(local) if local.exists() else shutil.which("mpiexec"))
        if not exe:
            raise SystemExit("[multi_gpu] no mpirun / mpiexec found")
        version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
        self.openmpi = "Open MPI" in version or "OpenRTE" in version
        if not self.openmpi and local.exists():
            exe = str(local)
        self.exe = exe

    def cmd(
        self, n: int, args: list[str], env: dict[str, str], let_survivors_run: bool = False
    ) -> list[str]:
        """The launch of `args` on n ranks.  Open MPI: the variables of FORWARD that are set
        (mpirun's environment reaches local ranks anyway; -x makes it explicit), no binding
        (a rank's Python, OpenMP and NCCL threads need more than one core).  MPICH:
        -disable-auto-cleanup when the survivors of a dead rank must report it themselves."""
        if self.openmpi:
            fwd = [x for v in self.FORWARD if v in env for x in ("-x", v)]
            return [self.exe, "-n", str(n), "--oversubscribe", "--bind-to", "none", *fwd, *args]
        if not let_survivors_run:
            return [self.exe, "-n", str(n), *args]
        # each rank as `sh -c '...; exit $?'`: a rank killed by a signal then reaches hydra as
        # an exit status; told of a signal, it sometimes kills every rank at once, before the
        # survivors can report (tests/test_dist_trainer.py has the measurements)
        wrap = ["sh", "-c", '"$0" "$@"; exit $?']
        return [self.exe, "-disable-auto-cleanup", "-n", str(n), *wrap, *args]


def base_env(a: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        NCCL_NVLS_ENABLE="0",  # NVLink multicast stays off (NCCL, torch, NVSHMEM): the machines'
        TORCH_SYMM_MEM_DISABLE_MULTICAST="1",  # rule, it can take shared GPUs out of service
        NVSHMEM_DISABLE_NVLS="1",
        PYTHONUNBUFFERED="1",
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1" if a.cpu else "4"),
    )
    models = str(ROOT / "packages" / "blutrain-models" / "python")
    env["PYTHONPATH"] = models + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if not a.cpu:
        env.setdefault("BLUTRAIN_DIST_TIMEOUT", "120")
    return env


def left() -> float:
    return DEADLINE - time.time()


def run(cmd: list[str], log: Path, env: dict[str, str], timeout: float) -> tuple[int, float]:
    """Run to completion (or kill at timeout, rc 124); stdout and stderr into log."""
    t0 = time.time()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        try:
            rc = p.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            rc = 124
            f.write(f"\n[multi_gpu] killed after {timeout:.0f} s\n")
    return rc, time.time() - t0


def tail(log: Path, n: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def blutrain_cmd() -> list[str]:
    script = Path(sys.executable).parent / "blutrain"
    return [str(script)] if script.exists() else [sys.executable, "-m", "blutrain.models"]


# ---- the parts -------------------------------------------------------------------------------
def part_check(a: argparse.Namespace, L: Launcher, out: Path, R: dict[str, Any]) -> None:
    env = base_env(a)
    env["BLUTRAIN_TEST_TIMEOUT"] = "120"
    env["BLUTRAIN_TEST_MICRO"] = str(a.n * max(1, 4 // a.n))  # a multiple of N, 4 at least
    if not a.cpu:
        env["BLUTRAIN_TEST_DEVICE"] = "cuda"
    cases = [
        "collectives_vs_numpy",
        "uneven_chunks_and_async",
        "training_matches_one_rank",
        "deterministic_bitwise",
    ]
    figures: dict[int, Any] = {}
    ok = True
    for n in (a.n, 1):
        d = out / f"check-{n}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        names = cases if n > 1 else ["deterministic_bitwise"]
        cmd = L.cmd(n, [sys.executable, str(WORKER), str(d), *names], env)
        rc, dt = run(cmd, out / f"check-{n}.log", env, min(240, left()))
        ranks = [json.loads(p.read_text()) for p in sorted(d.glob("rank*.json"))]
        bad = [(i, k) for i, r in enumerate(ranks) for k, v in r["results"].items() if v != "ok"]
        if rc != 0 or len(ranks) != n or bad:
            ok = False
            print(
                f"check at {n} rank(s): rc {rc}, {len(ranks)} result files, failed {bad}\n"
                + tail(out / f"check-{n}.log")
            )
        figures[n] = ranks[0]["figures"] if ranks else {}
    same = {
        m: figures[1].get(f"deterministic {m} digest")
        == figures[a.n].get(f"deterministic {m} digest")
        for m in ("ddp", "zero1", "zero2")
    }
    ok = ok and all(same.values())
    R["check"] = {"ok": ok, "deterministic_equal_1_vs_n": same, "figures": figures[a.n]}


def part_collectives(a: argparse.Namespace, L: Launcher, out: Path, R: dict[str, Any]) -> None:
    js = out / "collectives.json"
    max_bytes = (16 << 20) if a.cpu else (1 << 30)
    env = base_env(a)
    args = [sys.executable, str(BENCH), "--json", str(js), "--max-bytes", str(max_bytes)]
    rc, dt = run(L.cmd(a.n, args, env), out / "collectives.log", env, min(150, left()))
    rows = json.loads(js.read_text())["collectives"] if js.exists() else []
    R["collectives"] = {"rc": rc, "seconds": dt, "rows": rows}


def _gpt2_args(a: argparse.Namespace) -> list[str]:
    if a.cpu:
        return ["--model", "tiny", "-B", "2", "-T", "64", "--seconds", "0.5", "--min-steps", "2"]
    return ["--model", "gpt2", "-B", "16", "-T", "1024", "--seconds", "2.0"]


def gpt2_configs(a: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(N-GPU configs, extra one-GPU references), most important first (the budget may stop)."""
    precisions = ["fp32"] if a.cpu else ["bf16", "fp32", "tf32"]
    many, refs = [], []
    for p in precisions:
        many += [f"{p}:{m}" for m in ("ddp", "zero1", "zero2", "torch_ddp")]
        if p == "bf16" and not a.cpu:
            many.append(f"{p}:torch_ddp_compile")
        refs += [f"{p}:plain", f"{p}:torch"] + ([f"{p}:torch_compile"] if p == "bf16" else [])
    if a.cpu:
        refs = [r for r in refs if not r.endswith("compile")]
    return many, refs


def part_gpt2(a: argparse.Namespace, L: Launcher, out: Path, R: dict[str, Any]) -> None:
    many, refs = gpt2_configs(a)
    res: dict[str, Any] = {"n": a.n, "settings": _gpt2_args(a)}
    # the one-GPU phase needs about a third of what is left: the N-GPU job stops starting
    # configs at its deadline
    deadline_many = time.time() + 0.55 * (left() - 60)
    js = out / "gpt2-n.json"
    env = base_env(a)
    args = [sys.executable, str(BENCH), "--gpt2", *_gpt2_args(a), "--configs", ",".join(many),
            "--deadline", f"{deadline_many:.0f}", "--json", str(js)]  # fmt: skip
    rc, dt = run(L.cmd(a.n, args, env), out / "gpt2-n.log", env,
                 max(30, deadline_many - time.time() + 150))  # fmt: skip
    res["many"] = json.loads(js.read_text())["gpt2"] if js.exists() else {}
    res["many_rc"] = rc
    # one GPU: every config (the N-GPU ones at world size 1, and the single-process references)
    # as N jobs side by side, one per GPU (one by one on the CPU)
    singles = [c for c in many if not res["many"].get(c, {}).get("skipped")] + refs
    lanes = 1 if a.cpu else max(1, min(a.n, a.gpus))
    jobs = [singles[i::lanes] for i in range(lanes)]
    deadline_one = time.time() + max(30.0, left() * 0.5 - 30)
    procs = []
    for i, configs in enumerate(jobs):
        if not configs:
            continue
        env = base_env(a)
        if not a.cpu:
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        jf = out / f"gpt2-1-gpu{i}.json"
        cmd = [
            sys.executable,
            str(BENCH),
            "--gpt2",
            *_gpt2_args(a),
            "--configs",
            ",".join(configs),
            "--deadline",
            f"{deadline_one:.0f}",
            "--json",
            str(jf),
        ]
        log = open(out / f"gpt2-1-gpu{i}.log", "w")
        procs.append(
            (
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT),
                jf,
                log,
            )
        )
    one: dict[str, Any] = {}
    for p, jf, log in procs:
        try:
            p.wait(timeout=max(10.0, deadline_one - time.time() + 200))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        log.close()
        if jf.exists():
            one.update(json.loads(jf.read_text())["gpt2"])
    res["one"] = one
    R["gpt2"] = res


def metrics(run_dir: Path, key: str = "loss") -> dict[int, float]:
    out = {}
    p = run_dir / "metrics.jsonl"
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        r = json.loads(line)
        if key in r and "event" not in r and "step" in r:
            out[int(r["step"])] = float(r[key])
    return out


def moving_average(d: dict[int, float], steps: list[int], w: int = 10) -> list[float]:
    """The loss curve as w-step averages (the noise of single steps smoothed out)."""
    return [sum(d[s] for s in steps[i : i + w]) / w for i in range(len(steps) - w + 1)]


def weights_differ(a: Path, b: Path) -> list[str] | None:
    """Tensor names whose final weights differ (None: a checkpoint is missing)."""
    import numpy as np

    from blutrain.models import load_checkpoint

    try:
        wa, wb = (
            load_checkpoint(a / "checkpoint").weights,
            load_checkpoint(b / "checkpoint").weights,
        )
    except Exception:
        return None
    return [k for k in wa if k not in wb or not np.array_equal(wa[k], wb[k])]


def train_flags(a: argparse.Namespace, steps: int) -> list[str]:
    """`blutrain train` flags of the parity and fault runs (the global batch: --grad-accum)."""
    warmup = str(min(20, steps // 2))
    common = ["--data", str(a.data), "--max-steps", str(steps), "--warmup-steps", warmup,
              "--sample-interval", "0", "--no-progress", "--no-plot", "--eval-batches", "2",
              "--eval-interval", "100"]  # fmt: skip
    if a.cpu:
        return [*common, "--model", str(a.small), "--batch-size", "2", "--seq-len", "16",
                "--lr", "3e-3", "--device", "cpu", "--log-interval", "0"]  # fmt: skip
    return [*common, "--model", a.train_model, "--batch-size", str(a.parity_batch),
            "--seq-len", str(a.parity_seq), "--lr", "6e-4", "--precision", a.train_precision,
            "--log-interval", "20"]  # fmt: skip


def train_run(
    a,
    L,
    out: Path,
    name: str,
    n: int,
    flags: list[str],
    timeout: float,
    background: bool = False,
    gpu: int | None = None,
    env_extra: dict[str, str] | None = None,
    log_name: str | None = None,
) -> Any:
    """`blutrain train` on n ranks (n = 1: no launcher; on a GPU machine, on GPU `gpu`).
    Returns (rc, seconds), or the Popen of a background run."""
    env = {**base_env(a), **(env_extra or {})}
    if n == 1 and gpu is not None and not a.cpu:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    args = [*blutrain_cmd(), "train", "--out-dir", str(out / name), *flags]
    cmd = L.cmd(n, args, env, let_survivors_run=background) if n > 1 else args
    if "--resume" not in flags:
        shutil.rmtree(out / name, ignore_errors=True)
    log_path = out / f"{log_name or name}.log"
    if background:
        log = open(log_path, "ab")
        return subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
    return run(cmd, log_path, env, timeout)


PLANS = {  # label -> (dist mode, extra flags, the one-rank reference it is compared with)
    "bf16-ddp": ("ddp", [], "ddp"),
    "fp32-ddp": ("ddp", [], "ddp"),
    "det-ddp": ("ddp", ["--deterministic"], "det"),
    "det-zero1": ("zero1", ["--deterministic"], "det"),
    "det-zero2": ("zero2", ["--deterministic"], "det"),
}
# the references: the one-rank run with the same global batch (--grad-accum N); in
# deterministic mode DDP, ZeRO-1 and ZeRO-2 give the same bits, so one serves them all
REFERENCES = {"ddp": ("ddp", []), "det": ("ddp", ["--deterministic"])}


def part_parity(a: argparse.Namespace, L: Launcher, out: Path, R: dict[str, Any]) -> None:
    steps = a.parity_steps
    res: dict[str, Any] = {"steps": steps}
    plans = a.parity_plans.split(",")
    for label in plans:
        if label not in PLANS:
            raise SystemExit(f"[multi_gpu] unknown parity plan {label!r} (of {', '.join(PLANS)})")
    refs = sorted({PLANS[label][2] for label in plans})
    # the one-rank references side by side (one per GPU), then the N-rank runs one by one
    procs = []
    for i, ref in enumerate(refs):
        mode, extra = REFERENCES[ref]
        flags = [*train_flags(a, steps), "--dist", mode, "--grad-accum", str(a.n), *extra]
        if a.cpu:
            rc, dt = train_run(a, L, out, f"parity-ref-{ref}", 1, flags, left())
            res[f"reference {ref}"] = {"rc": rc, "seconds": round(dt, 1)}
        else:
            p = train_run(a, L, out, f"parity-ref-{ref}", 1, flags, left(), background=True,
                          gpu=i % a.gpus)  # fmt: skip
            procs.append((ref, p))
    for ref, p in procs:
        try:
            rc = p.wait(timeout=max(10.0, left() - 60))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            rc = 124
        res[f"reference {ref}"] = {"rc": rc}
    for label in plans:
        mode, extra, ref = PLANS[label]
        flags = [*train_flags(a, steps), "--dist", mode, *extra]
        run_dir, ref_dir = out / f"parity-{label}", out / f"parity-ref-{ref}"
        rc, dt = train_run(a, L, out, run_dir.name, a.n, flags, max(30.0, left() - 30))
        one, many = metrics(ref_dir), metrics(run_dir)
        common = sorted(set(one) & set(many))
        if rc != 0 or not common:
            res[label] = {"ok": False, "error": f"rc {rc}, {len(common)} steps to compare",
                          "log": tail(out / f"{run_dir.name}.log")}  # fmt: skip
            continue
        rel = [abs(many[s] - one[s]) / abs(one[s]) for s in common]
        ma1, man = moving_average(one, common), moving_average(many, common)
        curve = max((abs(x - y) / abs(y) for x, y in zip(man, ma1, strict=True)), default=0.0)
        entry: dict[str, Any] = {
            "seconds": round(dt, 1),
            "steps_compared": len(common),
            "max_rel_loss_diff": max(rel),
            "max_rel_diff_10_step_average": curve,
            "final_loss_1": one[common[-1]],
            f"final_loss_{a.n}": many[common[-1]],
        }
        if ref == "det":
            g1, gn = metrics(ref_dir, "grad_norm"), metrics(run_dir, "grad_norm")
            diff = weights_differ(ref_dir, run_dir)
            entry["bitwise_losses"] = (
                all(one[s] == many[s] for s in common) and len(common) == steps
            )
            entry["bitwise_grad_norms"] = all(g1.get(s) == gn.get(s) for s in common)
            entry["weights_differ"] = diff
            entry["ok"] = entry["bitwise_losses"] and entry["bitwise_grad_norms"] and diff == []
        else:  # the curves overlap: 10-step averages within 1%
            entry["ok"] = len(common) == steps and curve < 0.01
        res[label] = entry
    R["parity"] = res


def _rank_pids(root: int) -> dict[int, int]:
    """{MPI rank: pid} of the launcher's descendants (MPICH: PMI_RANK; Open MPI:
    OMPI_COMM_WORLD_RANK; PMIx: PMIX_RANK)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for kv in env:
            for key in (b"PMI_RANK=", b"OMPI_COMM_WORLD_RANK=", b"PMIX_RANK="):
                if kv.startswith(key):
                    found[int(kv[len(key) :])] = pid
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def part_fault(a: argparse.Namespace, L: Launcher, out: Path, R: dict[str, Any]) -> None:
    steps, every, timeout = a.fault_steps, a.fault_every, 30
    res: dict[str, Any] = {"steps": steps, "ckpt_interval": every, "timeout_s": timeout}
    base = [*train_flags(a, steps), "--dist", "zero2", "--deterministic"]
    ref = train_run(
        a,
        L,
        out,
        "fault-ref-1",
        1,
        [*base, "--grad-accum", str(a.n)],
        max(30.0, left() - 60),
        background=True,
        gpu=(a.gpus - 1) if a.gpus else None,
    )
    p = train_run(
        a,
        L,
        out,
        "fault-n",
        a.n,
        [*base, "--ckpt-interval", str(every)],
        0,
        background=True,
        env_extra={"BLUTRAIN_DIST_TIMEOUT": str(timeout)},
    )
    trainer_json = out / "fault-n" / "checkpoint" / "trainer.json"
    deadline = time.time() + max(30.0, left() - 60)
    while not trainer_json.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    if p.poll() is not None or not trainer_json.exists():
        res["error"] = f"no checkpoint before the run ended (rc {p.poll()})"
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        R["fault"] = res
        ref.wait()
        return
    pids = _rank_pids(p.pid)
    victim = 1 if a.n > 1 else 0
    os.kill(pids[victim], signal.SIGKILL)
    t_kill = time.time()
    try:
        rc = p.wait(timeout=timeout + 90)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        rc = "hung"
    res["exit_seconds_after_kill"] = round(time.time() - t_kill, 1)
    res["rc"] = rc
    time.sleep(1.0)
    res["left_behind"] = [q for q in pids.values() if _alive(q)]
    text = (out / "fault-n.log").read_text(errors="replace")
    silent = re.findall(r"rank\(s\) ([\d, ]+) did not answer", text)
    ours = any(str(victim) in m.split(", ") for m in silent)
    launcher = any(
        f"rank {victim} " in line and ("signal" in line or "exit" in line.lower())
        for line in text.splitlines()
    )
    res["named_by"] = "blutrain.dist" if ours else ("the launcher" if launcher else None)
    res["saved_step"] = json.loads(trainer_json.read_text())["step"]
    rc_ref = ref.wait()
    flags = [*base, "--grad-accum", str(a.n), "--resume"]
    rc2, dt2 = train_run(
        a, L, out, "fault-n", 1, flags, max(30.0, left()), gpu=0, log_name="fault-resume"
    )
    got, want = metrics(out / "fault-n"), metrics(out / "fault-ref-1")
    after = range(res["saved_step"] + 1, steps + 1)
    res["resume_rc"], res["reference_rc"] = rc2, rc_ref
    res["resumed_bitwise"] = bool(want) and all(got.get(s) == want.get(s) for s in after)
    res["weights_differ"] = weights_differ(out / "fault-n", out / "fault-ref-1")
    res["ok"] = (
        rc not in (0, "hung")
        and res["exit_seconds_after_kill"] < timeout + 30
        and res["named_by"] is not None
        and not res["left_behind"]
        and rc2 == 0
        and res["resumed_bitwise"]
        and res["weights_differ"] == []
    )
    R["fault"] = res


def run_watched(
    cmd: list[str], log: Path, env: dict[str, str], timeout: float
) -> tuple[int, float, dict[str, Any]]:
    """run() for a launcher's job, watching its ranks: {rank: pid} as they start and the ranks
    in the order they ended, so that a failure names the rank that went first (MPICH's launcher
    names only a PID)."""
    t0 = time.time()
    pids: dict[int, int] = {}
    first: list[int] = []  # the rank(s) found ended at the first poll that found any
    others_ran = False  # ... while other ranks still ran
    # A pidfd (Linux 5.3+) turns readable the moment its process ends: the watcher wakes before
    # the launcher's cleanup kills the other ranks, where a 0.25 s poll often found them all
    # dead (and MPICH's report names whichever PID it reaped first). Without pidfds: the poll.
    fds: dict[int, int] = {}  # fd -> rank
    waiter = select.poll() if hasattr(os, "pidfd_open") else None
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        while (rc := p.poll()) is None:
            if time.time() - t0 > timeout:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                rc = 124
                f.write(f"\n[multi_gpu] killed after {timeout:.0f} s\n")
                break
            for r, pid in _rank_pids(p.pid).items():
                if r not in pids and waiter is not None:
                    try:
                        fd = os.pidfd_open(pid)
                    except OSError:  # already gone: the poll below sees it
                        fd = -1
                    if fd >= 0:
                        fds[fd] = r
                        waiter.register(fd, select.POLLIN)
                pids.setdefault(r, pid)
            if not first:
                first = [r for r, pid in sorted(pids.items()) if not _alive(pid)]
                others_ran = bool(first) and len(first) < len(pids)
            if waiter is None or first:
                time.sleep(0.25)
                continue
            ended = sorted(fds[fd] for fd, _ in waiter.poll(250))  # ms
            if ended:
                first, others_ran = ended, len(ended) < len(pids)
    for fd in fds:
        os.close(fd)
    return rc, time.time() - t0, {"pids": pids, "ended_first": first, "others_ran": others_ran}


def _job_failure(rc: Any, log: Path, timeout: float, watch: dict[str, Any] | None = None) -> str:
    """Why a job failed: the timeout, the rank that ended first while the others ran, and the
    lines of the log that name ranks (blutrain.dist's "rank(s) N did not answer", Open MPI's
    "process rank N ... exited on signal", headline.py's "rank N: error", MPICH's "PID N")."""
    what = [f"killed at its timeout of {timeout:.0f} s" if rc == 124 else f"rc {rc}"]
    text = log.read_text(errors="replace") if log.exists() else ""
    by_pid = {pid: r for r, pid in (watch or {}).get("pids", {}).items()}
    if watch and watch["others_ran"]:
        ranks = ", ".join(map(str, watch["ended_first"]))
        what.append(f"rank(s) {ranks} ended first, the others still running")
    for m in re.finditer(r"\bPID (\d+) RUNNING AT", text):
        if int(m.group(1)) in by_pid:
            what.append(f"the launcher reports rank {by_pid[int(m.group(1))]} (PID {m.group(1)})")
    named = [
        line.strip()
        for line in text.splitlines()
        if re.search(r"(?i)\brank", line)
        and re.search(r"(?i)did not answer|signal|exit code|exited|killed|terminat|error", line)
    ]
    return "; ".join(what + named[:3]) + f" (log {log.name})"


def part_headline(a: argparse.Namespace, L: Launcher, out: Path, R: dict[str, Any]) -> None:
    """The seed's headline: N ranks, fp32, `blutrain train --dist ddp` against PyTorch DDP from
    the same initial weights on the same rows of the same corpus for the same steps; tokens/s,
    per-GPU peak memory, the whole val split's loss after the last step (headline.py)."""
    d = out / "headline"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    steps = a.headline_steps or (20 if a.cpu else 50)
    warmup = max(1, steps // 5)
    B, T = (2, 32) if a.cpu else (16, 1024)
    lr = "3e-3" if a.cpu else "6e-4"  # the tiny CPU model barely moves at 6e-4 in 20 steps
    model = str(a.small) if a.cpu else a.headline_model
    dev = "cpu" if a.cpu else "cuda"
    res: dict[str, Any] = {"ranks": a.n, "steps": steps, "warmup_steps": warmup, "B": B,
                           "T": T, "lr": float(lr), "model": model,
                           "precision": "fp32"}  # fmt: skip
    # The trainer gets the train shards only: it then builds no validation loader (the shipped
    # val split holds 33 rows of 1024 tokens, fewer than one global batch of 8 x 16); the whole
    # val split is scored afterwards, the same way for both sides.
    train, val = d / "train", sorted(str(f) for f in a.data.glob("*_val_*.bin"))
    if not val:
        raise FileNotFoundError(f"[multi_gpu] headline: no *_val_*.bin shard in {a.data}")
    train.mkdir()
    for f in a.data.glob("*_train_*.bin"):
        (train / f.name).symlink_to(f.resolve())
    env = base_env(a)
    py, hl = sys.executable, str(HERE / "headline.py")
    logs = {x: out / f"headline-{x}.log" for x in ("init", "ours", "torch", "eval")}
    init = d / "init"
    rc, dt = run([py, hl, "init", "--model", model, "--out", str(init)], logs["init"], env,
                 min(120, left()))  # fmt: skip
    if rc != 0:
        res["error"] = "initial weights: " + _job_failure(rc, logs["init"], min(120, left()))
        res["ok"] = False
        R["headline"] = res
        return
    # ours, then PyTorch, alone on the GPUs one after the other; each may take what is left
    # but the others' least (torch ~40 s, eval ~20 s on 8 H200s)
    common = ["--data", str(train), "--batch-size", str(B), "--seq-len", str(T), "--lr", lr,
              "--warmup-steps", str(warmup), "--seed", "1337", "--weight-decay", "0.1",
              "--grad-clip", "1.0"]  # fmt: skip
    flags = [*common, "--init-from", str(init), "--dist", "ddp", "--precision", "fp32",
             "--max-steps", str(steps), "--device", dev, "--eval-interval", "0",
             "--sample-interval", "0", "--log-interval", "10", "--no-progress", "--no-plot",
             "--out-dir", str(d / "ours")]  # fmt: skip
    t_ours = max(20.0, min(300.0, left() - (20 if a.cpu else 60)))
    cmd = L.cmd(a.n, [*blutrain_cmd(), "train", *flags], env)
    rc, dt, watch = run_watched(cmd, logs["ours"], env, t_ours)
    ours: dict[str, Any] = {"rc": rc, "seconds": round(dt, 1)}
    recs = [r for r in _jsonl(d / "ours" / "metrics.jsonl") if "loss" in r and "event" not in r]
    if rc != 0 or len(recs) != steps:
        ours["error"] = _job_failure(rc, logs["ours"], t_ours, watch) + f"; {len(recs)} steps"
    if recs:
        later = [r for r in recs if r["step"] > 1]
        tok_step = B * T * a.n
        ours.update(
            losses=[r["loss"] for r in recs],
            grad_norms=[r["grad_norm"] for r in recs],
            tokens_per_s=tok_step * len(later) / (sum(r["dt_ms"] for r in later) / 1e3)
            if later
            else None,
            first_step_s=recs[0]["dt_ms"] / 1e3,
            peak_bytes=max(r["peak_mem_bytes"] for r in recs),  # rank 0's, the allocator's
            peak_from="blutrain.alloc statistics (rank 0)" if not a.cpu else "peak RSS (rank 0)",
        )
    res["ours"] = ours
    t_torch = max(20.0, min(300.0, left() - (10 if a.cpu else 25)))
    # (both sides' min-lr: lr / 10, the trainer's default)
    targs = [py, hl, "torch", *common, "--init", str(init), "--steps", str(steps),
             "--device", dev, "--out", str(d / "torch"),
             "--timeout", env.get("BLUTRAIN_DIST_TIMEOUT", "60")]  # fmt: skip
    rc, dt, watch = run_watched(L.cmd(a.n, targs, env), logs["torch"], env, t_torch)
    theirs: dict[str, Any] = {"rc": rc, "seconds": round(dt, 1)}
    tj = d / "torch" / "result.json"
    if rc != 0 or not tj.exists():
        theirs["error"] = _job_failure(rc, logs["torch"], t_torch, watch)
    if tj.exists():
        theirs.update(json.loads(tj.read_text()))
    res["torch"] = theirs
    # the whole val split, every side's weights, one process on one device
    eenv = dict(env)
    if not a.cpu:
        eenv["CUDA_VISIBLE_DEVICES"] = "0"
    ej = d / "eval.json"
    eargs = [py, hl, "eval", "--init", str(init), "--val", *val, "--seq-len", str(T),
             "--device", dev, "--batch-size", "64" if a.cpu else "8",
             "--json", str(ej)]  # fmt: skip
    if recs:
        eargs += ["--ours", str(d / "ours")]
    if tj.exists():
        eargs += ["--torch", str(d / "torch" / "final")]
    t_eval = max(20.0, min(120.0, left()))
    rc, dt = run(eargs, logs["eval"], eenv, t_eval)
    if rc != 0 or not ej.exists():
        res["eval_error"] = _job_failure(rc, logs["eval"], t_eval)
    ev = json.loads(ej.read_text()) if ej.exists() else {}
    res["eval"] = ev
    for side, key in ((ours, "val_ours"), (theirs, "val_torch")):
        if key in ev:
            side["val_loss"] = ev[key]
    res.update(_headline_verdict(ours, theirs, ev))
    # every figure is in res, every log at the top of OUT: the ~2.5 GB of weights (GPT-2 124M)
    # and the run directories need not come back from a device call
    shutil.rmtree(train)
    if not a.keep_checkpoints:
        shutil.rmtree(d, ignore_errors=True)
    R["headline"] = res


def _jsonl(p: Path) -> list[dict[str, Any]]:
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


# the headline's agreement bars: fp32 on both sides, same init and data, so the first step's
# loss differs by float rounding only and the val losses by the trajectories' slow drift apart
HEADLINE_FIRST_LOSS_REL = 1e-5
HEADLINE_VAL_REL = 1e-2


def _headline_verdict(ours: dict, theirs: dict, ev: dict) -> dict[str, Any]:
    v: dict[str, Any] = {}
    lo, lt = ours.get("losses") or [], theirs.get("losses") or []
    if lo and lt:
        v["first_loss_rel_diff"] = abs(lo[0] - lt[0]) / abs(lt[0])
        n = min(len(lo), len(lt))
        v["max_train_loss_rel_diff"] = max(abs(x - y) / abs(y) for x, y in zip(lo[:n], lt[:n]))
    go, gt = ours.get("grad_norms") or [], theirs.get("grad_norms") or []
    if go and gt:
        v["first_grad_norm_rel_diff"] = abs(go[0] - gt[0]) / abs(gt[0])
    if "val_init_ours" in ev and "val_init_torch" in ev:
        v["val_init_rel_diff"] = abs(ev["val_init_ours"] - ev["val_init_torch"]) / abs(
            ev["val_init_torch"]
        )
    if "val_loss" in ours and "val_loss" in theirs:
        v["val_rel_diff"] = abs(ours["val_loss"] - theirs["val_loss"]) / abs(theirs["val_loss"])
    if ours.get("tokens_per_s") and theirs.get("tokens_per_s"):
        v["tokens_per_s_ratio"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
    if ours.get("peak_bytes") and theirs.get("peak_bytes"):
        v["peak_ratio"] = ours["peak_bytes"] / theirs["peak_bytes"]
    v["ok"] = (
        "error" not in ours
        and "error" not in theirs
        and v.get("first_loss_rel_diff", 1.0) <= HEADLINE_FIRST_LOSS_REL
        and v.get("val_init_rel_diff", 1.0) <= HEADLINE_FIRST_LOSS_REL
        and v.get("val_rel_diff", 1.0) <= HEADLINE_VAL_REL
    )
    return v


# ---- the summary -----------------------------------------------------------------------------
def headline_lines(h: dict[str, Any]) -> list[str]:
    """The headline's table: one row per side, then the agreement."""
    if "error" in h and "ours" not in h:
        return [f"headline: FAILED: {h['error']}"]

    def cell(x: Any, fmt: str) -> str:
        width = int(re.match(r"\d*", fmt).group() or 0)
        return format(x, fmt) if isinstance(x, (int, float)) else "n/a".rjust(width)

    lines = [
        f"headline: GPT-2 {h['model']} fp32, {h['ranks']} ranks x B{h['B']} x T{h['T']}, "
        f"{h['steps']} steps, lr {h['lr']:g} (warmup {h['warmup_steps']}, cosine), same init "
        f"and shards: {'ok' if h.get('ok') else 'FAILED'}",
        "  side                   tok/s (all ranks) | peak GiB per rank | val loss (whole split)",
    ]
    for name, key in (("ours (--dist ddp)", "ours"), ("PyTorch DDP", "torch")):
        side = h.get(key, {})
        peak = side.get("peak_bytes")
        lines.append(
            f"  {name:20s} {cell(side.get('tokens_per_s'), '17,.0f')} | "
            f"{cell(peak / 2**30 if peak else None, '17.2f')} | {cell(side.get('val_loss'), '.5f')}"
            + (f"  ERROR: {side['error']}" if "error" in side else "")
        )
    if "eval_error" in h:
        lines.append(f"  eval ERROR: {h['eval_error']}")
    ev = h.get("eval", {})
    lines.append(
        f"  ours / torch: tok/s x{cell(h.get('tokens_per_s_ratio'), '.3f')}, peak memory "
        f"x{cell(h.get('peak_ratio'), '.3f')}; val loss rel diff "
        f"{cell(h.get('val_rel_diff'), '.2e')} (bar {HEADLINE_VAL_REL:g}); first step's loss "
        f"{cell(h.get('first_loss_rel_diff'), '.2e')}, initial val loss "
        f"{cell(ev.get('val_init_ours'), '.5f')} / {cell(ev.get('val_init_torch'), '.5f')} "
        f"(bar {HEADLINE_FIRST_LOSS_REL:g}); {ev.get('val_tokens', 'n/a')} val tokens"
    )
    return lines


def summarize(a: argparse.Namespace, R: dict[str, Any]) -> tuple[str, bool]:
    lines = [f"blutrain.dist on {R['machine']}: {a.n} ranks, {time.time() - START:.0f} s"]
    ok = True
    for part, why in R.get("skipped", {}).items():
        lines.append(f"  {part}: SKIPPED ({why})")
    c = R.get("check")
    if c:
        ok &= c["ok"]
        lines.append(
            f"check: {'ok' if c['ok'] else 'FAILED'}; deterministic digests 1 vs "
            f"{a.n} ranks equal: {c['deterministic_equal_1_vs_n']}"
        )
    h = R.get("headline")
    if h:
        ok &= bool(h.get("ok"))
        lines += headline_lines(h)
    col = R.get("collectives")
    if col and col["rows"]:
        lines.append("collectives (busbw GB/s, ours / torch):")
        for op in ("all_reduce", "reduce_scatter", "all_gather"):
            rows = [r for r in col["rows"] if r["op"] == op]
            big = [r for r in rows if r["bytes"] >= 16 << 20]
            ratio = min(
                (
                    r["ours_busbw_GBs"] / r["torch_busbw_GBs"]
                    for r in big
                    if r["torch_busbw_GBs"] > 0
                ),
                default=float("nan"),
            )
            top = rows[-1] if rows else None
            if top:
                lines.append(
                    f"  {op:15s} at {top['bytes'] / 2**20:8.0f} MiB: ours "
                    f"{top['ours_busbw_GBs']:7.1f}, torch {top['torch_busbw_GBs']:7.1f};"
                    f" lowest ours/torch at >= 16 MiB: {ratio:.3f} (aim >= 0.95)"
                )
    elif col:
        lines.append(f"collectives: no figures (rc {col['rc']})")
    g = R.get("gpt2")
    if g:
        lines.append(
            f"GPT-2 ({' '.join(g['settings'])}): tok/s over all GPUs | per-GPU peak "
            "GiB | one GPU tok/s | scaling"
        )
        for key, r in g["many"].items():
            if ":" not in key or not isinstance(r, dict):
                continue
            if "tokens_per_s" not in r:
                lines.append(f"  {key:24s} {r.get('skipped') or r.get('error')}")
                continue
            one = g["one"].get(key, {})
            t1 = one.get("tokens_per_s")
            scale = r["tokens_per_s"] / (a.n * t1) if t1 else float("nan")
            lines.append(
                f"  {key:24s} {r['tokens_per_s']:12,.0f} | {r['peak_bytes'] / 2**30:6.2f}"
                f" | {t1 or float('nan'):10,.0f} | {scale:6.3f}"
            )
        for key, r in g["one"].items():
            if key not in g["many"] and isinstance(r, dict) and "tokens_per_s" in r:
                lines.append(
                    f"  {key:24s} one GPU {r['tokens_per_s']:12,.0f} tok/s | peak "
                    f"{r['peak_bytes'] / 2**30:6.2f} GiB"
                )
        for prec in ("bf16", "fp32", "tf32"):
            theirs = g["many"].get(f"{prec}:torch_ddp", {})
            for mode in ("ddp", "zero1", "zero2"):
                ours = g["many"].get(f"{prec}:{mode}", {})
                if "tokens_per_s" in ours and "tokens_per_s" in theirs:
                    lines.append(
                        f"  {prec}: ours {mode} / torch DDP: tok/s x"
                        f"{ours['tokens_per_s'] / theirs['tokens_per_s']:.3f}, per-GPU peak memory"
                        f" x{ours['peak_bytes'] / theirs['peak_bytes']:.3f}"
                    )
            one_ddp, one_plain = (
                g["one"].get(f"{prec}:{m}", {}).get("tokens_per_s") for m in ("ddp", "plain")
            )
            if one_ddp and one_plain:
                lines.append(
                    f"  {prec}: DDP at world size 1 costs "
                    f"{100 * (one_plain / one_ddp - 1):+.2f}% of the plain step (aim <= 2%)"
                )
    par = R.get("parity")
    if par:
        for label in PLANS:
            e = par.get(label)
            if e is None:
                continue
            ok &= bool(e.get("ok"))
            if "error" in e:
                lines.append(f"parity {label}: FAILED: {e['error']}")
                continue
            extra = ""
            if "bitwise_losses" in e:
                extra = (
                    f"; bitwise losses {e['bitwise_losses']}, grad norms "
                    f"{e['bitwise_grad_norms']}, weights differ {e['weights_differ']}"
                )
            lines.append(
                f"parity {label} ({e['steps_compared']} steps, {a.n} ranks vs 1): max rel "
                f"loss diff {e['max_rel_loss_diff']:.3g}, 10-step averages "
                f"{e['max_rel_diff_10_step_average']:.3g}{extra}: "
                f"{'ok' if e['ok'] else 'FAILED'}"
            )
    f = R.get("fault")
    if f:
        ok &= bool(f.get("ok"))
        lines.append(f"fault: {f}")
    return "\n".join(lines), ok


def main() -> int:
    global DEADLINE
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument(
        "--parts",
        default="check,headline,collectives,parity,fault,gpt2",
        help="in this order: the pass/fail parts first (the headline right after the collectives'"
        " correctness), throughput with what is left",
    )
    p.add_argument(
        "--data",
        default=None,
        help="token shards (*_train_*.bin, *_val_*.bin) of the headline, parity and fault runs"
        " (default: the shipped Tiny Shakespeare, prepared under --out)",
    )
    p.add_argument(
        "--headline-steps", type=int, default=0, help="of the headline (default 50; CPU: 20)"
    )
    p.add_argument(
        "--headline-model",
        default="gpt2",
        help="GPT2Config preset or JSON of the headline (GPU; CPU: the tiny model)",
    )
    p.add_argument("--cpu", action="store_true", help="CPU ranks and a tiny GPT-2 (no GPU)")
    p.add_argument("--ranks", type=int, default=0, help="default: every GPU (CPU: 4)")
    p.add_argument("--parity-steps", type=int, default=200)
    p.add_argument("--parity-batch", type=int, default=8, help="rows per GPU (T = --parity-seq)")
    p.add_argument("--parity-seq", type=int, default=1024)
    p.add_argument(
        "--parity-plans",
        default=None,
        help=f"of {', '.join(PLANS)} (default: bf16-ddp,det-zero2; CPU: fp32-ddp,det-zero2)",
    )
    p.add_argument(
        "--train-model",
        default="gpt2",
        help="GPT2Config preset or JSON of the parity and fault runs (GPU)",
    )
    p.add_argument("--train-precision", default="bf16", help="of the parity and fault runs (GPU)")
    p.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep the training runs' checkpoints (GPT-2 124M: ~2 GB each) under --out, and the"
        " headline's run directories (OUT/headline)",
    )
    p.add_argument("--fault-steps", type=int, default=40)
    p.add_argument(
        "--fault-every", type=int, default=10, help="checkpoint interval of the fault run"
    )
    a = p.parse_args()
    DEADLINE = START + a.budget_s
    if a.parity_plans is None:
        a.parity_plans = "fp32-ddp,det-zero2" if a.cpu else "bf16-ddp,det-zero2"
    a.gpus = 0
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    L = Launcher()
    if a.cpu:
        a.n, machine = a.ranks or 4, f"CPU ({os.cpu_count()} cores)"
    else:
        q = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        gpus = [x.strip() for x in q.stdout.splitlines() if x.strip()]
        if not gpus:
            raise SystemExit("[multi_gpu] no GPU found (nvidia-smi); use --cpu for the CPU parts")
        a.gpus = len(gpus)
        a.n, machine = a.ranks or len(gpus), f"{len(gpus)} x {gpus[0]}"
        if a.n > a.gpus:
            print(
                f"[multi_gpu] {a.n} ranks on {a.gpus} GPU(s): ranks share GPUs, so CUDA "
                "tensors go over MPI through pinned host memory (the test path, not NCCL)"
            )
        if a.n < 2:
            print(
                "[multi_gpu] one GPU: the N-GPU parts run at world size 1 (see gpu_dist.sh for "
                "the two-ranks-on-one-GPU path)"
            )
    # the shipped corpus for the training runs, prepared once (and a tiny model on the CPU)
    a.data = Path(a.data).resolve() if a.data else out / "data"
    if a.data != out / "data" and not list(a.data.glob("*_train_*.bin")):
        raise SystemExit(f"[multi_gpu] --data {a.data}: no *_train_*.bin shard there")
    if not (a.data / "data_train_000001.bin").exists() and not list(a.data.glob("*train*.bin")):
        subprocess.run(
            [*blutrain_cmd(), "prepare", "-o", str(a.data), "-q"],
            check=True,
            cwd=ROOT,
            env=base_env(a),
        )
    a.small = out / "small.json"
    if a.cpu:
        a.small.write_text(json.dumps({"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 16}))
    R: dict[str, Any] = {
        "machine": machine,
        "world_size": a.n,
        "budget_s": a.budget_s,
        "launcher": L.exe,
        "skipped": {},
    }
    # (the least time each part needs to be worth starting, in seconds)
    need = {"check": 30, "collectives": 40, "gpt2": 120, "parity": 90, "fault": 45,
            "headline": 60 if a.cpu else 150}  # fmt: skip
    multi = {"parity", "fault"}  # need two ranks at least
    parts = {
        "check": part_check,
        "headline": part_headline,
        "collectives": part_collectives,
        "gpt2": part_gpt2,
        "parity": part_parity,
        "fault": part_fault,
    }
    for name in a.parts.split(","):
        if name not in parts:
            raise SystemExit(f"[multi_gpu] unknown part {name!r} (of {', '.join(parts)})")
        if name in multi and a.n < 2:
            R["skipped"][name] = "needs 2 ranks at least"
            print(f"[multi_gpu] {name}: skipped ({R['skipped'][name]})", flush=True)
            continue
        if left() < need[name]:
            R["skipped"][name] = f"{left():.0f} s left, it needs ~{need[name]} s"
            print(f"[multi_gpu] {name}: skipped ({R['skipped'][name]})", flush=True)
            continue
        t0 = time.time()
        print(f"[multi_gpu] {name} ({left():.0f} s left) ...", flush=True)
        try:
            parts[name](a, L, out, R)
        except Exception as e:  # a broken part must not lose the others' figures
            R[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        R.setdefault("seconds", {})[name] = round(time.time() - t0, 1)
        (out / "multi_gpu.json").write_text(json.dumps(R, indent=1, default=str))
    if not a.keep_checkpoints:  # compared already; too large to come back from a device call
        for f in out.rglob("*.safetensors"):
            f.unlink()
    text, ok = summarize(a, R)
    (out / "summary.txt").write_text(text + "\n")
    (out / "multi_gpu.json").write_text(json.dumps(R, indent=1, default=str))
    print("=" * 30 + " multi_gpu summary " + "=" * 30)
    print(text)
    return 0 if ok else 1


DEADLINE = START + 540.0

if __name__ == "__main__":
    sys.exit(main())
