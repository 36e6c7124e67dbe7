"""Model shapes: GPT2Config (GPT-2: its presets, its JSON and Hugging Face forms) and LlamaConfig
(the LLaMA-style model of llama.py: its presets and JSON form)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# GPT-2's BPE has 50,257 tokens; <|endoftext|> is the last one.
GPT2_VOCAB_SIZE = 50257
EOT_TOKEN = 50256

# name -> (n_layer, n_head, n_embd, block_size). "tiny" is small enough to train on a laptop CPU
# in minutes; the others are the four published GPT-2 sizes (llm.c calls them d12..d48).
_PRESETS: dict[str, tuple[int, int, int, int]] = {
    "tiny": (4, 4, 128, 256),
    "gpt2": (12, 12, 768, 1024),
    "gpt2-medium": (24, 16, 1024, 1024),
    "gpt2-large": (36, 20, 1280, 1024),
    "gpt2-xl": (48, 25, 1600, 1024),
}
_ALIASES = {
    "124m": "gpt2",
    "d12": "gpt2",
    "gpt2-small": "gpt2",
    "350m": "gpt2-medium",
    "355m": "gpt2-medium",
    "medium": "gpt2-medium",
    "d24": "gpt2-medium",
    "774m": "gpt2-large",
    "large": "gpt2-large",
    "d36": "gpt2-large",
    "1.5b": "gpt2-xl",
    "1558m": "gpt2-xl",
    "xl": "gpt2-xl",
    "d48": "gpt2-xl",
}
# Hugging Face's names for our fields.
_HF_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


class _JsonConfig:
    """to_json / from_json and the unknown-field check, shared by the model configs (frozen
    dataclasses with to_dict / from_dict); errors name the config class."""

    @classmethod
    def _construct(cls, d: dict[str, Any]) -> Any:
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"[{cls.__name__}] unknown field(s) {unknown}; known fields: {sorted(known)}"
            )
        return cls(**d)

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2) + "\n"  # type: ignore[attr-defined]
        if path is not None:
            from ._io import atomic_write_bytes

            atomic_write_bytes(path, text.encode())
        return text

    @classmethod
    def from_json(cls, source: str | os.PathLike) -> Any:
        """From a JSON string or a path to a JSON file."""
        name = cls.__name__
        text = _read_text_or_path(source, name)
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"[{name}] {source!s:.200}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"[{name}] {source!s:.200}: expected a JSON object")
        return cls.from_dict(d)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class GPT2Config(_JsonConfig):
    """GPT-2 hyperparameters.

    `vocab_multiple` pads the token embedding (and so the logits) to a multiple of it, e.g. 128
    for tensor-core-friendly GEMMs; the padded rows are never produced as targets and their logits
    are masked, so padding never changes results. 1 means no padding.
    """

    block_size: int = 1024
    vocab_size: int = GPT2_VOCAB_SIZE
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_multiple: int = 1
    layer_norm_epsilon: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd", "vocab_multiple"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"[GPT2Config] {name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"[GPT2Config] n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if not self.layer_norm_epsilon > 0:
            raise ValueError(
                f"[GPT2Config] layer_norm_epsilon must be > 0, got {self.layer_norm_epsilon}"
            )
        if not self.init_std > 0:
            raise ValueError(f"[GPT2Config] init_std must be > 0, got {self.init_std}")

    # -- presets -------------------------------------------------------------------------------
    @classmethod
    def preset_names(cls) -> list[str]:
        return list(_PRESETS)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> GPT2Config:
        """A preset: tiny, gpt2 (124M), gpt2-medium (350M), gpt2-large (774M), gpt2-xl (1.5B).

        Aliases such as "124M", "d12", "350M", "1.5B" are accepted; keyword overrides change any
        field, e.g. ``GPT2Config.from_name("gpt2", vocab_multiple=128)``.
        """
        key = name.strip().lower()
        key = _ALIASES.get(key, key)
        if key not in _PRESETS:
            known = ", ".join(list(_PRESETS) + sorted(_ALIASES))
            raise ValueError(f"[GPT2Config] unknown model {name!r}; known: {known}")
        n_layer, n_head, n_embd, block_size = _PRESETS[key]
        fields = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size)
        fields.update(overrides)
        return cls(**fields)

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def padded_vocab_size(self) -> int:
        return round_up(self.vocab_size, self.vocab_multiple)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def param_shapes(self, padded: bool = True) -> dict[str, tuple[int, ...]]:
        """Parameter names and shapes, in llm.c's order (Linear weights are (out, in)).

        The names are nanoGPT's/llm.c's (``transformer.h.{i}.attn.c_attn.weight``...); the output
        head is tied to ``transformer.wte.weight`` and has no entry of its own.
        """
        V = self.padded_vocab_size if padded else self.vocab_size
        C, T, L = self.n_embd, self.block_size, self.n_layer
        shapes: dict[str, tuple[int, ...]] = {
            "transformer.wte.weight": (V, C),
            "transformer.wpe.weight": (T, C),
        }
        per_layer = [
            ("ln_1.weight", (C,)),
            ("ln_1.bias", (C,)),
            ("attn.c_attn.weight", (3 * C, C)),
            ("attn.c_attn.bias", (3 * C,)),
            ("attn.c_proj.weight", (C, C)),
            ("attn.c_proj.bias", (C,)),
            ("ln_2.weight", (C,)),
            ("ln_2.bias", (C,)),
            ("mlp.c_fc.weight", (4 * C, C)),
            ("mlp.c_fc.bias", (4 * C,)),
            ("mlp.c_proj.weight", (C, 4 * C)),
            ("mlp.c_proj.bias", (C,)),
        ]
        for i in range(L):
            for suffix, shape in per_layer:
                shapes[f"transformer.h.{i}.{suffix}"] = shape
        shapes["transformer.ln_f.weight"] = (C,)
        shapes["transformer.ln_f.bias"] = (C,)
        return shapes

    def n_params(self, non_embedding: bool = False, padded: bool = False) -> int:
        """Number of parameters (the output head is tied, so it counts once, as wte).

        `padded=True` counts the padding rows of wte as well (what the memory holds);
        `non_embedding=True` leaves out wte and wpe (the count scaling laws use).
        """
        C, L = self.n_embd, self.n_layer
        n = L * (12 * C * C + 13 * C) + 2 * C
        if not non_embedding:
            V = self.padded_vocab_size if padded else self.vocab_size
            n += V * C + self.block_size * C
        return n

    # -- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPT2Config:
        return cls._construct(d)

    # -- Hugging Face config.json --------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json of a Hugging Face GPT2LMHeadModel with this shape (unpadded vocab)."""
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": self.vocab_size,
            "n_positions": self.block_size,
            "n_ctx": self.block_size,
            "n_embd": self.n_embd,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_inner": None,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "initializer_range": self.init_std,
            # The published GPT-2 values; our model itself uses no dropout.
            "resid_pdrop": 0.1,
            "embd_pdrop": 0.1,
            "attn_pdrop": 0.1,
            "scale_attn_weights": True,
            "use_cache": True,
            "tie_word_embeddings": True,
            "bos_token_id": EOT_TOKEN,
            "eos_token_id": EOT_TOKEN,
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], vocab_multiple: int = 1) -> GPT2Config:
        """From a Hugging Face GPT-2 config.json; refuses what our GPT-2 does not implement."""
        where = "[GPT2Config] Hugging Face config"
        model_type = d.get("model_type", "gpt2")
        if model_type != "gpt2":
            raise ValueError(f"{where}: model_type is {model_type!r}, expected 'gpt2'")
        missing = [k for k in ("vocab_size", "n_embd", "n_layer", "n_head") if k not in d]
        if "n_positions" not in d and "n_ctx" not in d:
            missing.append("n_positions")
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing}")
        n_embd = d["n_embd"]
        n_inner = d.get("n_inner")
        if n_inner not in (None, 4 * n_embd):
            raise ValueError(f"{where}: n_inner={n_inner} is not supported (only 4 * n_embd)")
        act = d.get("activation_function", "gelu_new")
        if act not in _HF_ACTIVATIONS:
            raise ValueError(
                f"{where}: activation_function={act!r} is not supported (GPT-2 uses tanh GELU: "
                f"{', '.join(_HF_ACTIVATIONS)})"
            )
        if d.get("tie_word_embeddings", True) is False:
            raise ValueError(f"{where}: untied output embeddings are not supported")
        for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
            if d.get(flag):
                raise ValueError(f"{where}: {flag}=true is not supported")
        if d.get("scale_attn_weights", True) is False:
            raise ValueError(f"{where}: scale_attn_weights=false is not supported")
        return cls(
            block_size=d.get("n_positions", d.get("n_ctx")),
            vocab_size=d["vocab_size"],
            n_layer=d["n_layer"],
            n_head=d["n_head"],
            n_embd=n_embd,
            vocab_multiple=vocab_multiple,
            layer_norm_epsilon=d.get("layer_norm_epsilon", 1e-5),
            init_std=d.get("initializer_range", 0.02),
        )

    @classmethod
    def from_hf_config(cls, path: str | os.PathLike, vocab_multiple: int = 1) -> GPT2Config:
        """From a Hugging Face config.json file, or a directory that holds one."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"[GPT2Config] {path}: no such file (expected config.json)")
        try:
            d = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"[GPT2Config] {path}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"[GPT2Config] {path}: expected a JSON object")
        try:
            return cls.from_hf_dict(d, vocab_multiple=vocab_multiple)
        except ValueError as e:
            raise ValueError(f"{e} (in {path})") from None


# ---- LLaMA ---------------------------------------------------------------------------------

# name -> (n_layer, n_head, n_embd, intermediate_size, block_size). "llama-tiny" trains on a CPU;
# "llama-small" has GPT-2 124M's depth and width (12 x 768; 85M parameters besides the untied
# embedding and head), "llama-medium" GPT-2 medium's (24 x 1024). The MLP's hidden size is
# LLaMA's rule: 2/3 of 4 C, rounded up to a multiple of 256 (32 for the tiny one).
_LLAMA_PRESETS: dict[str, tuple[int, int, int, int, int]] = {
    "llama-tiny": (4, 4, 128, 352, 256),
    "llama-small": (12, 12, 768, 2048, 1024),
    "llama-medium": (24, 16, 1024, 2816, 1024),
}


# Recomputation a LLaMA block supports (Llama.recompute): "attn" (the attention sublayer keeps
# its input only) and "block" (the block keeps its input only), both through bt.checkpoint.
LLAMA_RECOMPUTE = ("none", "attn", "block")


def is_llama_name(name: str) -> bool:
    return name.strip().lower().startswith("llama")


@dataclass(frozen=True)
class LlamaConfig(_JsonConfig):
    """LLaMA-style hyperparameters (llama.py): RMSNorm, SwiGLU MLP, rotary position embedding,
    no biases, an untied output head; n_kv_head < n_head shares key / value heads (grouped
    queries). `vocab_multiple` pads the embedding and the head as GPT2Config's does."""

    block_size: int = 1024
    vocab_size: int = GPT2_VOCAB_SIZE
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int = 12
    n_embd: int = 768
    intermediate_size: int = 2048
    vocab_multiple: int = 1
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        ints = ("block_size", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd",
                "intermediate_size", "vocab_multiple")  # fmt: skip
        for name in ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"[LlamaConfig] {name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"[LlamaConfig] n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"
            )
        if self.head_dim % 2:
            raise ValueError(f"[LlamaConfig] the head size {self.head_dim} must be even (rotary)")
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"[LlamaConfig] n_head ({self.n_head}) must be a multiple of n_kv_head "
                f"({self.n_kv_head})"
            )
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"[LlamaConfig] {name} must be > 0, got {value!r}")

    @classmethod
    def preset_names(cls) -> list[str]:
        return list(_LLAMA_PRESETS)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> LlamaConfig:
        """A preset (llama-tiny, llama-small, llama-medium); keyword overrides change any field.
        n_kv_head defaults to n_head."""
        key = name.strip().lower()
        if key not in _LLAMA_PRESETS:
            raise ValueError(
                f"[LlamaConfig] unknown model {name!r}; known: {', '.join(_LLAMA_PRESETS)}"
            )
        n_layer, n_head, n_embd, ffn, block_size = _LLAMA_PRESETS[key]
        fields: dict[str, Any] = dict(
            n_layer=n_layer, n_head=n_head, n_kv_head=n_head, n_embd=n_embd,
            intermediate_size=ffn, block_size=block_size,
        )  # fmt: skip
        fields.update(overrides)
        if "n_head" in overrides and "n_kv_head" not in overrides:
            fields["n_kv_head"] = fields["n_head"]
        return cls(**fields)

    @property
    def padded_vocab_size(self) -> int:
        return round_up(self.vocab_size, self.vocab_multiple)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def param_shapes(self, padded: bool = True) -> dict[str, tuple[int, ...]]:
        """Parameter names (Hugging Face's LlamaForCausalLM names) and shapes."""
        V = self.padded_vocab_size if padded else self.vocab_size
        C, F, KV = self.n_embd, self.intermediate_size, self.n_kv_head * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, C)}
        per_layer = [
            ("input_layernorm.weight", (C,)),
            ("self_attn.q_proj.weight", (C, C)),
            ("self_attn.k_proj.weight", (KV, C)),
            ("self_attn.v_proj.weight", (KV, C)),
            ("self_attn.o_proj.weight", (C, C)),
            ("post_attention_layernorm.weight", (C,)),
            ("mlp.gate_proj.weight", (F, C)),
            ("mlp.up_proj.weight", (F, C)),
            ("mlp.down_proj.weight", (C, F)),
        ]
        for i in range(self.n_layer):
            for suffix, shape in per_layer:
                shapes[f"model.layers.{i}.{suffix}"] = shape
        shapes["model.norm.weight"] = (C,)
        shapes["lm_head.weight"] = (V, C)
        return shapes

    def n_params(self, non_embedding: bool = False, padded: bool = False) -> int:
        """Number of parameters; `non_embedding` leaves out the embedding (not the head)."""
        n = sum(math.prod(s) for s in self.param_shapes(padded).values())
        if non_embedding:
            V = self.padded_vocab_size if padded else self.vocab_size
            n -= V * self.n_embd
        return n

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": "llama", **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LlamaConfig:
        d = dict(d)
        kind = d.pop("model_type", "llama")
        if kind != "llama":
            raise ValueError(f"[LlamaConfig] model_type is {kind!r}, expected 'llama'")
        return cls._construct(d)


ModelConfig = GPT2Config | LlamaConfig


def config_from_dict(d: dict[str, Any]) -> ModelConfig:
    """A GPT2Config, or a LlamaConfig when d says "model_type": "llama"."""
    return LlamaConfig.from_dict(d) if d.get("model_type") == "llama" else GPT2Config.from_dict(d)


def model_config(name: str, vocab_multiple: int = 1) -> ModelConfig:
    """A model's config from a preset name (GPT2Config.from_name, or LlamaConfig.from_name for
    llama-*) or a JSON file of its fields (a LlamaConfig's has "model_type": "llama");
    `vocab_multiple` pads the vocabulary unless the file sets its own."""
    p = Path(name)
    if name.endswith(".json") or p.is_file():
        text = _read_text_or_path(p, "model_config")
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"[model_config] {p}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ValueError(f"[model_config] {p}: expected a JSON object")
        cfg = config_from_dict(d)
        if vocab_multiple != 1 and cfg.vocab_multiple == 1:
            cfg = dataclasses.replace(cfg, vocab_multiple=vocab_multiple)
        return cfg
    if is_llama_name(name):
        return LlamaConfig.from_name(name, vocab_multiple=vocab_multiple)
    return GPT2Config.from_name(name, vocab_multiple=vocab_multiple)


def _read_text_or_path(source: str | os.PathLike, op: str) -> str:
    if isinstance(source, os.PathLike) or (
        isinstance(source, str) and not source.lstrip().startswith("{")
    ):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"[{op}] {path}: no such file")
        return path.read_text()
    return str(source)


# Activation recomputation, per block (Block.set_recompute, GPT2.set_recompute(spec, layers)):
# "gelu" (the MLP keeps its pre-activation only), "ln" (the block's two LayerNorm outputs are not
# kept: the linears after them rebuild them in backward), "attn" (the attention sublayer keeps
# its input only) and "block" (the block keeps its input only); "none", one of them, or several
# joined by "+" (e.g. "ln+gelu").
RECOMPUTE_PARTS = ("gelu", "ln", "attn", "block")
RECOMPUTE = ("none", *RECOMPUTE_PARTS)


def parse_recompute(spec: Any, op: str = "GPT2") -> frozenset[str]:
    """The parts of a recompute spec: "none", a part, parts joined by "+" or ",", or an
    iterable of parts; raises ValueError (prefixed with `op`) naming what is wrong."""
    if isinstance(spec, str):
        items = [p.strip() for p in spec.replace(",", "+").split("+")]
    elif spec is None:
        items = ["none"]
    else:
        items = [str(p).strip() for p in spec]
    parts = frozenset(p for p in items if p and p != "none")
    bad = sorted(parts - set(RECOMPUTE_PARTS))
    if bad:
        raise ValueError(
            f"[{op}] recompute {spec!r} is not one of {', '.join(RECOMPUTE)} "
            f"(or parts joined by '+', e.g. 'ln+gelu')"
        )
    if "block" in parts and len(parts) > 1:
        raise ValueError(
            f"[{op}] recompute {spec!r}: 'block' already recomputes the whole block; "
            "it does not combine with other parts"
        )
    return parts


def recompute_name(parts: frozenset[str]) -> str:
    """The canonical spec of a set of parts ("none", "ln+gelu", ...)."""
    return "+".join(p for p in ("ln", "gelu", "attn", "block") if p in parts) or "none"
