"""Where the installed package keeps its header, library and CMake config."""

from __future__ import annotations

import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def include_dir() -> str:
    return os.path.join(_HERE, "include")


def cmake_dir() -> str:
    return os.path.join(_HERE, "cmake")


def library() -> str:
    from ._linalg import library_path

    return library_path()
