"""BLUTRAIN_ALLOC_CONF (Note [BLUTRAIN_ALLOC_CONF], src/c_api.cpp): a bad setting stops
`import blutrain.alloc` with a message naming the entry, the whole setting and the allowed keys;
C code linking the library gets it from its first call; a good one is applied. Each case runs in
a fresh interpreter (the variable is read once per process)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import blutrain.alloc as ba

ALLOWED = "; allowed keys: expandable_segments (0 or 1), caching (0 or 1)"


def _run(conf: str, code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, BLUTRAIN_ALLOC_CONF=conf)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)


BAD = [
    ("expandable_segment:1", "unknown key 'expandable_segment' (did you mean "
                             "'expandable_segments'?)"),
    ("cachin:0", "unknown key 'cachin' (did you mean 'caching'?)"),
    ("garbage_collection_threshold:0.8", "unknown key 'garbage_collection_threshold'"),
    ("caching:yes", "'caching' must be 0 or 1 (or true / false), got 'yes'"),
    ("expandable_segments:2", "'expandable_segments' must be 0 or 1 (or true / false), got '2'"),
    ("caching:", "'caching' must be 0 or 1 (or true / false), got ''"),
    ("caching", "'caching' is not key:value"),
    ("caching=0", "'caching=0' is not key:value"),
    ("caching:0,caching:1", "key 'caching' is given twice"),
    ("expandable_segments:1,cache:0", "unknown key 'cache' (did you mean 'caching'?)"),
]  # fmt: skip


@pytest.mark.parametrize(("conf", "what"), BAD)
def test_a_bad_setting_stops_the_import_and_names_the_entry(conf, what):
    r = _run(conf, "import blutrain.alloc")
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    want = f'[BLUTRAIN_ALLOC_CONF] {what} in BLUTRAIN_ALLOC_CONF="{conf}"{ALLOWED}'
    assert last == f"ImportError: {want}"


@pytest.mark.parametrize(
    "conf", ["", "expandable_segments:1", " expandable_segments : True , caching:FALSE ,", ","]
)
def test_good_settings_import(conf):
    r = _run(conf, "import blutrain.alloc as ba; print(ba.stats('cpu')['reserved_bytes'])")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0"


def test_c_code_linking_the_library_gets_the_error_from_every_call():
    # no Python module in the way: the library's own first (and second) pool-making call fails
    code = (
        "import ctypes, sys\n"
        f"lib = ctypes.CDLL({ba.library_path()!r})\n"
        "lib.bt_alloc_last_error.restype = ctypes.c_char_p\n"
        "p = ctypes.c_void_p()\n"
        "for _ in range(2):\n"
        "    rc = lib.bt_alloc_malloc(-1, 64, None, ctypes.byref(p))\n"
        "    print(rc, lib.bt_alloc_last_error().decode())\n"
    )
    r = _run("caching:maybe", code)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    want = (
        "-1 [BLUTRAIN_ALLOC_CONF] 'caching' must be 0 or 1 (or true / false), got 'maybe' in "
        f'BLUTRAIN_ALLOC_CONF="caching:maybe"{ALLOWED}'
    )
    assert lines == [want, want]


@pytest.mark.gpu
def test_caching_off_from_the_environment_is_applied():
    # caching:0 reaches the device pools: a freed block goes back to the system at once
    code = (
        "import blutrain.alloc as ba\n"
        "base = ba.stats(0)['reserved_bytes']\n"
        "p = ba.malloc(3 * 2**20 + 7, 0)\n"
        "print(ba.stats(0)['reserved_bytes'] - base)\n"
        "ba.free(p)\n"
        "print(ba.stats(0)['reserved_bytes'] - base)\n"
    )
    r = _run("caching:0", code)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(3 * 2**20 + 7), "0"]
