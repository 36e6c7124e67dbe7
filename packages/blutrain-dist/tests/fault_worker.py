"""Jobs that go wrong on purpose: ``mpiexec -n 3 python fault_worker.py KIND PIDDIR``.

hang: rank 1 sleeps instead of joining an all_reduce; kill: rank 2 is SIGKILLed while the others
wait in one; raise: rank 1 raises (uncaught) instead of joining it; exit: rank 1 calls
sys.exit(3) instead; late: nothing fails, rank 0 computes 3 s longer, then sends to rank 1,
which waits in recv meanwhile (rank 2, at shutdown, must wait for both).  Every rank first
writes its pid to PIDDIR so the test can check none is left.  BLUTRAIN_FAULT_DEVICE=cuda sets
up CUDA as well (the default device on a GPU machine), to see reports number the user's
collectives from #1 there too (Note [numbering starts after init] in _group.py)."""

from __future__ import annotations

import os
import signal
import sys
import time

import blutrain.dist as dist
import blutrain.tensor as bt

kind, piddir = sys.argv[1], sys.argv[2]
# CPU tensors, so device="cpu": on a GPU machine the default would set up CUDA too (and, with three
# ranks on one GPU, print the MPI-staging notice that test "late" must not see)
dist.init(
    device=os.environ.get("BLUTRAIN_FAULT_DEVICE", "cpu"),
    timeout=float(os.environ.get("BLUTRAIN_DIST_TIMEOUT", "4")),
)
r = dist.rank()
with open(os.path.join(piddir, f"{r}.pid"), "w") as f:
    f.write(str(os.getpid()))
x = bt.ones(1000)
dist.all_reduce(x)  # collective #1 completes on every rank
dist.barrier()
if kind == "hang" and r == 1:
    time.sleep(3600)  # hung outside blutrain.dist (its watchdog still answers)
if kind == "raise" and r == 1:
    raise RuntimeError("rank 1 fails on purpose")
if kind == "exit" and r == 1:
    sys.exit(3)  # no exception reaches the excepthook: shutdown's meeting sees the others wait
if kind == "kill" and r == 2:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(x)  # the others wait here
if kind == "late":
    if r == 0:
        time.sleep(3.0)  # rank 2 waits at shutdown meanwhile, and must not end the job
        dist.send(x, 1)
    elif r == 1:
        dist.recv(x, 0)  # numbered #4 here, but not a collective rank 2 must join
    print(f"rank {r}: done", flush=True)
else:
    print(f"rank {r}: unexpectedly completed", flush=True)
