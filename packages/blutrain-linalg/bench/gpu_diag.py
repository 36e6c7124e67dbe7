"""GPU smoke test with native crash traces: one small case per subprocess, so a crash in one
does not hide the others. Prints which option set works; gpu_check.sh uses that for the tests
and the benchmark. Usage: python gpu_diag.py [--pick] (--pick prints only the chosen options).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

CASE = r"""
import ctypes, os, sys
ctypes.CDLL(sys.argv[1])  # the SIGSEGV tracer
import numpy as np, torch
import blutrain.linalg as bl
kind = sys.argv[2]
dt = torch.bfloat16 if kind == "bf16" else torch.float32
a = torch.randn(1024, 768, device="cuda", dtype=dt)
b = torch.randn(2304, 768, device="cuda", dtype=dt)
out = torch.empty(1024, 2304, device="cuda", dtype=torch.bfloat16 if kind == "f32_to_bf16" else dt)
if kind == "alloc_out":
    out = bl.matmul(a, b, transb=True)
elif kind == "epilogue":
    bias = torch.randn(2304, device="cuda", dtype=dt)
    out, pre = bl.linear(a, b, bias, activation="gelu", save_preact=True)
else:
    bl.matmul(a, b, transb=True, out=out)
torch.cuda.synchronize()
ref = a.double() @ b.double().t()
if kind == "epilogue":
    ref = torch.nn.functional.gelu(ref + bias.double(), approximate="tanh")
err = ((out.double() - ref).norm() / ref.norm()).item()
libs = sorted({l.split()[-1] for l in open("/proc/self/maps") if "cublas" in l or "cudart" in l})
print("OK err=%.2e fallbacks=%d libs=%s" % (err, bl.get_option("fallback_epilogues"), libs))
"""

VARIANTS = [
    ("default", "f32", {}),
    ("no_alloc", "f32", {"BLUTRAIN_LINALG_OPTIONS": "use_alloc=0"}),
    ("no_workspace", "f32", {"BLUTRAIN_LINALG_OPTIONS": "use_alloc=0,workspace_bytes=0"}),
    (
        "toolkit_cublaslt",
        "f32",
        {"BLUTRAIN_LINALG_CUBLASLT": "/usr/local/cuda/lib64/libcublasLt.so.13"},
    ),
    ("bf16", "bf16", {}),
    ("f32_to_bf16_unfused", "f32_to_bf16", {}),
    ("alloc_out", "f32", {}),
    ("epilogue_bf16", "epilogue", {}),
]


def build_tracer(tmp: str) -> str:
    so = os.path.join(tmp, "segv_trace.so")
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-O0", "-g", os.path.join(HERE, "segv_trace.c"), "-o", so],
        check=True,
    )
    return so


def symbolize(text: str) -> str:
    out = []
    for line in text.splitlines():
        out.append(line)
        m = re.match(r"\s+#\d+ (\S*libblutrain_\w+\.so\S*) \+(0x[0-9a-f]+)", line)
        if m:
            r = subprocess.run(
                ["addr2line", "-f", "-C", "-i", "-e", m.group(1), m.group(2)],
                capture_output=True,
                text=True,
            )
            out.extend("      " + x for x in r.stdout.strip().splitlines())
    return "\n".join(out)


def main() -> int:
    pick_only = "--pick" in sys.argv
    with tempfile.TemporaryDirectory() as tmp:
        tracer = build_tracer(tmp)
        case = os.path.join(tmp, "case.py")
        with open(case, "w") as f:
            f.write(CASE)
        ok = {}
        for name, kind, env in VARIANTS:
            e = dict(os.environ, **env)
            e.setdefault("BLUTRAIN_CACHE_DIR", tmp)
            try:
                r = subprocess.run(
                    [sys.executable, case, tracer, kind],
                    capture_output=True,
                    text=True,
                    env=e,
                    timeout=90,
                )
                rc, text = r.returncode, (r.stdout + r.stderr)
            except subprocess.TimeoutExpired:
                rc, text = -1, "timeout"
            ok[name] = rc == 0 and "OK" in text
            if not pick_only:
                print(f"== {name} ({env or 'defaults'}): rc={rc}")
                print(symbolize(text.strip())[-6000:])
        chosen = (
            ""
            if ok.get("default")
            else "use_alloc=0"
            if ok.get("no_alloc")
            else "use_alloc=0,workspace_bytes=0"
            if ok.get("no_workspace")
            else "NONE"
        )
        print(chosen if pick_only else f"== chosen BLUTRAIN_LINALG_OPTIONS: {chosen!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
