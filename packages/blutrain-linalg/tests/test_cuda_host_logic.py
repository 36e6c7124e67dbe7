"""The CUDA backend's host logic on a CPU machine, against the CPU backend.

fake_cuda/ holds host stand-ins for the CUDA runtime, our kernels and cuBLASLt (computing its
column-major semantics on the CPU); the real src/cuda/gemm_cuda.cpp runs over them, built with
AddressSanitizer where the compiler has it. Skipped where cuda_runtime.h or cublasLt.h (the
toolkit or the nvidia-cublas wheel) is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.dirname(HERE)
ALLOC_INCLUDE = os.path.join(PKG, "..", "blutrain-alloc", "include")


def _find_header(name: str, dirs: list[str]) -> str | None:
    for d in dirs:
        if d and os.path.exists(os.path.join(d, name)):
            return d
    return None


def _include_dirs() -> tuple[str | None, str | None]:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    toolkit = [os.path.join(cuda_home, "include"), "/usr/local/cuda/include"]
    wheel = []
    try:
        import nvidia

        wheel = [os.path.join(p, "cu13", "include") for p in nvidia.__path__]
    except ImportError:
        pass
    return _find_header("cuda_runtime.h", toolkit + wheel), _find_header(
        "cublasLt.h", toolkit + wheel
    )


def _alloc_include() -> str:
    try:
        out = subprocess.check_output(
            [sys.executable, "-m", "blutrain.alloc", "--include"],
            text=True,
            stderr=subprocess.DEVNULL,
        ).strip()
        if os.path.exists(os.path.join(out, "blutrain", "alloc.h")):
            return out
    except (subprocess.CalledProcessError, OSError):
        pass
    return ALLOC_INCLUDE


def _blas_path() -> str | None:
    try:
        import scipy_openblas32 as sob
    except ImportError:
        return None
    path = os.path.join(sob.get_lib_dir(), f"lib{sob.get_library()}.so")
    return path if os.path.exists(path) else None


def _compile(cxx: str, args: list[str], sanitize: bool) -> subprocess.CompletedProcess:
    flags = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer"] if sanitize else []
    return subprocess.run(
        [cxx, "-std=c++17", "-O1", "-g", *flags, *args], capture_output=True, text=True
    )


@pytest.mark.skipif(sys.platform != "linux", reason="Linux only (dlopen of the fake cuBLASLt)")
def test_cuda_backend_host_logic_matches_cpu_backend(tmp_path):
    cxx = shutil.which("c++") or shutil.which("g++")
    rt, lt = _include_dirs()
    blas = _blas_path()
    if cxx is None or rt is None or lt is None or blas is None:
        pytest.skip("needs a C++ compiler, cuda_runtime.h, cublasLt.h and scipy-openblas32")
    fake = os.path.join(HERE, "fake_cuda")
    src = os.path.join(PKG, "src")
    inc = [
        f"-I{os.path.join(PKG, 'include')}",
        f"-I{src}",
        f"-I{_alloc_include()}",
        f"-I{rt}",
        f"-I{lt}",
    ]
    lib = str(tmp_path / "libfakelt.so")
    r = _compile(
        cxx,
        ["-shared", "-fPIC", *inc, os.path.join(fake, "fake_lt.cpp"), "-o", lib],
        sanitize=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    exe = str(tmp_path / "driver")
    sources = [
        os.path.join(src, "c_api.cpp"),
        os.path.join(src, "cpu", "gemm_cpu.cpp"),
        os.path.join(src, "cuda", "gemm_cuda.cpp"),
        os.path.join(src, "cuda", "cublaslt_loader.cpp"),
        os.path.join(fake, "fake_cuda.cpp"),
        os.path.join(fake, "driver.cpp"),
    ]
    args = ["-DBT_WITH_CUDA=1", *inc, *sources, "-ldl", "-lpthread", "-o", exe]
    r = _compile(cxx, args, sanitize=True)
    sanitized = r.returncode == 0
    if not sanitized:  # a compiler without the sanitizer runtimes
        r = _compile(cxx, args, sanitize=False)
    assert r.returncode == 0, r.stderr[-3000:]
    env = dict(
        os.environ,
        BLUTRAIN_LINALG_CUBLASLT=lib,
        HOME=str(tmp_path),
        BLUTRAIN_CACHE_DIR=str(tmp_path / "cache"),
        ASAN_OPTIONS="detect_leaks=0",
    )
    env.pop("FAKE_LT_NO_EPI", None)
    run = subprocess.run([exe, blas, "300"], capture_output=True, text=True, env=env, timeout=600)
    tail = (run.stdout + run.stderr)[-4000:]
    assert run.returncode == 0, tail
    assert "0 mismatches in 300" in run.stdout, tail
    # The second pass found what the first one persisted.
    assert os.path.exists(tmp_path / "cache" / "linalg" / "cublaslt_algos.txt")
    hits = [int(line.split()[3]) for line in run.stdout.splitlines() if line.startswith("pass 1")]
    assert hits and hits[0] > 0, tail
    # float32 calls took the 3xTF32 route (its host stand-in) in some iterations.
    x3 = [int(ln.split()[2]) for ln in run.stdout.splitlines() if ln.startswith("tf32x3 calls")]
    assert x3 and x3[0] > 0, tail
