"""Checkpoints of distributed training: the model written once, the optimizer state sharded.

    dist.save_checkpoint("ckpt", model, opt, extra={"step": 100})   # every rank calls it
    extra = dist.load_checkpoint("ckpt", model, opt)                 # any world size

Layout of the directory (safetensors, the format blutrain.models uses):
    model.safetensors               rank 0: the model's parameters (16-bit floats as their bits)
    optimizer.safetensors           rank 0: a replicated AdamW's state (DDP), or
    optimizer-rank00003.safetensors every rank: a ZeroOptimizer's pieces (master, exp_avg,
                                    exp_avg_sq of the elements it owns, keyed name@offset)
    dist.json                       rank 0: world size, kind, each shard's pieces, `extra`
A ZeroOptimizer saved from N ranks loads on M ranks: each rank reads the pieces that overlap the
elements it owns under the new layout.  The directory is built under ``<path>.tmp`` and renamed
into place when every rank has written, so an interrupted save leaves the previous one whole
(the directory must be on a filesystem every rank sees).
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import numpy as np

import blutrain.tensor as bt

from ._group import group
from .zero import ZeroOptimizer

_FORMAT = 1


def _to_numpy(t: bt.Tensor) -> tuple[np.ndarray, str]:
    t = t.detach().cpu()
    if t.dtype == bt.bfloat16:  # numpy has no bfloat16: keep the bits
        return np.array(t.to(bt.float32).numpy().view(np.uint32) >> 16, dtype=np.uint16), "bfloat16"
    return np.array(t.numpy(), copy=True), t.dtype.name


def _from_numpy(a: np.ndarray, dtype_name: str) -> bt.Tensor:
    if dtype_name == "bfloat16":
        f = (np.asarray(a, dtype=np.uint32) << 16).view(np.float32)
        return bt.tensor(np.ascontiguousarray(f)).to(bt.bfloat16)
    return bt.tensor(np.ascontiguousarray(a))


def _params(model: Any) -> list[tuple[str, bt.Tensor]]:
    return list(model.named_parameters())


def save_checkpoint(path: str, model: Any, optimizer: Any = None, extra: Any = None) -> None:
    """Write model (once, from rank 0), optimizer state (sharded for a ZeroOptimizer) and
    `extra` (JSON-able) to directory `path`; every rank calls it."""
    from safetensors.numpy import save_file

    g = group("save_checkpoint")
    tmp = f"{path}.tmp"
    if g.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    g.barrier()
    meta: dict[str, Any] = {"format": _FORMAT, "world_size": g.size, "extra": extra}
    dtypes = {}
    if g.rank == 0:
        tensors = {}
        for name, p in _params(model):
            tensors[name], dtypes[name] = _to_numpy(p)
        save_file(tensors, os.path.join(tmp, "model.safetensors"))
    meta["model_dtypes"] = dtypes
    if isinstance(optimizer, ZeroOptimizer):
        st = optimizer.shard_state()
        save_file(st["tensors"], os.path.join(tmp, f"optimizer-rank{g.rank:05d}.safetensors"))
        metas = g.allgather_object(st["meta"], "save_checkpoint")
        meta.update(kind="zero", shards=metas)
    elif optimizer is not None:
        sd = optimizer.state_dict()
        if g.rank == 0:
            save_file(sd["tensors"], os.path.join(tmp, "optimizer.safetensors"))
        meta.update(kind="replicated", optimizer=sd["meta"])
    else:
        meta.update(kind="model")
    g.barrier()
    if g.rank == 0:
        with open(os.path.join(tmp, "dist.json"), "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())
        old = f"{path}.old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    g.barrier()


def load_checkpoint(path: str, model: Any, optimizer: Any = None) -> Any:
    """Restore what save_checkpoint wrote, at any world size; returns `extra`.  Errors name the
    file and the tensor."""
    from safetensors import safe_open

    g = group("load_checkpoint")
    mpath = os.path.join(path, "dist.json")
    try:
        with open(mpath) as f:
            meta = json.load(f)
    except OSError as e:
        raise FileNotFoundError(f"[load_checkpoint] cannot read {mpath}: {e}") from None
    if meta.get("format") != _FORMAT:
        raise ValueError(
            f"[load_checkpoint] {mpath}: format {meta.get('format')!r}, expected {_FORMAT}"
        )
    own = dict(_params(model))
    with safe_open(os.path.join(path, "model.safetensors"), framework="numpy") as f:
        keys = set(f.keys())
        missing, unexpected = sorted(set(own) - keys), sorted(keys - set(own))
        if missing or unexpected:
            raise ValueError(
                f"[load_checkpoint] {path}/model.safetensors: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        with bt.no_grad():
            for name, p in own.items():
                a = f.get_tensor(name)
                if tuple(a.shape) != tuple(p.shape):
                    raise ValueError(
                        f"[load_checkpoint] {name}: the checkpoint has shape {tuple(a.shape)}, "
                        f"the model {tuple(p.shape)}"
                    )
                t = _from_numpy(a, meta["model_dtypes"].get(name, p.dtype.name))
                p.copy_(t.to(p.dtype).to(str(p.device)))
    kind = meta.get("kind")
    if optimizer is None:
        return meta.get("extra")
    if isinstance(optimizer, ZeroOptimizer):
        if kind != "zero":
            raise ValueError(
                f"[load_checkpoint] {path} holds a {kind} optimizer state, not ZeRO shards"
            )
        handles: dict[int, Any] = {}

        def read(k: int, key: str) -> np.ndarray:
            if k not in handles:
                handles[k] = safe_open(
                    os.path.join(path, f"optimizer-rank{k:05d}.safetensors"), framework="numpy"
                )
            return handles[k].get_tensor(key)

        optimizer.load_shards(meta["shards"], read)
    else:
        if kind != "replicated":
            raise ValueError(
                f"[load_checkpoint] {path} holds a {kind} optimizer state, not AdamW's"
            )
        with safe_open(os.path.join(path, "optimizer.safetensors"), framework="numpy") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        optimizer.load_state_dict({"meta": meta["optimizer"], "tensors": tensors})
    g.barrier()
    return meta.get("extra")
