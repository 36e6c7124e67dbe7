"""The disk cache of compiled programs.

Key: SHA-256 of the graph's canonical hash, this package's version, the MLIR bindings' version,
the target and the pass pipelines. An entry is a folder holding the artifact (CPU: a shared
library linked from ExecutionEngine's object file; GPU: the PTX of every module and the launch
plan) and `meta.json`, written last, with the artifact's SHA-256: an entry without a matching
meta is incomplete or corrupt and is rebuilt (and overwritten), never trusted. Every file is
written to a temporary name, fsync'ed and renamed, so concurrent processes see whole files only.
BLUTRAIN_COMPILE_CACHE sets the folder (default ~/.cache/blutrain/compiler); "0" turns it off.

Note [cache hits without MLIR]: a hit loads the artifact and partitions the graph again (the
groups' names find their kernels), which takes no MLIR: `import blutrain.compiler`, capture,
the key, fusion.partition (its op sets live in opsets.py, not in lower.py) and both runtimes
import the bindings only inside the functions that build code. So a GPU machine without the
bindings runs PTX compiled elsewhere (program.compile_gpu_cache, or a copied cache folder);
`test_cache_hits_across_processes_and_corrupt_entries_rebuild` runs a hit with them blocked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from typing import Any

log = logging.getLogger("blutrain.compiler")


def atomic_write(path: str, data: bytes) -> None:
    """Write to a temporary file in the same folder, fsync, rename: readers see all or nothing."""
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


MLIR_PIN = "22.1.8.4"  # xtc-mlir-python-bindings, pinned in pyproject.toml


_SOURCE_DIGEST: str | None = None


def source_digest() -> str:
    """SHA-256 of this package's Python sources: an edited compiler never reads old entries."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        h = hashlib.sha256()
        here = os.path.dirname(os.path.abspath(__file__))
        for name in sorted(os.listdir(here)):
            if name.endswith(".py"):
                with open(os.path.join(here, name), "rb") as f:
                    h.update(name.encode() + b"\0" + f.read())
        _SOURCE_DIGEST = h.hexdigest()[:16]
    return _SOURCE_DIGEST


def versions() -> dict[str, str]:
    """This package's version and the MLIR bindings' (the pin where they are not installed as
    a distribution: a GPU machine with the bundled bindings or none, reading cached code)."""
    from importlib import metadata

    from . import __version__

    try:
        mlir = metadata.version("xtc-mlir-python-bindings")
    except metadata.PackageNotFoundError:
        mlir = MLIR_PIN
    return {"blutrain-compiler": __version__, "sources": source_digest(), "mlir": mlir}


def folder() -> str | None:
    d = os.environ.get("BLUTRAIN_COMPILE_CACHE")
    if d == "0":
        return None
    return d or os.path.join(os.path.expanduser("~"), ".cache", "blutrain", "compiler")


def key(graph_hash: str, target: str, extra: str) -> str:
    from . import backend_gpu, pipelines

    h = hashlib.sha256()
    h.update(
        json.dumps(
            {
                "graph": graph_hash,
                "target": target,
                "versions": versions(),
                "extra": extra,
                "opt": os.environ.get("BLUTRAIN_COMPILE_OPT", "1"),
                # CPU code built with parallel loops calls __kmpc_* (libbtc_omp): an entry built
                # without that library is serial, and one built with it needs it
                "omp": target == "cpu" and _omp(),
            },
            sort_keys=True,
        ).encode()
    )
    for p in (
        pipelines.FUSE,
        pipelines.BUFFERIZE,
        pipelines.CPU_LOOPS,
        pipelines.CPU_LLVM,
        backend_gpu.OUTLINE,
        backend_gpu.CHIP,
        backend_gpu.FEATURES,
        str(backend_gpu.THREADS),
    ):
        h.update(p.encode())
    return h.hexdigest()[:32]


def _omp() -> bool:
    from . import backend_cpu

    return backend_cpu.omp_threads() > 0


class Entry:
    def __init__(self, k: str) -> None:
        root = folder()
        self.path = os.path.join(root, k) if root else None

    def load(self, artifact: str) -> tuple[str, dict[str, Any]] | None:
        """(artifact path, meta) when the entry is complete and its checksum matches."""
        if self.path is None:
            return None
        meta_p, art = os.path.join(self.path, "meta.json"), os.path.join(self.path, artifact)
        if not os.path.exists(meta_p):
            return None
        try:
            with open(meta_p, "rb") as f:
                meta = json.loads(f.read())
            with open(art, "rb") as f:
                data = f.read()
        except (OSError, ValueError) as e:
            log.warning("[compile] cache entry %s unreadable (%s): rebuilding", self.path, e)
            return None
        if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            log.warning("[compile] cache entry %s is corrupt (checksum): rebuilding", self.path)
            return None
        return art, meta

    def store(self, artifact: str, data: bytes, meta: dict[str, Any]) -> None:
        if self.path is None:
            return
        try:
            atomic_write(os.path.join(self.path, artifact), data)
            meta = dict(meta, sha256=hashlib.sha256(data).hexdigest(), versions=versions())
            atomic_write(os.path.join(self.path, "meta.json"), json.dumps(meta).encode())
        except OSError as e:  # a read-only or full disk costs a recompile later, nothing else
            log.warning("[compile] could not write cache entry %s: %s", self.path, e)
