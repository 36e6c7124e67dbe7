"""Token shards in llm.c's format, and a memory-mapped, shuffled, rank-sliced loader over them.

Shard format (llm.c's ``dev/data/data_common.py``): a header of 256 little-endian int32
(``[0]`` magic 20240520, ``[1]`` version 1, ``[2]`` token count, the rest zero), then the tokens
as little-endian uint16. Each document is preceded by <|endoftext|> (50256), as llm.c's own
preprocessing scripts do, so shards made by llm.c (Tiny Shakespeare, FineWeb...) load unchanged
and ours load in llm.c. The loader also reads llm.c's uint32 variant (magic 20240801, version 7).
"""

from __future__ import annotations

import glob as _glob
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._io import atomic_open, fsync_dir
from .config import EOT_TOKEN, GPT2_VOCAB_SIZE

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
DATA_MAGIC = 20240520
DATA_VERSION = 1
# (magic, version) -> token dtype; the second is llm.c's LLaMA-3 layout.
_FORMATS = {(DATA_MAGIC, DATA_VERSION): np.dtype("<u2"), (20240801, 7): np.dtype("<u4")}
DEFAULT_SHARD_TOKENS = 100_000_000  # llm.c's FineWeb shard size

Progress = Callable[[str, int, int], None]  # (what, done, total)


class ShardError(ValueError):
    """A token shard that is missing, malformed, truncated or holds ids outside the vocabulary."""


# ---------------------------------------------------------------------------------------------
# Writing


def write_shard(path: str | os.PathLike, tokens: np.ndarray | Sequence[int]) -> Path:
    """Write `tokens` as one llm.c shard (uint16), atomically. Returns the path."""
    path = Path(path)
    toks = np.asarray(tokens)
    if toks.ndim != 1:
        raise ValueError(f"[write_shard] {path}: tokens must be 1-D, got shape {toks.shape}")
    if toks.size and (toks.min() < 0 or toks.max() > np.iinfo(np.uint16).max):
        raise ValueError(
            f"[write_shard] {path}: token ids must lie in [0, 65535] for uint16 shards, "
            f"found [{int(toks.min())}, {int(toks.max())}]"
        )
    if toks.size >= 2**31:
        raise ValueError(f"[write_shard] {path}: {toks.size} tokens do not fit an int32 count")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = DATA_MAGIC, DATA_VERSION, toks.size
    with atomic_open(path) as f:
        f.write(header.tobytes())
        f.write(toks.astype("<u2", copy=False).tobytes())
    return path


def _split_documents(text: str, doc_split: str) -> list[str]:
    if doc_split == "file":
        return [text] if text else []
    if doc_split == "paragraph":
        # llm.c's Tiny Shakespeare rule: a new document starts after every blank line.
        parts = text.split("\n\n")
        docs = [p + "\n\n" for p in parts[:-1]] + [parts[-1]]
        return [d for d in docs if d]
    if doc_split == "line":
        return [line for line in text.splitlines(keepends=True) if line.strip()]
    raise ValueError(
        f"[prepare] doc_split must be 'file', 'paragraph' or 'line', got {doc_split!r}"
    )


def _expand_inputs(inputs: Iterable[str | os.PathLike]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(q for q in p.rglob("*.txt") if q.is_file())
            if not found:
                raise FileNotFoundError(f"[prepare] {p}: directory holds no .txt files")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            matches = sorted(Path(m) for m in _glob.glob(str(item)) if Path(m).is_file())
            if not matches:
                raise FileNotFoundError(f"[prepare] {p}: no such file or directory")
            files.extend(matches)
    if not files:
        raise ValueError("[prepare] no input files given")
    return files


@dataclass
class PrepareResult:
    out_dir: Path
    train_files: list[Path]
    val_files: list[Path]
    train_tokens: int
    val_tokens: int
    documents: int
    input_files: list[Path] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return self.train_tokens + self.val_tokens


def prepare(
    inputs: Iterable[str | os.PathLike] | None = None,
    out_dir: str | os.PathLike = "data/shakespeare",
    val_fraction: float = 0.1,
    *,
    val_tokens: int | None = None,
    name: str | None = None,
    doc_split: str | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    encoding: str = "utf-8",
    progress: Progress | None = None,
) -> PrepareResult:
    """Tokenize text into llm.c shards ``{name}_val_000000.bin``, ``{name}_train_000001.bin``...

    inputs: text files, directories (their ``*.txt``, recursively) or glob patterns; None means
        the shipped Tiny Shakespeare (then name defaults to "shakespeare" and doc_split to
        "paragraph", llm.c's rule, so ``val_tokens=32768`` reproduces llm.c's own
        tiny_shakespeare_{val,train}.bin token for token).
    val_fraction: the share of tokens, taken from the start of the stream as llm.c does, that
        becomes the validation split; `val_tokens` gives an exact count instead.
    doc_split: "file" (each file is one document; the default for your files), "paragraph"
        (split after blank lines) or "line". Every document is preceded by <|endoftext|>.
    shard_tokens: at most this many tokens per shard file (llm.c uses 100M).

    Text is encoded with ``encode_ordinary``: a literal "<|endoftext|>" in a file stays text.
    The whole token stream is held in memory (2 bytes a token) before it is split and written;
    every shard is written atomically, and shards of the same name left by an earlier, larger
    run are removed so a glob over `out_dir` never mixes two runs.
    """
    from .tokenizer import SHAKESPEARE_FILE, get_encoding

    if inputs is None:
        files = [SHAKESPEARE_FILE]
        name = name or "shakespeare"
        doc_split = doc_split or "paragraph"
    else:
        if isinstance(inputs, (str, os.PathLike)):
            inputs = [inputs]
        files = _expand_inputs(inputs)
        name = name or "data"
        doc_split = doc_split or "file"
    if not (0.0 <= val_fraction < 1.0):
        raise ValueError(f"[prepare] val_fraction must be in [0, 1), got {val_fraction}")
    if val_tokens is not None and val_tokens < 0:
        raise ValueError(f"[prepare] val_tokens must be >= 0, got {val_tokens}")
    if shard_tokens < 1:
        raise ValueError(f"[prepare] shard_tokens must be >= 1, got {shard_tokens}")
    if not name or any(c in name for c in "/\\*?[]"):
        raise ValueError(f"[prepare] name {name!r} must be a plain file-name prefix")

    enc = get_encoding()
    chunks: list[np.ndarray] = []
    n_docs = 0
    total_bytes = sum(f.stat().st_size for f in files)
    done_bytes = 0
    eot = np.array([EOT_TOKEN], dtype=np.uint16)
    for path in files:
        try:
            text = path.read_text(encoding=encoding)
        except UnicodeDecodeError as e:
            raise ValueError(f"[prepare] {path}: not {encoding} text ({e})") from None
        docs = _split_documents(text, doc_split)
        # encode_ordinary_batch runs tiktoken's threads over the documents.
        for ids in enc.encode_ordinary_batch(docs, num_threads=min(8, os.cpu_count() or 1)):
            chunks.append(eot)
            chunks.append(np.asarray(ids, dtype=np.uint16))
        n_docs += len(docs)
        done_bytes += path.stat().st_size
        if progress:
            progress("tokenize", done_bytes, total_bytes)
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint16)
    n = tokens.size
    if n == 0:
        raise ValueError(f"[prepare] the input files hold no text: {[str(f) for f in files]}")
    n_val = val_tokens if val_tokens is not None else int(round(n * val_fraction))
    if n_val >= n:
        raise ValueError(f"[prepare] val split ({n_val} tokens) leaves nothing of {n} to train on")
    splits = {"val": tokens[:n_val], "train": tokens[n_val:]}

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, list[Path]] = {"val": [], "train": []}
    index = 0  # llm.c numbers shards across splits: val is 000000, train starts at 000001
    todo = sum(-(-s.size // shard_tokens) for s in splits.values())
    # Shards are written (and fsync'ed) in a staging directory and renamed into place only when
    # all are complete: an interrupted run leaves the previous run's shards as they were.
    stage = Path(tempfile.mkdtemp(prefix=f".{name}.prepare-", dir=out))
    try:
        for split in ("val", "train"):
            data = splits[split]
            for start in range(0, data.size, shard_tokens):
                fname = f"{name}_{split}_{index:06d}.bin"
                write_shard(stage / fname, data[start : start + shard_tokens])
                written[split].append(out / fname)
                index += 1
                if progress:
                    progress("write", index, todo)
        for paths in written.values():
            for path in paths:
                os.replace(stage / path.name, path)
        fsync_dir(out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    keep = {p.name for paths in written.values() for p in paths}
    for split in ("val", "train"):
        for stale in out.glob(f"{name}_{split}_*.bin"):
            if stale.name not in keep:
                stale.unlink()
    return PrepareResult(
        out_dir=out,
        train_files=written["train"],
        val_files=written["val"],
        train_tokens=int(splits["train"].size),
        val_tokens=int(splits["val"].size),
        documents=n_docs,
        input_files=files,
    )


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    num_tokens: int
    dtype: np.dtype


def read_shard_header(path: str | os.PathLike) -> ShardInfo:
    """Check a shard's header against its file length; raise ShardError naming what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"[shard] {path}: no such file")
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise ShardError(
            f"[shard] {path}: truncated: {size} bytes, shorter than the {HEADER_BYTES}-byte header"
        )
    with open(path, "rb") as f:
        header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    magic, version, ntok = int(header[0]), int(header[1]), int(header[2])
    if magic not in {m for m, _ in _FORMATS}:
        raise ShardError(
            f"[shard] {path}: bad magic {magic}, expected {DATA_MAGIC} (an llm.c token shard); "
            "is this a token shard made by `blutrain prepare` or llm.c?"
        )
    dtype = _FORMATS.get((magic, version))
    if dtype is None:
        expected = [v for m, v in _FORMATS if m == magic]
        raise ShardError(
            f"[shard] {path}: unsupported version {version} for magic {magic}, "
            f"expected {expected[0]}"
        )
    if ntok < 0:
        raise ShardError(f"[shard] {path}: negative token count {ntok} in the header")
    expected_size = HEADER_BYTES + ntok * dtype.itemsize
    if size != expected_size:
        what = "truncated" if size < expected_size else "has trailing bytes"
        raise ShardError(
            f"[shard] {path}: {what}: header says {ntok} tokens, so {expected_size} bytes, "
            f"but the file has {size} bytes"
        )
    return ShardInfo(path=path, num_tokens=ntok, dtype=dtype)


def load_shard(path: str | os.PathLike, vocab_size: int | None = GPT2_VOCAB_SIZE) -> np.memmap:
    """The tokens of one shard, memory-mapped read-only (header checked; ids checked if asked)."""
    info = read_shard_header(path)
    toks = np.memmap(
        info.path, dtype=info.dtype, mode="r", offset=HEADER_BYTES, shape=(info.num_tokens,)
    )
    if vocab_size is not None and info.num_tokens:
        _check_ids(toks, vocab_size, info.path, 0)
    return toks


def _check_ids(toks: np.ndarray, vocab_size: int, path: Path, offset: int) -> None:
    hi = int(toks.max())
    if hi >= vocab_size:
        pos = int(np.argmax(toks >= vocab_size))
        raise ShardError(
            f"[shard] {path}: token id {int(toks[pos])} at token {offset + pos} is outside the "
            f"vocabulary [0, {vocab_size})"
        )


def _resolve_files(files: str | os.PathLike | Iterable[str | os.PathLike], split: str | None):
    if isinstance(files, (str, os.PathLike)):
        p = Path(files)
        if p.is_dir():
            # Ours and llm.c's FineWeb: name_val_000000.bin; llm.c's Tiny Shakespeare: name_val.bin.
            patterns = [f"*_{split}_*.bin", f"*_{split}.bin"] if split else ["*.bin"]
            found = sorted({f for pat in patterns for f in p.glob(pat) if f.is_file()})
            if not found:
                raise FileNotFoundError(
                    f"[DataLoader] {p}: no shards matching {' or '.join(map(repr, patterns))}"
                )
            return found
        if p.is_file():
            return [p]
        found = sorted(Path(m) for m in _glob.glob(str(files)))
        if not found:
            raise FileNotFoundError(
                f"[DataLoader] {files}: no such file, directory or matching shard"
            )
        return found
    out = [Path(f) for f in files]
    if not out:
        raise ValueError("[DataLoader] no shard files given")
    return out


class DataLoader:
    """(inputs, targets) batches of shape (B, T) from llm.c token shards, memory-mapped.

    A shard of N tokens holds (N - 1) // T rows: row j is tokens [jT, jT + T) and its targets
    are the same window shifted by one token. Every epoch the rows of all shards form one
    stream (shards in order, or in a seeded random order with their rows permuted when
    `shuffle`); consecutive groups of ``world_size * B`` rows make the global batches, of which
    rank r takes rows [rB, rB + B). Every rank computes the same permutation from (seed, epoch),
    so the ranks read disjoint rows with no communication. An epoch ends at a whole number of
    `step_rows` (default ``world_size * B``; the trainer passes the rows of one optimizer step,
    world_size x grad_accum x B): the tail is dropped, so two runs with the same global batch
    read the same batches, epoch after epoch, whatever their world sizes.

    The position is resumable: ``state_dict()`` gives (epoch, rows consumed) and
    ``load_state_dict()`` continues from there, bit for bit; with another B or world size it
    continues the same row stream (only the dropped tail of an epoch depends on `step_rows`).
    Token ids are checked against `vocab_size` in every batch (cheap), so a shard of another
    tokenizer is an error naming the file and position, never an out-of-range gather.
    """

    def __init__(
        self,
        files: str | os.PathLike | Iterable[str | os.PathLike],
        batch_size: int,
        seq_len: int,
        *,
        split: str | None = None,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        seed: int = 1337,
        vocab_size: int | None = GPT2_VOCAB_SIZE,
        dtype: np.dtype | type = np.int64,
        step_rows: int | None = None,
    ) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(
                f"[DataLoader] batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}"
            )
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"[DataLoader] need 0 <= rank < world_size, got {rank}, {world_size}")
        self.files = _resolve_files(files, split)
        self.shards = [read_shard_header(f) for f in self.files]
        self.B, self.T = int(batch_size), int(seq_len)
        self.rank, self.world_size = int(rank), int(world_size)
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.vocab_size = vocab_size
        self.dtype = np.dtype(dtype)
        self._rows = np.array([max(0, (s.num_tokens - 1) // self.T) for s in self.shards])
        group = self.world_size * self.B
        self.step_rows = group if step_rows is None else int(step_rows)
        if self.step_rows < group or self.step_rows % group:
            raise ValueError(
                f"[DataLoader] step_rows={step_rows} must be a positive multiple of world_size x "
                f"batch_size = {group}"
            )
        need = self.step_rows
        if self._rows.sum() < need:
            shown = [str(f) for f in self.files][:4]
            raise ValueError(
                f"[DataLoader] {len(self.files)} shard(s) with {self.num_tokens} tokens hold "
                f"{int(self._rows.sum())} rows of T={self.T}; one batch of B={self.B} on "
                f"{self.world_size} rank(s)"
                + (f" x {need // group} micro-batches a step" if need > group else "")
                + f" needs {need} (files: {shown})"
            )
        self._maps: dict[int, np.memmap] = {}
        self.epoch = 0
        self.rows_consumed = 0  # global rows consumed in this epoch, over all ranks
        self._order_epoch = -1

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return int(sum(s.num_tokens for s in self.shards))

    @property
    def rows_per_epoch(self) -> int:
        return int(self._rows.sum())

    @property
    def batches_per_epoch(self) -> int:
        """Batches each rank reads in an epoch (a whole number of steps)."""
        used = self.rows_per_epoch // self.step_rows * self.step_rows
        return used // (self.world_size * self.B)

    # -- order ---------------------------------------------------------------------------------
    def _shard_order(self) -> tuple[np.ndarray, np.ndarray]:
        """This epoch's shard order and the cumulative row counts along it."""
        if self._order_epoch != self.epoch:
            n = len(self.shards)
            if self.shuffle:
                order = np.random.default_rng([self.seed, self.epoch]).permutation(n)
            else:
                order = np.arange(n)
            self._order = (order, np.cumsum(self._rows[order]))
            self._order_epoch = self.epoch
            self._perms: dict[int, np.ndarray] = {}
        return self._order

    def _row(self, g: int) -> tuple[int, int]:
        """(shard, row in shard) of the epoch's g-th row. Memory is one shard's permutation at a
        time (rows of a shard are permuted by an RNG of (seed, epoch, shard)), not the corpus's."""
        order, cum = self._shard_order()
        k = int(np.searchsorted(cum, g, side="right"))
        s = int(order[k])
        local = g - (int(cum[k - 1]) if k else 0)
        if not self.shuffle:
            return s, local
        perm = self._perms.get(s)
        if perm is None:
            rng = np.random.default_rng([self.seed, self.epoch, s])
            perm = rng.permutation(int(self._rows[s]))
            if len(self._perms) >= 2:  # a batch spans at most a few shards
                self._perms.pop(next(iter(self._perms)))
            self._perms[s] = perm
        return s, int(perm[local])

    def _tokens(self, s: int) -> np.memmap:
        m = self._maps.get(s)
        if m is None:
            info = read_shard_header(self.shards[s].path)  # the file may have changed under us
            if info != self.shards[s]:
                raise ShardError(
                    f"[DataLoader] {info.path}: changed since the loader opened it "
                    f"({self.shards[s].num_tokens} -> {info.num_tokens} tokens)"
                )
            m = np.memmap(
                info.path, dtype=info.dtype, mode="r", offset=HEADER_BYTES, shape=(info.num_tokens,)
            )
            self._maps[s] = m
        return m

    # -- batches -------------------------------------------------------------------------------
    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """This rank's next (inputs, targets), each (B, T) of `dtype`; wraps to a new epoch."""
        group = self.world_size * self.B
        if self.rows_consumed + group > self.rows_per_epoch // self.step_rows * self.step_rows:
            self.epoch += 1
            self.rows_consumed = 0
        lo = self.rows_consumed + self.rank * self.B
        x = np.empty((self.B, self.T), dtype=self.dtype)
        y = np.empty((self.B, self.T), dtype=self.dtype)
        for b in range(self.B):
            s, r = self._row(lo + b)
            start = r * self.T
            window = self._tokens(s)[start : start + self.T + 1]
            if self.vocab_size is not None:
                _check_ids(window, self.vocab_size, self.shards[s].path, start)
            x[b] = window[:-1]
            y[b] = window[1:]
        self.rows_consumed += group
        return x, y

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Batches without end (training counts steps); see `batches_per_epoch`."""
        while True:
            yield self.next_batch()

    def __next__(self) -> tuple[np.ndarray, np.ndarray]:
        return self.next_batch()

    def reset(self) -> None:
        self.epoch = 0
        self.rows_consumed = 0

    # -- resume --------------------------------------------------------------------------------
    def _fingerprint(self) -> list[list]:
        return [[s.path.name, s.num_tokens] for s in self.shards]

    def state_dict(self) -> dict:
        """JSON-able position: save it with the checkpoint's trainer state."""
        return {
            "epoch": self.epoch,
            "rows_consumed": self.rows_consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "seq_len": self.T,
            "shards": self._fingerprint(),
        }

    def check_state_dict(self, state: Any) -> tuple[int, int]:
        """The (epoch, rows consumed) of `state` if this loader can continue from it; raises
        ValueError naming what differs (shards, seed, shuffle, T) or is malformed."""
        try:
            epoch, rows = state["epoch"], state["rows_consumed"]
            saved = {k: state[k] for k in ("seed", "shuffle", "seq_len", "shards")}
            saved["shards"] = [list(x) for x in saved["shards"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"[DataLoader] not a DataLoader state: missing or bad {e}") from None
        for name, v in (("epoch", epoch), ("rows_consumed", rows)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"[DataLoader] not a DataLoader state: {name} is {v!r}")
        mine = {
            "seed": self.seed,
            "shuffle": self.shuffle,
            "seq_len": self.T,
            "shards": self._fingerprint(),
        }
        for key in mine:
            if saved[key] != mine[key]:
                raise ValueError(
                    f"[DataLoader] cannot resume: {key} was {saved[key]!r} when saved, "
                    f"is {mine[key]!r} now"
                )
        if epoch < 0 or not 0 <= rows <= self.rows_per_epoch:
            raise ValueError(f"[DataLoader] bad position epoch={epoch} rows_consumed={rows}")
        return epoch, rows

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state`; shards, seed, shuffle and T must be those it was saved with."""
        self.epoch, self.rows_consumed = self.check_state_dict(state)
