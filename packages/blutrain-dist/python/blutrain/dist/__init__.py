"""blutrain.dist: distributed training over MPI and NCCL (DDP, ZeRO-1/2).

    mpiexec -n 4 python train.py            # or mpirun, or srun; or plain python: one rank

    import blutrain.dist as dist
    dist.init()                              # rank / world size / local rank from MPI
    model.to(dist.device())                  # cuda:<local rank>, or cpu
    x = bt.ones(8, device=dist.device())
    dist.all_reduce(x, op="avg")             # in place, every rank: the mean
    work = dist.all_gather(out, x, async_op=True); ...; work.wait()

Process start-up, rank and local rank (a shared-memory split) come from MPI through mpi4py; a
process started without a launcher is a group of one and needs no MPI.  CPU tensors travel over
MPI; CUDA tensors over NCCL on a communication stream ordered with the compute stream by events
(or, with ``backend="mpi"``, over MPI through pinned host memory: two ranks may share a GPU).

Training: :class:`DistributedDataParallel` (gradients in flat buckets reduced while backward
runs) and :class:`ZeroOptimizer` (ZeRO stage 1 / 2: optimizer state, and with stage 2 the
gradients, sharded across ranks).  Deterministic mode (``init(deterministic=True)``, or
blutrain.tensor's ``use_deterministic_algorithms``) makes sums fixed-order, so results are
bitwise the same for world sizes 1, 2 and 4 with the same global batch.

A rank that dies or hangs ends the job within ``timeout`` seconds (default 300,
``BLUTRAIN_DIST_TIMEOUT``) with a message naming the ranks that did not answer and what the
others wait in; a rank that raises (uncaught) or calls :func:`abort` ends it at once.
``check_collectives=True`` (``BLUTRAIN_DIST_CHECK=1``) compares every collective's kind, dtype
and size across ranks before moving data.
"""

from __future__ import annotations

from . import _dist
from ._backend import Work
from ._group import (
    DEFAULT_TIMEOUT_S,
    DistError,
    DistTimeoutError,
    ProcessGroup,
    launched_by_mpi,
    shutdown,
)
from ._group import group as _group
from ._group import init as _init
from .checkpoint import load_checkpoint, save_checkpoint
from .collectives import (
    all_gather,
    all_reduce,
    allgather_object,
    barrier,
    broadcast,
    recv,
    reduce_scatter,
    send,
)
from .ddp import DistributedDataParallel
from .zero import ZeroOptimizer

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistError",
    "DistributedDataParallel",
    "DistTimeoutError",
    "ProcessGroup",
    "Work",
    "ZeroOptimizer",
    "abort",
    "all_gather",
    "all_reduce",
    "allgather_object",
    "backend",
    "barrier",
    "broadcast",
    "device",
    "init",
    "is_initialized",
    "launched_by_mpi",
    "load_checkpoint",
    "local_rank",
    "local_world_size",
    "rank",
    "recv",
    "reduce_scatter",
    "save_checkpoint",
    "send",
    "shutdown",
    "world_size",
]


def init(
    backend: str = "auto",
    device: str | None = None,
    timeout: float | None = None,
    check_collectives: bool | None = None,
    on_fault: str = "abort",
    deterministic: bool | None = None,
) -> ProcessGroup:
    """Start blutrain.dist in this process; every rank of the job calls it.

    backend: for CUDA tensors, "auto" (NCCL when libnccl loads and each rank of a node has its
      own GPU, else MPI through pinned host memory), "nccl" or "mpi".  CPU tensors always use MPI.
    device: None picks ``cuda:<local rank>`` when a GPU is present, else ``cpu``.
    timeout: seconds a collective may wait before the job ends (Note [no hangs] in _group.py).
    check_collectives: compare every collective across ranks before it runs (a cheap allgather).
    on_fault: "abort" (print the diagnosis, MPI_Abort: no process left behind) or "raise"
      (DistTimeoutError on the rank that timed out).
    deterministic: fixed-order sums; None follows bt.use_deterministic_algorithms.
    """
    return _init(backend, device, timeout, check_collectives, on_fault, deterministic)


def abort(reason: str, code: int = 1) -> None:
    """End every process of the job now: for a rank that must stop on an error the others did
    not see (they would wait for it until their timeout).  Prints one line naming this rank and
    `reason`, then MPI_Abort with exit status `code`; without other ranks, exits with `code`.
    An uncaught exception does this by itself (``init(on_fault="abort")``, the default)."""
    if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code <= 255:
        raise TypeError(f"[abort] code must be an int exit status in [0, 255], got {code!r}")
    _group("abort").leave(str(reason), code)


def is_initialized() -> bool:
    """True between init() and shutdown()."""
    import sys

    return sys.modules[f"{__name__}._group"]._GROUP is not None  # `_group` here is group()


def rank() -> int:
    """This process's rank in [0, world_size())."""
    return _group("rank").rank


def world_size() -> int:
    """Number of processes in the job."""
    return _group("world_size").size


def local_rank() -> int:
    """This process's rank among those sharing its node (MPI's shared-memory split)."""
    return _group("local_rank").local_rank


def local_world_size() -> int:
    """Number of processes on this node."""
    return _group("local_world_size").local_size


def device() -> str:
    """This rank's device: "cuda:N" (N = local rank modulo the GPUs present) or "cpu"."""
    return _group("device").device


def backend() -> str:
    """How CUDA tensors travel: "nccl", "mpi" (staged through pinned host memory), "self" (one
    rank, nothing to move) or "none" (a CPU device)."""
    return _group("backend").cuda_backend


def nccl_version() -> int | None:
    """NCCL_VERSION_CODE of the loaded libnccl (e.g. 22805), None when it is not loaded."""
    try:
        return int(_dist.nccl_version()) if _dist.built_with_nccl() else None
    except RuntimeError:
        return None
