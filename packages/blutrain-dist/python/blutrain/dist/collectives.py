"""Collectives on blutrain.tensor tensors: the checks, the sequence numbers, the fingerprints,
then the backend (CPU tensors: MPI; CUDA tensors: NCCL, or MPI staged through pinned memory).

Every collective is called by every rank in the same order (send / recv by the pair).  With
``async_op=True`` it returns a :class:`Work`; otherwise it has been waited for (for CUDA tensors
that means the current stream waits for it, not the host, as in PyTorch).  Errors name the
collective and the offending values; ranks that call different collectives, or the same one with
different dtypes or sizes, are caught before any data moves when the group checks collectives
(``init(check_collectives=True)`` or ``BLUTRAIN_DIST_CHECK=1``), each rank raising an error that
names both ranks and what differs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

import blutrain.tensor as bt

from . import _backend
from ._backend import Work
from ._group import COLLECTIVES, OP_NAMES, OPS, DistError, ProcessGroup, group


def _op_code(op: Any, name: str) -> int:
    if isinstance(op, str) and op.lower() in OPS:
        return OPS[op.lower()]
    raise ValueError(f"[{name}] op must be one of {sorted(OPS)}, got {op!r}")


def _check_tensor(t: Any, name: str, what: str, g: ProcessGroup) -> None:
    if not isinstance(t, bt.Tensor):
        raise TypeError(f"[{name}] {what} must be a blutrain.tensor Tensor, got {type(t).__name__}")
    if t.is_symbolic:
        raise ValueError(f"[{name}] {what} is symbolic (made in capture mode): it has no data")
    if not t.is_contiguous():
        raise ValueError(
            f"[{name}] {what} of shape {tuple(t.shape)} is not contiguous: collectives need dense "
            "memory (call .contiguous() first)"
        )
    dev = str(t.device)
    if dev != "cpu" and dev != g.device:
        raise ValueError(
            f"[{name}] {what} is on {dev}, but this rank's device is {g.device} (CPU tensors go "
            "over MPI, CUDA tensors must be on dist.device())"
        )


def _backend_for(t: bt.Tensor, g: ProcessGroup) -> Any:
    cache = g.__dict__.setdefault("_backends", {})
    kind = "cpu" if str(t.device) == "cpu" else g.cuda_backend
    b = cache.get(kind)
    if b is None:
        if kind == "nccl":
            b = _backend.NcclBackend(g)
        elif g.comm is not None:
            b = _backend.MpiBackend(g)
        else:
            b = _backend.SelfBackend(g)
        cache[kind] = b
    return b


def _describe(name: str, t: bt.Tensor, extra: str = "") -> str:
    return f"{name}({t.dtype.name}, {t.numel()} elements{extra})"


def _fingerprint(g: ProcessGroup, name: str, dtype: Any, numel: int, extra: int, text: str) -> None:
    """Note [per-collective fingerprints]: every rank shares (collective, dtype, size, op or root)
    before moving data; a disagreement raises on every rank, naming both ranks."""
    if not g.check_collectives or g.size == 1 or g.comm is None:
        return
    mine = np.array(
        [COLLECTIVES.index(name), -1 if dtype is None else dtype.value, numel, extra], np.int64
    )
    rows = np.empty((g.size, 4), dtype=np.int64)
    g.wait_requests([g.comm.Iallgather(mine, rows)], f"{name} #{g.seq} (fingerprint)")
    descs = g.__dict__.setdefault("_fp_text", {})
    descs[g.rank] = text
    for q in range(g.size):
        if not np.array_equal(rows[q], mine):
            other = rows[q]
            oname = COLLECTIVES[int(other[0])] if 0 <= other[0] < len(COLLECTIVES) else "?"
            raise DistError(
                f"[{name}] ranks disagree on collective #{g.seq}: rank {g.rank} calls {text}, "
                f"rank {q} calls {oname} (dtype code {int(other[1])}, {int(other[2])} elements, "
                f"op/root/peer {int(other[3])})"
            )


def _finish(work: Work, async_op: bool) -> Work | None:
    if async_op:
        return work
    work.wait()
    return None


def all_reduce(tensor: bt.Tensor, op: str = "sum", async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` over every rank, in place: op "sum", "avg" (sum / world size, rounded
    once), "max" or "min".  Any dtype (bool: sum and max are logical or, min logical and; avg
    needs a floating dtype), any size including 0."""
    g = group("all_reduce")
    _check_tensor(tensor, "all_reduce", "tensor", g)
    code = _op_code(op, "all_reduce")
    if code == OPS["avg"] and not tensor.is_floating_point():
        raise TypeError(f"[all_reduce] op 'avg' needs a floating dtype, got {tensor.dtype.name}")
    seq = g.next_seq()
    what = f"all_reduce #{seq} ({tensor.dtype.name}, {tensor.numel()} elements, {OP_NAMES[code]})"
    _fingerprint(
        g,
        "all_reduce",
        tensor.dtype,
        tensor.numel(),
        code,
        _describe("all_reduce", tensor, f", {op}"),
    )
    return _finish(_backend_for(tensor, g).all_reduce(tensor, code, what, seq), async_op)


def _same_kind(a: bt.Tensor, b: bt.Tensor, name: str) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"[{name}] output is {a.dtype.name} but input is {b.dtype.name}")
    if str(a.device) != str(b.device):
        raise ValueError(f"[{name}] output is on {a.device} but input is on {b.device}")


def reduce_scatter(
    output: bt.Tensor, input: Any, op: str = "sum", async_op: bool = False
) -> Work | None:
    """Reduce ``input`` over every rank and give rank r its r-th chunk in ``output``.

    input: a tensor of world_size x output.numel() elements (chunk r = elements
    [r * n, (r + 1) * n)), or a list of world_size tensors (chunk r = input[r]; the chunks may
    differ in size, output having this rank's size: pad nothing yourself)."""
    g = group("reduce_scatter")
    name = "reduce_scatter"
    _check_tensor(output, name, "output", g)
    code = _op_code(op, name)
    if code == OPS["avg"] and not output.is_floating_point():
        raise TypeError(f"[{name}] op 'avg' needs a floating dtype, got {output.dtype.name}")
    if isinstance(input, (list, tuple)):
        if len(input) != g.size:
            raise ValueError(f"[{name}] got {len(input)} input chunks for world size {g.size}")
        for k, t in enumerate(input):
            _check_tensor(t, name, f"input[{k}]", g)
            _same_kind(output, t, name)
        if input[g.rank].numel() != output.numel():
            raise ValueError(
                f"[{name}] output has {output.numel()} elements but this rank's chunk "
                f"input[{g.rank}] has {input[g.rank].numel()}"
            )
        seq = g.next_seq()
        sizes = [t.numel() for t in input]
        what = f"reduce_scatter #{seq} ({output.dtype.name}, chunks {sizes}, {OP_NAMES[code]})"
        _fingerprint(
            g,
            name,
            output.dtype,
            sum(sizes),
            code,
            f"reduce_scatter({output.dtype.name}, chunks {sizes})",
        )
        return _finish(
            _backend_for(output, g).reduce_scatter_v(output, list(input), code, what, seq), async_op
        )
    _check_tensor(input, name, "input", g)
    _same_kind(output, input, name)
    if input.numel() != output.numel() * g.size:
        raise ValueError(
            f"[{name}] input has {input.numel()} elements; expected world size {g.size} x "
            f"output's {output.numel()} = {output.numel() * g.size} (pass a list of chunks for "
            "uneven ones)"
        )
    seq = g.next_seq()
    what = (
        f"reduce_scatter #{seq} ({output.dtype.name}, {output.numel()} elements a rank, "
        f"{OP_NAMES[code]})"
    )
    _fingerprint(g, name, output.dtype, input.numel(), code, _describe(name, input, f", {op}"))
    return _finish(_backend_for(output, g).reduce_scatter(output, input, code, what, seq), async_op)


def all_gather(output: Any, input: bt.Tensor, async_op: bool = False) -> Work | None:
    """Every rank's ``input``, in rank order, on every rank.

    output: a tensor of world_size x input.numel() elements, or a list of world_size tensors
    (output[r] receives rank r's input; their sizes may differ, each rank passing all of them)."""
    g = group("all_gather")
    name = "all_gather"
    _check_tensor(input, name, "input", g)
    if isinstance(output, (list, tuple)):
        if len(output) != g.size:
            raise ValueError(f"[{name}] got {len(output)} outputs for world size {g.size}")
        for k, t in enumerate(output):
            _check_tensor(t, name, f"output[{k}]", g)
            _same_kind(t, input, name)
        if output[g.rank].numel() != input.numel():
            raise ValueError(
                f"[{name}] input has {input.numel()} elements but this rank's slot "
                f"output[{g.rank}] has {output[g.rank].numel()}"
            )
        seq = g.next_seq()
        sizes = [t.numel() for t in output]
        what = f"all_gather #{seq} ({input.dtype.name}, sizes {sizes})"
        _fingerprint(
            g, name, input.dtype, sum(sizes), -1, f"all_gather({input.dtype.name}, sizes {sizes})"
        )
        return _finish(
            _backend_for(input, g).all_gather_v(list(output), input, what, seq), async_op
        )
    _check_tensor(output, name, "output", g)
    _same_kind(output, input, name)
    if output.numel() != input.numel() * g.size:
        raise ValueError(
            f"[{name}] output has {output.numel()} elements; expected world size {g.size} x "
            f"input's {input.numel()} = {input.numel() * g.size}"
        )
    seq = g.next_seq()
    what = f"all_gather #{seq} ({input.dtype.name}, {input.numel()} elements a rank)"
    _fingerprint(g, name, input.dtype, output.numel(), -1, _describe(name, input))
    return _finish(_backend_for(input, g).all_gather(output, input, what, seq), async_op)


def broadcast(tensor: bt.Tensor, src: int = 0, async_op: bool = False) -> Work | None:
    """Rank ``src``'s ``tensor`` into every rank's ``tensor``, in place."""
    g = group("broadcast")
    _check_tensor(tensor, "broadcast", "tensor", g)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < g.size:
        raise ValueError(f"[broadcast] src must be a rank in [0, {g.size}), got {src!r}")
    seq = g.next_seq()
    what = f"broadcast #{seq} ({tensor.dtype.name}, {tensor.numel()} elements, from rank {src})"
    _fingerprint(
        g,
        "broadcast",
        tensor.dtype,
        tensor.numel(),
        src,
        _describe("broadcast", tensor, f", src {src}"),
    )
    return _finish(_backend_for(tensor, g).broadcast(tensor, src, what, seq), async_op)


def _peer(peer: Any, name: str, g: ProcessGroup) -> int:
    if (
        isinstance(peer, bool)
        or not isinstance(peer, int)
        or not 0 <= peer < g.size
        or peer == g.rank
    ):
        raise ValueError(
            f"[{name}] peer must be another rank in [0, {g.size}) (this is rank {g.rank}), "
            f"got {peer!r}"
        )
    return peer


def send(tensor: bt.Tensor, dst: int, async_op: bool = False) -> Work | None:
    """Send ``tensor`` to rank ``dst`` (which calls :func:`recv` with the same dtype and size)."""
    g = group("send")
    _check_tensor(tensor, "send", "tensor", g)
    dst = _peer(dst, "send", g)
    seq = g.next_seq(p2p=True)
    what = f"send #{seq} ({tensor.dtype.name}, {tensor.numel()} elements, to rank {dst})"
    return _finish(_backend_for(tensor, g).send(tensor, dst, what, seq), async_op)


def recv(tensor: bt.Tensor, src: int, async_op: bool = False) -> Work | None:
    """Receive into ``tensor`` what rank ``src`` sends."""
    g = group("recv")
    _check_tensor(tensor, "recv", "tensor", g)
    src = _peer(src, "recv", g)
    seq = g.next_seq(p2p=True)
    what = f"recv #{seq} ({tensor.dtype.name}, {tensor.numel()} elements, from rank {src})"
    return _finish(_backend_for(tensor, g).recv(tensor, src, what, seq), async_op)


def barrier() -> None:
    """Wait until every rank has reached this point (host side: queued GPU work may still run)."""
    group("barrier").barrier()


def allgather_object(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj`` in rank order (small metadata, not tensors)."""
    return group("allgather_object").allgather_object(obj, "allgather_object")
