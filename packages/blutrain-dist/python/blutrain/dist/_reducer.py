"""Gradient buckets and their reduction while backward runs: the engine under
DistributedDataParallel (all-reduce) and ZeroOptimizer (reduce-scatter to shards).

Policy.
- Buckets hold parameters in reverse registration order (backward produces gradients roughly in
  that order), one dtype and device each, the first one small (``first_bucket_mb``, so the first
  reduction starts early) and the others up to ``bucket_mb``.  Each bucket is one flat buffer
  padded to ``world_size x chunk`` elements (chunk a multiple of 16): rank r owns chunk r (ZeRO's
  shard) and every collective moves equal pieces.
- A parameter's ``.grad`` is a view of its bucket (no copy between the gradient and the bucket).
  A window of accumulation (the micro-batches of one optimizer step) starts without a zero fill:
  every parameter's next gradient replaces its view's values (blutrain.tensor's
  ``_set_grad_overwrite``); later micro-batches add in place.
- Hooks drive everything.  A leaf's tensor hook runs before its gradient is accumulated: the
  first one of a backward opens the micro-batch (and the window).  Its "gradient final" hook runs
  after: when the last parameter of a bucket has reported in a synchronising backward (not under
  ``no_sync()``), the bucket's collective is launched, in bucket order (every rank issues the
  same sequence), on the communication stream, while backward goes on.  When every parameter has
  reported, the current stream waits for all of them (no host sync with NCCL), so the gradients
  are reduced when ``backward()`` returns, as in PyTorch.
- Note [deterministic accumulation]: in deterministic mode the micro-batches of a window are
  summed in the tree of Note [ordered sum] (src/cuda/kernels.cu): micro-batch i pushes a fresh
  buffer when the top of the per-bucket stack holds more than one micro-batch, equal-size
  subtrees are merged when a micro-batch completes, and the rest is folded from the top when the
  bucket is reduced.  The reduction then sums the ranks' subtrees in the same tree, so 1, 2 or 4
  ranks with the same global batch give the same bits.  It costs log2(accumulation) extra
  buffers; with one micro-batch per step, none.
- ZeRO-2 (``keep_full_grads=False``): a bucket's buffer exists from its first gradient until its
  reduce-scatter has been issued; then ``.grad`` is dropped and the buffer goes back to the
  allocator at once (record_stream keeps it from reuse until the collective has read it), so
  with one micro-batch per step the full gradient never exists at once: backward's peak holds
  the buckets in flight only.  Under ``no_sync()`` the buckets accumulate whole until the
  synchronising backward.
- Cost per step (the hot path): no zero fill and no copy beyond the one each gradient needs to
  land in its view; the views of a persistent buffer (DDP, ZeRO-1) are made once; per parameter
  one pre-hook and one post-hook call of a few attribute reads; per bucket one collective
  launch (two event records and a stream wait, no host sync with NCCL).

Locking rule: hooks run on the thread that calls backward; nothing here is shared with the
watchdog thread.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import blutrain.tensor as bt

from . import _backend
from ._backend import AVG, SUM, Work
from ._group import DistError, ProcessGroup

_ALIGN = 16  # elements a chunk is a multiple of (64 bytes of float32)
_MB = 1 << 20


class Bucket:
    """Parameters reduced together, and where they live in the flat buffer."""

    def __init__(self, index: int, dtype: Any, device: str) -> None:
        self.index = index
        self.dtype = dtype
        self.device = device
        self.params: list[bt.Tensor] = []
        self.names: list[str] = []
        self.offsets: list[int] = []
        self.numel = 0  # real elements
        self.chunk = 0  # elements a rank owns
        self.padded = 0  # world_size x chunk
        self.buffer: bt.Tensor | None = None
        self.buffer_views: list[bt.Tensor] | None = None  # of a persistent buffer, made once
        self.stack: list[tuple[bt.Tensor, int]] = []  # Note [deterministic accumulation]
        self.pending = 0
        self.seen_this_micro = False
        self.launched = False
        self.work: Work | None = None

    def add(self, name: str, p: bt.Tensor) -> None:
        self.params.append(p)
        self.names.append(name)
        self.offsets.append(self.numel)
        self.numel += p.numel()

    def finalize(self, world: int) -> None:
        chunk = -(-self.numel // world)
        self.chunk = -(-chunk // _ALIGN) * _ALIGN
        self.padded = self.chunk * world

    def views(self, buf: bt.Tensor) -> list[bt.Tensor]:
        return [
            buf[o : o + p.numel()].view(*p.shape) if p.ndim else buf[o : o + 1].view()
            for p, o in zip(self.params, self.offsets, strict=True)
        ]

    def nbytes(self) -> int:
        return self.padded * self.dtype.itemsize


def build_buckets(
    named: list[tuple[str, bt.Tensor]], world: int, first_bucket_mb: float, bucket_mb: float
) -> list[Bucket]:
    """Buckets over the parameters in reverse order (see the module docstring)."""
    if not bucket_mb > 0 or not first_bucket_mb > 0:
        raise ValueError(
            f"[buckets] bucket sizes must be > 0 MiB, got first_bucket_mb={first_bucket_mb}, "
            f"bucket_mb={bucket_mb}"
        )
    buckets: list[Bucket] = []
    cur: Bucket | None = None
    for name, p in reversed(named):
        cap = (
            first_bucket_mb
            if not buckets or (len(buckets) == 1 and cur is buckets[0])
            else bucket_mb
        ) * _MB
        full = cur is not None and cur.numel and (cur.numel + p.numel()) * p.dtype.itemsize > cap
        if cur is None or full or cur.dtype != p.dtype or cur.device != str(p.device):
            cur = Bucket(len(buckets), p.dtype, str(p.device))
            buckets.append(cur)
        cur.add(name, p)
    for b in buckets:
        b.finalize(world)
    return buckets


def layout_description(buckets: list[Bucket]) -> list[tuple[Any, ...]]:
    return [
        (b.index, b.dtype.name, b.device.split(":")[0], n, tuple(p.shape))
        for b in buckets
        for n, p in zip(b.names, b.params, strict=True)
    ]


def check_layout_agrees(g: ProcessGroup, buckets: list[Bucket], who: str) -> None:
    """Note [setup check]: every rank's parameter names, shapes, dtypes and bucket layout must
    match rank 0's; a digest is compared first, the descriptions only on a mismatch."""
    if g.size == 1:
        return
    desc = layout_description(buckets)
    digest = hashlib.sha256(repr(desc).encode()).hexdigest()
    digests = g.allgather_object(digest, f"{who} setup check")
    if len(set(digests)) == 1:
        return
    descs = g.allgather_object(desc, f"{who} setup check (details)")
    bad = next(q for q, d in enumerate(digests) if d != digests[0])
    a, b = descs[0], descs[bad]
    for i in range(max(len(a), len(b))):
        ea = a[i] if i < len(a) else None
        eb = b[i] if i < len(b) else None
        if ea != eb:

            def fmt(e: Any) -> str:
                if e is None:
                    return "nothing (fewer parameters)"
                return f"{e[3]} {e[4]} {e[1]} on {e[2]} in bucket {e[0]}"

            raise DistError(
                f"[{who}] ranks disagree on the model at parameter #{i}: rank 0 has {fmt(ea)}, "
                f"rank {bad} has {fmt(eb)}"
            )
    raise DistError(f"[{who}] ranks 0 and {bad} disagree on the bucket layout")  # pragma: no cover


class Reducer:
    """See the module docstring.  ``mode``: "all_reduce" (DDP) or "reduce_scatter" (ZeRO; the
    reduced chunk of bucket b lands in ``shard_out(b)``)."""

    def __init__(
        self,
        g: ProcessGroup,
        named: list[tuple[str, bt.Tensor]],
        *,
        who: str,
        mode: str,
        reduce_dtype: Any,
        first_bucket_mb: float,
        bucket_mb: float,
        keep_full_grads: bool,
        find_unused_parameters: bool,
        shard_out: Callable[[Bucket], bt.Tensor] | None = None,
    ) -> None:
        self.g = g
        self.who = who
        self.mode = mode
        self.keep_full_grads = keep_full_grads
        self.find_unused = find_unused_parameters
        self.shard_out = shard_out
        self.named = [(n, p) for n, p in named if p.requires_grad]
        if not self.named:
            raise ValueError(f"[{who}] the model has no parameter that requires grad")
        for n, p in self.named:
            if not p.is_floating_point():
                raise TypeError(f"[{who}] parameter {n} is {p.dtype.name}, not floating point")
            if not p.is_contiguous():
                raise ValueError(f"[{who}] parameter {n} is not contiguous")
            dev = str(p.device)
            if dev != "cpu" and dev != g.device:
                raise ValueError(
                    f"[{who}] parameter {n} is on {dev} but this rank's device is {g.device}: "
                    "move the model to dist.device() first"
                )
        self.buckets = build_buckets(self.named, g.size, first_bucket_mb, bucket_mb)
        self.reduce_dtype = reduce_dtype
        floats = (bt.float32, bt.bfloat16, bt.float16, bt.float64)
        if reduce_dtype is not None and reduce_dtype not in floats:
            raise TypeError(f"[{who}] reduce_dtype must be a floating dtype, got {reduce_dtype}")
        check_layout_agrees(g, self.buckets, who)
        self._where: dict[int, tuple[Bucket, int]] = {}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)
        self._sync = True
        self.window_open = False
        self.micro = -1  # micro-batch index inside the window
        self._micro_done = True
        self._micro_sync = True
        self._arrived: set[int] = set()
        self._next_launch = 0
        self.reductions = 0  # bucket collectives launched (tests count them)
        self.windows = 0  # synchronising backwards reduced (one per optimizer step)
        # bytes of gradient buffers alive now, and the most at once in the current window
        self.live_grad_bytes = 0
        self.peak_grad_bytes = 0
        self._handles: list[Any] = []
        if keep_full_grads:
            for b in self.buckets:
                b.buffer = bt.zeros(b.padded, dtype=b.dtype, device=b.device)
                b.buffer_views = b.views(b.buffer)
                self._attach(b, b.buffer)
                self._grad_bytes(b.nbytes())
        for _, p in self.named:
            self._handles.append(p.register_hook(self._make_pre_hook(p)))
            self._handles.append(p.register_post_accumulate_grad_hook(self._make_post_hook(p)))

    # -- windows and micro-batches -------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    def _attach(self, b: Bucket, buf: bt.Tensor) -> None:
        views = b.buffer_views if buf is b.buffer and b.buffer_views else b.views(buf)
        for p, v in zip(b.params, views, strict=True):
            p.grad = v
        bt._tensor._set_grad_overwrite(b.params, True)

    def _grad_bytes(self, delta: int) -> None:
        self.live_grad_bytes += delta
        self.peak_grad_bytes = max(self.peak_grad_bytes, self.live_grad_bytes)

    def _deterministic(self) -> bool:
        return self.g.deterministic

    def _make_pre_hook(self, p: bt.Tensor) -> Callable[[bt.Tensor], None]:
        pid, me = id(p), weakref.ref(self)

        def hook(grad: bt.Tensor) -> None:
            self = me()
            if self is None:
                return None
            if self._micro_done:
                self._start_micro()
            elif pid in self._arrived:  # a new backward: the last one left parameters out
                if self._micro_sync or not self.find_unused:
                    self._missing_error()
                self._start_micro()
            b, _ = self._where[pid]
            if not b.seen_this_micro:
                b.seen_this_micro = True
                self._route(b)
            return None

        return hook

    def _start_micro(self) -> None:
        if not self.window_open:
            self.window_open = True
            self.peak_grad_bytes = self.live_grad_bytes
            self.micro = -1
            self._next_launch = 0
            for b in self.buckets:
                b.launched = False
                b.work = None
        self.micro += 1
        self._micro_done = False
        self._micro_sync = self._sync
        self._arrived = set()
        for b in self.buckets:
            b.pending = len(b.params)
            b.seen_this_micro = False

    def _route(self, b: Bucket) -> None:
        """Where this micro-batch's gradients of bucket b go (Note [deterministic
        accumulation]); called at the bucket's first gradient of the micro-batch."""
        if self.micro == 0:
            if b.buffer is None:  # ZeRO-2: this bucket's buffer exists from now to its reduction
                b.buffer = bt.empty(b.padded, dtype=b.dtype, device=b.device)
                if b.padded > b.numel:
                    b.buffer[b.numel :].zero_()
                self._grad_bytes(b.nbytes())
            b.stack = [(b.buffer, 1)]
            self._attach(b, b.buffer)
            return
        if not self._deterministic():
            return  # accumulate in place into the top buffer
        top, count = b.stack[-1]
        if count == 1:  # g_{i-1} + g_i: a pair, in place
            b.stack[-1] = (top, 2)
            return
        buf = bt.empty(b.padded, dtype=b.dtype, device=b.device)
        if b.padded > b.numel:
            buf[b.numel :].zero_()
        b.stack.append((buf, 1))
        self._attach(b, buf)
        self._grad_bytes(b.nbytes())

    def _merge_equal(self, b: Bucket) -> None:
        while len(b.stack) >= 2 and b.stack[-1][1] == b.stack[-2][1]:
            (lo, n), (hi, _) = b.stack[-2], b.stack[-1]
            with bt.no_grad():
                lo.add_(hi)
            b.stack[-2:] = [(lo, 2 * n)]
            self._grad_bytes(-b.nbytes())

    def _fold(self, b: Bucket) -> None:
        while len(b.stack) >= 2:
            (lo, n), (hi, m) = b.stack[-2], b.stack[-1]
            with bt.no_grad():
                lo.add_(hi)
            b.stack[-2:] = [(lo, n + m)]
            self._grad_bytes(-b.nbytes())
        if b.stack and b.stack[0][0] is not b.buffer:  # pragma: no cover - stack[0] is the buffer
            raise RuntimeError("[reducer] internal: the stack lost its bucket buffer")

    def _make_post_hook(self, param: bt.Tensor) -> Callable[[bt.Tensor], None]:
        # The hook gets a new wrapper of the leaf: keep the parameter's identity.  Weak: the
        # tensor's C++ hook list would otherwise hold the reducer in a cycle Python cannot see.
        pid, me = id(param), weakref.ref(self)

        def hook(_: bt.Tensor) -> None:
            s = me()
            if s is not None:
                s._post_hook(pid)

        return hook

    def _post_hook(self, pid: int) -> None:
        b, i = self._where[pid]
        p = b.params[i]
        self._arrived.add(pid)
        g = p.grad
        if g is None or g.data_ptr() != b.stack[-1][0].data_ptr() + b.offsets[i] * b.dtype.itemsize:
            self._reattach(p, b, i)
        b.pending -= 1
        if self._sync and b.pending == 0:
            self._ready(b)
        if len(self._arrived) == len(self.named):
            self._micro_complete()

    def _reattach(self, p: bt.Tensor, b: Bucket, i: int) -> None:
        """.grad was replaced (zero_grad(set_to_none=True), an assignment): copy it into the
        bucket and point .grad back at the view."""
        top = b.stack[-1][0]
        view = b.views(top)[i]
        with bt.no_grad():
            if p.grad is not None:
                view.copy_(p.grad)
            else:
                view.zero_()
        p.grad = view

    def _micro_complete(self) -> None:
        self._micro_done = True
        if not self._sync:
            if self._deterministic():
                for b in self.buckets:
                    self._merge_equal(b)
            return
        self._finish_window()

    def _ready(self, b: Bucket) -> None:
        while self._next_launch < len(self.buckets):
            nb = self.buckets[self._next_launch]
            if nb.pending != 0:
                break
            self._launch(nb)
            self._next_launch += 1

    def _launch(self, b: Bucket) -> None:
        if self._deterministic() and len(b.stack) > 1:
            self._merge_equal(b)
            self._fold(b)
            views = b.buffer_views or b.views(b.buffer)
            for p, v in zip(b.params, views, strict=True):
                p.grad = v  # back to the bucket itself (the folded sum)
        buf = b.buffer
        seq = self.g.next_seq()
        what = (
            f"{self.mode} #{seq} ({self.who} bucket {b.index}, {b.dtype.name}, {b.padded} elements)"
        )
        be = self._backend(buf)
        rd = self.reduce_dtype if self.reduce_dtype not in (None, b.dtype) else None
        if self.mode == "all_reduce":
            if rd is None:
                w = be.all_reduce(buf, AVG, what, seq)
            else:
                w = self._cast_reduce(be, buf, rd, what, seq)
        else:
            out = self.shard_out(b) if self.shard_out else None
            if rd is None:
                w = be.reduce_scatter(out, buf, AVG, what, seq)
            else:
                tmp = buf.to(rd)
                w = be.reduce_scatter(out, tmp, AVG, what, seq)
        b.work = w
        b.launched = True
        self.reductions += 1
        if not self.keep_full_grads:
            self._release(b)

    def _release(self, b: Bucket) -> None:
        """ZeRO-2: the bucket's full gradient is no longer needed once its reduce-scatter has
        been issued.  NCCL's inputs are record_stream'ed on the comm stream (so the allocator
        hands the memory out again only after the collective has read it); the staged path is
        synchronous; an MPI work keeps its input until it completes, so the earlier buckets'
        works are polled here (MPI progresses, and the finished ones let their buffers go)."""
        for p in b.params:
            p.grad = None
        if b.buffer is not None:
            self._grad_bytes(-b.nbytes())
        b.buffer = None
        b.stack = []
        for q in self.buckets[: b.index]:
            w = q.work
            if isinstance(w, _backend._MpiWork) and not w._done:
                w.is_completed()

    def _cast_reduce(self, be: Any, buf: bt.Tensor, rd: Any, what: str, seq: int) -> Work:
        """All-reduce in reduce_dtype: cast in, SUM, then cast back divided by the world size
        (rounded once: Note [exact average])."""
        n = self.g.size
        if isinstance(be, _backend.NcclBackend):
            tmp = bt.empty(buf.numel(), dtype=rd, device=buf.device)
            be._begin()
            from . import _dist

            _dist.cast_(buf, tmp, 1, be.cs)
            if self._deterministic() and n > 1:
                mine = bt.empty(buf.numel() // n, dtype=rd, device=buf.device)
                be._ordered(tmp, mine, SUM)
                be.nccl.all_gather(mine, tmp, be.cs)
                mine.record_stream(be.cs)
            else:
                be.nccl.all_reduce(tmp, tmp, SUM, be.cs)
            _dist.cast_(tmp, buf, n, be.cs)
            return be._end(what, seq, [buf, tmp])
        tmp = buf.to(rd)
        w = be.all_reduce(tmp, SUM, what, seq)
        w.wait()
        with bt.no_grad():
            buf.copy_(tmp.double() / float(n) if n > 1 else tmp)
        return w

    def _backend(self, t: bt.Tensor) -> Any:
        from .collectives import _backend_for

        return _backend_for(t, self.g)

    def _finish_window(self) -> None:
        """Every bucket launched: the current stream waits for the reductions (NCCL), the host
        for MPI's; the window closes."""
        for b in self.buckets:
            if not b.launched:
                self._flush_unused(b)
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            b.stack = []
        self.window_open = False
        self.windows += 1

    def _flush_unused(self, b: Bucket) -> None:
        """Reduce a bucket some of whose parameters got no gradient in this window (their part
        counts as zero on this rank); only with find_unused_parameters=True."""
        if b.buffer is None:
            b.buffer = bt.zeros(b.padded, dtype=b.dtype, device=b.device)
            b.stack = [(b.buffer, 1)]
            self._grad_bytes(b.nbytes())
        if self._deterministic():
            self._merge_equal(b)
            self._fold(b)
        views = b.buffer_views or b.views(b.buffer)
        for p, v in zip(b.params, views, strict=True):
            if p._grad_overwrite:  # no gradient reached it in the whole window
                with bt.no_grad():
                    v.zero_()
                p.grad = v
                bt._tensor._set_grad_overwrite([p], False)
        b.pending = 0
        self._launch(b)

    def _missing_error(self) -> None:
        missing = [n for n, p in self.named if id(p) not in self._arrived]
        names = f"{missing[:6]}{' ...' if len(missing) > 6 else ''}"
        if self.find_unused:
            raise DistError(
                f"[{self.who}] a new backward started before the last synchronising one was "
                f"finished (parameter(s) {names} got no gradient): with "
                "find_unused_parameters=True call finish_gradient_sync() after each step's last "
                "backward"
            )
        raise DistError(
            f"[{self.who}] parameter(s) {names} got no gradient in the last backward, so their "
            "buckets were never reduced: pass find_unused_parameters=True (their gradient then "
            "counts as 0 on this rank; call finish_gradient_sync() after each step's last "
            "backward), or make them take part in the loss"
        )

    def finish(self) -> None:
        """End the window after the last backward of a step.  A no-op when every parameter got
        its gradient (the window closed itself); otherwise, with find_unused_parameters=True,
        the buckets still open are reduced with zeros for the missing gradients."""
        if not self.window_open or self._micro_done:
            return
        if not self._micro_sync:
            raise DistError(
                f"[{self.who}] finish_gradient_sync() after a backward under no_sync(): the "
                "last backward of a step must synchronise"
            )
        if not self.find_unused:
            self._missing_error()
        self._micro_done = True
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if not b.launched:
                self._flush_unused(b)
            self._next_launch += 1
        self._finish_window()

    def check_window_closed(self) -> None:
        """At a forward: the last synchronising backward must have been reduced."""
        if self.window_open and not self._micro_done and self._micro_sync:
            self.finish()

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
