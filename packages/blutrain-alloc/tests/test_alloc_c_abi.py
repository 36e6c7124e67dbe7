"""The C ABI as other projects see it: find_package from C, the capsule importer (the shared
blutrain/capi_import.h every package's <pkg>_import.h uses), fed wrong capsules."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import types

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
    assert cc is not None, "these tests build a C extension: install a C compiler"
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    out = tmp_path / f"{name}{suffix}"
    cmd = [cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", f"-DMODNAME=\"{name}\"",
           f"-DMODNAME_ID={name}",
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
    with pytest.raises(ImportError, match=rf"^\[alloc_probe\] blutrain.alloc C ABI {major}\."
                                          rf"{minor} is installed, but alloc_probe was built for "
                                          r"2\.0: rebuild alloc_probe against the installed"):
        _load("probe_new", path)


# ---- wrong capsules: what sits at blutrain.alloc._alloc._C_API is swapped in sys.modules --------
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class _Header(ctypes.Structure):
    _fields_ = [("abi_version", ctypes.c_uint32), ("struct_size", ctypes.c_uint32)]


def _capsule(name: bytes, version: int, size: int):
    """A capsule named `name` holding a table header; keeps its memory alive on the capsule's
    holder (the fake module below)."""
    header = _Header(version, size)
    cap = _capsule_new(ctypes.addressof(header), name, None)
    return cap, (header, name)


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    path = _build_probe(tmp_path_factory.mktemp("probe"), "probe_swap",
                        ['-DBT_CAPI_IMPORTER="blutrain.dependent"'])
    return _load("probe_swap", path)


@pytest.fixture
def swap_module(monkeypatch):
    """swap_module(obj): blutrain.alloc._alloc is obj while the test runs."""

    def swap(obj):
        monkeypatch.setitem(sys.modules, "blutrain.alloc._alloc", obj)

    return swap


def _fake(**attrs):
    m = types.ModuleType("blutrain.alloc._alloc")
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


WANT = rf"{ba.ABI_VERSION >> 16}\.{ba.ABI_VERSION & 0xFFFF}"
NAME = b"blutrain.alloc._C_API"


def test_the_real_capsule_is_taken(probe):
    assert probe.try_import() is None


def test_a_module_that_cannot_be_imported(probe, swap_module):
    swap_module(None)  # what a missing module looks like to the import system
    with pytest.raises(ImportError, match=rf"^\[blutrain.dependent\] needs blutrain.alloc's C ABI "
                                          rf"{WANT} but cannot import blutrain.alloc._alloc: .*"
                                          r"; pip install blutrain-alloc$"):
        probe.try_import()


def test_a_module_without_a_capsule(probe, swap_module):
    swap_module(_fake())
    with pytest.raises(ImportError, match=r"^\[blutrain.dependent\] blutrain.alloc._alloc has no "
                                          r"_C_API capsule, but blutrain.dependent needs "
                                          rf"blutrain.alloc's C ABI {WANT} from it"):
        probe.try_import()


def test_something_that_is_not_a_capsule(probe, swap_module):
    swap_module(_fake(_C_API="not a capsule"))
    with pytest.raises(ImportError, match=r"^\[blutrain.dependent\] blutrain.alloc._alloc._C_API "
                                          r"is a str, not the capsule 'blutrain.alloc._C_API'"):
        probe.try_import()


@pytest.mark.parametrize("name", [b"blutrain.linalg._C_API", None])
def test_another_packages_capsule(probe, swap_module, name):
    cap, keep = _capsule(name, ba.ABI_VERSION, 4096)
    swap_module(_fake(_C_API=cap, keep=keep))
    found = name.decode() if name else "(unnamed)"
    with pytest.raises(ImportError, match=rf"^\[blutrain.dependent\] blutrain.alloc._alloc._C_API "
                                          rf"is the capsule '{re.escape(found)}', not "
                                          r"'blutrain.alloc._C_API'"):
        probe.try_import()


@pytest.mark.parametrize("version", [(2 << 16) | 0, (0 << 16) | 7, ba.ABI_VERSION - 1])
def test_a_version_it_was_not_built_for(probe, swap_module, version):
    if version == ba.ABI_VERSION - 1 and ba.ABI_VERSION & 0xFFFF == 0:
        version = (ba.ABI_VERSION & ~0xFFFF) - 1  # the previous major's last minor
    cap, keep = _capsule(NAME, version, 4096)
    swap_module(_fake(_C_API=cap, keep=keep))
    have = rf"{version >> 16}\.{version & 0xFFFF}"
    with pytest.raises(ImportError, match=rf"^\[blutrain.dependent\] blutrain.alloc C ABI {have} "
                                          r"is installed, but blutrain.dependent was built for "
                                          rf"{WANT}"):
        probe.try_import()


def test_a_newer_minor_is_taken_and_a_short_table_is_not(probe, swap_module):
    newer = ba.ABI_VERSION + 1
    cap, keep = _capsule(NAME, newer, 4096)
    swap_module(_fake(_C_API=cap, keep=keep))
    assert probe.try_import() is None
    cap, keep = _capsule(NAME, ba.ABI_VERSION, 8)
    swap_module(_fake(_C_API=cap, keep=keep))
    with pytest.raises(ImportError, match=rf"^\[blutrain.dependent\] blutrain.alloc C ABI {WANT} "
                                          r"is installed with a 8-byte function table, but "
                                          r"blutrain.dependent was built for a \d+-byte one"):
        probe.try_import()
