"""The C ABI as dependents see it: the capsule importer, the table, the installed paths."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

import blutrain.alloc as ba
import blutrain.linalg as bl
from blutrain.linalg import _linalg

HERE = os.path.dirname(os.path.abspath(__file__))


def test_paths_cli():
    for flag, probe in [
        ("--include", "blutrain/linalg.h"),
        ("--include", "blutrain/linalg_import.h"),
        ("--cmake-dir", "BlutrainLinalgConfig.cmake"),
    ]:
        out = subprocess.check_output([sys.executable, "-m", "blutrain.linalg", flag], text=True)
        assert os.path.exists(os.path.join(out.strip(), probe)), (flag, probe)
    lib = subprocess.check_output([sys.executable, "-m", "blutrain.linalg", "--library"], text=True)
    assert os.path.exists(lib.strip()) and "libblutrain_linalg" in lib


def test_capsule_is_named_and_versioned():
    import ctypes

    cap = _linalg._C_API
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype = ctypes.c_char_p
    get_name.argtypes = [ctypes.py_object]
    assert get_name(cap) == b"blutrain.linalg._C_API"
    assert _linalg.ABI_VERSION >> 16 == 1


def _build_probe(tmp_path, name: str, extra: list[str]) -> str:
    cc = shutil.which("cc")
    assert cc is not None, "these tests build a C extension: install a C compiler"
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    out = tmp_path / f"{name}{suffix}"
    cmd = [
        cc,
        "-shared",
        "-fPIC",
        "-O1",
        "-Wall",
        "-Werror",
        f'-DMODNAME="{name}"',
        f"-DMODNAME_ID={name}",
        f"-I{sysconfig.get_paths()['include']}",
        f"-I{bl.get_include()}",
        f"-I{ba.get_include()}",  # blutrain/capi_import.h, the shared importer
        *extra,
        os.path.join(HERE, "linalg_abi_probe.c"),
        "-o",
        str(out),
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    return str(out)


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_capsule_importer_runs_a_gemm_through_the_table(tmp_path):
    mod = _load("bt_linalg_probe_ok", _build_probe(tmp_path, "bt_linalg_probe_ok", []))
    d, rc, msg = mod.gemm_bias()
    # [[1,2,3],[4,5,6]] @ [[1,0],[0,1],[1,1]] + [10, 20] = [[14, 25], [20, 31]]
    assert d == (14.0, 25.0, 20.0, 31.0)
    assert rc == -1 and msg.startswith("[gemm] desc.struct_size is 8")


def test_capsule_importer_refuses_a_newer_minor(tmp_path):
    # Pretend the dependent was built against ABI 1.99: the installed 1.x must be refused.
    assert shutil.which("cc") is not None, "these tests build a C extension: install a C compiler"
    src = tmp_path / "probe_new.c"
    text = open(os.path.join(HERE, "linalg_abi_probe.c")).read()
    text = text.replace(
        '#include "blutrain/linalg_import.h"',
        '#include "blutrain/linalg.h"\n#undef BT_LINALG_ABI_VERSION\n'
        "#define BT_LINALG_ABI_VERSION ((1u << 16) | 99u)\n"
        '#include "blutrain/linalg_import.h"',
    )
    src.write_text(text)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    out = tmp_path / f"bt_linalg_probe_new2{suffix}"
    subprocess.run(
        [
            shutil.which("cc"),
            "-shared",
            "-fPIC",
            "-O1",
            '-DMODNAME="bt_linalg_probe_new2"',
            "-DMODNAME_ID=bt_linalg_probe_new2",
            f"-I{sysconfig.get_paths()['include']}",
            f"-I{bl.get_include()}",
            f"-I{ba.get_include()}",  # blutrain/capi_import.h, the shared importer
            str(src),
            "-o",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    v = _linalg.ABI_VERSION
    with pytest.raises(
        ImportError,
        match=rf"^\[this module\] blutrain.linalg C ABI {v >> 16}.{v & 0xFFFF} is installed, "
        r"but this module was built for 1.99",
    ):
        _load("bt_linalg_probe_new2", str(out))


def test_an_alloc_it_cannot_use_is_named_with_both_sides():
    # blutrain.alloc's module swapped for one without a capsule: linalg still
    # imports (alloc is optional on the CPU) and says why it runs without it, naming both sides.
    code = (
        "import sys, types\n"
        "sys.modules['blutrain.alloc._alloc'] = types.ModuleType('blutrain.alloc._alloc')\n"
        "from blutrain.linalg import _linalg\n"
        "print(_linalg.alloc_available(), _linalg.alloc_error())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith(
        "False [blutrain.linalg] blutrain.alloc._alloc has no _C_API capsule, but "
        "blutrain.linalg needs blutrain.alloc's C ABI 1."
    ), out.stdout
