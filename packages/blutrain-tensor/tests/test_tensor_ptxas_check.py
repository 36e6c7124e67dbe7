"""tools/ptxas_check.py's verdict on ptxas logs (CI's cuda_build runs it on the real compile)."""

from __future__ import annotations

import os
import subprocess
import sys

TOOL = os.path.join(os.path.dirname(__file__), "..", "tools", "ptxas_check.py")
BWD = "_ZN2bt4cuda16attn_bwd_sm90_wsI13__nv_bfloat16Li64EEEvNS0_10AttnParamsE"
FWD = "_ZN2bt4cuda16attn_fwd_sm90_wsI13__nv_bfloat16Li64EEEvNS0_10AttnParamsE"
CONVERT = "_ZN2bt4cuda19attn_bwd_dq_convertI13__nv_bfloat16Li64EEEvNS0_10AttnParamsE"


def entry(name: str, regs: int, stack: int = 0) -> str:
    return (
        f"ptxas info    : Compiling entry function '{name}' for 'sm_90a'\n"
        f"ptxas info    : Function properties for {name}\n"
        f"    {stack} bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        f"ptxas info    : Used {regs} registers, used 1 barriers\n"
    )


def serialised(name: str) -> str:
    return (
        "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are "
        "serialized due to program dependence on compiler-inserted WG.AR in divergent path in "
        f"the function '{name}'\n"
    )


def run(tmp_path, log: str) -> subprocess.CompletedProcess:
    f = tmp_path / "ptxas.log"
    f.write_text(log)
    return subprocess.run([sys.executable, TOOL, "--log", str(f)], capture_output=True, text=True)


def test_a_serialised_attention_kernel_fails_and_is_named(tmp_path):
    r = run(tmp_path, entry(FWD, 154) + serialised(BWD) + entry(BWD, 168, 64))
    assert r.returncode == 1, r.stdout + r.stderr
    assert BWD in r.stderr and FWD not in r.stderr
    assert "Note [no calls in wgmma kernels]" in r.stderr
    assert "168 registers" in r.stdout and "stack 64 B" in r.stdout


def test_clean_kernels_pass_and_other_kernels_are_not_judged(tmp_path):
    # a C7520 in a kernel that is not one of the watched wgmma kernels is not this check's
    r = run(tmp_path, entry(FWD, 154) + entry(BWD, 168) + serialised(CONVERT))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "no serialised wgmma" in r.stdout and "154 registers" in r.stdout
