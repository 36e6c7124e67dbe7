"""blutrain-dist tests: the multi-rank cases run under mpiexec (tests/dist_worker.py), launched
once per world size (dist_runs.py); fault tests launch their own small jobs."""
