"""The C ABI as other projects see it: find_package from C, the capsule importer."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

import blutrain.alloc as ba

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "examples", "c_consumer")


def test_paths_cli():
    for flag, probe in [("--include", "blutrain/alloc.h"),
                        ("--cmake-dir", "BlutrainAllocConfig.cmake")]:
        out = subprocess.check_output([sys.executable, "-m", "blutrain.alloc", flag], text=True)
        assert os.path.exists(os.path.join(out.strip(), probe))
    lib = subprocess.check_output([sys.executable, "-m", "blutrain.alloc", "--library"], text=True)
    assert os.path.exists(lib.strip()) and "libblutrain_alloc" in lib


@pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("cc") is None,
                    reason="needs cmake and a C compiler")
def test_c_program_builds_with_find_package(tmp_path):
    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", EXAMPLE, "-B", str(build),
                    f"-DCMAKE_PREFIX_PATH={ba.get_cmake_dir()}"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build)], check=True, capture_output=True)
    run = subprocess.run([str(build / "alloc_consumer")], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ok" in run.stdout and "already freed" in run.stdout


def _build_probe(tmp_path, name: str, extra: list[str]) -> str:
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("needs a C compiler")
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    out = tmp_path / f"{name}{suffix}"
    cmd = [cc, "-shared", "-fPIC", "-O1", f"-DMODNAME=\"{name}\"", f"-DMODNAME_ID={name}",
           f"-I{sysconfig.get_paths()['include']}", f"-I{ba.get_include()}", *extra,
           os.path.join(HERE, "alloc_abi_probe.c"), "-o", str(out)]
    subprocess.run(cmd, check=True, capture_output=True)
    return str(out)


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_capsule_importer_accepts_matching_abi(tmp_path):
    mod = _load("probe_ok", _build_probe(tmp_path, "probe_ok", []))
    assert mod.roundtrip() % 512 == 0


def test_capsule_importer_refuses_other_major_version(tmp_path):
    path = _build_probe(tmp_path, "probe_new", ["-DBT_ALLOC_IMPORT_WANT_VERSION=0x20000u"])
    major, minor = ba.ABI_VERSION >> 16, ba.ABI_VERSION & 0xFFFF
    with pytest.raises(ImportError, match=rf"C ABI {major}\.{minor} is installed, but this module "
                                          r"was built for 2\.0"):
        _load("probe_new", path)
