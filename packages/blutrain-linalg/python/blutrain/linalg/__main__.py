"""``python -m blutrain.linalg --cmake-dir|--include|--library``: paths for C/C++ builds."""

from __future__ import annotations

import argparse

from ._paths import cmake_dir, include_dir, library


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m blutrain.linalg", description=__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--cmake-dir", action="store_true", help="directory for find_package")
    group.add_argument("--include", action="store_true", help="directory holding blutrain/linalg.h")
    group.add_argument("--library", action="store_true", help="path of libblutrain_linalg")
    args = parser.parse_args()
    print(cmake_dir() if args.cmake_dir else include_dir() if args.include else library())


if __name__ == "__main__":
    main()
