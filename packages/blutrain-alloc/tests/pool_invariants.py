"""Checks of the pool's structure shared by the host and the GPU tests."""

from __future__ import annotations

import blutrain.alloc as ba

GRANULE = 512  # bytes
SMALL_REQUEST = 1 << 20  # bytes
MIB = 1 << 20


def rounded(n: int) -> int:
    return (n + GRANULE - 1) // GRANULE * GRANULE


def segment_size(n: int) -> int:
    r = rounded(n)
    if r <= SMALL_REQUEST:
        return 2 * MIB
    if r < 10 * MIB:
        return 20 * MIB
    return (r + 2 * MIB - 1) // (2 * MIB) * (2 * MIB)


def check_structure(device, live: dict[int, int]) -> None:
    """Segments are tiled by their blocks without gaps or overlaps, no two free
    neighbours are left unmerged, and the live set matches ours and the stats."""
    blocks = ba.snapshot(device)
    stats = ba.stats(device)
    by_segment: dict[int, list[dict]] = {}
    for b in blocks:
        by_segment.setdefault(b["segment"], []).append(b)
    reserved = 0
    allocated = 0
    seen_live = {}
    for seg, blks in by_segment.items():
        blks.sort(key=lambda b: b["address"])
        assert blks[0]["address"] == seg, "a segment must start with its first block"
        for a, b in zip(blks, blks[1:]):
            assert a["address"] + a["size"] == b["address"], "gap or overlap between blocks"
            assert a["allocated"] or b["allocated"], "two free neighbours were not merged"
        for b in blks:
            assert b["size"] % GRANULE == 0 and b["size"] > 0
            assert b["address"] % GRANULE == 0
            if b["allocated"]:
                allocated += b["size"]
                seen_live[b["address"]] = b["requested"]
        reserved += sum(b["size"] for b in blks)
    assert seen_live == live
    # A large block keeps an unsplit remainder of at most 1 MiB.
    assert stats["allocated_bytes"] == allocated
    exact = sum(rounded(n) for n in live.values())
    slack = sum(SMALL_REQUEST for n in live.values() if rounded(n) > SMALL_REQUEST)
    assert exact <= allocated <= exact + slack
    assert stats["requested_bytes"] == sum(live.values())
    assert stats["reserved_bytes"] == reserved
    assert stats["active_blocks"] == len(live)
    assert stats["segments"] == len(by_segment)
