"""Human-readable views of the allocator: a text table and a PNG of the segments."""

from __future__ import annotations

import os
import tempfile


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def memory_summary(device: int | str = "cpu") -> str:
    """A table of the pool's byte totals (now and peak) and counters."""
    from . import stats

    s = stats(device)
    rows = [
        ("allocated", s["allocated_bytes"], s["allocated_bytes_peak"]),
        ("requested", s["requested_bytes"], s["requested_bytes_peak"]),
        ("reserved", s["reserved_bytes"], s["reserved_bytes_peak"]),
    ]
    width = 58
    lines = [f"blutrain.alloc memory summary: device {device}".center(width), "-" * width]
    lines.append(f"{'':<22}{'now':>18}{'peak':>18}")
    lines += [f"{name:<22}{_fmt(now):>18}{_fmt(peak):>18}" for name, now, peak in rows]
    lines.append("-" * width)
    counters = [
        ("cached free", _fmt(s["cached_free_bytes"])),
        ("largest free block", _fmt(s["largest_free_block"])),
        ("free inside split segs", _fmt(s["inactive_split_bytes"])),
        ("fragmentation", f"{100 * s['fragmentation']:.1f} %"),
        ("live blocks", str(s["active_blocks"])),
        ("segments", str(s["segments"])),
        ("mallocs / frees", f"{s['alloc_count']} / {s['free_count']}"),
        ("system allocs / frees", f"{s['system_alloc_count']} / {s['system_free_count']}"),
        ("out-of-memory errors", str(s["oom_count"])),
        ("cache flushes", str(s["cache_flushes"])),
        ("limit", _fmt(s["limit_bytes"]) if s["limit_bytes"] else "none"),
    ]
    lines += [f"{name:<22}{value:>36}" for name, value in counters]
    return "\n".join(lines)


def plot_snapshot(path: str, device: int | str = "cpu", blocks: list[dict] | None = None) -> str:
    """Draw each segment as a bar of its blocks (live: colour by pool, free: grey) to a PNG.

    Needs matplotlib (``pip install blutrain-alloc[plot]``). Written atomically;
    returns ``path``.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "plot_snapshot needs matplotlib: pip install 'blutrain-alloc[plot]'"
        ) from e
    from . import snapshot

    if blocks is None:
        blocks = snapshot(device)
    segments: dict[int, list[dict]] = {}
    for b in blocks:
        segments.setdefault(b["segment"], []).append(b)
    colours = {"small": "#4c72b0", "large": "#dd8452"}
    fig, ax = plt.subplots(figsize=(10, max(2.0, 0.3 * len(segments) + 1)))
    for row, (seg, blks) in enumerate(sorted(segments.items())):
        for b in blks:
            colour = colours.get(b["pool"], "#55a868") if b["allocated"] else "#d0d0d0"
            ax.barh(row, b["size"] / 2**20, left=(b["address"] - seg) / 2**20, color=colour,
                    edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(segments)))
    ax.set_yticklabels([f"{seg:#x}" for seg in sorted(segments)], fontsize=6)
    ax.set_xlabel("offset in segment (MiB)")
    ax.set_title(f"blutrain.alloc segments on {device}: live small (blue), large (orange), "
                 "graph (green), free (grey)", fontsize=9)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=directory)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path
