"""Training checkpoints: safetensors weights, optimizer tensors, and a JSON of everything else.

A checkpoint is a directory::

    model.safetensors      the weights (name -> array)
    optimizer.safetensors  optimizer tensors, e.g. "exp_avg/transformer.wte.weight" (optional)
    trainer.json           step, config, RNG states, loader position, optimizer scalars (optional)
    manifest.json          format version, and size and sha256 of each file above

It is built in a temporary directory beside the target, every file fsync'ed, then renamed into
place (see `_io.atomic_write_dir`), so a crash leaves either the previous checkpoint or the new
one, never half of one. Loading checks the manifest (missing files, truncation, corruption) and,
when given what the model expects, every tensor's name, shape and dtype.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._bf16 import bf16_bits_to_fp32
from ._io import atomic_write_dir

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
TRAINER_FILE = "trainer.json"
MANIFEST_FILE = "manifest.json"
KNOWN_FILES = (MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE)
FORMAT = "blutrain-checkpoint"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, corrupt, or does not fit the model."""


def to_numpy(x: Any, name: str = "tensor") -> np.ndarray:
    """A numpy array from a numpy array, a DLPack-capable tensor, or anything array-like."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "__dlpack__"):
        try:
            return np.from_dlpack(x)
        except (TypeError, RuntimeError, BufferError):
            pass  # e.g. a device tensor: fall back to __array__ below
    if hasattr(x, "numpy") and callable(x.numpy):
        return np.asarray(x.numpy())
    try:
        return np.asarray(x)
    except Exception as e:  # report which tensor could not be converted
        raise TypeError(
            f"[checkpoint] {name}: cannot convert {type(x).__name__} to numpy ({e})"
        ) from None


def _as_arrays(tensors: Mapping[str, Any], what: str) -> dict[str, np.ndarray]:
    if not isinstance(tensors, Mapping):
        raise TypeError(f"[save_checkpoint] {what} must be a mapping of name -> array")
    out = {}
    for k, v in tensors.items():
        if not isinstance(k, str):
            raise TypeError(f"[save_checkpoint] {what}: tensor names must be str, got {k!r}")
        a = to_numpy(v, k)
        if a.dtype == object:
            raise TypeError(f"[save_checkpoint] {what}: {k} has dtype object")
        out[k] = np.array(a, order="C", copy=not a.flags.c_contiguous)  # keeps 0-d shapes
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def save_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict | None = None):
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata=metadata)


def save_checkpoint(
    path: str | os.PathLike,
    weights: Mapping[str, Any],
    optimizer: Mapping[str, Any] | None = None,
    trainer: Mapping[str, Any] | None = None,
) -> Path:
    """Write a checkpoint directory at `path` atomically (replacing one that is there).

    weights, optimizer: name -> numpy array or DLPack-capable tensor.
    trainer: anything JSON can hold (step, config dict, RNG states, loader position...).
    """
    path = Path(path)
    w = _as_arrays(weights, "weights")
    opt = _as_arrays(optimizer, "optimizer") if optimizer is not None else None
    if trainer is not None:
        try:
            trainer_text = json.dumps(trainer, indent=2, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"[save_checkpoint] trainer state is not JSON-serializable: {e}"
            ) from None

    def fill(tmp: Path) -> None:
        save_safetensors(tmp / MODEL_FILE, w, {"format": "pt"})
        if opt is not None:
            save_safetensors(tmp / OPTIMIZER_FILE, opt, {"format": "pt"})
        if trainer is not None:
            (tmp / TRAINER_FILE).write_text(trainer_text + "\n")
        files = {}
        for name in (MODEL_FILE, OPTIMIZER_FILE, TRAINER_FILE):
            f = tmp / name
            if f.exists():
                files[name] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
        manifest = {"format": FORMAT, "version": FORMAT_VERSION, "files": files}
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")

    atomic_write_dir(path, fill)
    return path


@dataclass
class Checkpoint:
    path: Path
    weights: dict[str, np.ndarray]
    optimizer: dict[str, np.ndarray] | None = None
    trainer: dict[str, Any] | None = None
    manifest: dict[str, Any] = field(default_factory=dict)


def _read_manifest(path: Path) -> dict:
    mpath = path / MANIFEST_FILE
    if not path.exists():
        leftovers = sorted(p.name for p in path.parent.glob(f"{path.name}.old-*"))
        hint = f" (a previous save was interrupted: see {leftovers})" if leftovers else ""
        raise FileNotFoundError(f"[load_checkpoint] {path}: no such checkpoint directory{hint}")
    if not path.is_dir():
        raise CheckpointError(f"[load_checkpoint] {path}: not a directory")
    if not mpath.is_file():
        raise FileNotFoundError(
            f"[load_checkpoint] {mpath}: missing (expected a checkpoint directory written by "
            "save_checkpoint)"
        )
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"[load_checkpoint] {mpath}: corrupt JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"[load_checkpoint] {mpath}: format is not {FORMAT!r}")
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"[load_checkpoint] {mpath}: version {manifest.get('version')!r}, "
            f"expected {FORMAT_VERSION}"
        )
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"[load_checkpoint] {mpath}: 'files' is not a JSON object")
    for name, entry in files.items():
        if name not in KNOWN_FILES:
            raise CheckpointError(
                f"[load_checkpoint] {mpath}: lists {name!r}, not one of {', '.join(KNOWN_FILES)}"
            )
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("bytes"), int)
            and not isinstance(entry.get("bytes"), bool)
            and entry["bytes"] >= 0
            and isinstance(entry.get("sha256"), str)
            and len(entry["sha256"]) == 64
        ):
            raise CheckpointError(
                f"[load_checkpoint] {mpath}: the entry of {name} is {entry!r:.120}, expected "
                '{"bytes": int, "sha256": 64 hex digits}'
            )
    if MODEL_FILE not in files:
        raise CheckpointError(f"[load_checkpoint] {mpath}: lists no {MODEL_FILE}")
    return manifest


def _verify_file(path: Path, entry: dict, verify_hash: bool) -> None:
    if not path.is_file():
        raise FileNotFoundError(f"[load_checkpoint] {path}: missing (listed in {MANIFEST_FILE})")
    size = path.stat().st_size
    if size != entry["bytes"]:
        what = "truncated" if size < entry["bytes"] else "larger than written"
        raise CheckpointError(
            f"[load_checkpoint] {path}: {what}: {size} bytes, expected {entry['bytes']}"
        )
    if verify_hash and _sha256(path) != entry["sha256"]:
        raise CheckpointError(
            f"[load_checkpoint] {path}: corrupt: sha256 differs from the one recorded at save"
        )


_ST_DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U64": "<u8",
    "U32": "<u4",
    "U16": "<u2",
    "U8": "u1",
    "BOOL": "?",
}


def _safetensors_header(path: Path) -> tuple[dict, int]:
    """Parse and check a safetensors header against the file size: (header, data offset)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"[safetensors] {path}: truncated: {size} bytes, no header")
        n = int.from_bytes(head, "little")
        if n > min(size - 8, 100_000_000):
            raise CheckpointError(
                f"[safetensors] {path}: truncated or corrupt: header claims {n} bytes, "
                f"the file has {size}"
            )
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"[safetensors] {path}: corrupt header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"[safetensors] {path}: corrupt header (not a JSON object)")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, TypeError, ValueError, IndexError):
            raise CheckpointError(f"[safetensors] {path}: corrupt entry for {name!r}") from None
    if 8 + n + end > size:
        raise CheckpointError(
            f"[safetensors] {path}: truncated: tensors need {8 + n + end} bytes, "
            f"the file has {size}"
        )
    return header, 8 + n


def load_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a safetensors file as numpy arrays, with errors that name the file.

    BF16 tensors (which numpy cannot hold) are returned upcast to float32, exactly.
    """
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"[safetensors] {path}: no such file")
    header, base = _safetensors_header(path)
    dtypes = {k: v.get("dtype") for k, v in header.items() if k != "__metadata__"}
    if "BF16" in dtypes.values() or any(d not in _ST_DTYPES for d in dtypes.values()):
        out = {}
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        for name, info in header.items():
            if name == "__metadata__":
                continue
            lo, hi = (base + int(o) for o in info["data_offsets"])
            shape = tuple(info["shape"])
            if info["dtype"] == "BF16":
                bits = np.frombuffer(raw[lo:hi].tobytes(), dtype="<u2")
                out[name] = bf16_bits_to_fp32(bits).reshape(shape)
            elif info["dtype"] in _ST_DTYPES:
                out[name] = np.frombuffer(raw[lo:hi].tobytes(), _ST_DTYPES[info["dtype"]]).reshape(
                    shape
                )
            else:
                raise CheckpointError(
                    f"[safetensors] {path}: tensor {name!r} has dtype {info['dtype']}, "
                    "which numpy cannot hold"
                )
        return out
    try:
        return load_file(str(path))
    except (SafetensorError, ValueError, OSError, TypeError) as e:
        raise CheckpointError(f"[safetensors] {path}: corrupt safetensors file ({e})") from None


Spec = Mapping[
    str, Any
]  # name -> array (its shape and dtype are what is expected) or (shape, dtype)


def check_tensors(
    found: Mapping[str, np.ndarray], expected: Spec, source: str | os.PathLike, strict: bool = True
) -> None:
    """Raise CheckpointError naming the first tensor whose name, shape or dtype is not expected.

    expected: name -> array-like (its shape and dtype) or a (shape, dtype) pair; dtype None
    accepts any dtype. With `strict`, tensors in `found` that are not expected are an error too.
    """
    for name, spec in expected.items():
        if isinstance(spec, tuple) and len(spec) == 2 and isinstance(spec[0], tuple):
            shape, dtype = spec
        else:
            a = to_numpy(spec, name) if not hasattr(spec, "shape") else spec
            shape, dtype = tuple(a.shape), a.dtype
        if name not in found:
            raise CheckpointError(f"[checkpoint] {source}: tensor {name!r} is missing")
        t = found[name]
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"[checkpoint] {source}: tensor {name!r} has shape {tuple(t.shape)}, "
                f"expected {tuple(shape)}"
            )
        if dtype is not None and np.dtype(t.dtype) != np.dtype(dtype):
            raise CheckpointError(
                f"[checkpoint] {source}: tensor {name!r} has dtype {np.dtype(t.dtype)}, "
                f"expected {np.dtype(dtype)}"
            )
    if strict:
        extra = sorted(set(found) - set(expected))
        if extra:
            more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
            raise CheckpointError(f"[checkpoint] {source}: unexpected tensor(s) {extra[:5]}{more}")


def load_checkpoint(
    path: str | os.PathLike,
    expected_weights: Spec | None = None,
    expected_optimizer: Spec | None = None,
    *,
    strict: bool = True,
    verify_hash: bool = True,
) -> Checkpoint:
    """Read a checkpoint written by `save_checkpoint`.

    Missing files, truncation and (with `verify_hash`) any changed byte are errors naming the
    file; with `expected_*` (e.g. the model's state_dict()), a missing or unexpected tensor or a
    shape or dtype mismatch is an error naming the tensor, its shape and the expected one.
    """
    path = Path(path)
    manifest = _read_manifest(path)
    files = manifest["files"]
    for name, entry in files.items():
        _verify_file(path / name, entry, verify_hash)
    weights = load_safetensors(path / MODEL_FILE)
    if expected_weights is not None:
        check_tensors(weights, expected_weights, path / MODEL_FILE, strict)
    optimizer = None
    if OPTIMIZER_FILE in files:
        optimizer = load_safetensors(path / OPTIMIZER_FILE)
        if expected_optimizer is not None:
            check_tensors(optimizer, expected_optimizer, path / OPTIMIZER_FILE, strict)
    elif expected_optimizer is not None:
        raise FileNotFoundError(f"[load_checkpoint] {path}: holds no {OPTIMIZER_FILE}")
    trainer = None
    if TRAINER_FILE in files:
        try:
            trainer = json.loads((path / TRAINER_FILE).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"[load_checkpoint] {path / TRAINER_FILE}: corrupt ({e})"
            ) from None
        if not isinstance(trainer, dict):
            raise CheckpointError(f"[load_checkpoint] {path / TRAINER_FILE}: not a JSON object")
    return Checkpoint(
        path=path, weights=weights, optimizer=optimizer, trainer=trainer, manifest=manifest
    )
