"""llm.c model .bin and Hugging Face directories, to and from our canonical weights."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from blutrain.models import CheckpointError, GPT2Config, load_hf, read_llmc, save_hf, write_llmc
from blutrain.models.checkpoint import load_safetensors, save_safetensors
from blutrain.models.convert import (
    bf16_bits_to_fp32,
    fp32_to_bf16_bits,
    from_hf_state_dict,
    to_hf_state_dict,
)

CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


# -- bf16 --------------------------------------------------------------------------------------


def bf16_reference(x: np.ndarray) -> np.ndarray:
    """Nearest bf16 by float64 distance, ties to the even pattern (finite, in-range inputs)."""
    bits = x.astype(np.float32).view(np.uint32)
    lo = (bits & np.uint32(0xFFFF0000)).astype(np.uint64)
    hi = lo + 0x10000  # next pattern away from zero
    lo_v = (lo.astype(np.uint32)).view(np.float32).astype(np.float64)
    hi_v = (hi.astype(np.uint32)).view(np.float32).astype(np.float64)
    v = x.astype(np.float64)
    d_lo, d_hi = np.abs(v - lo_v), np.abs(v - hi_v)
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & ((lo >> 16) % 2 == 1))
    return (np.where(pick_hi, hi, lo) >> 16).astype(np.uint16)


def test_bf16_rounding_matches_a_float64_reference(rng):
    x = (rng.standard_normal(200_000) * np.exp(rng.uniform(-80, 80, 200_000))).astype(np.float32)
    # Ties and near-ties: values whose low 16 bits are exactly 0x8000 or next to it.
    ties = rng.integers(0, 2**31 - 2**24, 5000, dtype=np.uint32) & np.uint32(0xFFFF0000)
    ties = np.concatenate([ties | 0x8000, ties | 0x7FFF, ties | 0x8001]).view(np.float32)
    x = np.concatenate([x, ties[np.isfinite(ties)]])
    assert np.array_equal(fp32_to_bf16_bits(x), bf16_reference(x))


def test_bf16_special_values():
    cases = {
        1.0: 0x3F80,
        1 + 2**-8: 0x3F80,
        1 + 3 * 2**-8: 0x3F82,
        -0.0: 0x8000,
        float("inf"): 0x7F80,
        float("-inf"): 0xFF80,
        3.4028235e38: 0x7F80,
        1e-45: 0x0000,
    }
    x = np.array(list(cases), dtype=np.float32)
    assert fp32_to_bf16_bits(x).tolist() == list(cases.values())
    nan = fp32_to_bf16_bits(np.array([np.nan, -np.nan], np.float32))
    assert np.isnan(bf16_bits_to_fp32(nan)).all()
    exact = np.array([0.5, -3.0, 2.0**-130], np.float32)  # representable: round trip exactly
    assert np.array_equal(bf16_bits_to_fp32(fp32_to_bf16_bits(exact)), exact)


def test_bf16_matches_torch(rng):
    import torch

    x = (rng.standard_normal(10_000) * 1e3).astype(np.float32)
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(fp32_to_bf16_bits(x), ref)


# -- llm.c .bin ------------------------------------------------------------------------------


def llmc_reference_bytes(w, cfg, version, Vp):
    """llm.c's write_model, restated: header, then wte (padded), wpe, each per-layer tensor
    over all layers in llm.c's order, lnf; fp32 or bf16."""
    header = np.zeros(256, np.int32)
    header[:8] = [
        20240326,
        version,
        cfg.block_size,
        cfg.vocab_size,
        cfg.n_layer,
        cfg.n_head,
        cfg.n_embd,
        Vp,
    ]
    wte = np.zeros((Vp, cfg.n_embd), np.float32)
    wte[: cfg.vocab_size] = w["transformer.wte.weight"][: cfg.vocab_size]
    tensors = [wte, w["transformer.wpe.weight"]]
    for suffix in [
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
    ]:
        tensors += [w[f"transformer.h.{i}.{suffix}"] for i in range(cfg.n_layer)]
    tensors += [w["transformer.ln_f.weight"], w["transformer.ln_f.bias"]]
    out = header.tobytes()
    for t in tensors:
        t = np.asarray(t, np.float32)
        out += t.tobytes() if version == 3 else bf16_reference(t).tobytes()
    return out


def test_llmc_fp32_layout_and_round_trip(small_config, make_weights, tmp_path):
    w = make_weights(small_config)
    path = write_llmc(tmp_path / "model.bin", w, small_config)
    Vp = -(-small_config.vocab_size // 128) * 128  # llm.c pads to 128 at export
    assert path.read_bytes() == llmc_reference_bytes(w, small_config, 3, Vp)
    cfg, back = read_llmc(path)
    # a vocabulary that is already a multiple of 128 (small_config draws 128 and 256 too) has
    # no padding in the file, so nothing says it was padded to 128: it reads back as multiple 1
    assert cfg.padded_vocab_size == Vp
    assert cfg.vocab_multiple == (1 if Vp == small_config.vocab_size else 128)
    assert (cfg.block_size, cfg.vocab_size, cfg.n_layer, cfg.n_head, cfg.n_embd) == (
        small_config.block_size,
        small_config.vocab_size,
        small_config.n_layer,
        small_config.n_head,
        small_config.n_embd,
    )
    assert list(back) == list(small_config.param_shapes())
    V = small_config.vocab_size
    for k, v in w.items():
        if k == "transformer.wte.weight":
            assert np.array_equal(back[k][:V], v[:V]) and not back[k][V:].any()
        else:
            assert np.array_equal(back[k], v), k


def test_llmc_bf16(small_config, make_weights, tmp_path):
    w = make_weights(small_config)
    path = write_llmc(tmp_path / "m.bin", w, small_config, dtype="bfloat16")
    Vp = -(-small_config.vocab_size // 128) * 128
    assert path.read_bytes() == llmc_reference_bytes(w, small_config, 5, Vp)
    assert (
        path.stat().st_size
        == 1024
        + 2 * small_config.n_params(padded=True)
        + 2 * (Vp - small_config.vocab_size) * small_config.n_embd
    )
    _, back = read_llmc(path)
    for k, v in w.items():
        want = bf16_bits_to_fp32(bf16_reference(v))
        n = min(v.shape[0], back[k].shape[0])
        assert np.array_equal(back[k][:n], want[:n]), k


def test_llmc_keeps_an_existing_padding(make_weights, tmp_path):
    cfg = GPT2Config(block_size=8, vocab_size=300, n_layer=1, n_head=2, n_embd=8, vocab_multiple=64)
    w = make_weights(cfg)  # wte (320, 8)
    write_llmc(tmp_path / "a.bin", w, cfg)
    got, _ = read_llmc(tmp_path / "a.bin")
    assert got.padded_vocab_size == 320
    write_llmc(tmp_path / "b.bin", w, cfg, padded_vocab_size=300)
    got, back = read_llmc(tmp_path / "b.bin")
    assert got.padded_vocab_size == 300 and back["transformer.wte.weight"].shape == (300, 8)


def header_bytes(*ints):
    return struct.pack(f"<{len(ints)}i", *ints) + b"\0" * (1024 - 4 * len(ints))


@pytest.mark.parametrize(
    "make,msg",
    [
        (lambda b: header_bytes(20240520, 3) + b[1024:], r"bad magic 20240520, expected 20240326"),
        (
            lambda b: b[:4] + struct.pack("<i", 2) + b[8:],
            r"unsupported version 2, expected 3 \(fp32\)"
            r" or 5 \(bf16\)",
        ),
        (lambda b: b[:-4], r"truncated: the header's config .* needs \d+ bytes, the file has"),
        (lambda b: b + b"\0" * 4, r"has trailing bytes"),
        (lambda b: b[:512], r"truncated: 512 bytes, shorter than the 1024-byte header"),
        (
            lambda b: header_bytes(20240326, 3, 8, 50, 1, 3, 8, 64) + b[1024:],
            r"bad header: C=8 not divisible by NH=3",
        ),
        (
            lambda b: header_bytes(20240326, 3, 8, 50, 1, 2, 8, 40) + b[1024:],
            r"bad header: .*Vp=40",
        ),
    ],
)
def test_llmc_bad_files(small_config, make_weights, tmp_path, make, msg):
    good = write_llmc(tmp_path / "good.bin", make_weights(small_config), small_config).read_bytes()
    bad = tmp_path / "bad_model.bin"
    bad.write_bytes(make(good))
    with pytest.raises(CheckpointError, match=r"\[llmc\] .*bad_model.bin: " + msg):
        read_llmc(bad)


def test_llmc_write_errors(small_config, make_weights, tmp_path):
    w = make_weights(small_config)
    name = "transformer.h.0.attn.c_attn.weight"
    C = small_config.n_embd
    w[name] = np.zeros((C, 3 * C), np.float32)  # HF layout by mistake
    with pytest.raises(
        CheckpointError,
        match=rf"'{name}' has shape \({C}, {3 * C}\), expected "
        rf"\({3 * C}, {C}\)",
    ):
        write_llmc(tmp_path / "x.bin", w, small_config)
    del w[name]
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is missing"):
        write_llmc(tmp_path / "x.bin", w, small_config)
    assert not (tmp_path / "x.bin").exists()
    with pytest.raises(FileNotFoundError, match="absent.bin"):
        read_llmc(tmp_path / "absent.bin")
    with pytest.raises(ValueError, match="dtype must be"):
        write_llmc(tmp_path / "x.bin", make_weights(small_config), small_config, dtype="float16")


# -- Hugging Face ----------------------------------------------------------------------------


def test_hf_layout_is_conv1d(small_config, make_weights, rng):
    w = make_weights(small_config)
    hf = to_hf_state_dict(w, small_config)
    assert hf["transformer.wte.weight"].shape == (small_config.vocab_size, small_config.n_embd)
    for i in range(small_config.n_layer):
        for s in CONV1D:
            k = f"transformer.h.{i}.{s}"
            # Conv1D computes x @ W + b with W (in, out); Linear computes x @ W.T + b.
            # float64 reference, so the comparison checks the layout, not fp32 rounding.
            x = rng.standard_normal((3, hf[k].shape[0]))
            np.testing.assert_allclose(
                x @ hf[k].astype(np.float64), x @ w[k].astype(np.float64).T, rtol=1e-12, atol=1e-12
            )
    assert "lm_head.weight" not in hf


def test_hf_directory_round_trip(make_weights, tmp_path, rng):
    cfg = GPT2Config(
        block_size=16, vocab_size=257, n_layer=2, n_head=2, n_embd=8, vocab_multiple=128
    )
    w = make_weights(cfg)
    w["transformer.wte.weight"][cfg.vocab_size :] = 0
    save_hf(tmp_path / "hf", w, cfg)
    conf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert conf["vocab_size"] == 257 and conf["n_positions"] == 16 and conf["n_layer"] == 2
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "np") as f:
        assert f.metadata() == {"format": "pt"}  # transformers refuses files without it
        assert all(k.startswith("transformer.") for k in f.keys())
    got_cfg, back = load_hf(tmp_path / "hf", vocab_multiple=128)
    assert got_cfg == cfg
    assert back.keys() == w.keys()
    for k in w:
        assert np.array_equal(back[k], w[k]), k
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]


def test_hf_hub_layout_without_prefix_with_buffers_and_tied_head(
    small_config, make_weights, tmp_path
):
    # The gpt2 files on the Hub: no "transformer." prefix, attention-mask buffers stored.
    w = make_weights(small_config, padded=False)
    hf = {k.removeprefix("transformer."): v for k, v in to_hf_state_dict(w, small_config).items()}
    T = small_config.block_size
    for i in range(small_config.n_layer):
        hf[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, T, T), np.float32))
    hf["lm_head.weight"] = hf["wte.weight"].copy()
    d = tmp_path / "hub"
    d.mkdir()
    save_safetensors(d / "model.safetensors", hf, {"format": "pt"})
    (d / "config.json").write_text(json.dumps(small_config.to_hf_dict()))
    cfg, back = load_hf(d)
    assert cfg == small_config
    for k in w:
        assert np.array_equal(back[k], w[k]), k


def test_hf_errors(small_config, make_weights, tmp_path):
    w = make_weights(small_config, padded=False)
    hf = to_hf_state_dict(w, small_config)
    C = small_config.n_embd
    bad = dict(hf, **{"lm_head.weight": hf["transformer.wte.weight"] + 1})
    with pytest.raises(CheckpointError, match="lm_head.weight differs from wte"):
        from_hf_state_dict(bad, small_config)
    k = "transformer.h.0.mlp.c_fc.weight"
    bad = dict(hf, **{k: hf[k].T})  # Linear layout in an HF file
    with pytest.raises(
        CheckpointError,
        match=rf"'{k}' has shape \({4 * C}, {C}\), expected "
        rf"\({C}, {4 * C}\)",
    ):
        from_hf_state_dict(bad, small_config, source="x/model.safetensors")
    bad = {n: v for n, v in hf.items() if n != "transformer.ln_f.bias"}
    with pytest.raises(CheckpointError, match="'transformer.ln_f.bias' is missing"):
        from_hf_state_dict(bad, small_config)
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_hf(tmp_path / "none")
    (tmp_path / "d").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text(json.dumps(small_config.to_hf_dict()))
    with pytest.raises(FileNotFoundError, match=r"model.safetensors: no such file"):
        load_hf(tmp_path / "d")
    (tmp_path / "d" / "model.safetensors").write_bytes(b"\x10\0\0\0\0\0\0\0{}")
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated"):
        load_hf(tmp_path / "d")


def test_llmc_to_hf_to_llmc_is_byte_identical(small_config, make_weights, tmp_path):
    w = make_weights(small_config, padded=False)
    a = write_llmc(tmp_path / "a.bin", w, small_config)
    cfg, canon = read_llmc(a)
    save_hf(tmp_path / "hf", canon, cfg)
    cfg2, canon2 = load_hf(tmp_path / "hf", vocab_multiple=cfg.vocab_multiple)
    b = write_llmc(tmp_path / "b.bin", canon2, cfg2)
    assert a.read_bytes() == b.read_bytes()
    assert load_safetensors(tmp_path / "hf" / "model.safetensors").keys() == set(
        to_hf_state_dict(canon, cfg)
    )
