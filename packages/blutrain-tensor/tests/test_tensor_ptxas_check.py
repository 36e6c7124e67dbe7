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


def sass(name: str, body: list[str]) -> str:
    """A `cuobjdump -sass` listing of one function (addresses and encodings as cuobjdump's)."""
    lines = [
        f"\t\tFunction : {name}",
        '\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"',
    ]
    for k, ins in enumerate(body):
        lines.append(
            f"        /*{16 * k:04x}*/                   {ins} ;    /* 0x000000000000794d */"
        )
        lines.append(
            "                                                      /* 0x000fea0003800000 */"
        )
    return "\n".join(lines) + "\n"


def run_sass(tmp_path, listing: str) -> subprocess.CompletedProcess:
    (tmp_path / "ptxas.log").write_text(entry(FWD, 154) + entry(BWD, 168))
    (tmp_path / "a.sass").write_text(listing)
    cmd = [
        sys.executable,
        TOOL,
        "--log",
        str(tmp_path / "ptxas.log"),
        "--sass",
        str(tmp_path / "a.sass"),
    ]
    return subprocess.run(cmd, capture_output=True, text=True)


def wgmma_body(n_mma: int, arrive_each: bool) -> list[str]:
    body = ["LDC R1, c[0x0][0x28]", "WARPGROUP.ARRIVE"]
    for _ in range(n_mma):
        if arrive_each:
            body += ["WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR.LE gsb0, 0x0"]
        body.append("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0")
    return body + ["WARPGROUP.DEPBAR.LE gsb0, 0x0", "EXIT"]


def convert_body(entry_stores: int) -> list[str]:
    body = ["LDC R1, c[0x0][0x28]", "S2R R3, SR_CTAID.X"]
    body += [f"STL.64 [R1+{hex(8 * i)}], R4" for i in range(entry_stores)]
    # stores after the first exit are the fix path's: not counted
    return body + ["@P0 EXIT", "LDG.E.128 R4, desc[UR4][R2.64]", "STL [R1+0x100], R4", "EXIT"]


def test_sass_clean_kernels_pass(tmp_path):
    listing = sass(BWD, wgmma_body(48, False)) + sass(FWD, wgmma_body(24, False))
    listing += sass(CONVERT, convert_body(3))
    r = run_sass(tmp_path, listing)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "48 HGMMA, 1 WARPGROUP.ARRIVE" in r.stdout
    assert "3 stack stores before its first exit" in r.stdout
    assert "and the SASS" in r.stdout


def test_sass_serialised_wgmma_fails_without_a_c7520(tmp_path):
    # ptxas's log is clean; the machine code has an arrive before every HGMMA
    listing = sass(BWD, wgmma_body(48, True)) + sass(FWD, wgmma_body(24, False))
    r = run_sass(tmp_path, listing)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "attn_bwd_sm90_ws" in r.stderr and "49 WARPGROUP.ARRIVE for 48 HGMMA" in r.stderr
    assert "attn_fwd_sm90_ws" not in r.stderr


def test_sass_conversion_copying_its_parameters_fails(tmp_path):
    r = run_sass(tmp_path, sass(CONVERT, convert_body(37)))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "attn_bwd_dq_convert" in r.stderr and "37 stack stores" in r.stderr
    assert "parameters" in r.stderr
