"""Jobs that go wrong on purpose: ``mpiexec -n 3 python fault_worker.py KIND PIDDIR``.

hang: rank 1 sleeps instead of joining an all_reduce; kill: rank 2 is SIGKILLed while the others
wait in one; raise: rank 1 raises (uncaught) instead of joining it.  Every rank first writes its
pid to PIDDIR so the test can check none is left."""

from __future__ import annotations

import os
import signal
import sys
import time

import blutrain.dist as dist
import blutrain.tensor as bt

kind, piddir = sys.argv[1], sys.argv[2]
dist.init(timeout=float(os.environ.get("BLUTRAIN_DIST_TIMEOUT", "4")))
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
if kind == "kill" and r == 2:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(x)  # the others wait here
print(f"rank {r}: unexpectedly completed", flush=True)
