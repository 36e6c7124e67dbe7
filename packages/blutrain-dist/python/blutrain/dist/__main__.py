"""``python -m blutrain.dist --include|--library``: paths for C/C++ builds."""

from __future__ import annotations

import argparse
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m blutrain.dist", description=__doc__)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--include", action="store_true", help="directory holding blutrain/dist.h")
    group.add_argument("--library", action="store_true", help="the extension module (C ABI host)")
    args = parser.parse_args()
    if args.include:
        print(_HERE / "include")
    else:
        print(next(_HERE.glob("_dist*.so"), _HERE / "_dist.so"))


if __name__ == "__main__":
    main()
