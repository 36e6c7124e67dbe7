"""How a collective moves bytes: MPI (CPU tensors; CUDA tensors staged through pinned host
memory), NCCL (CUDA tensors, on the communication stream), or nothing (one rank).

Every entry takes validated arguments (collectives.py checks them) and returns a :class:`Work`.
Reductions of 16-bit floats over MPI run in float32 (MPI has no bfloat16) and round once into the
tensor.  AVG is SUM then a division by the world size, rounded once (exact for any size).  In
deterministic mode SUM / AVG of floating tensors are an all-to-all, a fixed-order sum of the
ranks' chunks (Note [ordered sum] in src/cuda/kernels.cu) and an all-gather: the same bits for
every world size when each rank's contribution is an aligned subtree of the same global sum.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import blutrain.tensor as bt

from . import _dist

SUM, AVG, MAX, MIN = 0, 1, 2, 3
_FLOAT16 = (bt.float16, bt.bfloat16)


def load_nccl() -> str | None:
    """Load libnccl (the nvidia-nccl-cu13 wheel's first, then the soname); None on success,
    else the reason."""
    if not _dist.built_with_nccl():
        return "blutrain-dist was built without CUDA / NCCL headers"
    paths = []
    try:
        import nvidia  # the nvidia-nccl-cu13 wheel installs nvidia/nccl/lib/libnccl.so.2

        for base in list(nvidia.__path__):
            p = os.path.join(base, "nccl", "lib", "libnccl.so.2")
            if os.path.exists(p):
                paths.append(p)
    except ImportError:
        pass
    _dist.nccl_set_candidates(paths)
    try:
        _dist.nccl_version()
    except RuntimeError as e:
        return str(e)
    return None


# ---- works -----------------------------------------------------------------------------------
class Work:
    """A collective in flight.  ``wait()``: for CUDA tensors the current stream waits for it (no
    host sync, as in PyTorch); for CPU tensors the host waits.  ``is_completed()`` never blocks;
    ``synchronize()`` blocks the host until the data is in place."""

    def __init__(self, what: str, seq: int) -> None:
        self.what = what
        self.seq = seq
        self._done = False

    def wait(self) -> None:
        """Order the result before what comes next: the current CUDA stream waits for it
        (CUDA tensors, no host sync) or the host waits (CPU tensors).  Idempotent."""
        self._done = True

    def is_completed(self) -> bool:
        """True when the data is in place; never blocks."""
        return True

    def synchronize(self) -> None:
        """Block the host until the data is in place (wait() plus, on the GPU, an event sync)."""
        self.wait()

    def __repr__(self) -> str:
        return f"blutrain.dist.Work({self.what}, completed={self.is_completed()})"


class _MpiWork(Work):
    """MPI requests plus what to do once they complete (divide, cast back, copy out)."""

    def __init__(
        self, group: Any, what: str, seq: int, reqs: list[Any], finish: Callable[[], None] | None
    ) -> None:
        super().__init__(what, seq)
        self._group = group
        self._reqs = reqs
        self._finish = finish

    def _complete(self) -> None:
        if self._done:
            return
        self._done = True
        if self._finish is not None:
            f, self._finish = self._finish, None
            f()
        self._group.done_seq = max(self._group.done_seq, self.seq)

    def wait(self) -> None:
        if not self._done:
            self._group.wait_requests(self._reqs, self.what)
            self._complete()

    def is_completed(self) -> bool:
        if self._done:
            return True
        if self._group.MPI.Request.Testall(self._reqs):
            self._complete()
            return True
        return False


class _CudaWork(Work):
    """An event recorded on the communication stream after the collective."""

    def __init__(self, group: Any, what: str, seq: int, device: int, event: int) -> None:
        super().__init__(what, seq)
        self._group = group
        self.device = device
        self.event = event
        self.t0 = time.monotonic()
        self._completed = False

    def poll(self) -> bool:  # the watchdog's query (any thread)
        if not self._completed and self.event and _dist.event_query(self.event):
            self._completed = True
            self._group.done_seq = max(self._group.done_seq, self.seq)
        return self._completed

    def wait(self) -> None:
        if not self._done:
            self._done = True
            _dist.stream_wait_event(bt.cuda.current_stream(self.device), self.event)

    def is_completed(self) -> bool:
        return self.poll()

    def synchronize(self) -> None:
        self.wait()
        _dist.event_synchronize(self.event)
        self.poll()

    def __del__(self) -> None:
        ev, self.event = getattr(self, "event", 0), 0
        try:
            if ev and (getattr(self, "_completed", False) or _dist.event_query(ev)):
                _dist.event_release(ev)  # back to the pool; an incomplete one is never reused
        except Exception:  # pragma: no cover - interpreter shutdown
            pass


def done_work(group: Any, what: str, seq: int) -> Work:
    group.done_seq = max(group.done_seq, seq)
    w = Work(what, seq)
    w._done = True
    return w


# ---- helpers -----------------------------------------------------------------------------------
def _ordered_sum_cpu(chunks: list[bt.Tensor]) -> bt.Tensor:
    """Note [ordered sum]: the binary counter's tree over chunks, each add rounded as bt's."""
    stack: list[tuple[bt.Tensor, int]] = []
    for c in chunks:
        stack.append((c, 1))
        while len(stack) >= 2 and stack[-1][1] == stack[-2][1]:
            (a, n), (b, _) = stack[-2], stack[-1]
            stack[-2:] = [(a + b, 2 * n)]
    while len(stack) >= 2:
        (a, n), (b, m) = stack[-2], stack[-1]
        stack[-2:] = [(a + b, n + m)]
    return stack[0][0]


def _same_memory(a: bt.Tensor, b: bt.Tensor) -> bool:
    """Whether a and b are the same bytes (one rank's in-place collective: nothing to move)."""
    return a.numel() == b.numel() and a.dtype == b.dtype and a.data_ptr() == b.data_ptr()


def _pad_to(n: int, size: int) -> int:
    return -(-n // size) * size


# ---- MPI (CPU tensors, and CUDA tensors staged through pinned host memory) -------------------
class MpiBackend:
    """Collectives over mpi4py on host memory.  CUDA tensors are staged: copied to pinned host
    memory on the comm stream (the host waits for that copy), moved by MPI, and copied back; the
    work completes before the call returns.  This is the test path that lets two ranks share a
    GPU; NCCL is the fast one."""

    def __init__(self, group: Any) -> None:
        self.g = group
        self.MPI = group.MPI
        M = self.MPI
        self._types = {
            bt.bool: M.UINT8_T,  # as 0/1 bytes: sum and max are logical or, min logical and
            bt.uint8: M.UINT8_T,
            bt.int32: M.INT32_T,
            bt.int64: M.INT64_T,
            bt.float16: M.UINT16_T,  # moved as bits; reduced in float32
            bt.bfloat16: M.UINT16_T,
            bt.float32: M.FLOAT,
            bt.float64: M.DOUBLE,
        }

    def _op(self, op: int, dtype: Any) -> Any:
        M = self.MPI
        if dtype == bt.bool:
            return M.MIN if op == MIN else M.MAX
        return {SUM: M.SUM, AVG: M.SUM, MAX: M.MAX, MIN: M.MIN}[op]

    def _spec(self, t: bt.Tensor, count: int | None = None) -> list[Any]:
        """[bytes, count, MPI type] of a contiguous CPU tensor (count: elements, per rank for
        the all-to-all / all-gather family)."""
        return [_dist.host_view(t), t.numel() if count is None else count, self._types[t.dtype]]

    # staged CUDA tensors: host copies in, device copies out --------------------------------
    def _to_host(self, t: bt.Tensor) -> tuple[bt.Tensor, Any]:
        """A CPU tensor holding t's values (t itself on the CPU) and what to do to write back."""
        if not t.is_cuda:
            return t, None
        dev = int(str(t.device).split(":")[1])
        cs = _dist.comm_stream(dev)
        ev = _dist.event_record(dev, bt.cuda.current_stream(dev))
        _dist.stream_wait_event(cs, ev)
        _dist.event_release(ev)
        host = bt.empty(tuple(t.shape), dtype=t.dtype)
        pinned = _dist.pinned_empty(max(1, t.numel() * t.element_size()))
        _dist.copy_d2h(t, pinned, cs)
        _dist.stream_synchronize(cs)
        _dist.host_view(host)[:] = pinned[: t.numel() * t.element_size()]
        return host, (dev, cs)

    def _to_device(self, host: bt.Tensor, t: bt.Tensor, where: Any) -> None:
        dev, cs = where
        n = t.numel() * t.element_size()
        pinned = _dist.pinned_empty(max(1, n))
        pinned[:n] = _dist.host_view(host)
        _dist.copy_h2d(pinned, t, cs)
        _dist.record_host_stream(pinned, cs)
        ev = _dist.event_record(dev, cs)
        _dist.stream_wait_event(bt.cuda.current_stream(dev), ev)
        _dist.event_release(ev)

    def _run(
        self,
        what: str,
        seq: int,
        tensors_in: list[bt.Tensor],
        start: Callable[[list[bt.Tensor]], tuple[list[Any], Callable[[], None] | None]],
        outputs: list[int],
    ) -> Any:
        """Stage CUDA tensors to host, start MPI, and (staged) finish synchronously."""
        hosts, wheres = [], []
        for t in tensors_in:
            h, w = self._to_host(t)
            hosts.append(h)
            wheres.append(w)
        reqs, finish = start(hosts)
        staged = any(w is not None for w in wheres)

        def done() -> None:
            if finish is not None:
                finish()
            for i in outputs:
                if wheres[i] is not None:
                    self._to_device(hosts[i], tensors_in[i], wheres[i])
                _dist.bump_version(tensors_in[i])

        work = _MpiWork(self.g, what, seq, reqs, done)
        if staged:
            work.wait()
        return work

    # reductions -----------------------------------------------------------------------------
    def _reduce_buffer(self, t: bt.Tensor) -> tuple[bt.Tensor, Callable[[], None] | None]:
        """float32 copy of 16-bit floats (MPI cannot add them), written back after."""
        if t.dtype not in _FLOAT16:
            return t, None
        f = t.to(bt.float32)
        return f, lambda: t.copy_(f)

    def all_reduce(self, t: bt.Tensor, op: int, what: str, seq: int) -> Any:
        M, n = self.MPI, self.g.size

        def start(h: list[bt.Tensor]) -> tuple[list[Any], Any]:
            x = h[0]
            if self.g.deterministic and op in (SUM, AVG) and x.is_floating_point():
                return self._ordered_all_reduce(x, op)
            buf, back = self._reduce_buffer(x)
            req = self.g.comm.Iallreduce(M.IN_PLACE, self._spec(buf), self._op(op, x.dtype))

            def finish() -> None:
                if op == AVG and n > 1:
                    buf.div_(float(n))
                if back is not None:
                    back()

            return [req], finish

        return self._run(what, seq, [t], start, [0])

    def _ordered_all_reduce(self, x: bt.Tensor, op: int) -> tuple[list[Any], Any]:
        # all-to-all of chunks, the fixed-order sum of this rank's chunk, all-gather (synchronous
        # inside: this is the deterministic path, not the fast one)
        n, r = self.g.size, self.g.rank
        numel = x.numel()
        chunk = _pad_to(numel, n) // n
        flat = bt.zeros(chunk * n, dtype=x.dtype)
        flat[:numel].copy_(x.reshape(-1))
        recv = bt.empty(chunk * n, dtype=x.dtype)
        req = self.g.comm.Ialltoall(self._spec(flat, chunk), self._spec(recv, chunk))
        self.g.wait_requests([req], "all_reduce (ordered all-to-all)")
        mine = _ordered_sum_cpu([recv[k * chunk : (k + 1) * chunk] for k in range(n)])
        if op == AVG and n > 1:
            mine = mine / float(n)
        flat[r * chunk : (r + 1) * chunk].copy_(mine)
        M = self.MPI
        req = self.g.comm.Iallgather(M.IN_PLACE, self._spec(flat, chunk))

        def finish() -> None:
            x.reshape(-1).copy_(flat[:numel])

        return [req], finish

    def reduce_scatter(self, out: bt.Tensor, inp: bt.Tensor, op: int, what: str, seq: int) -> Any:
        n = self.g.size
        cnt = out.numel()

        def start(h: list[bt.Tensor]) -> tuple[list[Any], Any]:
            o, i = h
            if self.g.deterministic and op in (SUM, AVG) and o.is_floating_point():
                recv = bt.empty(cnt * n, dtype=o.dtype)
                req = self.g.comm.Ialltoall(self._spec(i, cnt), self._spec(recv, cnt))

                def fin_ordered() -> None:
                    s = _ordered_sum_cpu([recv[k * cnt : (k + 1) * cnt] for k in range(n)])
                    if op == AVG and n > 1:
                        s = s / float(n)
                    o.copy_(s.reshape(tuple(o.shape)))

                return [req], fin_ordered
            ib, _ = self._reduce_buffer(i)
            ob, back = self._reduce_buffer(o)
            if ob._shares_storage(
                ib
            ):  # in place (ZeRO-1's chunk of its bucket): MPI forbids aliasing
                dst, ob = ob, bt.empty(tuple(ob.shape), dtype=ob.dtype)
            else:
                dst = None
            req = self.g.comm.Ireduce_scatter_block(
                self._spec(ib, cnt), self._spec(ob), self._op(op, o.dtype)
            )

            def finish() -> None:
                if op == AVG and n > 1:
                    ob.div_(float(n))
                if dst is not None:
                    dst.copy_(ob)
                if back is not None:
                    back()

            return [req], finish

        return self._run(what, seq, [out, inp], start, [0])

    def all_gather(self, out: bt.Tensor, inp: bt.Tensor, what: str, seq: int) -> Any:
        def start(h: list[bt.Tensor]) -> tuple[list[Any], Any]:
            o, i = h
            slot = o.data_ptr() + self.g.rank * i.numel() * i.element_size()
            if i._shares_storage(o) and i.numel():
                if i.data_ptr() != slot:  # aliased elsewhere: MPI forbids it
                    i = i.clone()
                else:  # this rank's slot of the output (ZeRO's parameter chunk)
                    req = self.g.comm.Iallgather(self.MPI.IN_PLACE, self._spec(o, i.numel()))
                    return [req], None
            req = self.g.comm.Iallgather(self._spec(i), self._spec(o, i.numel()))
            return [req], None

        return self._run(what, seq, [out, inp], start, [0])

    def all_gather_v(self, outs: list[bt.Tensor], inp: bt.Tensor, what: str, seq: int) -> Any:
        sizes = [o.numel() for o in outs]
        total = sum(sizes)

        def start(h: list[bt.Tensor]) -> tuple[list[Any], Any]:
            i = h[0]
            flat = bt.empty(max(total, 1), dtype=i.dtype)
            displs = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
            req = self.g.comm.Iallgatherv(
                self._spec(i), [_dist.host_view(flat), sizes, displs, self._types[i.dtype]]
            )

            def finish() -> None:
                for o, d, s in zip(outs, displs, sizes, strict=True):
                    if s:
                        o.reshape(-1).copy_(flat[int(d) : int(d) + s].to(o.device))
                    _dist.bump_version(o)

            return [req], finish

        return self._run(what, seq, [inp], start, [])

    def reduce_scatter_v(
        self, out: bt.Tensor, inps: list[bt.Tensor], op: int, what: str, seq: int
    ) -> Any:
        n = self.g.size
        sizes = [i.numel() for i in inps]
        flat_in = (
            bt.cat([i.reshape(-1).cpu() for i in inps])
            if sum(sizes)
            else bt.empty(1, dtype=out.dtype)
        )

        def start(h: list[bt.Tensor]) -> tuple[list[Any], Any]:
            o = h[0]
            ib, _ = self._reduce_buffer(flat_in)
            ob, back = self._reduce_buffer(o)
            req = self.g.comm.Ireduce_scatter(
                self._spec(ib, sum(sizes)), self._spec(ob), sizes, self._op(op, o.dtype)
            )

            def finish() -> None:
                if op == AVG and n > 1:
                    ob.div_(float(n))
                if back is not None:
                    back()

            return [req], finish

        return self._run(what, seq, [out], start, [0])

    def broadcast(self, t: bt.Tensor, root: int, what: str, seq: int) -> Any:
        def start(h: list[bt.Tensor]) -> tuple[list[Any], Any]:
            return [self.g.comm.Ibcast(self._spec(h[0]), root=root)], None

        return self._run(what, seq, [t], start, [0])

    def send(self, t: bt.Tensor, peer: int, what: str, seq: int) -> Any:
        def start(h: list[bt.Tensor]) -> tuple[list[Any], Any]:
            return [self.g.comm.Isend(self._spec(h[0]), dest=peer, tag=1)], None

        return self._run(what, seq, [t], start, [])

    def recv(self, t: bt.Tensor, peer: int, what: str, seq: int) -> Any:
        def start(h: list[bt.Tensor]) -> tuple[list[Any], Any]:
            return [self.g.comm.Irecv(self._spec(h[0]), source=peer, tag=1)], None

        return self._run(what, seq, [t], start, [0])


# ---- NCCL (CUDA tensors on the communication stream) ------------------------------------------
class NcclBackend:
    """Note [stream order] in src/cuda/streams.cpp: the comm stream waits for the compute stream,
    runs the collective, and records the work's event; tensors are marked in use on the comm
    stream (record_stream) so their memory is not reused before NCCL is done with it."""

    def __init__(self, group: Any) -> None:
        self.g = group
        self.nccl = group.nccl
        self.device = int(group.device.split(":")[1])
        self.cs = _dist.comm_stream(self.device)

    def _begin(self) -> int:
        cur = bt.cuda.current_stream(self.device)
        ev = _dist.event_record(self.device, cur)
        _dist.stream_wait_event(self.cs, ev)
        _dist.event_release(ev)  # the wait took the event's state now: safe to reuse
        return cur

    def _end(self, what: str, seq: int, tensors: list[bt.Tensor]) -> Work:
        for t in tensors:
            t.record_stream(self.cs)
            _dist.bump_version(t)
        w = _CudaWork(self.g, what, seq, self.device, _dist.event_record(self.device, self.cs))
        if not _dist.stream_capturing(self.cs):
            self.g.watch_cuda(w)
        return w

    def _ordered(self, src: bt.Tensor, dst_chunk: bt.Tensor, op: int) -> None:
        """dst_chunk = the fixed-order sum of this rank's chunk over every rank (Note [ordered
        sum]); src holds world_size chunks of dst_chunk's size."""
        n = self.g.size
        recv = bt.empty(tuple(src.shape), dtype=src.dtype, device=src.device)
        self.nccl.all_to_all(src, recv, self.cs)
        _dist.ordered_sum_(recv, n, dst_chunk, n if op == AVG else 1, self.cs)
        recv.record_stream(self.cs)

    def all_reduce(self, t: bt.Tensor, op: int, what: str, seq: int) -> Work:
        n = self.g.size
        if not (self.g.deterministic and op in (SUM, AVG) and t.is_floating_point() and n > 1):
            self._begin()
            self.nccl.all_reduce(t, t, op, self.cs)
            return self._end(what, seq, [t])
        numel = t.numel()
        chunk = _pad_to(numel, n) // n
        flat = t.reshape(-1)
        padded = chunk * n != numel
        if padded:  # on the compute stream, before the event the comm stream waits on
            flat = bt.zeros(chunk * n, dtype=t.dtype, device=t.device)
            flat[:numel].copy_(t.reshape(-1))
        self._begin()
        mine = bt.empty(chunk, dtype=t.dtype, device=t.device)
        self._ordered(flat, mine, op)
        self.nccl.all_gather(mine, flat, self.cs)
        if padded:
            _dist.cast_(flat[:numel], t.reshape(-1), 1, self.cs)
        return self._end(what, seq, [t, flat, mine])

    def reduce_scatter(self, out: bt.Tensor, inp: bt.Tensor, op: int, what: str, seq: int) -> Work:
        self._begin()
        if (
            self.g.deterministic
            and op in (SUM, AVG)
            and out.is_floating_point()
            and self.g.size > 1
        ):
            self._ordered(inp.reshape(-1), out.reshape(-1), op)
        else:
            self.nccl.reduce_scatter(inp, out, op, self.cs)
        return self._end(what, seq, [out, inp])

    def all_gather(self, out: bt.Tensor, inp: bt.Tensor, what: str, seq: int) -> Work:
        self._begin()
        self.nccl.all_gather(inp, out, self.cs)
        return self._end(what, seq, [out, inp])

    def broadcast(self, t: bt.Tensor, root: int, what: str, seq: int) -> Work:
        self._begin()
        self.nccl.broadcast(t, root, self.cs)
        return self._end(what, seq, [t])

    def send(self, t: bt.Tensor, peer: int, what: str, seq: int) -> Work:
        self._begin()
        self.nccl.send(t, peer, self.cs)
        return self._end(what, seq, [t])

    def recv(self, t: bt.Tensor, peer: int, what: str, seq: int) -> Work:
        self._begin()
        self.nccl.recv(t, peer, self.cs)
        return self._end(what, seq, [t])

    # uneven chunks: NCCL's collectives take equal ones, so pad each to the largest ----------
    def all_gather_v(self, outs: list[bt.Tensor], inp: bt.Tensor, what: str, seq: int) -> Work:
        n = self.g.size
        m = max(1, max(o.numel() for o in outs))
        src = bt.zeros(m, dtype=inp.dtype, device=inp.device)
        if inp.numel():
            src[: inp.numel()].copy_(inp.reshape(-1))
        flat = bt.empty(n * m, dtype=inp.dtype, device=inp.device)
        self._begin()
        self.nccl.all_gather(src, flat, self.cs)
        for k, o in enumerate(outs):
            if o.numel():
                self._copy(flat[k * m : k * m + o.numel()], o.reshape(-1))
        return self._end(what, seq, [inp, src, flat, *outs])

    def reduce_scatter_v(
        self, out: bt.Tensor, inps: list[bt.Tensor], op: int, what: str, seq: int
    ) -> Work:
        n = self.g.size
        m = max(1, max(i.numel() for i in inps))
        flat = bt.zeros(n * m, dtype=out.dtype, device=out.device)
        for k, i in enumerate(inps):
            if i.numel():
                flat[k * m : k * m + i.numel()].copy_(i.reshape(-1))
        mine = bt.empty(m, dtype=out.dtype, device=out.device)
        self._begin()
        if self.g.deterministic and op in (SUM, AVG) and out.is_floating_point() and n > 1:
            self._ordered(flat, mine, op)
        else:
            self.nccl.reduce_scatter(flat, mine, op, self.cs)
        if out.numel():
            self._copy(mine[: out.numel()], out.reshape(-1))
        return self._end(what, seq, [out, flat, mine])

    def _copy(self, src: bt.Tensor, dst: bt.Tensor) -> None:
        """dst = src on the comm stream (same dtype; floating via the cast kernel, else NCCL-free
        byte copy through a one-rank-style device copy)."""
        if src.is_floating_point():
            _dist.cast_(src, dst, 1, self.cs)
        else:
            _dist.copy_d2d(src, dst, self.cs)


# ---- one rank, no communicator ---------------------------------------------------------------
class SelfBackend:
    """World size 1 without MPI (or without NCCL on a GPU): every collective is local."""

    def __init__(self, group: Any) -> None:
        self.g = group

    def _done(self, what: str, seq: int) -> Work:
        return done_work(self.g, what, seq)

    def all_reduce(self, t: bt.Tensor, op: int, what: str, seq: int) -> Work:
        return self._done(what, seq)  # sum, avg (/ 1), max, min of one rank: itself

    def reduce_scatter(self, out: bt.Tensor, inp: bt.Tensor, op: int, what: str, seq: int) -> Work:
        if not _same_memory(out, inp):  # ZeRO-1's in-place chunk is the whole bucket here
            out.reshape(-1).copy_(inp.reshape(-1))
        return self._done(what, seq)

    def all_gather(self, out: bt.Tensor, inp: bt.Tensor, what: str, seq: int) -> Work:
        if not _same_memory(out, inp):  # ZeRO's parameter chunk is the whole bucket here
            out.reshape(-1).copy_(inp.reshape(-1))
        return self._done(what, seq)

    def all_gather_v(self, outs: list[bt.Tensor], inp: bt.Tensor, what: str, seq: int) -> Work:
        if inp.numel():
            outs[0].reshape(-1).copy_(inp.reshape(-1))
        return self._done(what, seq)

    def reduce_scatter_v(
        self, out: bt.Tensor, inps: list[bt.Tensor], op: int, what: str, seq: int
    ) -> Work:
        if out.numel():
            out.reshape(-1).copy_(inps[0].reshape(-1))
        return self._done(what, seq)

    def broadcast(self, t: bt.Tensor, root: int, what: str, seq: int) -> Work:
        return self._done(what, seq)

    def send(self, t: bt.Tensor, peer: int, what: str, seq: int) -> Work:  # pragma: no cover
        raise ValueError(f"[send] world size is 1: there is no rank {peer} to send to")

    recv = send
