"""A tour of blutrain.alloc: a transformer-like allocation pattern, the memory table,
and a picture of the segments. Uses the GPU when one is present, else host memory."""

from __future__ import annotations

import os
import sys

import blutrain.alloc as ba

MIB = 1 << 20


def main(out_dir: str = "out") -> None:
    device = "cuda:0" if ba.device_count() > 0 else "cpu"
    print(f"blutrain.alloc demo on {device}\n")
    params = [ba.malloc(n, device) for n in (150 * MIB, 9 * MIB, 7 * MIB, 2 * MIB, 3072 * 4)]
    for step in range(3):  # forward saves activations, backward frees them
        saved = [ba.malloc(n, device) for n in (24 * MIB, 72 * MIB, 96 * MIB, 600_000) * 4]
        grads = [ba.malloc(n, device) for n in (9 * MIB, 7 * MIB, 3072 * 4)]
        for p in reversed(saved):
            ba.free(p)
        for g in grads:
            ba.free(g)
        s = ba.stats(device)
        print(f"step {step}: {s['alloc_count']} mallocs, {s['system_alloc_count']} from the "
              f"system, reserved {s['reserved_bytes'] / MIB:.0f} MiB")
    print()
    print(ba.memory_summary(device))
    os.makedirs(out_dir, exist_ok=True)
    try:
        path = ba.plot_snapshot(os.path.join(out_dir, "alloc_snapshot.png"), device)
        print(f"\nsegment picture: {path}")
    except ImportError as e:
        print(f"\n(no picture: {e})")
    for p in params:
        ba.free(p)
    ba.empty_cache(device)


if __name__ == "__main__":
    main(*sys.argv[1:])
