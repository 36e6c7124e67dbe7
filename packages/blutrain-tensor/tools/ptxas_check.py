"""ptxas's verdict on the Hopper attention kernels, without a GPU (CI's cuda_build runs it).

Compiles src/cuda/attention_sm90.cu for sm_90a with `-Xptxas -v` and fails when ptxas reports
that it serialises a kernel's wgmma instructions (message C7520): a call or a divergent use of
wgmma registers in attn_fwd_sm90_ws / attn_bwd_sm90_ws does that, and cost GPT-2's bf16 step
1.5 ms in session 50 (Note [no calls in wgmma kernels], src/cuda/attention_rows.cuh). Also
prints the kernels' registers and stack frames.

Where cuobjdump is found (PATH, CUDA's bin, or pip's nvidia-cuda-cuobjdump with
nvidia-cuda-nvdisasm), it also reads the machine code (SASS) of both attention files: a wgmma
kernel with as many WARPGROUP.ARRIVEs as HGMMAs is serialised whatever ptxas printed, and a dq
conversion that stores more than MAX_ENTRY_STL words to its stack before its first exit copies
its parameters there per thread (3x the kernel's time, session 50; the fix paths must read
them in place).

    python packages/blutrain-tensor/tools/ptxas_check.py [--nvcc PATH] [--log FILE]
        [--sass FILE]
    --log FILE   judge a saved ptxas log instead of compiling (the parser's own test)
    --sass FILE  judge a saved `cuobjdump -sass` listing as well (with --log)
"""

from __future__ import annotations

import argparse
import glob
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
# the conversions after the Hopper backward (src/cuda/attention.cu), and how many stack stores
# their entry may make (2-3 spilled indices in session 51; 37 when they copied their parameters)
CONVERTS = ("attn_bwd_dq_convert",)
MAX_ENTRY_STL = 8


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


def find_cuobjdump(nvcc: str | None) -> str | None:
    """cuobjdump on PATH, beside nvcc, or from pip's nvidia-cuda-cuobjdump; else None."""
    found = shutil.which("cuobjdump")
    if not found and nvcc and os.path.exists(os.path.join(os.path.dirname(nvcc), "cuobjdump")):
        found = os.path.join(os.path.dirname(nvcc), "cuobjdump")
    for d in sys.path if not found else ():
        hits = sorted(glob.glob(os.path.join(d, "nvidia", "*", "bin", "cuobjdump")))
        if hits:
            return hits[-1]
    return found


def compile_log(nvcc: str, cuobjdump: str | None = None) -> tuple[str, str]:
    """ptxas -v's report for attention_sm90.cu (sm_90a), as the package's build compiles it, and
    the SASS of it and attention.cu ("" without cuobjdump)."""
    log, sass = "", ""
    names = ("attention_sm90.cu", "attention.cu") if cuobjdump else ("attention_sm90.cu",)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            obj = os.path.join(tmp, name + ".o")
            one = compile_one(nvcc, os.path.join(os.path.dirname(SOURCE), name), obj)
            log += one if name == "attention_sm90.cu" else ""
            if cuobjdump:
                # (cuobjdump runs nvdisasm: pip's nvidia-cuda-nvdisasm puts it beside cuobjdump)
                path = os.path.dirname(cuobjdump) + os.pathsep + os.environ["PATH"]
                r = subprocess.run(
                    [cuobjdump, "-sass", obj],
                    capture_output=True,
                    text=True,
                    env=dict(os.environ, PATH=path),
                )
                if r.returncode != 0:
                    raise SystemExit(
                        f"ptxas_check: cuobjdump failed on {name}:\n{r.stderr[-2000:]}"
                    )
                sass += r.stdout
    return log, sass


def compile_one(nvcc: str, source: str, obj: str) -> str:
    """Compiles source to obj as the package's build does; ptxas -v's report."""
    root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    sys_inc = [d for d in (os.path.join(root, "include", "cccl"),) if os.path.isdir(d)]
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
        source,
        "-o",
        obj,
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


def short(name: str) -> str:
    """A mangled kernel name without its namespaces' prefix, for the report."""
    return re.sub(r"^_ZN2bt4cuda\d+_GLOBAL__N__\w+?_cu_[0-9a-f]{8}\d+", "", name)[:100]


def sass_functions(sass: str) -> dict[str, list[str]]:
    """Each function of a `cuobjdump -sass` listing: its instructions (opcode and operands)."""
    out: dict[str, list[str]] = {}
    cur = None
    for line in sass.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = out.setdefault(m.group(1), [])
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if cur is not None and m:
            cur.append(m.group(1))
    return out


def judge_sass(sass: str) -> tuple[list[str], list[str]]:
    """(kernels the machine code condemns, with why; one line per judged kernel)."""
    bad, rows = [], []
    for name, ins in sass_functions(sass).items():
        if any(k in name for k in KERNELS):
            mma = sum("HGMMA" in i for i in ins)
            arrive = sum("WARPGROUP.ARRIVE" in i for i in ins)
            rows.append(f"{short(name)}: {mma} HGMMA, {arrive} WARPGROUP.ARRIVE")
            if mma > 1 and arrive >= mma:  # an arrive (and a wait) before every HGMMA
                bad.append(f"{short(name)}: {arrive} WARPGROUP.ARRIVE for {mma} HGMMA (serialised)")
        elif any(k in name for k in CONVERTS):
            entry = []
            for i in ins:
                entry.append(i)
                if "EXIT" in i:
                    break
            stl = sum(re.search(r"(^|\s)STL(\.|\s)", i) is not None for i in entry)
            rows.append(f"{short(name)}: {stl} stack stores before its first exit")
            if stl > MAX_ENTRY_STL:
                bad.append(
                    f"{short(name)}: {stl} stack stores before its first exit (max "
                    f"{MAX_ENTRY_STL}: parameters copied per thread?)"
                )
    return bad, rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nvcc", default=None)
    p.add_argument("--log", default=None)
    p.add_argument("--sass", default=None)
    a = p.parse_args()
    if a.log:
        with open(a.log) as f:
            log = f.read()
        sass = ""
        if a.sass:
            with open(a.sass) as f:
                sass = f.read()
    else:
        nvcc = a.nvcc or os.environ.get("CUDACXX") or shutil.which("nvcc")
        if not nvcc and os.path.exists("/usr/local/cuda/bin/nvcc"):
            nvcc = "/usr/local/cuda/bin/nvcc"
        if not nvcc:
            print("ptxas_check: no nvcc on PATH (--nvcc PATH)", file=sys.stderr)
            return 2
        cuobjdump = find_cuobjdump(nvcc)
        if not cuobjdump:
            print(
                "ptxas_check: no cuobjdump (pip install nvidia-cuda-cuobjdump "
                "nvidia-cuda-nvdisasm): ptxas's report only"
            )
        log, sass = compile_log(nvcc, cuobjdump)
    bad, rows = judge(log)
    sass_bad, sass_rows = judge_sass(sass) if sass else ([], [])
    print("\n".join(rows + sass_rows))
    if bad or sass_bad:
        print(
            "ptxas_check: wgmma instructions serialised (C7520) in:\n  " + "\n  ".join(bad)
            if bad
            else "ptxas_check: the machine code fails:",
            *(["  " + b for b in sass_bad]),
            "keep calls and recomputation out of these kernels and read the conversions' "
            "parameters in place (Note [no calls in wgmma kernels], src/cuda/attention_rows.cuh)",
            sep="\n",
            file=sys.stderr,
        )
        return 1
    what = "ptxas's report" + (" and the SASS" if sass else "")
    print(f"ptxas_check: no serialised wgmma in {', '.join(KERNELS)} ({what})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
