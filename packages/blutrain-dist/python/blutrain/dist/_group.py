"""The process group: start-up from MPI, ranks, the wait loop with its timeout, and faults.

Policy.  Processes start under an MPI launcher (``mpiexec``/``mpirun``/``srun``); rank, world
size and local rank come from MPI itself (the local rank from a shared-memory split of the
world, never from launcher variables).  Without a launcher the group has one rank and needs no
MPI at all.  The group owns three MPI communicators duplicated from COMM_WORLD (so user traffic
on COMM_WORLD can never match ours): one for collectives, one for the shared-memory split, one
for health queries.  CUDA tensors use an NCCL communicator built from a unique id that rank 0
makes and broadcasts over MPI.

Note [no hangs]: every wait on MPI is a polling loop with a deadline (``timeout``, 300 s by
default, ``BLUTRAIN_DIST_TIMEOUT``); NCCL work is watched by a thread that queries its events.
When a wait times out, the rank asks every other rank, over the health communicator, what it is
doing (Note [health queries]), prints one message naming the ranks that did not answer (dead,
or hung outside blutrain.dist) and what the others wait in, and calls MPI_Abort: the launcher
then ends every process of the job, the hung one included.  ``on_fault="raise"`` raises
:class:`DistTimeoutError` instead (the job is then the caller's to end).

Note [health queries]: a query is a small message on the health communicator; it is answered
by whichever thread of the peer polls first: its own wait loop, or the watchdog thread (when MPI
runs with MPI_THREAD_MULTIPLE, mpi4py's default), which also answers while the main thread
computes.  A peer killed by a signal never answers; under MPICH's default the launcher kills the
job at once anyway, and under ``mpiexec -disable-auto-cleanup`` MPICH signals the survivors
(SIGUSR1), which the wait loop turns into the same report.

Note [a rank that leaves]: a rank that stops on an error only it saw (an exception, the CLI's
one-line error) would otherwise sit in MPI_Finalize while the others wait in their next
collective until the timeout (300 s by default).  With ``on_fault="abort"`` an uncaught exception
ends the job at once: the usual traceback, one line naming the rank, MPI_Abort
(``sys.excepthook``, installed by init for more than one rank).  Code that catches its own
errors calls :func:`blutrain.dist.abort` (the ``blutrain`` CLI does).  A rank that just exits
(``sys.exit(n)``, or the end of the script while the others still run) gives no hook its exit
status, so ``shutdown`` (which atexit calls) makes the end a meeting: every rank waits there, in
a non-blocking barrier on the health communicator, for the others.  While it waits it asks them
every ``_EXIT_LOOK_S`` what they are doing; one that waits while it has issued more collectives
over every rank than this one (send and recv are not counted: their numbers differ between
ranks) waits for a collective this rank will never join, so this rank ends the job at once,
naming the rank and the collective.  Peers that still compute, or wait in a collective
this rank issued, are waited for without a deadline, as MPI_Finalize would.

Locking rule: ``_lock`` guards the health communicator's sends and the status fields the
watchdog reads; the main thread issues every collective.
"""

from __future__ import annotations

import array
import atexit
import os
import signal
import sys
import threading
import time
from collections import deque
from typing import Any

import numpy as np

import blutrain.tensor as bt

from . import _dist

# Launcher variables that say "this process was started by an MPI launcher": only used to decide
# whether to initialise MPI at all (rank, size and local rank come from MPI).
_LAUNCHER_VARS = (
    "PMI_RANK",  # MPICH hydra
    "PMI_SIZE",
    "PMIX_RANK",  # Open MPI 5, srun --mpi=pmix
    "OMPI_COMM_WORLD_SIZE",  # Open MPI 4
    "SLURM_STEP_ID",  # inside an srun step
    "MV2_COMM_WORLD_SIZE",  # MVAPICH
)
DEFAULT_TIMEOUT_S = 300.0  # 5 minutes (PyTorch: 30); BLUTRAIN_DIST_TIMEOUT overrides
_HEALTH_QUERY, _HEALTH_REPLY = 7101, 7102  # tags on the health communicator
_POLL_ANSWER_S = 0.05  # seconds between health polls inside a wait loop
_WATCHDOG_S = 0.1  # seconds between watchdog passes
_REPORT_DRAIN_S = 2.0  # seconds, at most, that abort waits for the launcher to read the report
_EXIT_LOOK_S = 0.5  # seconds between looks at the others while waiting at shutdown

OPS = {"sum": 0, "avg": 1, "max": 2, "min": 3}
OP_NAMES = {v: k for k, v in OPS.items()}
# opcodes of collectives, for fingerprints and health replies
COLLECTIVES = (
    "barrier",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "broadcast",
    "send",
    "recv",
    "all_to_all",
    "allgather_object",
    "init",
)


def _collective_name(code: int) -> str:
    """The collective named by a health reply's code ("?" for none or an unknown one)."""
    return COLLECTIVES[code] if 0 <= code < len(COLLECTIVES) else "?"


def _wait_until_read(fds: tuple[int, ...], limit_s: float) -> None:
    """Wait, at most `limit_s` seconds, until the reader of each pipe in `fds` has taken every
    byte written to it (FIONREAD on a pipe's write end counts the unread bytes).

    Note [report before abort]: under MPICH's hydra a rank's stdout and stderr are pipes that its
    proxy reads and forwards to mpiexec, while MPI_Abort reaches the launcher by the PMI socket;
    an abort that overtakes the report can end the job with the report unread.  Measured with 4
    ranks on 2 busy cores: at the abort some of the report was still in the pipe in 13 of 30 runs
    (it drained in 5-9 ms), and 2 of 120 runs lost every survivor's message.  Files, terminals and
    sockets are left alone; a reader that is gone costs the limit."""
    import fcntl
    import stat
    import termios

    deadline = time.monotonic() + limit_s
    n = array.array("i", [0])
    for fd in fds:
        try:
            if not stat.S_ISFIFO(os.fstat(fd).st_mode):
                continue
            while time.monotonic() < deadline:
                fcntl.ioctl(fd, termios.FIONREAD, n)
                if n[0] == 0:
                    break
                time.sleep(0.005)
        except OSError:
            continue


class DistError(RuntimeError):
    """A distributed operation failed (a peer's error, a disagreement between ranks)."""


class DistTimeoutError(DistError):
    """A collective did not complete within the group's timeout (``on_fault="raise"``)."""


def launched_by_mpi() -> bool:
    """Whether an MPI launcher started this process (its environment says so)."""
    return any(v in os.environ for v in _LAUNCHER_VARS)


def _import_mpi(op: str) -> Any:
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - mpi4py is a dependency
        raise ImportError(
            f"[{op}] this process runs under an MPI launcher, but mpi4py cannot be imported ({e}):"
            " pip install mpi4py mpich (or build mpi4py against the system MPI)"
        ) from e
    return MPI


class ProcessGroup:
    """Every rank of the job.  Made by :func:`blutrain.dist.init`; see the module docstring."""

    def __init__(
        self,
        backend: str,
        device: str | None,
        timeout: float,
        check_collectives: bool,
        on_fault: str,
        deterministic: bool | None,
    ) -> None:
        self.timeout = float(timeout)
        self.check_collectives = bool(check_collectives)
        self.on_fault = on_fault
        self._deterministic = deterministic
        self.seq = 0  # collectives issued by this rank
        self.group_seq = 0  # of them, those over every rank (all but send and recv)
        self.done_seq = 0  # the last one completed
        self._waiting: tuple[int, str] | None = None  # (seq, what) while in a wait loop
        self._lock = threading.RLock()
        self._peer_failed = False
        self._faulted = False
        self._closed = False
        self._at_shutdown = False  # in meet_at_shutdown (health state 3)
        self._pending_sends: list[Any] = []
        self._cuda_works: deque[Any] = deque()  # NCCL works the watchdog watches
        self._watchdog: threading.Thread | None = None
        self._stop = threading.Event()
        self.MPI: Any = None
        self.comm: Any = None
        self.health: Any = None
        self.rank, self.size, self.local_rank, self.local_size = 0, 1, 0, 1
        if backend == "mpi" or launched_by_mpi():
            self._init_mpi()
        self.device = self._pick_device(device)
        self.cuda_backend = "none"
        self.nccl: Any = None
        if self.device.startswith("cuda"):
            self._init_cuda(backend)
        # Note [numbering starts after init]: init's own allgathers (the GPU check, the backend
        # agreement: two on a GPU, none on the CPU) are not the user's; every rank has finished
        # them here, so all restart at 0 and reports count the user's collectives from #1
        # (session 61: on a GPU machine the CPU fault jobs' reports said #5 for the third)
        self.seq = self.group_seq = self.done_seq = 0
        if self.MPI is not None and self.size > 1:
            self._install_failure_signal()
            if on_fault == "abort":
                self._install_excepthook()
            if self.MPI.Query_thread() == self.MPI.THREAD_MULTIPLE:
                self._watchdog = threading.Thread(
                    target=self._watch, name="blutrain.dist watchdog", daemon=True
                )
                self._watchdog.start()

    # -- start-up ----------------------------------------------------------------------------------
    def _init_mpi(self) -> None:
        MPI = _import_mpi("init")
        self.MPI = MPI
        world = MPI.COMM_WORLD
        self.comm = world.Dup()
        self.health = world.Dup()
        self.local = world.Split_type(MPI.COMM_TYPE_SHARED)
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.local_rank, self.local_size = self.local.Get_rank(), self.local.Get_size()

    def _pick_device(self, device: str | None) -> str:
        if device is None:
            if not bt.cuda.is_available():
                return "cpu"
            return f"cuda:{self.local_rank % bt.cuda.device_count()}"
        text = str(device)
        if text == "cpu":
            return text
        if text == "cuda":
            if not bt.cuda.is_available():
                raise RuntimeError("[init] device='cuda' but no CUDA device is available")
            return f"cuda:{self.local_rank % bt.cuda.device_count()}"
        if text.startswith("cuda:") and text[5:].isdigit():
            n = bt.cuda.device_count()
            if int(text[5:]) >= n:
                raise ValueError(f"[init] device {text!r}: only {n} CUDA device(s) present")
            return text
        raise ValueError(f"[init] device must be None, 'cpu', 'cuda' or 'cuda:N', got {device!r}")

    def _init_cuda(self, backend: str) -> None:
        from ._backend import load_nccl

        dev = int(self.device.split(":")[1])
        ndev = bt.cuda.device_count()
        sharing = self._ranks_sharing_my_gpu(dev)  # NCCL refuses two ranks on one GPU
        shared = bool(sharing)
        if backend == "nccl" and shared:
            raise RuntimeError(
                f"[init] backend='nccl' with {self.local_size} ranks on this node and {ndev} "
                f"visible GPU(s): rank {self.rank} shares its GPU (cuda:{dev}) with rank(s) "
                f"{', '.join(map(str, sharing))}, which NCCL refuses; use backend='mpi' (staged "
                "through pinned host memory) or one rank per GPU"
            )
        reason = None
        if backend in ("auto", "nccl") and not shared:
            reason = load_nccl()
            if reason is None:
                self.cuda_backend = "nccl"
            elif backend == "nccl":
                raise RuntimeError(f"[init] backend='nccl': {reason}")
        if self.cuda_backend != "nccl":
            self.cuda_backend = "mpi" if self.size > 1 else "self"
        if self.size > 1:  # every rank must agree (a rank without NCCL would deadlock the rest)
            kinds = self.allgather_object(self.cuda_backend, "init")
            if len(set(kinds)) > 1:
                bad = {r: k for r, k in enumerate(kinds)}
                raise DistError(
                    f"[init] ranks chose different CUDA backends {bad} (NCCL missing on some?); "
                    "pass the same backend= everywhere"
                )
        if self.cuda_backend == "nccl":
            uid = _dist.nccl_unique_id() if self.rank == 0 else bytes(_dist.UNIQUE_ID_BYTES)
            if self.size > 1:
                buf = bytearray(uid)
                self.wait_requests([self.comm.Ibcast(buf, root=0)], "init (NCCL unique id)")
                uid = bytes(buf)
            self.nccl = _dist.NcclComm(uid, self.size, self.rank, dev)
        elif self.cuda_backend == "mpi" and self.rank == 0 and backend == "auto":
            reason = reason or f"ranks share a GPU ({self.local_size} ranks, {ndev} GPU(s) here)"
            print(
                f"[blutrain.dist] CUDA tensors go over MPI through pinned host memory: {reason}",
                file=sys.stderr,
            )

    def _ranks_sharing_my_gpu(self, dev: int) -> list[int]:
        """World ranks of this node whose GPU is this rank's (compared by PCI bus id, so it
        holds whatever CUDA_VISIBLE_DEVICES each process sees: Slurm's per-task GPU binding
        gives every rank one device numbered 0).  A collective over the world."""
        if self.size == 1 or self.comm is None:
            return []
        mine = (self._node_key(), _dist.device_pci_bus_id(dev))
        rows = self.allgather_object(mine, "init (GPU of each rank)")
        return [q for q, row in enumerate(rows) if q != self.rank and row == mine]

    def _node_key(self) -> int:
        """The world rank of this node's local rank 0 (every rank of a node agrees on it)."""
        buf = np.array([self.rank if self.local_rank == 0 else -1], dtype=np.int64)
        out = np.empty(1, dtype=np.int64)
        self.wait_requests([self.local.Iallreduce(buf, out, op=self.MPI.MAX)], "init (node)")
        return int(out[0])

    def _install_failure_signal(self) -> None:
        # MPICH signals survivors of a failed process with SIGUSR1 (mpiexec -disable-auto-cleanup)
        if threading.current_thread() is not threading.main_thread():
            return
        if "MPICH" not in self.MPI.Get_library_version()[:64]:
            return
        if signal.getsignal(signal.SIGUSR1) is not signal.SIG_DFL:
            return

        def on_failure(signum: int, frame: Any) -> None:
            self._peer_failed = True

        signal.signal(signal.SIGUSR1, on_failure)

    def _install_excepthook(self) -> None:
        # Note [a rank that leaves]; after shutdown() the hook only calls the one it wraps (a
        # hook installed later by the user, e.g. rich's, stays in place)
        prev = sys.excepthook

        def on_uncaught(etype: type[BaseException], value: BaseException, tb: Any) -> None:
            prev(etype, value, tb)  # the traceback, as without blutrain.dist
            if not self._closed:
                self.leave(f"uncaught {etype.__name__}", 1)

        sys.excepthook = on_uncaught

    def leave(self, reason: str, code: int = 1) -> None:
        """End the whole job now from this rank (Note [a rank that leaves]): one line naming
        the rank and `reason`, then MPI_Abort with exit status `code`."""
        print(
            f"[blutrain.dist] rank {self.rank}/{self.size}: {reason}; ending the job now (ranks "
            "still running would wait for this one until their timeout)",
            file=sys.stderr,
            flush=True,
        )
        with self._lock:
            self._faulted = True
        self.abort(code)

    @property
    def deterministic(self) -> bool:
        """Fixed-order reductions (bitwise equal across world sizes; Note [ordered sum]):
        init(deterministic=...) when given, else blutrain.tensor's deterministic mode."""
        if self._deterministic is not None:
            return self._deterministic
        return bool(bt.are_deterministic_algorithms_enabled())

    # -- the wait loop (Note [no hangs]) ------------------------------------------------------
    def wait_requests(self, reqs: list[Any], what: str) -> None:
        """Wait for MPI requests, answering health queries; a timeout ends the job."""
        MPI = self.MPI
        if not reqs or MPI.Request.Testall(reqs):
            return
        with self._lock:
            self._waiting = (self.seq, what)
        try:
            t0 = time.monotonic()
            deadline = t0 + self.timeout
            next_poll = t0
            spins = 0
            while not MPI.Request.Testall(reqs):
                spins += 1
                if spins < 256:
                    os.sched_yield()  # spin first: small messages finish in microseconds
                    continue
                now = time.monotonic()
                if now >= next_poll:
                    self.answer_queries()
                    next_poll = now + _POLL_ANSWER_S
                if self._peer_failed:
                    self.fault(what, "failed: MPI reported a failed process")
                if now > deadline:
                    self.fault(what, f"did not complete within {self.timeout:g} s")
                time.sleep(2e-4 if now - t0 < 0.05 else 2e-3)
        finally:
            with self._lock:
                self._waiting = None

    # -- health (Note [health queries]) ---------------------------------------------------------
    def _status(self) -> np.ndarray:
        """[rank, state (0 idle, 1 waiting, 2 GPU work pending, 3 at shutdown), seq, last done,
        what code, collectives over every rank issued]."""
        with self._lock:
            if self._at_shutdown:
                seq, what, state = self.seq, "", 3
            elif self._waiting is not None:
                seq, what = self._waiting
                state = 1
            elif self._cuda_works:
                w = self._cuda_works[0]
                seq, what, state = w.seq, w.what, 2
            else:
                seq, what, state = self.seq, "", 0
        code = next((i for i, n in enumerate(COLLECTIVES) if what.startswith(n)), -1)
        return np.array(
            [self.rank, state, seq, self.done_seq, code, self.group_seq], dtype=np.int64
        )

    def answer_queries(self) -> None:
        """Answer every pending health query (non-blocking)."""
        if self.health is None:
            return
        MPI = self.MPI
        with self._lock:
            st = MPI.Status()
            while self.health.Iprobe(source=MPI.ANY_SOURCE, tag=_HEALTH_QUERY, status=st):
                src = st.Get_source()
                buf = np.empty(1, dtype=np.int64)
                self.health.Recv(buf, source=src, tag=_HEALTH_QUERY)
                self._pending_sends.append(
                    self.health.Isend(self._status(), dest=src, tag=_HEALTH_REPLY)
                )
            self._pending_sends = [r for r in self._pending_sends if not r.Test()]

    def _diagnose(self, grace: float) -> dict[int, np.ndarray]:
        """Ask every other rank for its status; the replies that came within `grace` s."""
        MPI = self.MPI
        replies: dict[int, np.ndarray] = {}
        with self._lock:
            for q in range(self.size):
                if q != self.rank:
                    self._pending_sends.append(
                        self.health.Isend(np.zeros(1, np.int64), dest=q, tag=_HEALTH_QUERY)
                    )
        deadline = time.monotonic() + grace
        st = MPI.Status()
        while time.monotonic() < deadline and len(replies) < self.size - 1:
            self.answer_queries()
            with self._lock:
                while self.health.Iprobe(source=MPI.ANY_SOURCE, tag=_HEALTH_REPLY, status=st):
                    buf = np.empty(6, dtype=np.int64)
                    self.health.Recv(buf, source=st.Get_source(), tag=_HEALTH_REPLY)
                    replies[int(buf[0])] = buf
            time.sleep(0.005)
        return replies

    def fault(self, what: str, cause: str) -> None:
        """Report a failed wait (naming the other ranks' states) and end the job (or raise)."""
        with self._lock:
            if self._faulted:
                if self.on_fault == "raise":
                    raise DistTimeoutError(f"[{what}] the group already failed")
                return
            self._faulted = True
        lines = [f"[blutrain.dist] rank {self.rank}/{self.size}: {what} {cause}."]
        if self.size > 1 and self.health is not None:
            grace = min(10.0, max(1.0, self.timeout / 10))
            replies = self._diagnose(grace)
            silent = [q for q in range(self.size) if q != self.rank and q not in replies]
            if silent:
                lines.append(
                    f"  rank(s) {', '.join(map(str, silent))} did not answer within {grace:g} s: "
                    "dead, or hung outside blutrain.dist"
                )
            for q in sorted(replies):
                _, state, seq, done, code, _ = (int(v) for v in replies[q])
                name = _collective_name(code)
                if state == 1:
                    lines.append(f"  rank {q} waits in {name} #{seq}")
                elif state == 2:
                    lines.append(f"  rank {q} has GPU work pending in {name} #{seq}")
                elif state == 3:
                    lines.append(f"  rank {q} has reached shutdown after issuing #{seq}")
                else:
                    lines.append(
                        f"  rank {q} is not in a collective (it has issued {seq}; this rank "
                        f"is in #{self.seq})"
                    )
        msg = "\n".join(lines)
        print(msg, file=sys.stderr, flush=True)
        if self.on_fault == "raise":
            raise DistTimeoutError(msg)
        self.abort(1)

    def abort(self, code: int = 1) -> None:
        """End every process of the job now (MPI_Abort; os._exit without MPI)."""
        sys.stderr.flush()
        sys.stdout.flush()
        if self.MPI is not None:
            _wait_until_read((2, 1), _REPORT_DRAIN_S)  # Note [report before abort]
            self.MPI.COMM_WORLD.Abort(code)
        os._exit(code)

    # -- the watchdog thread ---------------------------------------------------------------------
    def watch_cuda(self, work: Any) -> None:
        """Have the watchdog check an NCCL work's completion against the timeout."""
        if self._watchdog is None:  # one rank, or MPI without threads: nothing to report to
            return
        with self._lock:
            self._cuda_works.append(work)

    def _watch(self) -> None:
        next_err = 0.0
        while not self._stop.wait(_WATCHDOG_S):
            try:
                self.answer_queries()
                self._check_cuda_works()
                now = time.monotonic()
                if self.nccl is not None and now >= next_err:
                    next_err = now + 1.0
                    err = self.nccl.async_error()
                    if err:
                        self.fault(
                            f"NCCL communicator (after #{self.done_seq})", f"failed (error {err})"
                        )
            except Exception as e:  # pragma: no cover - the watchdog must not die silently
                if self._stop.is_set() or self._closed:
                    return
                print(f"[blutrain.dist] watchdog: {type(e).__name__}: {e}", file=sys.stderr)

    def _check_cuda_works(self) -> None:
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._cuda_works:
                    return
                w = self._cuda_works[0]
            if w.poll():
                with self._lock:
                    if self._cuda_works and self._cuda_works[0] is w:
                        self._cuda_works.popleft()
                continue
            if now - w.t0 > self.timeout:
                self.fault(w.what, f"did not complete on the GPU within {self.timeout:g} s")
            return

    # -- small collectives used by setup checks ----------------------------------------------
    def next_seq(self, p2p: bool = False) -> int:
        """Number the next collective (the sequence named in fault reports and fingerprints);
        p2p: a send or recv, which not every rank issues."""
        self.seq += 1
        self.group_seq += not p2p
        return self.seq

    def allgather_object(self, obj: Any, what: str) -> list[Any]:
        """Every rank's picklable object, in rank order (setup checks, checkpoints)."""
        if self.size == 1 or self.comm is None:
            return [obj]
        import pickle

        self.next_seq()
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        sizes = np.zeros(self.size, dtype=np.int64)
        mine = np.array([data.size], dtype=np.int64)
        self.wait_requests([self.comm.Iallgather(mine, sizes)], f"allgather_object ({what})")
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        req = self.comm.Iallgatherv(data, [out, sizes, displs, self.MPI.BYTE])
        self.wait_requests([req], f"allgather_object ({what})")
        self.done_seq = self.seq
        return [
            pickle.loads(out[int(d) : int(d) + int(s)].tobytes())
            for d, s in zip(displs, sizes, strict=True)
        ]

    def barrier(self) -> None:
        """Every rank reaches this point, within the group's timeout."""
        if self.size == 1 or self.comm is None:
            return
        seq = self.next_seq()
        self.wait_requests([self.comm.Ibarrier()], f"barrier #{seq}")
        self.done_seq = seq

    # -- shutdown --------------------------------------------------------------------------------
    def meet_at_shutdown(self) -> None:
        """Wait until every rank reaches shutdown; end the job at once when another rank waits
        in a collective this one never issued (Note [a rank that leaves])."""
        if self.MPI is None or self.size == 1 or self._faulted or self.on_fault != "abort":
            return
        with self._lock:
            self._at_shutdown = True
            req = self.health.Ibarrier()
        t0 = time.monotonic()
        next_look = t0 + _EXIT_LOOK_S
        while True:
            with self._lock:
                if req.Test():
                    return
            self.answer_queries()
            if self._peer_failed:
                self.fault("shutdown", "failed: MPI reported a failed process")
            if time.monotonic() >= next_look:
                replies = self._diagnose(_EXIT_LOOK_S)
                left_for = {
                    q: r for q, r in replies.items() if r[1] in (1, 2) and r[5] > self.group_seq
                }
                if left_for:
                    _, _, seq, _, code, _ = (int(v) for v in left_for[min(left_for)])
                    name = _collective_name(code)
                    self.leave(
                        f"exited after {self.group_seq} collective(s) while rank(s) "
                        f"{', '.join(map(str, sorted(left_for)))} wait in {name} #{seq}, "
                        "which it never issued",
                        1,
                    )
                next_look = time.monotonic() + _EXIT_LOOK_S
            time.sleep(2e-3 if time.monotonic() - t0 < 1.0 else 0.02)  # a long wait costs no CPU

    def close(self) -> None:
        """Stop the watchdog, destroy (after a fault: abort) the NCCL communicator, cancel pending
        sends and free the MPI communicators; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=2.0)
        if self.nccl is not None:
            nccl, self.nccl = self.nccl, None
            try:
                if self._faulted:
                    nccl.abort()
                else:
                    nccl.destroy()
            except Exception as e:  # pragma: no cover
                print(f"[blutrain.dist] shutdown: {e}", file=sys.stderr)
        for r in self._pending_sends:
            r.Cancel()
        self._pending_sends = []
        for c in ("comm", "health", "local"):
            obj = getattr(self, c, None)
            if obj is not None:
                try:
                    obj.Free()
                except Exception:  # pragma: no cover - MPI already finalized
                    pass
                setattr(self, c, None)


_GROUP: ProcessGroup | None = None


def group(op: str = "dist") -> ProcessGroup:
    """The initialised group; a clear error before init()."""
    if _GROUP is None:
        raise RuntimeError(
            f"[{op}] blutrain.dist is not initialised: call blutrain.dist.init() first"
        )
    return _GROUP


def init(
    backend: str = "auto",
    device: str | None = None,
    timeout: float | None = None,
    check_collectives: bool | None = None,
    on_fault: str = "abort",
    deterministic: bool | None = None,
) -> ProcessGroup:
    """Start blutrain.dist in this process (see :mod:`blutrain.dist`)."""
    global _GROUP
    if backend not in ("auto", "nccl", "mpi"):
        raise ValueError(f"[init] backend must be 'auto', 'nccl' or 'mpi', got {backend!r}")
    if on_fault not in ("abort", "raise"):
        raise ValueError(f"[init] on_fault must be 'abort' or 'raise', got {on_fault!r}")
    if timeout is None:
        env = os.environ.get("BLUTRAIN_DIST_TIMEOUT")
        try:
            timeout = float(env) if env else DEFAULT_TIMEOUT_S
        except ValueError:
            raise ValueError(
                f"[init] BLUTRAIN_DIST_TIMEOUT={env!r} is not a number of seconds"
            ) from None
    if not timeout > 0:
        raise ValueError(f"[init] timeout must be > 0 seconds, got {timeout}")
    if check_collectives is None:
        check_collectives = os.environ.get("BLUTRAIN_DIST_CHECK", "0") not in ("", "0")
    if _GROUP is not None:
        raise RuntimeError("[init] blutrain.dist is already initialised (call shutdown() first)")
    g = ProcessGroup(backend, device, timeout, check_collectives, on_fault, deterministic)
    _GROUP = g
    return g


def shutdown() -> None:
    """Finish blutrain.dist on this rank: wait for every rank to reach it (Note [a rank that
    leaves]: a rank that exits while the others still wait in a collective ends the job), then
    destroy the NCCL communicator and free our MPI communicators (MPI itself is finalized by
    mpi4py at exit).  Called at exit; init() may be called again afterwards."""
    global _GROUP
    g, _GROUP = _GROUP, None
    if g is not None:
        try:
            g.meet_at_shutdown()
        finally:
            g.close()


atexit.register(shutdown)
