"""GPT2Config: presets, parameter counts, JSON and Hugging Face config.json."""

from __future__ import annotations

import json

import numpy as np
import pytest

from blutrain.models import GPT2Config

# Published parameter counts of the four GPT-2 checkpoints (tied head, V=50257, T=1024).
PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
}


@pytest.mark.parametrize("name,count", PUBLISHED.items())
def test_published_parameter_counts(name, count):
    cfg = GPT2Config.from_name(name)
    assert cfg.n_params() == count
    assert sum(int(np.prod(s)) for s in cfg.param_shapes(padded=False).values()) == count


@pytest.mark.parametrize(
    "alias,name",
    [
        ("124M", "gpt2"),
        ("d12", "gpt2"),
        ("350M", "gpt2-medium"),
        ("774M", "gpt2-large"),
        ("1.5B", "gpt2-xl"),
        ("d48", "gpt2-xl"),
        ("TINY", "tiny"),
    ],
)
def test_aliases(alias, name):
    assert GPT2Config.from_name(alias) == GPT2Config.from_name(name)


def test_tiny_is_small_and_overrides_apply():
    tiny = GPT2Config.from_name("tiny")
    assert tiny.n_params(non_embedding=True) < 1_000_000
    assert GPT2Config.from_name("tiny", block_size=64).block_size == 64
    with pytest.raises(ValueError, match="unknown model 'gpt5'"):
        GPT2Config.from_name("gpt5")


def test_vocab_padding(rng):
    V = int(rng.integers(1, 100_000))
    cfg = GPT2Config(vocab_size=V, vocab_multiple=128, n_layer=1, n_head=1, n_embd=8)
    Vp = cfg.padded_vocab_size
    assert Vp % 128 == 0 and V <= Vp < V + 128
    assert cfg.param_shapes()["transformer.wte.weight"] == (Vp, 8)
    assert cfg.param_shapes(padded=False)["transformer.wte.weight"] == (V, 8)
    assert cfg.n_params(padded=True) - cfg.n_params() == (Vp - V) * 8
    assert GPT2Config.from_name("gpt2", vocab_multiple=128).padded_vocab_size == 50304


def test_param_count_matches_shapes_for_random_configs(small_config):
    shapes = small_config.param_shapes(padded=False)
    assert sum(int(np.prod(s)) for s in shapes.values()) == small_config.n_params()
    non_emb = small_config.n_params(non_embedding=True)
    emb = int(np.prod(shapes["transformer.wte.weight"])) + int(
        np.prod(shapes["transformer.wpe.weight"])
    )
    assert non_emb == small_config.n_params() - emb


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        ({"n_embd": 10, "n_head": 3}, "divisible by n_head"),
        ({"n_layer": 0}, "n_layer"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"block_size": 2.5}, "block_size"),
        ({"layer_norm_epsilon": 0.0}, "layer_norm_epsilon"),
    ],
)
def test_invalid_configs(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        GPT2Config(**kwargs)


def test_json_round_trip(small_config, tmp_path):
    text = small_config.to_json()
    assert GPT2Config.from_json(text) == small_config
    path = tmp_path / "cfg.json"
    small_config.to_json(path)
    assert GPT2Config.from_json(path) == small_config
    assert json.loads(path.read_text())["n_layer"] == small_config.n_layer


def test_json_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['n_lyer'\]"):
        GPT2Config.from_json('{"n_lyer": 3}')
    with pytest.raises(FileNotFoundError, match="nope.json"):
        GPT2Config.from_json(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        GPT2Config.from_json(bad)


def test_hf_config_round_trip(small_config, tmp_path):
    d = small_config.to_hf_dict()
    assert d["n_positions"] == small_config.block_size and d["activation_function"] == "gelu_new"
    assert GPT2Config.from_hf_dict(d) == small_config
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert GPT2Config.from_hf_config(tmp_path) == small_config
    assert GPT2Config.from_hf_config(tmp_path, vocab_multiple=64).vocab_multiple == 64


def test_hf_published_gpt2_config():
    # The fields of Hugging Face's gpt2/config.json that matter (n_ctx as older files have it).
    hf = {
        "activation_function": "gelu_new",
        "architectures": ["GPT2LMHeadModel"],
        "attn_pdrop": 0.1,
        "bos_token_id": 50256,
        "embd_pdrop": 0.1,
        "eos_token_id": 50256,
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05,
        "model_type": "gpt2",
        "n_ctx": 1024,
        "n_embd": 768,
        "n_head": 12,
        "n_layer": 12,
        "n_positions": 1024,
        "resid_pdrop": 0.1,
        "vocab_size": 50257,
    }
    assert GPT2Config.from_hf_dict(hf) == GPT2Config.from_name("gpt2")
    del hf["n_positions"]
    assert GPT2Config.from_hf_dict(hf).block_size == 1024


@pytest.mark.parametrize(
    "change,msg",
    [
        ({"model_type": "llama"}, "model_type is 'llama'"),
        ({"activation_function": "relu"}, "activation_function='relu'"),
        ({"n_inner": 100}, "n_inner=100"),
        ({"tie_word_embeddings": False}, "untied"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ],
)
def test_hf_config_refuses_what_we_do_not_implement(change, msg):
    d = GPT2Config.from_name("tiny").to_hf_dict()
    d.update(change)
    with pytest.raises(ValueError, match=msg):
        GPT2Config.from_hf_dict(d)


def test_hf_config_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        GPT2Config.from_hf_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_embd": 8}')
    with pytest.raises(ValueError, match=r"missing field\(s\).*in .*config.json"):
        GPT2Config.from_hf_config(tmp_path)
