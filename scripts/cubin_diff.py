"""Compare the kernels of two cubins byte for byte, to show a source change left the kernels
that run untouched.

    nvcc <the build's flags> -cubin -o before.cubin file.cu     # at the old commit
    nvcc <the build's flags> -cubin -o after.cubin file.cu      # at the new one
    python scripts/cubin_diff.py before.cubin after.cubin [--rename 'REGEX=>REPL' ...]

Per kernel (matched by demangled name; --rename rewrites the before names, for template arguments
or parameters that were removed): the machine code (.text.<kernel>) must be identical; differences
in the parameter bank size (.nv.constant0) and the attributes (.nv.info: registers, parameters;
symbol indices masked) are listed.  Kernels only in one file are listed.  Exit status 1 when a
common kernel's code differs or the after file has kernels the before file lacks.  Needs c++filt.
"""

from __future__ import annotations

import argparse
import re
import struct
import subprocess
import sys


def sections(path: str) -> dict[str, bytes]:
    d = open(path, "rb").read()
    if d[:4] != b"\x7fELF" or d[4] != 2:
        raise SystemExit(f"{path}: not a 64-bit ELF cubin")
    (shoff,) = struct.unpack_from("<Q", d, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", d, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQ", d, shoff + i * shentsize) for i in range(shnum)]
    stroff = hdrs[shstrndx][4]
    out = {}
    for name, typ, _flags, _addr, off, size in hdrs:
        n = d[stroff + name : d.index(b"\0", stroff + name)].decode()
        out[n] = d[off : off + size] if typ != 8 else b"\0" * size  # 8: NOBITS
    return out


def info_entries(b: bytes) -> list[tuple[int, bytes]]:
    """.nv.info as (attribute, data); EIATTR_PARAM_CBANK (0x0a) starts with a symbol index, which
    moves when other kernels leave the file: masked."""
    out, i = [], 0
    while i < len(b):
        fmt, attr = b[i], b[i + 1]
        if fmt == 4:  # EIFMT_SVAL: a sized value
            (size,) = struct.unpack_from("<H", b, i + 2)
            data, i = b[i + 4 : i + 4 + size], i + 4 + size
        else:
            data, i = b[i + 2 : i + 4], i + 4
        out.append((attr, b"\0\0\0\0" + data[4:] if attr == 0x0A else data))
    return out


def kernels(path: str, renames: list[tuple[str, str]]) -> dict[str, tuple[bytes, int, list]]:
    secs = sections(path)
    mangled = [n[len(".text.") :] for n in secs if n.startswith(".text.")]
    dm = subprocess.run(["c++filt"], input="\n".join(mangled), capture_output=True, text=True)
    out = {}
    for m, name in zip(mangled, dm.stdout.splitlines(), strict=True):
        for pat, repl in renames:
            name = re.sub(pat, repl, name)
        text = secs[".text." + m]
        out[name] = (
            text,
            len(secs.get(".nv.constant0." + m, b"")),
            info_entries(secs.get(".nv.info." + m, b"")),
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rename", action="append", default=[], help="REGEX=>REPL on before names")
    args = ap.parse_args()
    renames = [tuple(r.split("=>", 1)) for r in args.rename]
    b, a = kernels(args.before, renames), kernels(args.after, [])
    common = sorted(set(a) & set(b))
    differ = [k for k in common if a[k][0] != b[k][0]]
    for k in differ:
        print("CODE DIFFERS:", k)
    for k in common:
        if a[k][1] != b[k][1]:
            print(f"  parameter bank {b[k][1]} -> {a[k][1]} bytes: {k[:140]}")
        elif a[k][2] != b[k][2]:
            print(f"  attributes differ: {k[:140]}")
    only_b, only_a = sorted(set(b) - set(a)), sorted(set(a) - set(b))
    for k in only_b:
        print("  only before:", k[:140])
    for k in only_a:
        print("  only after:", k[:140])
    print(
        f"{args.before} -> {args.after}: {len(b)} kernels before, {len(a)} after; "
        f"{len(common) - len(differ)} identical code, {len(differ)} different; "
        f"{len(only_b)} only before, {len(only_a)} only after"
    )
    return 1 if differ or only_a else 0


if __name__ == "__main__":
    sys.exit(main())
