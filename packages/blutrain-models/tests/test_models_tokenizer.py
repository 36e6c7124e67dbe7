"""The GPT-2 tokenizer shipped in the package."""

from __future__ import annotations

import hashlib

import pytest
import tiktoken
from hypothesis import given, settings
from hypothesis import strategies as st

from blutrain.models import tokenizer
from blutrain.models.tokenizer import EOT, decode, encode, get_encoding


def test_hello_world():
    assert get_encoding().encode("Hello world") == [15496, 995]
    assert encode("Hello world") == [15496, 995]


def test_vocabulary_and_special_token():
    enc = get_encoding()
    assert enc.n_vocab == 50257 and enc.eot_token == 50256 and enc.name == "gpt2"
    assert encode(EOT, allow_eot=True) == [50256]
    # By default a literal <|endoftext|> in text stays text, so data cannot inject a break.
    ordinary = encode(EOT)
    assert 50256 not in ordinary and decode(ordinary) == EOT
    with pytest.raises(ValueError):
        enc.encode(EOT)  # tiktoken refuses disallowed specials outright


def test_known_tokens():
    # Some ids every GPT-2 user knows: " the" 262, "\n" 198, " world" 995, "!" 0.
    assert encode(" the") == [262]
    assert encode("\n") == [198]
    assert encode("!") == [0]
    assert decode([464, 2068, 7586, 21831]) == "The quick brown fox"


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_round_trip_any_text(text):
    assert decode(encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab 'sltvmdre\n\t1234.,!?éß中 ")), max_size=80))
def test_split_pattern_matches_tiktokens_fast_form(text):
    # tiktoken ships a faster, equivalent form of GPT-2's pattern; ours is the published one.
    from tiktoken_ext.openai_public import r50k_pat_str

    enc = get_encoding()
    fast = tiktoken.Encoding(
        name="gpt2-fast",
        pat_str=r50k_pat_str,
        mergeable_ranks=enc._mergeable_ranks,
        special_tokens={EOT: 50256},
    )
    assert enc.encode_ordinary(text) == fast.encode_ordinary(text)


def test_decode_rejects_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match=r"token id 50257 is outside GPT-2's vocabulary"):
        decode([1, 50257])
    with pytest.raises(ValueError, match="token id -1"):
        decode([-1])


def test_shipped_assets_and_license():
    data = tokenizer.RANKS_FILE.read_bytes()
    assert hashlib.sha256(data).hexdigest() == tokenizer.RANKS_SHA256
    lic = (tokenizer.ASSETS / "LICENSE-gpt2-tiktoken.txt").read_text()
    assert "MIT License" in lic and "Copyright (c) 2022 OpenAI" in lic
    assert "public domain" in (tokenizer.ASSETS / "README.md").read_text()
    assert tokenizer.SHAKESPEARE_FILE.read_text().startswith("First Citizen:")


def test_damaged_ranks_file_is_a_clear_error(tmp_path, monkeypatch):
    bad = tmp_path / "gpt2.tiktoken"
    bad.write_bytes(tokenizer.RANKS_FILE.read_bytes()[:-100])
    monkeypatch.setattr(tokenizer, "RANKS_FILE", bad)
    tokenizer.get_encoding.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"gpt2.tiktoken: not GPT-2's ranks file"):
            tokenizer.get_encoding()
        monkeypatch.setattr(tokenizer, "RANKS_FILE", tmp_path / "missing.tiktoken")
        with pytest.raises(FileNotFoundError, match="missing.tiktoken"):
            tokenizer.get_encoding()
    finally:
        tokenizer.get_encoding.cache_clear()
