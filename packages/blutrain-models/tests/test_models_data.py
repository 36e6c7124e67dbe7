"""llm.c token shards: prepare(), the header checks, and the DataLoader."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blutrain.models import DataLoader, ShardError, get_encoding, load_shard, prepare, write_shard
from blutrain.models.data import HEADER_BYTES, read_shard_header

EOT = 50256
WORDS = ["the", "king", "shall", "not", "die", "to", "morrow", "Rome", "é", "中文", "!", "?\n"]


def random_text(rng, n_words):
    return " ".join(rng.choice(WORDS, size=n_words)) + "\n"


def llmc_shard_bytes(tokens, magic=20240520, version=1, count=None, dtype="<u2"):
    """An llm.c shard built independently of our writer (struct + numpy)."""
    header = struct.pack("<3i", magic, version, len(tokens) if count is None else count)
    header += b"\0" * (1024 - len(header))
    return header + np.asarray(tokens, dtype=dtype).tobytes()


# -- writing -----------------------------------------------------------------------------------


def test_write_shard_is_llmcs_format(rng, tmp_path):
    toks = rng.integers(0, 50257, size=int(rng.integers(0, 5000)))
    path = write_shard(tmp_path / "a.bin", toks)
    assert path.read_bytes() == llmc_shard_bytes(toks)
    assert np.array_equal(load_shard(path), toks)
    assert [p.name for p in tmp_path.iterdir()] == ["a.bin"]  # no temporary file left


def test_write_shard_rejects_ids_that_do_not_fit(tmp_path):
    with pytest.raises(ValueError, match=r"x.bin: token ids must lie in \[0, 65535\]"):
        write_shard(tmp_path / "x.bin", [1, 70000])
    assert not (tmp_path / "x.bin").exists()


def test_prepare_tokenizes_documents_after_eot(rng, tmp_path):
    enc = get_encoding()
    files = []
    for i in range(3):
        f = tmp_path / "in" / f"doc{i}.txt"
        f.parent.mkdir(exist_ok=True)
        f.write_text(random_text(rng, int(rng.integers(50, 400))))
        files.append(f)
    expected = []
    for f in files:  # doc_split="file": each file one document, preceded by <|endoftext|>
        expected += [EOT] + enc.encode_ordinary(f.read_text())
    res = prepare(files, tmp_path / "out", val_fraction=0.25)
    n_val = round(len(expected) * 0.25)
    assert res.val_tokens == n_val and res.train_tokens == len(expected) - n_val
    assert res.documents == 3
    got = np.concatenate([load_shard(p) for p in res.val_files + res.train_files])
    assert got.tolist() == expected
    assert [p.name for p in res.val_files] == ["data_val_000000.bin"]
    assert [p.name for p in res.train_files] == ["data_train_000001.bin"]
    # A directory input finds the same files (sorted) and gives the same tokens.
    res2 = prepare([tmp_path / "in"], tmp_path / "out2", val_fraction=0.25)
    assert res2.total_tokens == res.total_tokens


def test_prepare_shards_and_removes_stale_ones(rng, tmp_path):
    f = tmp_path / "t.txt"
    f.write_text(random_text(rng, 2000))
    res = prepare([f], tmp_path / "out", 0.1, shard_tokens=300, name="t")
    sizes = [read_shard_header(p).num_tokens for p in res.train_files]
    assert len(res.train_files) > 2 and max(sizes) == 300 and sum(sizes) == res.train_tokens
    names = [p.name for p in res.val_files + res.train_files]
    assert names == [
        f"t_{'val' if i < len(res.val_files) else 'train'}_{i:06d}.bin" for i in range(len(names))
    ]
    # A second run with bigger shards leaves only its own files behind.
    res = prepare([f], tmp_path / "out", 0.1, shard_tokens=10**6, name="t")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "t_train_000001.bin",
        "t_val_000000.bin",
    ]


def test_interrupted_prepare_keeps_the_previous_shards(rng, tmp_path, monkeypatch):
    from blutrain.models import data

    f = tmp_path / "t.txt"
    f.write_text(random_text(rng, 3000))
    first = prepare([f], tmp_path / "out", 0.1, shard_tokens=500)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    f.write_text(random_text(rng, 3000))  # new text, so new shards would differ
    calls = []
    real = data.write_shard

    def dies_on_third(path, tokens):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(path, tokens)

    monkeypatch.setattr(data, "write_shard", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        prepare([f], tmp_path / "out", 0.1, shard_tokens=500)
    after = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    assert after == before and len(first.train_files) > 3  # untouched, no staging left behind


def test_prepare_reports_progress(rng, tmp_path):
    files = []
    for i in range(3):
        files.append(tmp_path / f"{i}.txt")
        files[-1].write_text(random_text(rng, 500))
    events = []
    res = prepare(
        files, tmp_path / "o", 0.2, shard_tokens=400, progress=lambda *e: events.append(e)
    )
    tok = [e for e in events if e[0] == "tokenize"]
    wr = [e for e in events if e[0] == "write"]
    assert len(tok) == 3 and tok[-1][1] == tok[-1][2] == sum(f.stat().st_size for f in files)
    n = len(res.train_files) + len(res.val_files)
    assert [e[1] for e in wr] == list(range(1, n + 1)) and all(e[2] == n for e in wr)


def test_default_shakespeare_matches_llmc(tmp_path):
    # llm.c's dev/data/tinyshakespeare.py prints 32,768 val and 305,260 train tokens.
    res = prepare(out_dir=tmp_path, val_tokens=32768)
    assert (res.val_tokens, res.train_tokens) == (32768, 305260)
    val = load_shard(res.val_files[0])
    assert val[0] == EOT and get_encoding().decode(val[1:4].tolist()) == "First Citizen:"
    assert res.val_files[0].name == "shakespeare_val_000000.bin"


def test_paragraph_and_line_splits(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("A b.\n\nC d.\nE f.\n\n\nG.")
    para = prepare([f], tmp_path / "a", 0.0, doc_split="paragraph")
    line = prepare([f], tmp_path / "b", 0.0, doc_split="line")
    whole = prepare([f], tmp_path / "c", 0.0)
    assert (whole.documents, para.documents, line.documents) == (1, 3, 4)
    toks = load_shard(para.train_files[0])
    assert int((toks == EOT).sum()) == 3
    # Splitting only inserts <|endoftext|>; the text is unchanged.
    assert get_encoding().decode([t for t in toks.tolist() if t != EOT]) == f.read_text()


@pytest.mark.parametrize(
    "kwargs,err,msg",
    [
        ({"inputs": ["missing.txt"]}, FileNotFoundError, "missing.txt: no such file"),
        ({"val_fraction": 1.0}, ValueError, r"val_fraction must be in \[0, 1\)"),
        ({"val_tokens": 10**9}, ValueError, "leaves nothing"),
        ({"shard_tokens": 0}, ValueError, "shard_tokens"),
        ({"doc_split": "chapter"}, ValueError, "doc_split"),
    ],
)
def test_prepare_bad_input(tmp_path, monkeypatch, kwargs, err, msg):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ok.txt").write_text("hello there\n")
    kwargs = {"inputs": ["ok.txt"], "out_dir": "out", **kwargs}
    with pytest.raises(err, match=msg):
        prepare(**kwargs)


def test_prepare_empty_and_undecodable_inputs(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="hold no text"):
        prepare([tmp_path / "empty.txt"], tmp_path / "o")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(ValueError, match=r"bin.txt: not utf-8 text"):
        prepare([tmp_path / "bin.txt"], tmp_path / "o")


# -- header checks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (
            lambda b, t: llmc_shard_bytes(t, magic=20240326),
            r"bad magic 20240326, expected 20240520",
        ),
        (lambda b, t: llmc_shard_bytes(t, version=2), r"unsupported version 2 .*expected 1"),
        (lambda b, t: b[:-1], r"truncated: header says \d+ tokens, so \d+ bytes, but the file has"),
        (lambda b, t: b + b"\0\0", r"has trailing bytes"),
        (lambda b, t: b[:100], r"truncated: 100 bytes, shorter than the 1024-byte header"),
        (lambda b, t: llmc_shard_bytes(t, count=-5), r"negative token count"),
    ],
)
def test_corrupt_shards_are_clear_errors(rng, tmp_path, mutate, msg):
    toks = rng.integers(0, 50257, size=300)
    path = tmp_path / "bad_shard.bin"
    path.write_bytes(mutate(llmc_shard_bytes(toks), toks))
    with pytest.raises(ShardError, match=r"bad_shard.bin: " + msg):
        load_shard(path)
    with pytest.raises(ShardError, match="bad_shard.bin"):
        DataLoader(path, 2, 8)


def test_missing_shards(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.bin"):
        load_shard(tmp_path / "nothing.bin")
    with pytest.raises(FileNotFoundError, match=r"no shards matching '\*_train_\*.bin' or"):
        DataLoader(tmp_path, 2, 8, split="train")
    with pytest.raises(FileNotFoundError, match="nope_"):
        DataLoader(str(tmp_path / "nope_*.bin"), 2, 8)


def test_ids_outside_the_vocabulary(rng, tmp_path):
    toks = rng.integers(0, 50257, size=1000)
    toks[637] = 60000  # fits uint16, not GPT-2
    path = tmp_path / "other_tokenizer.bin"
    path.write_bytes(llmc_shard_bytes(toks))
    with pytest.raises(
        ShardError,
        match=r"other_tokenizer.bin: token id 60000 at token 637 is "
        r"outside the vocabulary \[0, 50257\)",
    ):
        load_shard(path)
    loader = DataLoader(path, 4, 10, shuffle=False)  # the header is fine: found when read
    with pytest.raises(ShardError, match="other_tokenizer.bin: token id 60000 at token 637"):
        for _ in range(loader.batches_per_epoch):
            loader.next_batch()
    assert load_shard(path, vocab_size=None)[637] == 60000


def test_reads_a_directory_named_as_llmc_names_its_files(rng, tmp_path):
    # dev/data/tinyshakespeare.py writes tiny_shakespeare_{val,train}.bin; fineweb.py writes
    # fineweb_{val,train}_00000N.bin.
    val = rng.integers(0, 50257, size=300)
    train = [rng.integers(0, 50257, size=400) for _ in range(2)]
    (tmp_path / "tiny_shakespeare_val.bin").write_bytes(llmc_shard_bytes(val))
    for i, t in enumerate(train):
        (tmp_path / f"fineweb_train_{i + 1:06d}.bin").write_bytes(llmc_shard_bytes(t))
    v = DataLoader(tmp_path, 1, 299, split="val", shuffle=False)
    x, y = v.next_batch()
    assert np.array_equal(x[0], val[:-1]) and np.array_equal(y[0], val[1:])
    tr = DataLoader(tmp_path, 1, 8, split="train")
    assert [f.name for f in tr.files] == ["fineweb_train_000001.bin", "fineweb_train_000002.bin"]
    assert tr.num_tokens == 800


def test_reads_llmc_uint32_shards(rng, tmp_path):
    toks = rng.integers(0, 128256, size=500)
    path = tmp_path / "llama.bin"
    path.write_bytes(llmc_shard_bytes(toks, magic=20240801, version=7, dtype="<u4"))
    assert np.array_equal(load_shard(path, vocab_size=128256), toks)


# -- the loader --------------------------------------------------------------------------------


def make_shards(rng, tmp_path, sizes, split="train"):
    paths, arrays = [], []
    for i, n in enumerate(sizes):
        toks = rng.integers(0, 50257, size=n)
        paths.append(write_shard(tmp_path / f"d_{split}_{i:06d}.bin", toks))
        arrays.append(toks)
    return paths, arrays


def test_batches_without_shuffle_follow_the_stream(rng, tmp_path):
    paths, arrays = make_shards(rng, tmp_path, [1001, 1500])
    B, T = 3, 10
    loader = DataLoader(tmp_path, B, T, split="train", shuffle=False)
    rows = [a[j * T : j * T + T + 1] for a in arrays for j in range((a.size - 1) // T)]
    assert loader.rows_per_epoch == len(rows) == 100 + 149
    for step in range(loader.batches_per_epoch):
        x, y = loader.next_batch()
        assert x.shape == y.shape == (B, T) and x.dtype == np.int64
        want = np.stack(rows[step * B : step * B + B])
        assert np.array_equal(x, want[:, :-1]) and np.array_equal(y, want[:, 1:])
    x, _ = loader.next_batch()  # wraps into epoch 1
    assert loader.epoch == 1 and np.array_equal(x, np.stack(rows[:B])[:, :-1])


def test_shuffle_is_seeded_and_covers_every_row_once(rng, tmp_path):
    _, arrays = make_shards(rng, tmp_path, [700, 333, 1200])
    B, T = 4, 8
    a = DataLoader(tmp_path, B, T, seed=5, dtype=np.int32)
    b = DataLoader(tmp_path, B, T, seed=5, dtype=np.int32)
    c = DataLoader(tmp_path, B, T, seed=6, dtype=np.int32)
    seen, xs_c = [], []
    for _ in range(a.batches_per_epoch):
        xa, ya = a.next_batch()
        xb, _ = b.next_batch()
        xs_c.append(c.next_batch()[0])
        assert np.array_equal(xa, xb) and xa.dtype == np.int32
        assert np.array_equal(xa[:, 1:], ya[:, :-1])
        seen += [tuple(int(v) for v in r) for r in xa]
    assert not np.array_equal(np.concatenate(xs_c), np.array(seen))
    all_rows = [
        tuple(int(v) for v in arr[j * T : j * T + T])
        for arr in arrays
        for j in range((arr.size - 1) // T)
    ]
    assert len(set(seen)) == len(seen)  # no row twice within an epoch
    assert set(seen) <= set(all_rows)
    assert 0 <= len(all_rows) - len(seen) < B  # only an incomplete last batch is dropped
    assert seen != all_rows[: len(seen)]  # and it is shuffled
    # The next epoch is another permutation.
    nxt = np.concatenate([a.next_batch()[0] for _ in range(a.batches_per_epoch)])
    assert a.epoch == 1 and not np.array_equal(nxt, np.array(seen))


@pytest.mark.parametrize("shuffle", [True, False])
def test_ranks_split_the_global_batch(rng, tmp_path, shuffle):
    make_shards(rng, tmp_path, [900, 1300])
    B, T, W = 3, 7, 4
    whole = DataLoader(tmp_path, B * W, T, seed=11, shuffle=shuffle)
    ranks = [
        DataLoader(tmp_path, B, T, rank=r, world_size=W, seed=11, shuffle=shuffle) for r in range(W)
    ]
    for _ in range(2 * whole.batches_per_epoch + 1):  # across epoch boundaries too
        x, y = whole.next_batch()
        parts = [ld.next_batch() for ld in ranks]
        assert np.array_equal(x, np.concatenate([p[0] for p in parts]))
        assert np.array_equal(y, np.concatenate([p[1] for p in parts]))


def test_epochs_end_at_a_whole_step_so_world_sizes_read_the_same_batches(rng, tmp_path):
    # 4 ranks x 1 micro-batch and 1 rank x 4 micro-batches: the same global batch of 8 rows;
    # 97 + 130 rows an epoch is not a multiple of 8, so the tail dropped must be a whole step's
    make_shards(rng, tmp_path, [971, 1301])
    B, T, W, steps = 2, 10, 4, 70  # 28 steps an epoch: 70 steps cross two epoch ends
    ranks = [DataLoader(tmp_path, B, T, seed=3, rank=r, world_size=W) for r in range(W)]
    one = DataLoader(tmp_path, B, T, seed=3, step_rows=W * B)
    assert one.batches_per_epoch == W * ranks[0].batches_per_epoch == 4 * 28
    for step in range(steps):
        many = np.concatenate([ld.next_batch()[0] for ld in ranks])
        single = np.concatenate([one.next_batch()[0] for _ in range(W)])
        assert np.array_equal(many, single), f"step {step}"
    assert one.epoch == ranks[0].epoch == 2
    with pytest.raises(ValueError, match=r"step_rows=6 must be a positive multiple of .* = 4"):
        DataLoader(tmp_path, B, T, world_size=2, rank=0, step_rows=6)


def test_resume_continues_bit_exactly(rng, tmp_path):
    make_shards(rng, tmp_path, [1000, 2000])
    a = DataLoader(tmp_path, 5, 16, seed=3)
    k = int(rng.integers(1, 3 * a.batches_per_epoch))
    for _ in range(k):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))  # it goes through the trainer's JSON
    b = DataLoader(tmp_path, 5, 16, seed=3)
    b.load_state_dict(state)
    for _ in range(a.batches_per_epoch + 3):
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb)
    # Resuming with twice the ranks continues the same row stream (away from an epoch's end,
    # where the incomplete group that is dropped depends on the group size: the 2-rank loaders
    # wrap once a group of 10 rows passes the epoch's rows rounded down to 10).
    while a.rows_consumed + 10 > a.rows_per_epoch // 10 * 10:
        a.next_batch()
    c = [DataLoader(tmp_path, 5, 16, seed=3, rank=r, world_size=2) for r in range(2)]
    for ld in c:
        ld.load_state_dict(a.state_dict())
    x2 = np.concatenate([ld.next_batch()[0] for ld in c])
    x1 = np.concatenate([a.next_batch()[0] for _ in range(2)])
    assert np.array_equal(x1, x2)


@pytest.mark.parametrize(
    "change,msg",
    [
        ({"seed": 4}, "seed was 3 when saved, is 4 now"),
        ({"seq_len": 8}, "seq_len"),
        ({"shuffle": False}, "shuffle"),
    ],
)
def test_resume_refuses_another_setup(rng, tmp_path, change, msg):
    make_shards(rng, tmp_path, [500])
    state = DataLoader(tmp_path, 2, 16, seed=3).state_dict()
    kwargs = {"seed": 3, "shuffle": True, "seq_len": 16, **change}
    other = DataLoader(tmp_path, 2, kwargs.pop("seq_len"), **kwargs)
    with pytest.raises(ValueError, match="cannot resume: " + msg):
        other.load_state_dict(state)
    write_shard(tmp_path / "d_train_000009.bin", np.arange(100))
    with pytest.raises(ValueError, match="cannot resume: shards"):
        DataLoader(tmp_path, 2, 16, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="not a DataLoader state"):
        DataLoader(tmp_path, 2, 16, seed=3).load_state_dict({"epoch": 0})


def test_loader_argument_errors(rng, tmp_path):
    make_shards(rng, tmp_path, [50])
    with pytest.raises(ValueError, match=r"hold 4 rows of T=12; one batch of B=3 on 2 rank\(s\)"):
        DataLoader(tmp_path, 3, 12, world_size=2)
    with pytest.raises(ValueError, match="rank < world_size"):
        DataLoader(tmp_path, 1, 4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size and seq_len"):
        DataLoader(tmp_path, 0, 4)


def test_loader_reads_a_list_a_glob_and_a_shard_changed_underneath(rng, tmp_path):
    paths, _ = make_shards(rng, tmp_path, [300, 300])
    assert DataLoader(paths, 2, 8).files == paths
    assert DataLoader(str(tmp_path / "d_train_*.bin"), 2, 8).files == paths
    loader = DataLoader(paths[:1], 2, 8, shuffle=False)
    write_shard(paths[0], np.arange(200))  # replaced before the loader mapped it
    with pytest.raises(ShardError, match=r"d_train_000000.bin: changed since the loader opened"):
        loader.next_batch()


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 400), min_size=1, max_size=4),
    B=st.integers(1, 4),
    T=st.integers(1, 9),
    W=st.integers(1, 3),
    seed=st.integers(0, 2**31),
)
def test_property_ranks_read_disjoint_valid_windows(tmp_path_factory, sizes, B, T, W, seed):
    d = tmp_path_factory.mktemp("prop")
    arrays = []
    for i, n in enumerate(sizes):
        # Each token encodes (shard, position) so that a window tells where it came from.
        toks = (np.arange(n) % 5000) * 10 + i
        write_shard(d / f"p_{i}.bin", toks)
        arrays.append(toks)
    total_rows = sum(max(0, (n - 1) // T) for n in sizes)
    if total_rows < B * W:
        with pytest.raises(ValueError, match="needs"):
            DataLoader(d, B, T, world_size=W, seed=seed)
        return
    loaders = [DataLoader(d, B, T, rank=r, world_size=W, seed=seed) for r in range(W)]
    starts = []
    for _ in range(loaders[0].batches_per_epoch):
        for ld in loaders:
            x, y = ld.next_batch()
            for xr, yr in zip(x, y):
                shard, pos = int(xr[0] % 10), int(xr[0] // 10)
                assert pos % T == 0
                window = arrays[shard][pos : pos + T + 1]
                assert np.array_equal(xr, window[:-1]) and np.array_equal(yr, window[1:])
                starts.append((shard, pos))
    assert len(set(starts)) == len(starts) == (total_rows // (B * W)) * B * W
    assert HEADER_BYTES == 1024
