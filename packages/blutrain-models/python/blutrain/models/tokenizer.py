"""GPT-2's byte-pair encoding, through tiktoken, over the ranks file shipped in this package.

No network: the ranks come from ``assets/gpt2.tiktoken`` (MIT, OpenAI; see the LICENSE file
beside it), checked against their published sha256 when loaded.
"""

from __future__ import annotations

import functools
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from .config import EOT_TOKEN, GPT2_VOCAB_SIZE

ASSETS = Path(__file__).resolve().parent / "assets"
RANKS_FILE = ASSETS / "gpt2.tiktoken"
RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
SHAKESPEARE_FILE = ASSETS / "tinyshakespeare.txt"

EOT = "<|endoftext|>"
# GPT-2's pre-tokenizer split pattern (contractions, letters, numbers, other, whitespace).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@functools.cache
def get_encoding() -> tiktoken.Encoding:
    """The GPT-2 tokenizer (a ``tiktoken.Encoding``; 50,257 tokens, <|endoftext|> = 50256).

    Use ``enc.encode_ordinary(text)`` for untrusted text (a literal "<|endoftext|>" stays text),
    ``enc.encode(text, allowed_special={EOT})`` to let it become the special token, and
    ``enc.decode(ids)``.
    """
    if not RANKS_FILE.is_file():
        raise FileNotFoundError(
            f"[tokenizer] {RANKS_FILE}: the GPT-2 ranks file is missing from the installed package"
        )
    try:
        ranks = load_tiktoken_bpe(str(RANKS_FILE), expected_hash=RANKS_SHA256)
    except ValueError as e:
        raise ValueError(
            f"[tokenizer] {RANKS_FILE}: not GPT-2's ranks file (expected sha256 {RANKS_SHA256}); "
            f"reinstall blutrain-models ({e})"
        ) from None
    if len(ranks) != EOT_TOKEN:
        raise ValueError(
            f"[tokenizer] {RANKS_FILE}: expected {EOT_TOKEN} ranks, found {len(ranks)}"
        )
    enc = tiktoken.Encoding(
        name="gpt2",
        explicit_n_vocab=GPT2_VOCAB_SIZE,
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={EOT: EOT_TOKEN},
    )
    return enc


def encode(text: str, allow_eot: bool = False) -> list[int]:
    """Token ids of `text`; with `allow_eot`, a literal "<|endoftext|>" becomes token 50256."""
    enc = get_encoding()
    if allow_eot:
        return enc.encode(text, allowed_special={EOT})
    return enc.encode_ordinary(text)


def decode(ids) -> str:
    """Text of token ids (any iterable of ints, e.g. a numpy array); bad bytes become U+FFFD."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < GPT2_VOCAB_SIZE]
    if bad:
        raise ValueError(
            f"[tokenizer] token id {bad[0]} is outside GPT-2's vocabulary [0, {GPT2_VOCAB_SIZE})"
        )
    return get_encoding().decode(ids)
