"""ptxas's verdict on the Hopper attention kernels, without a GPU (CI's cuda_build runs it).

Compiles src/cuda/attention_sm90.cu for sm_90a with `-Xptxas -v` and fails when ptxas reports
that it serialises a kernel's wgmma instructions (message C7520): a call or a divergent use of
wgmma registers in attn_fwd_sm90_ws / attn_bwd_sm90_ws does that, and cost GPT-2's bf16 step
1.5 ms in session 50 (Note [no calls in wgmma kernels], src/cuda/attention_rows.cuh). Also
prints the kernels' registers and stack frames.

    python packages/blutrain-tensor/tools/ptxas_check.py [--nvcc PATH] [--log FILE]
    --log FILE  judge a saved ptxas log instead of compiling (the parser's own test)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.dirname(HERE)
SOURCE = os.path.join(PKG, "src", "cuda", "attention_sm90.cu")
# the kernels whose wgmmas must not be serialised (GPT-2's, and every Hopper attention kernel)
KERNELS = ("attn_fwd_sm90_ws", "attn_bwd_sm90_ws", "attn_fwd_sm90I")


def include_dirs() -> list[str]:
    """blutrain.alloc's and blutrain.linalg's headers (installed packages), and CUDA's cccl."""
    dirs = [os.path.join(PKG, "include"), os.path.join(PKG, "src")]
    for mod in ("blutrain.alloc", "blutrain.linalg"):
        try:
            m = __import__(mod, fromlist=["_"])
        except ImportError:
            continue
        inc = os.path.join(os.path.dirname(m.__file__), "include")
        if os.path.isdir(inc):
            dirs.append(inc)
    return dirs


def compile_log(nvcc: str) -> str:
    """ptxas -v's report for attention_sm90.cu (sm_90a), as the package's build compiles it."""
    root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    sys_inc = [d for d in (os.path.join(root, "include", "cccl"),) if os.path.isdir(d)]
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            nvcc,
            "-DBT_CUDA_SM90A=1",
            "-DBT_WITH_CUDA=1",
            "-O3",
            "-DNDEBUG",
            "-std=c++17",
            "--generate-code=arch=compute_90a,code=[sm_90a]",
            "--expt-relaxed-constexpr",
            "-Xptxas=-v",
            "-x",
            "cu",
            "-c",
            SOURCE,
            "-o",
            os.path.join(tmp, "a.o"),
        ]
        cmd[1:1] = [f"-I{d}" for d in include_dirs()] + [f"-isystem{d}" for d in sys_inc]
        r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"ptxas_check: nvcc failed (exit {r.returncode}):\n{r.stderr[-4000:]}")
    return r.stdout + r.stderr


def judge(log: str) -> tuple[list[str], list[str]]:
    """(serialised kernels, one line per watched kernel: registers and stack frame)."""
    bad = sorted(
        {
            m.group(1)
            for m in re.finditer(r"C7520\).*?function '(\S+?)'", log)
            if any(k in m.group(1) for k in KERNELS)
        }
    )
    rows, cur = [], None
    for line in log.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?(\S+?)'?$", line)
        if m:
            cur = m.group(1) if any(k in m.group(1) for k in KERNELS) else None
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores", line)
        if cur and m:
            rows.append(f"{cur[:90]}: stack {m.group(1)} B, spill stores {m.group(2)} B")
        m = re.search(r"Used (\d+) registers", line)
        if cur and m:
            rows.append(f"{cur[:90]}: {m.group(1)} registers")
    return bad, rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvcc", default=None)
    p.add_argument("--log", default=None)
    a = p.parse_args()
    if a.log:
        with open(a.log) as f:
            log = f.read()
    else:
        nvcc = a.nvcc or os.environ.get("CUDACXX") or shutil.which("nvcc")
        if not nvcc and os.path.exists("/usr/local/cuda/bin/nvcc"):
            nvcc = "/usr/local/cuda/bin/nvcc"
        if not nvcc:
            print("ptxas_check: no nvcc on PATH (--nvcc PATH)", file=sys.stderr)
            return 2
        log = compile_log(nvcc)
    bad, rows = judge(log)
    print("\n".join(rows))
    if bad:
        print(
            "ptxas_check: wgmma instructions serialised (C7520) in:\n  "
            + "\n  ".join(bad)
            + "\nkeep calls and recomputation out of these kernels (Note [no calls in wgmma "
            "kernels], src/cuda/attention_rows.cuh)",
            file=sys.stderr,
        )
        return 1
    print(f"ptxas_check: no serialised wgmma in {', '.join(KERNELS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
