"""The caching policy on pageable host memory: the same code path as on the GPU."""

from __future__ import annotations

import ctypes
import random
import threading

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import blutrain.alloc as ba

from pool_invariants import MIB, check_structure, rounded, segment_size


def fill(ptr: int, size: int, tag: int) -> None:
    ctypes.memset(ptr, tag & 0xFF, size)


def holds(ptr: int, size: int, tag: int) -> bool:
    """Probe the start, middle and end for the tag written by fill()."""
    want = bytes([tag & 0xFF])
    return all(
        ctypes.string_at(ptr + off, 1) == want for off in {0, size // 2, size - 1}
    )


def test_rounding_and_exact_stats(host_clean):
    sizes = [1, 511, 512, 513, 4096, 1_000_000, 1 << 20, (1 << 20) + 1, 9 * MIB, 33 * MIB]
    ptrs = [ba.malloc(n) for n in sizes]
    s = ba.stats("cpu")
    # 33 MiB comes from a 34 MiB segment; the 1 MiB rest is too small to split off.
    assert s["allocated_bytes"] == sum(rounded(n) for n in sizes) + MIB
    assert s["requested_bytes"] == sum(sizes)
    assert s["active_blocks"] == len(sizes)
    for p in ptrs:
        assert p % 512 == 0
    check_structure("cpu", dict(zip(ptrs, sizes)))
    for p in ptrs:
        ba.free(p)
    s = ba.stats("cpu")
    assert s["allocated_bytes"] == 0 and s["requested_bytes"] == 0
    assert s["allocated_bytes_peak"] == sum(rounded(n) for n in sizes) + MIB
    assert s["requested_bytes_peak"] == sum(sizes)
    assert s["alloc_count"] - s["free_count"] == 0


def test_segment_sizes_follow_the_policy(host_clean):
    for n in [100, 700_000, 2 * MIB, 11 * MIB, 31 * MIB + 5]:
        before = ba.stats("cpu")["reserved_bytes"]
        p = ba.malloc(n)
        grown = ba.stats("cpu")["reserved_bytes"] - before
        assert grown in (0, segment_size(n)), (n, grown)
        ba.free(p)
        ba.empty_cache("cpu")


def test_freed_block_is_reused_at_once(host_clean):
    p = ba.malloc(3000)
    ba.free(p)
    q = ba.malloc(2900)  # same rounded size class: best fit gives the same block back
    assert q == p
    ba.free(q)


def test_split_and_merge_restore_one_block(host_clean):
    a, b, c = ba.malloc(1000), ba.malloc(1000), ba.malloc(1000)
    assert b == a + 1024 and c == b + 1024, "consecutive blocks split from one segment"
    ba.free(b)
    ba.free(a)
    ba.free(c)
    blocks = [x for x in ba.snapshot("cpu") if x["segment"] <= a < x["segment"] + 2 * MIB]
    assert len(blocks) == 1 and not blocks[0]["allocated"] and blocks[0]["size"] == 2 * MIB


def test_empty_cache_returns_everything(host_clean):
    ptrs = [ba.malloc(n) for n in (10, 2 * MIB, 25 * MIB)]
    for p in ptrs:
        ba.free(p)
    assert ba.stats("cpu")["reserved_bytes"] > 0
    ba.empty_cache("cpu")
    s = ba.stats("cpu")
    assert s["reserved_bytes"] == 0 and s["segments"] == 0
    assert s["system_free_count"] >= 3


def test_contents_survive_neighbours(host_clean):
    rng = random.Random(7)
    live = {}
    for i in range(300):
        n = rng.choice([rng.randint(1, 4096), rng.randint(1, 3 * MIB)])
        p = ba.malloc(n)
        fill(p, n, i)
        live[p] = (n, i)
        if rng.random() < 0.4:
            q = rng.choice(list(live))
            nq, tag = live.pop(q)
            assert holds(q, nq, tag), "a block's contents were overwritten"
            ba.free(q)
    for p, (n, tag) in live.items():
        assert holds(p, n, tag)
        ba.free(p)


class PoolMachine(RuleBasedStateMachine):
    """Random malloc/free sequences keep the pool's structure and statistics exact."""

    def __init__(self):
        super().__init__()
        ba.empty_cache("cpu")
        self.live: dict[int, tuple[int, int]] = {}
        self.tag = 0

    @rule(size=st.one_of(st.integers(1, 8192), st.integers(8192, 3 * MIB),
                         st.integers(3 * MIB, 24 * MIB)))
    def malloc(self, size):
        p = ba.malloc(size)
        assert p not in self.live
        self.tag += 1
        fill(p, size, self.tag)
        self.live[p] = (size, self.tag)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        p = data.draw(st.sampled_from(sorted(self.live)))
        size, tag = self.live.pop(p)
        assert holds(p, size, tag)
        ba.free(p)

    @rule()
    def empty_cache(self):
        ba.empty_cache("cpu")
        s = ba.stats("cpu")
        # Only segments holding live blocks may remain.
        live_segments = {b["segment"] for b in ba.snapshot("cpu") if b["allocated"]}
        assert s["segments"] == len(live_segments)

    @invariant()
    def structure(self):
        check_structure("cpu", {p: n for p, (n, _) in self.live.items()})

    def teardown(self):
        for p in list(self.live):
            ba.free(p)
        ba.empty_cache("cpu")
        assert ba.stats("cpu")["reserved_bytes"] == 0


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class ExpandablePoolMachine(PoolMachine):
    """The same invariants with large blocks in one growing, shrinking segment."""

    def __init__(self):
        super().__init__()
        ba.set_expandable(True, "cpu")

    def teardown(self):
        super().teardown()
        ba.set_expandable(False, "cpu")


TestExpandablePoolMachine = ExpandablePoolMachine.TestCase
TestExpandablePoolMachine.settings = settings(max_examples=40, stateful_step_count=40,
                                              deadline=None)


def test_expandable_segment_grows_in_place_and_shrinks(host_clean):
    ba.set_expandable(True, "cpu")
    try:
        a = ba.malloc(30 * MIB)
        b = ba.malloc(5 * MIB)
        assert b == a + 30 * MIB, "one segment grows at its end"
        fill(a, 30 * MIB, 1)
        fill(b, 5 * MIB, 2)
        ba.free(b)
        c = ba.malloc(50 * MIB)  # the free tail grows in place to serve a bigger request
        assert c == b
        assert holds(a, 30 * MIB, 1)
        (seg,) = {x["segment"] for x in ba.snapshot("cpu")}
        assert ba.stats("cpu")["reserved_bytes"] == 80 * MIB
        ba.free(c)
        ba.empty_cache("cpu")
        assert ba.stats("cpu")["reserved_bytes"] == 30 * MIB, "the free tail was unmapped"
        ba.free(a)
        ba.empty_cache("cpu")
        s = ba.stats("cpu")
        assert s["reserved_bytes"] == 0 and s["segments"] == 0
        del seg
    finally:
        ba.set_expandable(False, "cpu")


def test_no_caching_gives_each_request_its_own_exact_segment(host_clean):
    keep = ba.malloc(5000)
    ba.free(keep)
    assert ba.stats("cpu")["reserved_bytes"] > 0, "cached before"
    ba.set_caching(False, "cpu")
    try:
        assert ba.stats("cpu")["reserved_bytes"] == 0, "turning caching off returns the cache"
        sizes = [1, 1000, 3 * MIB + 7]
        ptrs = [ba.malloc(n) for n in sizes]
        for p, n in zip(ptrs, sizes):
            fill(p, n, n)
        s = ba.stats("cpu")
        assert s["segments"] == len(sizes)
        assert s["reserved_bytes"] == s["allocated_bytes"] == sum(sizes)
        blocks = {x["address"]: x for x in ba.snapshot("cpu")}
        assert sorted(b["size"] for b in blocks.values()) == sorted(sizes)
        ba.free(ptrs[1])
        assert ba.stats("cpu")["reserved_bytes"] == sizes[0] + sizes[2], "freed at once"
        assert holds(ptrs[0], sizes[0], sizes[0]) and holds(ptrs[2], sizes[2], sizes[2])
        for p in (ptrs[0], ptrs[2]):
            ba.free(p)
        s = ba.stats("cpu")
        assert s["reserved_bytes"] == 0 and s["segments"] == 0
    finally:
        ba.set_caching(True, "cpu")
    p, q = ba.malloc(1000), ba.malloc(1000)
    assert q == p + 1024, "caching again: blocks split from one segment"
    ba.free(p)
    ba.free(q)


def test_unknown_option_names_the_known_ones():
    known = "known: expandable_segments, caching"
    with pytest.raises(ValueError, match=f"unknown option 'cachng'; {known}"):
        ba.set_option("cachng", 0)


def test_many_threads(host_clean):
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        mine = {}
        try:
            for i in range(2000):
                if mine and rng.random() < 0.5:
                    p = rng.choice(list(mine))
                    n, tag = mine.pop(p)
                    if not holds(p, n, tag):
                        errors.append("corrupted block")
                    ba.free(p)
                else:
                    n = rng.choice([rng.randint(1, 2048), rng.randint(1, 2 * MIB)])
                    p = ba.malloc(n)
                    fill(p, n, seed * 7 + i)
                    mine[p] = (n, seed * 7 + i)
            for p, (n, tag) in mine.items():
                if not holds(p, n, tag):
                    errors.append("corrupted block")
                ba.free(p)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    s = ba.stats("cpu")
    assert s["active_blocks"] == 0 and s["allocated_bytes"] == 0
    check_structure("cpu", {})


@pytest.mark.parametrize("size", [0, -1, -(1 << 40)])
def test_bad_sizes(host_clean, size):
    with pytest.raises(ValueError, match=r"\[malloc\] size must be positive"):
        ba.malloc(size)


def test_huge_size(host_clean):
    with pytest.raises(ValueError, match=r"\[malloc\] size .* beyond any device"):
        ba.malloc(1 << 60)
    with pytest.raises(ba.OutOfMemoryError, match="out of memory"):
        ba.malloc(1 << 49)  # within the sanity limit, beyond this machine
    p = ba.malloc(100)  # still works
    ba.free(p)


def test_double_free_and_foreign_pointer(host_clean):
    p = ba.malloc(64)
    ba.free(p)
    with pytest.raises(ValueError, match=r"\[free\] pointer .* not allocated by blutrain.alloc"):
        ba.free(p)
    foreign = ctypes.addressof(ctypes.create_string_buffer(64))
    with pytest.raises(ValueError, match="not allocated"):
        ba.free(foreign)
    with pytest.raises(ValueError, match=r"\[record_stream\]"):
        ba.record_stream(foreign, 0)
    ba.free(0)  # like free(NULL): nothing to do


def test_bad_devices(host_clean):
    with pytest.raises(ValueError, match="device -7 is not valid"):
        ba.malloc(10, -7)
    with pytest.raises(ValueError, match="unknown device"):
        ba.malloc(10, "tpu")
    with pytest.raises(ValueError, match=r"\[set_memory_fraction\] fraction must be in"):
        ba.set_memory_fraction(1.5, "cpu")


@pytest.mark.skipif(ba.device_count() > 0, reason="checks the CPU-only build's error")
def test_cuda_in_cpu_only_build_is_a_clear_error():
    with pytest.raises(RuntimeError, match="CUDA"):
        ba.malloc(10, "cuda:0")
    with pytest.raises(RuntimeError, match="pinned host memory needs"):
        ba.malloc(10, "pinned")


def test_limit_gives_oom_with_stats_then_recovers(host_clean):
    ba.set_memory_limit(24 * MIB, "cpu")
    p = ba.malloc(15 * MIB)  # 20 MiB segment
    with pytest.raises(ba.OutOfMemoryError) as info:
        ba.malloc(15 * MIB)
    msg = str(info.value)
    assert "tried to allocate 15.00 MiB" in msg and "reserved" in msg and "limit 24.00 MiB" in msg
    assert isinstance(info.value, MemoryError)
    s = ba.stats("cpu")
    assert s["oom_count"] >= 1 and s["limit_bytes"] == 24 * MIB
    ba.free(p)
    q = ba.malloc(15 * MIB)  # reuses the cached segment
    ba.free(q)


def test_oom_releases_cache_before_failing(host_clean):
    a = ba.malloc(15 * MIB)  # a 16 MiB segment, cached once freed
    ba.free(a)
    b = ba.malloc(1000)  # a small segment: 2 MiB
    reserved = ba.stats("cpu")["reserved_bytes"]
    assert reserved == 18 * MIB
    ba.set_memory_limit(reserved + 2 * MIB, "cpu")
    c = ba.malloc(17 * MIB)  # an 18 MiB segment fits only once the cached 16 MiB is returned
    s = ba.stats("cpu")
    assert s["cache_flushes"] >= 1 and s["reserved_bytes"] == 20 * MIB
    ba.free(b)
    ba.free(c)


def test_reset_peak_stats(host_clean):
    p = ba.malloc(5 * MIB)
    ba.free(p)
    assert ba.stats("cpu")["allocated_bytes_peak"] >= 5 * MIB
    ba.reset_peak_stats("cpu")
    assert ba.stats("cpu")["allocated_bytes_peak"] == 0


def test_summary(host_clean):
    p = ba.malloc(3 * MIB)
    text = ba.memory_summary("cpu")
    ba.free(p)
    assert "allocated" in text and "3.00 MiB" in text and "fragmentation" in text


def test_plot_snapshot(host_clean, tmp_path):
    pytest.importorskip("matplotlib")
    p = ba.malloc(3 * MIB)
    try:
        out = ba.plot_snapshot(str(tmp_path / "segments.png"), "cpu")
    finally:
        ba.free(p)
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_graph_pool_needs_a_cuda_device(host_clean):
    with pytest.raises(ValueError, match="needs a CUDA device"):
        with ba.graph_pool("cpu", 0):
            pass
