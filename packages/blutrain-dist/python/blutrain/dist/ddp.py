"""DistributedDataParallel: every rank holds the whole model; gradients are averaged across
ranks while backward runs (_reducer.py has the bucket engine and its Notes).

    model = GPT2(cfg, device=dist.device())
    ddp = dist.DistributedDataParallel(model)          # broadcasts rank 0's weights
    opt = AdamW(model.named_parameters(), lr=6e-4)
    for step in range(steps):
        for micro in range(accum):
            with ddp.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                loss = ddp(x[micro], y[micro], return_logits=False)[1] / accum
                loss.backward()                         # the last one reduces, bucket by bucket
        opt.step()
        opt.zero_grad(set_to_none=False)                # .grad stays a view of its bucket

After the synchronising backward returns, every ``.grad`` holds the mean over ranks of the
local gradients (sum / world size, rounded once).  ``zero_grad(set_to_none=True)`` works too
(the next backward points ``.grad`` back at the buckets, with a copy for that step).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import blutrain.tensor as bt

from ._group import ProcessGroup, group
from ._reducer import Reducer


def _broadcast(g: ProcessGroup, named: list[tuple[str, bt.Tensor]], who: str) -> None:
    """Rank 0's values into every rank's parameters (so replicas start equal)."""
    if g.size == 1:
        return
    from .collectives import _backend_for

    works = []
    with bt.no_grad():
        for name, p in named:
            seq = g.next_seq()
            be = _backend_for(p, g)
            works.append(be.broadcast(p.detach(), 0, f"broadcast #{seq} ({who}: {name})", seq))
    for w in works:
        w.wait()


class DistributedDataParallel:
    """Data parallelism over every rank of the group (see the module docstring).

    bucket_cap_mb / first_bucket_mb: bucket sizes (MiB of gradient); the first bucket reduced
      is small so communication starts early.  PyTorch's defaults (25 / 1).
    reduce_dtype: None (the gradients' dtype), bt.float32 or bt.bfloat16: the dtype the
      collective sums in (the result is cast back, divided by the world size, rounded once).
    find_unused_parameters: allow parameters without a gradient in a backward (they count as
      zero); then call :meth:`finish_gradient_sync` after each step's last backward.
    broadcast_parameters: copy rank 0's parameters to every rank at construction.
    """

    def __init__(
        self,
        module: Any,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        reduce_dtype: Any = None,
        find_unused_parameters: bool = False,
        broadcast_parameters: bool = True,
    ) -> None:
        g = group("DistributedDataParallel")
        self.module = module
        self.group = g
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if broadcast_parameters:
            _broadcast(g, named, "DistributedDataParallel")
        self.reducer = Reducer(
            g,
            named,
            who="DistributedDataParallel",
            mode="all_reduce",
            reduce_dtype=reduce_dtype,
            first_bucket_mb=first_bucket_mb,
            bucket_mb=bucket_cap_mb,
            keep_full_grads=True,
            find_unused_parameters=find_unused_parameters,
        )

    # -- the module's face ---------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward (checks the previous step's reductions were waited for)."""
        self.reducer.check_window_closed()
        return self.module(*args, **kwargs)

    forward = __call__

    def __getattr__(self, name: str) -> Any:  # train(), eval(), state_dict(), config, ...
        return getattr(self.__dict__["module"], name)

    def parameters(self) -> Iterator[bt.Tensor]:
        """The wrapped module's parameters (their .grad are views into the buckets)."""
        return self.module.parameters()

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, bt.Tensor]]:
        """The wrapped module's (name, parameter) pairs, names as in its state_dict."""
        return self.module.named_parameters(prefix)

    # -- gradient synchronisation -------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally without communicating; the next one
        outside reduces the sum of all of them once."""
        with self.reducer.no_sync():
            yield

    def finish_gradient_sync(self) -> None:
        """Reduce buckets a backward left open (only with find_unused_parameters=True); a no-op
        when every parameter got its gradient."""
        self.reducer.finish()

    @property
    def reductions(self) -> int:
        """Bucket all-reduces launched so far."""
        return self.reducer.reductions

    @property
    def syncs(self) -> int:
        """Synchronising backwards reduced so far (one per optimizer step)."""
        return self.reducer.windows

    def bucket_layout(self) -> list[dict[str, Any]]:
        """The buckets in reduction order: parameters, elements, padded elements, dtype."""
        return [
            {
                "index": b.index,
                "params": list(b.names),
                "numel": b.numel,
                "padded": b.padded,
                "dtype": b.dtype.name,
                "bytes": b.nbytes(),
            }
            for b in self.reducer.buckets
        ]

    def __repr__(self) -> str:
        return (
            f"DistributedDataParallel(world_size={self.group.size}, "
            f"buckets={len(self.reducer.buckets)}, module={type(self.module).__name__})"
        )


broadcast_parameters = _broadcast
__all__ = ["DistributedDataParallel", "broadcast_parameters"]
