"""Where the installed package keeps its header, library and CMake config."""

from __future__ import annotations

import importlib.util
import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def _installed_dir() -> str:
    """The directory the build installed into: the native module's. In a wheel install that is
    this package's directory; in an editable one the Python sources stay in the checkout and the
    built files (module, headers, library, CMake config) sit in site-packages."""
    spec = importlib.util.find_spec("blutrain.alloc._alloc")
    return os.path.dirname(spec.origin) if spec is not None and spec.origin else _HERE


def include_dir() -> str:
    return os.path.join(_installed_dir(), "include")


def cmake_dir() -> str:
    return os.path.join(_installed_dir(), "cmake")


def library() -> str:
    from ._alloc import library_path

    return library_path()
