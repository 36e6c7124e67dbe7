"""ZeroOptimizer: ZeRO stage 1 and 2 around blutrain.models' AdamW.

    model = GPT2(cfg, device=dist.device(), precision=bt.amp.Policy(compute=bt.bfloat16,
                                                                     param=bt.bfloat16))
    opt = dist.ZeroOptimizer(AdamW(model.named_parameters(), lr=6e-4), stage=2)
    for step in range(steps):
        for micro in range(accum):
            with opt.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                (model(x, y, return_logits=False)[1] / accum).backward()
        norm, coef = opt.grad_norm_and_clip_coef(1.0)
        opt.set_lr(sched(step))
        opt.step(grad_scale=coef)

Layout.  The parameters move into flat buffers, one per gradient bucket (_reducer.py), padded to
world_size equal chunks; rank r owns chunk r of every bucket.  Its AdamW state (exp_avg,
exp_avg_sq, float32) covers its chunks only, and so does its float32 master copy when the
parameters are 16-bit (float32 parameters are their own masters).  Backward reduce-scatters each
bucket as soon as its gradients are complete (the average over ranks, rounded once); step()
updates the owned chunks and all-gathers the parameters back, bucket by bucket: the update of
one bucket (compute stream) overlaps the all-gather of the one before (communication stream),
in forward order (the bucket holding the first layers goes first), and the compute stream
waits for the gathers on the GPU (no host sync).  Note: the gathers do not yet overlap the next
forward itself (that needs per-layer waits inside the model's forward).

Stage 1 keeps every bucket's gradient buffer (``.grad`` stay views of it); stage 2 frees a bucket
once it is reduced and keeps only the owned chunk (``.grad`` is None after backward).  Bytes per
parameter of model state on each rank, for bf16 parameters with float32 masters (ZeRO's 2+2+12):

    stage 1: 2 (params) + 2 (gradients)     + 12 / N (master, exp_avg, exp_avg_sq)
    stage 2: 2 (params) + 2 / N (gradients) + 12 / N

:meth:`memory` reports the bytes held and this formula.  Under ZeRO ``.grad`` (stage 1) holds
the reduced gradient only in the owned chunks: clip with :meth:`grad_norm_and_clip_coef`.

Deterministic mode: the gradient norm is computed from the gathered whole gradient, tensor by
tensor in model order, exactly as DistributedDataParallel's (bt.optim.grad_norm), so clipping
keeps results bitwise equal across world sizes and modes; it costs one all-gather of the
gradients per step (and, at stage 2, the whole gradient for that moment).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

import blutrain.tensor as bt

from . import _dist
from ._group import group
from ._reducer import Bucket, Reducer
from .ddp import broadcast_parameters as _broadcast_parameters

_16BIT = (bt.float16, bt.bfloat16)


class _Piece:
    """The part of one parameter inside this rank's chunk of a bucket."""

    __slots__ = ("bucket", "name", "param", "lo", "hi", "start", "wd")

    def __init__(
        self, bucket: Bucket, name: str, param: bt.Tensor, lo: int, hi: int, start: int, wd: float
    ) -> None:
        self.bucket = bucket
        self.name = name
        self.param = param
        self.lo, self.hi = lo, hi  # element range inside the parameter (flattened)
        self.start = start  # offset inside the rank's chunk
        self.wd = wd


class ZeroOptimizer:
    """ZeRO-1 / ZeRO-2 over an AdamW (see the module docstring).

    optimizer: a blutrain.models.optim.AdamW built on the model's named_parameters(); its
      hyperparameters, weight-decay choices and lr are used, its state is not (state is sharded
      here).
    stage: 1 (optimizer state sharded) or 2 (gradients too).
    master_dtype: the dtype of the master weights and of the AdamW update for 16-bit
      parameters (float32).
    reduce_dtype: the dtype gradients are summed in (None: theirs).
    """

    def __init__(
        self,
        optimizer: Any,
        stage: int = 1,
        reduce_dtype: Any = None,
        bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        master_dtype: Any = bt.float32,
        broadcast_parameters: bool = True,
        find_unused_parameters: bool = False,
    ) -> None:
        g = group("ZeroOptimizer")
        if stage not in (1, 2):
            raise ValueError(f"[ZeroOptimizer] stage must be 1 or 2, got {stage!r}")
        for attr in ("params", "betas", "eps", "weight_decay", "decay", "lr"):
            if not hasattr(optimizer, attr):
                raise TypeError(
                    f"[ZeroOptimizer] optimizer must be blutrain.models.optim.AdamW (it lacks "
                    f".{attr}), got {type(optimizer).__name__}"
                )
        if getattr(optimizer, "state", None):
            raise ValueError(
                "[ZeroOptimizer] the AdamW already has state: wrap it before its first step "
                "(or load a checkpoint into the ZeroOptimizer)"
            )
        self.g = g
        self.opt = optimizer
        self.stage = stage
        self.master_dtype = master_dtype
        self.step_count = 0
        named = [(n, p) for n, p in optimizer.params if p.requires_grad]
        if broadcast_parameters:
            _broadcast_parameters(g, named, "ZeroOptimizer")
        self._shard_grads: dict[int, bt.Tensor] = {}
        self.reducer = Reducer(
            g,
            named,
            who="ZeroOptimizer",
            mode="reduce_scatter",
            reduce_dtype=reduce_dtype,
            first_bucket_mb=first_bucket_mb,
            bucket_mb=bucket_cap_mb,
            keep_full_grads=stage == 1,
            find_unused_parameters=find_unused_parameters,
            shard_out=self._shard_out,
        )
        self.buckets = self.reducer.buckets
        r = g.rank
        self.param_buffers: list[bt.Tensor] = []
        self.masters: list[bt.Tensor] = []
        self.exp_avg: list[bt.Tensor] = []
        self.exp_avg_sq: list[bt.Tensor] = []
        self.pieces: list[list[_Piece]] = []
        with bt.no_grad():
            for b in self.buckets:
                # the parameters move into the bucket's flat buffer (p.data = view)
                buf = bt.zeros(b.padded, dtype=b.dtype, device=b.device)
                views = b.views(buf)
                for p, v in zip(b.params, views, strict=True):
                    v.copy_(p.detach())
                    bt._tensor._set_data(p, v)
                bt._tensor._share_version_counter(b.params)  # Note [version counter groups]
                self.param_buffers.append(buf)
                own = buf[r * b.chunk : (r + 1) * b.chunk]
                if b.dtype in _16BIT and master_dtype not in _16BIT:
                    master = own.to(master_dtype)
                else:
                    master = own  # float32 / float64 parameters are their own masters
                self.masters.append(master)
                sd = bt.float64 if master.dtype == bt.float64 else bt.float32
                self.exp_avg.append(bt.zeros(b.chunk, dtype=sd, device=b.device))
                self.exp_avg_sq.append(bt.zeros(b.chunk, dtype=sd, device=b.device))
                self.pieces.append(self._pieces_of(b, r))
        self._names = {n for n, _ in named}
        self._model_order = [p for _, p in named]
        self._update_lists: list[Any] = []
        self._build_update_lists()
        self._gc_window = -1  # reducer window the cached gradient chunks belong to
        self._gc: list[bt.Tensor] = []
        self._gs: list[list[bt.Tensor]] = []

    def _build_update_lists(self) -> None:
        """Per bucket, this rank's pieces of master / exp_avg / exp_avg_sq and their weight
        decays: views of persistent buffers, made once (step() only adds the gradients')."""
        self._update_lists = []
        for b, pcs in zip(self.buckets, self.pieces, strict=True):
            if not pcs:
                self._update_lists.append(None)
                continue
            master, m, v = self.masters[b.index], self.exp_avg[b.index], self.exp_avg_sq[b.index]
            sl = [(pc.start, pc.start + pc.hi - pc.lo) for pc in pcs]
            self._update_lists.append(
                (
                    [master[a:e] for a, e in sl],
                    [m[a:e] for a, e in sl],
                    [v[a:e] for a, e in sl],
                    [pc.wd for pc in pcs],
                    sl,
                )
            )

    # -- layout ----------------------------------------------------------------------------------
    def _pieces_of(self, b: Bucket, r: int) -> list[_Piece]:
        lo_c, hi_c = r * b.chunk, (r + 1) * b.chunk
        out = []
        for name, p, off in zip(b.names, b.params, b.offsets, strict=True):
            lo, hi = max(off, lo_c), min(off + p.numel(), hi_c)
            if lo < hi:
                wd = self.opt.weight_decay if self.opt.decay.get(name, p.ndim >= 2) else 0.0
                out.append(_Piece(b, name, p, lo - off, hi - off, lo - lo_c, wd))
        return out

    def _shard_out(self, b: Bucket) -> bt.Tensor:
        """Where bucket b's reduced chunk goes: stage 1 in place (its own chunk of the bucket,
        in the gradient dtype); stage 2 a kept buffer of chunk size."""
        rd = self.reducer.reduce_dtype or b.dtype
        if self.stage == 1 and rd == b.dtype:
            r = self.g.rank
            return b.buffer[r * b.chunk : (r + 1) * b.chunk]
        t = self._shard_grads.get(b.index)
        if t is None:
            t = bt.zeros(b.chunk, dtype=rd, device=b.device)
            self._shard_grads[b.index] = t
        return t

    def _grad_chunk(self, b: Bucket) -> bt.Tensor:
        g = self._shard_out(b)
        return g if g.dtype == self.masters[b.index].dtype else g.to(self.masters[b.index].dtype)

    def _grad_slices(self) -> list[list[bt.Tensor]]:
        """Per bucket, the reduced gradient of this rank's pieces in the master dtype: made once
        per optimizer step (norm and update share them)."""
        if self._gc_window == self.reducer.windows and self._gc:
            return self._gs
        self._gc, self._gs = [], []
        for b, u in zip(self.buckets, self._update_lists, strict=True):
            gc = self._grad_chunk(b) if u is not None else None
            self._gc.append(gc)
            self._gs.append([gc[a:e] for a, e in u[4]] if u is not None else [])
        self._gc_window = self.reducer.windows
        return self._gs

    # -- the optimizer's face ------------------------------------------------------------------
    @property
    def lr(self) -> float:
        return float(self.opt.lr)

    def set_lr(self, lr: float) -> None:
        """Set the wrapped AdamW's learning rate (schedulers call this every step)."""
        self.opt.set_lr(lr)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally (full gradients, both stages); the next
        one outside reduce-scatters the sum once."""
        with self.reducer.no_sync():
            yield

    def finish_gradient_sync(self) -> None:
        """Reduce-scatter buckets a backward left open (parameters without a gradient); a no-op
        when every parameter got one."""
        self.reducer.finish()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the next backward's gradients replace the buckets' values."""

    def grad_norm_and_clip_coef(
        self, max_norm: float | None, eps: float = 1e-6
    ) -> tuple[bt.Tensor, bt.Tensor | None]:
        """(global gradient norm, clip coefficient) as 0-d tensors on the device, from every
        rank's chunks (no host sync with NCCL): pass the coefficient to step(grad_scale=).
        In deterministic mode the norm is DistributedDataParallel's, bit for bit (see the
        module docstring)."""
        import math

        self.reducer.finish()
        if self.g.deterministic:
            norm = self._gathered_norm()
        else:
            grads = [g for gs in self._grad_slices() for g in gs]
            dev = self.buckets[0].device
            if grads:
                local = bt._tensor._grad_norm(grads).to(bt.float64)
                sq = (local * local).reshape(1)
            else:
                sq = bt.zeros(1, dtype=bt.float64, device=dev)
            if self.g.size > 1:
                from .collectives import _backend_for

                seq = self.g.next_seq()
                what = f"all_reduce #{seq} (gradient norm)"
                _backend_for(sq, self.g).all_reduce(sq, 0, what, seq).wait()
            norm = sq.sqrt().reshape(()).to(bt.float32)
        if max_norm is None or not math.isfinite(max_norm) or max_norm <= 0:
            return norm, None
        return norm, bt._tensor._clip_coef(norm, float(max_norm), eps)

    def _gathered_norm(self) -> bt.Tensor:
        """The norm of the whole reduced gradient, each tensor in model order (as DDP's)."""
        from .collectives import _backend_for

        views: dict[int, bt.Tensor] = {}
        works = []
        for b in self.buckets:
            gc = self._shard_out(b)
            if self.g.size == 1:  # the chunk is the whole bucket
                full = gc
            else:
                full = bt.empty(b.padded, dtype=gc.dtype, device=b.device)
                seq = self.g.next_seq()
                what = f"all_gather #{seq} (ZeroOptimizer bucket {b.index} gradient, its norm)"
                works.append(_backend_for(full, self.g).all_gather(full, gc, what, seq))
            for p, v in zip(b.params, b.views(full), strict=True):
                views[id(p)] = v
        for w in works:
            w.wait()
        grads = [views[id(p)] for p in self._model_order if id(p) in views]
        return bt._tensor._grad_norm(grads).to(bt.float32)

    @bt.no_grad()
    def step(self, grad_scale: bt.Tensor | None = None) -> None:
        """Update this rank's chunks from the reduced gradients and all-gather the parameters,
        bucket by bucket in forward order (each gather overlaps the next bucket's update)."""
        self.reducer.finish()
        self.step_count += 1
        b1, b2 = self.opt.betas
        gs = self._grad_slices()
        works = []
        for b in reversed(self.buckets):  # the first layers' bucket: the next forward's first
            u = self._update_lists[b.index]
            if u is not None:
                bt._tensor._adamw_(
                    u[0],
                    gs[b.index],
                    u[1],
                    u[2],
                    self.opt.lr,
                    b1,
                    b2,
                    self.opt.eps,
                    u[3],
                    float(self.step_count),
                    grad_scale,
                )
            works.append((b, self._gather_bucket(b)))
        self._gc, self._gs, self._gc_window = [], [], -1  # the next backward makes new ones
        self._finish_gathers(works)

    def _gather_bucket(self, b: Bucket) -> Any:
        """Start the all-gather of bucket b's parameters from this rank's updated chunk."""
        from .collectives import _backend_for

        r = self.g.rank
        buf = self.param_buffers[b.index]
        own = buf[r * b.chunk : (r + 1) * b.chunk]
        master = self.masters[b.index]
        if master is not own and not master._shares_storage(own):
            own.copy_(master)  # rounds the float32 master into the 16-bit parameter
        seq = self.g.next_seq()
        what = f"all_gather #{seq} (ZeroOptimizer bucket {b.index} parameters)"
        return _backend_for(buf, self.g).all_gather(buf, own, what, seq)

    def _finish_gathers(self, works: list[tuple[Bucket, Any]]) -> None:
        """The compute stream waits for the gathers (NCCL: on the GPU), and the parameters'
        version moves on (casts cached from the old values are dropped)."""
        for b, w in works:
            w.wait()
            _dist.bump_version(b.params[0])  # the bucket's version group (Note [...] in tensor.h)

    def _gather_parameters(self) -> None:
        self._finish_gathers([(b, self._gather_bucket(b)) for b in reversed(self.buckets)])

    # -- memory ----------------------------------------------------------------------------------
    def memory(self) -> dict[str, Any]:
        """Bytes of model state this rank holds, and ZeRO's formula for them."""
        n = self.g.size
        P = sum(b.numel for b in self.buckets)
        pbytes = sum(buf.numel() * buf.element_size() for buf in self.param_buffers)
        if self.stage == 1:
            gbytes = sum(b.nbytes() for b in self.buckets)
        else:
            gbytes = 0
        gbytes += sum(t.numel() * t.element_size() for t in self._shard_grads.values())
        master = sum(
            t.numel() * t.element_size()
            for t, buf in zip(self.masters, self.param_buffers, strict=True)
            if not t._shares_storage(buf)
        )
        states = sum(t.numel() * t.element_size() for t in self.exp_avg + self.exp_avg_sq)
        pe = self.buckets[0].dtype.itemsize
        ge = (self.reducer.reduce_dtype or self.buckets[0].dtype).itemsize
        me = self.master_dtype.itemsize if pe < 4 else 0
        se = 8 if self.buckets[0].dtype == bt.float64 else 4
        grads_f = pe if self.stage == 1 else ge / n
        formula = P * (pe + grads_f + (me + 2 * se) / n)
        return {
            "params": P,
            "param_bytes": pbytes,
            "grad_bytes": gbytes,
            "master_bytes": master,
            "state_bytes": states,
            "total_bytes": pbytes + gbytes + master + states,
            "formula_bytes": formula,
            # the most full-gradient bucket bytes alive at once in the last step's backward
            # (stage 2: the buckets between their first gradient and their reduce-scatter)
            "grad_peak_bytes": self.reducer.peak_grad_bytes,
            "formula": f"{pe} + {grads_f:g} + ({me} + {2 * se}) / {n} bytes/param",
        }

    # -- whole state, AdamW's format (the trainer's checkpoints) --------------------------------
    def _separate_master(self, b: Bucket) -> bool:
        return not self.masters[b.index]._shares_storage(self.param_buffers[b.index])

    def full_state_dict(self) -> dict[str, Any]:
        """The whole optimizer state on every rank (a collective: each bucket's chunks are
        all-gathered), in AdamW.state_dict()'s format: {"meta": {"hyperparameters", "steps"},
        "tensors": {"exp_avg/<name>", "exp_avg_sq/<name>"}} plus "master/<name>" (float32) for
        16-bit parameters.  Loads at any world size (load_full_state_dict)."""
        from .collectives import _backend_for

        tensors: dict[str, np.ndarray] = {}
        steps: dict[str, int] = {}
        if self.step_count > 0:
            for b in self.buckets:
                kinds = [
                    ("exp_avg", self.exp_avg[b.index]),
                    ("exp_avg_sq", self.exp_avg_sq[b.index]),
                ]
                if self._separate_master(b):
                    kinds.append(("master", self.masters[b.index]))
                for kind, chunk in kinds:
                    full = bt.empty(b.padded, dtype=chunk.dtype, device=b.device)
                    seq = self.g.next_seq()
                    what = f"all_gather #{seq} (ZeroOptimizer state, bucket {b.index})"
                    _backend_for(full, self.g).all_gather(full, chunk, what, seq).wait()
                    arr = full.cpu().numpy()
                    for name, p, off in zip(b.names, b.params, b.offsets, strict=True):
                        tensors[f"{kind}/{name}"] = np.array(
                            arr[off : off + p.numel()].reshape(tuple(p.shape)), copy=True
                        )
                for name in b.names:
                    steps[name] = self.step_count
        return {
            "meta": {"hyperparameters": self.opt.hyperparameters(), "steps": steps},
            "tensors": tensors,
        }

    @bt.no_grad()
    def load_full_state_dict(self, state: Any) -> None:
        """Restore full_state_dict()'s (or AdamW.state_dict()'s) result: this rank keeps its
        chunks.  Everything is checked first; errors name the parameter."""
        try:
            meta, tensors = state["meta"], state["tensors"]
            hp, steps = meta["hyperparameters"], meta["steps"]
        except (KeyError, TypeError):
            raise ValueError(
                "[ZeroOptimizer] load_full_state_dict: not an optimizer state (needs 'meta' with "
                "'hyperparameters' and 'steps', and 'tensors')"
            ) from None
        own = {n: p for b in self.buckets for n, p in zip(b.names, b.params, strict=True)}
        unknown = sorted(set(steps) - set(own))
        if unknown:
            raise ValueError(f"[ZeroOptimizer] state for unknown parameter(s) {unknown[:5]}")
        counts = {int(v) for v in steps.values()}
        if len(counts) > 1:
            raise ValueError(
                f"[ZeroOptimizer] parameters at different step counts {sorted(counts)}"
            )
        if steps and set(steps) != set(own):
            raise ValueError(f"[ZeroOptimizer] no state for {sorted(set(own) - set(steps))[:5]}")
        for name in steps:
            for kind in ("exp_avg", "exp_avg_sq"):
                a = tensors.get(f"{kind}/{name}")
                if a is None:
                    raise ValueError(f"[ZeroOptimizer] missing tensor {kind}/{name}")
                if tuple(np.shape(a)) != tuple(own[name].shape):
                    raise ValueError(
                        f"[ZeroOptimizer] {kind}/{name} has shape {tuple(np.shape(a))}, the "
                        f"parameter has {tuple(own[name].shape)}"
                    )
        for b, pcs in zip(self.buckets, self.pieces, strict=True):
            dsts = [("exp_avg", self.exp_avg[b.index]), ("exp_avg_sq", self.exp_avg_sq[b.index])]
            if self._separate_master(b):
                dsts.append(("master", self.masters[b.index]))
            for pc in pcs:
                s0, e0 = pc.start, pc.start + pc.hi - pc.lo
                for kind, dst in dsts:
                    key = f"{kind}/{pc.name}"
                    if key in tensors:
                        src = np.asarray(tensors[key]).reshape(-1)[pc.lo : pc.hi]
                    elif kind == "master":  # from the (already loaded) parameter itself
                        src = (
                            pc.param.detach()
                            .reshape(-1)[pc.lo : pc.hi]
                            .to(bt.float32)
                            .cpu()
                            .numpy()
                        )
                    elif not steps:
                        src = np.zeros(pc.hi - pc.lo, np.float32)
                    else:  # pragma: no cover - checked above
                        raise ValueError(f"[ZeroOptimizer] missing tensor {key}")
                    dst[s0:e0].copy_(
                        bt.tensor(np.ascontiguousarray(src)).to(dst.dtype).to(b.device)
                    )
        self.step_count = counts.pop() if counts else 0
        self.opt.lr = float(hp["lr"])
        self.opt.betas = (float(hp["betas"][0]), float(hp["betas"][1]))
        self.opt.eps = float(hp["eps"])
        self.opt.weight_decay = float(hp["weight_decay"])
        for pcs in self.pieces:
            for pc in pcs:
                decays = self.opt.decay.get(pc.name, pc.param.ndim >= 2)
                pc.wd = self.opt.weight_decay if decays else 0.0
        self._build_update_lists()

    # -- state (sharded: checkpoint.py reassembles any world size) -----------------------------
    def shard_state(self) -> dict[str, Any]:
        """This rank's pieces: {"meta": ..., "tensors": {"exp_avg/<name>@<lo>": np, ...}}."""
        tensors: dict[str, np.ndarray] = {}
        pieces = []
        for b, pcs in zip(self.buckets, self.pieces, strict=True):
            master, m, v = self.masters[b.index], self.exp_avg[b.index], self.exp_avg_sq[b.index]
            arrs = {
                "master": master.detach()
                .cpu()
                .to(bt.float32 if master.dtype != bt.float64 else master.dtype),
                "exp_avg": m.detach().cpu(),
                "exp_avg_sq": v.detach().cpu(),
            }
            for pc in pcs:
                s, e = pc.start, pc.start + pc.hi - pc.lo
                for kind, t in arrs.items():
                    tensors[f"{kind}/{pc.name}@{pc.lo}"] = np.array(t[s:e].numpy(), copy=True)
                pieces.append([pc.name, pc.lo, pc.hi])
        meta = {
            "stage": self.stage,
            "step": self.step_count,
            "world_size": self.g.size,
            "rank": self.g.rank,
            "pieces": pieces,
            "hyperparameters": self.opt.hyperparameters(),
        }
        return {"meta": meta, "tensors": tensors}

    @bt.no_grad()
    def load_shards(self, metas: list[dict[str, Any]], read: Any) -> None:
        """Fill this rank's chunks from any number of saved shards: ``metas[k]`` is shard k's
        meta, ``read(k, key)`` its tensor ``key`` as numpy.  Errors name the parameter."""
        index: dict[str, list[tuple[int, int, int]]] = {}
        for k, meta in enumerate(metas):
            for name, lo, hi in meta["pieces"]:
                index.setdefault(name, []).append((lo, hi, k))
        steps = {int(m["step"]) for m in metas}
        if len(steps) != 1:
            raise ValueError(f"[ZeroOptimizer] the shards are at different steps {sorted(steps)}")
        unknown = sorted(set(index) - self._names)
        if unknown:
            raise ValueError(
                f"[ZeroOptimizer] the checkpoint has state for unknown parameter(s) {unknown[:5]}"
            )
        for b, pcs in zip(self.buckets, self.pieces, strict=True):
            master, m, v = self.masters[b.index], self.exp_avg[b.index], self.exp_avg_sq[b.index]
            for pc in pcs:
                segs = sorted(index.get(pc.name, []))
                covered = pc.lo
                for lo, hi, k in segs:
                    a, z = max(lo, pc.lo), min(hi, pc.hi)
                    if a >= z:
                        continue
                    if a > covered:
                        break
                    for kind, dst in (("master", master), ("exp_avg", m), ("exp_avg_sq", v)):
                        src = np.asarray(read(k, f"{kind}/{pc.name}@{lo}"))[a - lo : z - lo]
                        d0 = pc.start + (a - pc.lo)
                        dst[d0 : d0 + (z - a)].copy_(
                            bt.tensor(np.ascontiguousarray(src)).to(dst.dtype)
                        )
                    covered = max(covered, z)
                if covered < pc.hi:
                    raise ValueError(
                        f"[ZeroOptimizer] the checkpoint lacks state for {pc.name} elements "
                        f"[{covered}, {pc.hi})"
                    )
        self.step_count = steps.pop()
        hp = metas[0].get("hyperparameters")
        if hp:
            self.opt.lr = float(hp["lr"])
        # parameters follow the masters (16-bit), then every rank gathers the full model
        self._gather_parameters()

    def __repr__(self) -> str:
        return (
            f"ZeroOptimizer(stage={self.stage}, world_size={self.g.size}, "
            f"buckets={len(self.buckets)}, step={self.step_count})"
        )
