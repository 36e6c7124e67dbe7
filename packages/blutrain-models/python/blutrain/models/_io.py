"""Atomic file and directory writes.

A file is written to a temporary name in the same directory, flushed and fsync'ed, then
os.replace'd onto its final name, and the directory is fsync'ed so that the rename itself is
durable. A reader therefore sees the old file or the complete new one, never a half-written file,
whatever the moment a crash or a kill happens.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or a new entry in `path` durable (no-op where a directory can't be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path` to write by any means; on a clean exit it is
    fsync'ed and becomes `path`. On an exception it is removed and `path` is left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        fsync_file(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """Open a temporary file beside `path` for binary writing; on a clean exit it becomes `path`.

    On an exception the temporary file is removed and `path` is left as it was.
    """
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        yield f


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path) as f:
        f.write(data)


def fsync_file(path: str | os.PathLike) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def atomic_write_dir(path: str | os.PathLike, fill: Callable[[Path], None]) -> None:
    """Build a directory with `fill(tmpdir)` and put it in place of `path` atomically.

    Every file `fill` writes is fsync'ed before the directory is renamed into place. When `path`
    already exists it is first renamed aside (to ``<path>.old-*/<name>``) and removed after the
    new one is in place. A Python exception at any point puts the previous directory back; a
    kill between the two renames leaves it complete in ``<path>.old-*``, from where the next save
    restores it before doing anything else. Temporary directories of killed saves are removed
    by the next save. One writer per path (rank 0, say) is assumed.
    """
    path = Path(path)
    parent = path.parent
    parent.mkdir(parents=True, exist_ok=True)
    for stale in parent.glob(f".{glob_escape(path.name)}.*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    olds = sorted(parent.glob(f"{glob_escape(path.name)}.old-*"), key=lambda p: p.stat().st_mtime)
    if not path.exists():
        for old in reversed(olds):
            if (old / path.name).is_dir():
                os.replace(old / path.name, path)
                break
    for old in olds:
        shutil.rmtree(old, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent))
    old = None
    try:
        fill(tmp)
        for child in tmp.rglob("*"):
            if child.is_file():
                fsync_file(child)
        os.chmod(tmp, 0o755)
        fsync_dir(tmp)
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f"{path.name}.old-", dir=parent))
            os.replace(path, old / path.name)
        os.replace(tmp, path)
    except BaseException:
        if old is not None and not path.exists():
            os.replace(old / path.name, path)
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        raise
    fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)
