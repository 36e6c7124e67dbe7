"""Cross-package facts: `blutrain` is a namespace, and each installed package stands alone."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys

import pytest

PACKAGES = ["alloc", "linalg", "tensor", "dist", "compiler", "models"]


def installed() -> list[str]:
    return [p for p in PACKAGES if importlib.util.find_spec(f"blutrain.{p}") is not None]


def test_blutrain_is_a_namespace_package():
    import blutrain

    assert getattr(blutrain, "__file__", None) is None, "no wheel may ship blutrain/__init__.py"
    assert installed(), "no BluTrain package is installed"


@pytest.mark.parametrize("name", installed())
def test_each_package_imports_in_a_fresh_interpreter(name):
    subprocess.run([sys.executable, "-c", f"import blutrain.{name}"], check=True)
