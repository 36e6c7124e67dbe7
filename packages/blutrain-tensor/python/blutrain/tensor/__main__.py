"""``python -m blutrain.tensor --cmake-dir|--include|--library``: paths for C/C++ builds."""

from __future__ import annotations

import argparse
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m blutrain.tensor", description=__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--cmake-dir", action="store_true", help="(none: the core is not shipped)")
    group.add_argument("--include", action="store_true", help="directory holding blutrain/tensor.h")
    group.add_argument("--library", action="store_true", help="the extension module (C ABI host)")
    args = parser.parse_args()
    if args.include:
        print(_HERE / "include")
    elif args.library:
        print(next(_HERE.glob("_tensor*.so"), _HERE / "_tensor.so"))
    else:
        # The C ABI is served by the Python module's _C_API capsule; there is no C++ library to
        # find_package, so there is no CMake config either.
        print(_HERE / "include")


if __name__ == "__main__":
    main()
