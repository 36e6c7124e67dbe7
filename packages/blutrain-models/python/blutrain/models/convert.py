"""GPT-2 weights in other formats: llm.c's model .bin, and Hugging Face directories.

Our canonical state dict uses nanoGPT/llm.c names with Linear layout (out, in)::

    transformer.wte.weight (Vp, C)   transformer.wpe.weight (maxT, C)
    transformer.h.{i}.ln_1.{weight,bias} (C)     transformer.h.{i}.attn.c_attn.weight (3C, C) ...
    transformer.ln_f.{weight,bias} (C)

with the output head tied to wte (no lm_head entry). `config.param_shapes()` lists them all.

llm.c's .bin (``train_gpt2.py: write_model``, read by ``gpt2_build_from_checkpoint``): a header
of 256 int32 -- magic 20240326, version (3: fp32, 5: bf16), maxT, V, L, NH, C, Vp -- then, all in
the header's dtype, wte (Vp, C) with zero rows past V, wpe, and each per-layer tensor stacked
over the L layers in the order ln1w, ln1b, qkvw, qkvb, attprojw, attprojb, ln2w, ln2b, fcw, fcb,
fcprojw, fcprojb, then lnfw, lnfb. bf16 is the top 16 bits of the fp32 value, rounded to
nearest even (what torch's .to(torch.bfloat16) does).

Hugging Face GPT-2 uses Conv1D, whose weights are stored (in, out): they are transposed both ways.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ._bf16 import bf16_bits_to_fp32, fp32_to_bf16_bits
from ._io import atomic_open, atomic_path, atomic_write_bytes
from .checkpoint import CheckpointError, check_tensors, load_safetensors, to_numpy
from .config import GPT2Config, round_up

LLMC_MAGIC = 20240326
LLMC_FP32 = 3
LLMC_BF16 = 5
LLMC_VOCAB_MULTIPLE = 128  # llm.c pads V to this at export
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4

# Per-layer tensors in llm.c's order (its ParameterTensors struct).
_LAYER_ORDER = [
    "ln_1.weight",
    "ln_1.bias",
    "attn.c_attn.weight",
    "attn.c_attn.bias",
    "attn.c_proj.weight",
    "attn.c_proj.bias",
    "ln_2.weight",
    "ln_2.bias",
    "mlp.c_fc.weight",
    "mlp.c_fc.bias",
    "mlp.c_proj.weight",
    "mlp.c_proj.bias",
]
# HF Conv1D weights are (in, out): transpose against our Linear (out, in).
_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_HF_BUFFERS = (".attn.bias", ".attn.masked_bias")


# ---------------------------------------------------------------------------------------------
# llm.c .bin


def _config_from_header(h: np.ndarray, path: Path) -> tuple[GPT2Config, int, int]:
    maxT, V, L, NH, C, Vp = (int(v) for v in h[2:8])
    if min(maxT, V, L, NH, C) < 1 or Vp < V:
        raise CheckpointError(
            f"[llmc] {path}: bad header: maxT={maxT} V={V} L={L} NH={NH} C={C} Vp={Vp}"
        )
    if C % NH:
        raise CheckpointError(f"[llmc] {path}: bad header: C={C} not divisible by NH={NH}")
    # Keep llm.c's padding: multiple 128 when that is what it is, else exactly Vp.
    if Vp == V:
        multiple = 1
    elif Vp == round_up(V, LLMC_VOCAB_MULTIPLE):
        multiple = LLMC_VOCAB_MULTIPLE
    else:
        multiple = Vp
    cfg = GPT2Config(
        block_size=maxT, vocab_size=V, n_layer=L, n_head=NH, n_embd=C, vocab_multiple=multiple
    )
    return cfg, Vp, int(h[1])


def read_llmc(path: str | os.PathLike) -> tuple[GPT2Config, dict[str, np.ndarray]]:
    """Read an llm.c model .bin (version 3 fp32 or 5 bf16) into fp32 arrays, canonical names.

    wte keeps llm.c's padded rows (Vp, C); the returned config's padded_vocab_size is Vp.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"[llmc] {path}: no such file")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise CheckpointError(
            f"[llmc] {path}: truncated: {size} bytes, shorter than the {HEADER_BYTES}-byte header"
        )
    with open(path, "rb") as f:
        h = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
        if int(h[0]) != LLMC_MAGIC:
            raise CheckpointError(
                f"[llmc] {path}: bad magic {int(h[0])}, expected {LLMC_MAGIC} (an llm.c model .bin)"
            )
        if int(h[1]) not in (LLMC_FP32, LLMC_BF16):
            raise CheckpointError(
                f"[llmc] {path}: unsupported version {int(h[1])}, expected {LLMC_FP32} (fp32) "
                f"or {LLMC_BF16} (bf16)"
            )
        cfg, Vp, version = _config_from_header(h, path)
        shapes = _llmc_shapes(cfg, Vp)
        itemsize = 4 if version == LLMC_FP32 else 2
        n = sum(int(np.prod(s)) for s in shapes.values())
        expected = HEADER_BYTES + n * itemsize
        if size != expected:
            what = "truncated" if size < expected else "has trailing bytes"
            raise CheckpointError(
                f"[llmc] {path}: {what}: the header's config (maxT={cfg.block_size} "
                f"V={cfg.vocab_size} L={cfg.n_layer} C={cfg.n_embd} Vp={Vp}) needs {expected} "
                f"bytes, the file has {size}"
            )
        dtype = "<f4" if version == LLMC_FP32 else "<u2"
        flat = np.frombuffer(f.read(), dtype=dtype)
    if version == LLMC_BF16:
        flat = bf16_bits_to_fp32(flat)
    out: dict[str, np.ndarray] = {}
    off = 0
    for key, shape in shapes.items():
        count = int(np.prod(shape))
        block = flat[off : off + count].reshape(shape)
        off += count
        if key.startswith("h."):
            suffix = key[2:]
            for i in range(cfg.n_layer):
                out[f"transformer.h.{i}.{suffix}"] = block[i].copy()
        else:
            out[f"transformer.{key}"] = block.copy()
    return cfg, _reorder(out, cfg)


def _llmc_shapes(cfg: GPT2Config, Vp: int) -> dict[str, tuple[int, ...]]:
    """llm.c's tensors in file order; per-layer ones (key 'h.<suffix>') stacked over L."""
    one = cfg.param_shapes(padded=False)
    shapes: dict[str, tuple[int, ...]] = {
        "wte.weight": (Vp, cfg.n_embd),
        "wpe.weight": (cfg.block_size, cfg.n_embd),
    }
    for suffix in _LAYER_ORDER:
        shapes[f"h.{suffix}"] = (cfg.n_layer, *one[f"transformer.h.0.{suffix}"])
    shapes["ln_f.weight"] = (cfg.n_embd,)
    shapes["ln_f.bias"] = (cfg.n_embd,)
    return shapes


def _reorder(d: dict[str, np.ndarray], cfg: GPT2Config) -> dict[str, np.ndarray]:
    return {k: d[k] for k in cfg.param_shapes() if k in d}


def _check_canonical(weights: Mapping[str, Any], cfg: GPT2Config, op: str) -> dict[str, np.ndarray]:
    """Arrays of `weights`, checked against cfg (wte may be (V, C) or padded (>= V, C))."""
    arrays = {k: to_numpy(v, k) for k, v in weights.items()}
    expected = {k: (s, None) for k, s in cfg.param_shapes(padded=False).items()}
    wte = arrays.get("transformer.wte.weight")
    if wte is not None and wte.ndim == 2 and wte.shape[0] > cfg.vocab_size:
        expected["transformer.wte.weight"] = (wte.shape, None)
    check_tensors(arrays, expected, f"[{op}] weights for {_describe(cfg)}")
    return arrays


def _describe(cfg: GPT2Config) -> str:
    return (
        f"GPT-2 L={cfg.n_layer} H={cfg.n_head} C={cfg.n_embd} V={cfg.vocab_size} T={cfg.block_size}"
    )


def write_llmc(
    path: str | os.PathLike,
    weights: Mapping[str, Any],
    config: GPT2Config,
    dtype: str = "float32",
    padded_vocab_size: int | None = None,
) -> Path:
    """Write canonical GPT-2 weights as an llm.c model .bin (atomically).

    dtype: "float32" (version 3) or "bfloat16" (version 5). wte is padded with zero rows to
    `padded_vocab_size` (default: the rows it already has if padded, else V rounded up to 128,
    as llm.c's train_gpt2.py does).
    """
    path = Path(path)
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"[llmc] dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    arrays = _check_canonical(weights, config, "llmc")
    C, V = config.n_embd, config.vocab_size
    wte = arrays["transformer.wte.weight"]
    Vp = padded_vocab_size or (
        wte.shape[0] if wte.shape[0] > V else round_up(V, LLMC_VOCAB_MULTIPLE)
    )
    if Vp < V:
        raise ValueError(f"[llmc] padded_vocab_size {Vp} < vocab_size {V}")
    wte_p = np.zeros((Vp, C), dtype=np.float32)
    wte_p[:V] = wte[:V]
    header = np.zeros(HEADER_INTS, dtype="<i4")
    version = LLMC_FP32 if dtype == "float32" else LLMC_BF16
    header[:8] = [LLMC_MAGIC, version, config.block_size, V, config.n_layer, config.n_head, C, Vp]

    def emit(f, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        f.write(
            (
                a.astype("<f4") if version == LLMC_FP32 else fp32_to_bf16_bits(a).astype("<u2")
            ).tobytes()
        )

    with atomic_open(path) as f:
        f.write(header.tobytes())
        emit(f, wte_p)
        emit(f, arrays["transformer.wpe.weight"])
        for suffix in _LAYER_ORDER:
            for i in range(config.n_layer):
                emit(f, arrays[f"transformer.h.{i}.{suffix}"])
        emit(f, arrays["transformer.ln_f.weight"])
        emit(f, arrays["transformer.ln_f.bias"])
    return path


# ---------------------------------------------------------------------------------------------
# Hugging Face


def to_hf_state_dict(weights: Mapping[str, Any], config: GPT2Config) -> dict[str, np.ndarray]:
    """Canonical -> Hugging Face GPT2LMHeadModel names ("transformer." prefix, Conv1D (in, out),
    wte cut to V rows; lm_head is tied and left out, as save_pretrained does)."""
    arrays = _check_canonical(weights, config, "hf")
    out: dict[str, np.ndarray] = {}
    for k, a in arrays.items():
        if k == "transformer.wte.weight":
            a = a[: config.vocab_size]
        elif k.endswith(_CONV1D):
            a = a.T
        out[k] = np.ascontiguousarray(a)
    return out


def from_hf_state_dict(
    hf: Mapping[str, Any], config: GPT2Config, source: str = "Hugging Face state dict"
) -> dict[str, np.ndarray]:
    """Hugging Face GPT-2 tensors (keys with or without "transformer.") -> canonical, with wte
    padded with zero rows to config.padded_vocab_size. Buffers (attn.bias, attn.masked_bias) are
    dropped; an lm_head.weight must equal wte (GPT-2 ties them)."""
    found: dict[str, np.ndarray] = {}
    lm_head = None
    for k, v in hf.items():
        if k.endswith(_HF_BUFFERS):
            continue
        if k == "lm_head.weight":
            lm_head = to_numpy(v, k)
            continue
        found[k if k.startswith("transformer.") else f"transformer.{k}"] = to_numpy(v, k)
    # Checked in Hugging Face's own layout, so that a message's shapes match the file.
    expected = {
        k: (s[::-1] if k.endswith(_CONV1D) else s, None)
        for k, s in config.param_shapes(padded=False).items()
    }
    check_tensors(found, expected, source)
    canon = {k: (a.T if k.endswith(_CONV1D) else a) for k, a in found.items()}
    wte = canon["transformer.wte.weight"]
    if lm_head is not None and (lm_head.shape != wte.shape or not np.array_equal(lm_head, wte)):
        raise CheckpointError(
            f"[hf] {source}: lm_head.weight differs from wte: untied heads are not supported"
        )
    Vp = config.padded_vocab_size
    if Vp > wte.shape[0]:
        padded = np.zeros((Vp, wte.shape[1]), dtype=wte.dtype)
        padded[: wte.shape[0]] = wte
        canon["transformer.wte.weight"] = padded
    return {k: np.ascontiguousarray(canon[k]) for k in config.param_shapes()}


def save_hf(path: str | os.PathLike, weights: Mapping[str, Any], config: GPT2Config) -> Path:
    """Write a Hugging Face GPT-2 directory (config.json + model.safetensors), each atomically,
    loadable by ``transformers.GPT2LMHeadModel.from_pretrained(path)``."""
    from .checkpoint import save_safetensors

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd = to_hf_state_dict(weights, config)
    with atomic_path(path / "model.safetensors") as tmp:
        save_safetensors(tmp, sd, {"format": "pt"})
    atomic_write_bytes(
        path / "config.json", (json.dumps(config.to_hf_dict(), indent=2) + "\n").encode()
    )
    return path


def load_hf(
    path: str | os.PathLike, vocab_multiple: int = 1
) -> tuple[GPT2Config, dict[str, np.ndarray]]:
    """Read a local Hugging Face GPT-2 directory: config.json and model.safetensors."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"[hf] {path}: no such directory")
    config = GPT2Config.from_hf_config(path / "config.json", vocab_multiple=vocab_multiple)
    st = path / "model.safetensors"
    if not st.is_file():
        raise FileNotFoundError(f"[hf] {st}: no such file (only safetensors weights are read)")
    sd = load_safetensors(st)
    return config, from_hf_state_dict(sd, config, source=str(st))
