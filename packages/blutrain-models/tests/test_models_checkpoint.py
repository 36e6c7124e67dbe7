"""Checkpoints: atomic safetensors + JSON directories, and their errors."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from blutrain.models import CheckpointError, load_checkpoint, save_checkpoint
from blutrain.models import checkpoint as ckpt_mod
from blutrain.models.checkpoint import check_tensors, load_safetensors


def random_state(rng):
    weights = {
        "transformer.wte.weight": rng.standard_normal((37, 8)).astype(np.float32),
        "transformer.h.0.attn.c_attn.weight": rng.standard_normal((24, 8)).astype(np.float32),
        "scalar": np.asarray(rng.standard_normal(), dtype=np.float64),
        "half": rng.standard_normal(5).astype(np.float16),
        "ids": rng.integers(-(2**40), 2**40, size=(3, 2)),
        "mask": rng.random(6) < 0.5,
        "bytes": rng.integers(0, 255, size=4, dtype=np.uint8),
        "empty": np.zeros((0, 3), dtype=np.float32),
    }
    optimizer = {
        f"exp_avg/{k}": rng.standard_normal(v.shape).astype(np.float32)
        for k, v in weights.items()
        if v.dtype == np.float32
    }
    gen = np.random.default_rng(int(rng.integers(2**32)))
    gen.random(int(rng.integers(1, 100)))
    trainer = {
        "step": int(rng.integers(10**6)),
        "lr": float(rng.random()),
        "config": {"n_layer": 2},
        "rng": gen.bit_generator.state,
        "loss_history": [float(v) for v in rng.random(3)],
    }
    return weights, optimizer, trainer, gen


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert np.array_equal(a[k], b[k]), k


def test_round_trip_is_exact(rng, tmp_path):
    weights, optimizer, trainer, gen = random_state(rng)
    path = save_checkpoint(tmp_path / "ckpt", weights, optimizer, trainer)
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json",
        "model.safetensors",
        "optimizer.safetensors",
        "trainer.json",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing temporary left
    ck = load_checkpoint(path, expected_weights=weights, expected_optimizer=optimizer)
    assert_same(ck.weights, weights)
    assert_same(ck.optimizer, optimizer)
    assert ck.trainer == trainer
    # The RNG state resumes the same stream, bit for bit.
    restored = np.random.default_rng()
    restored.bit_generator.state = ck.trainer["rng"]
    assert np.array_equal(restored.random(10), gen.random(10))


def test_weights_only_and_dlpack_inputs(rng, tmp_path):
    class OnlyDLPack:  # what a tensor library hands over: __dlpack__ and nothing numpy
        def __init__(self, a):
            self._a = a

        def __dlpack__(self, **kw):
            return self._a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self._a.__dlpack_device__()

    a = rng.standard_normal((4, 3)).astype(np.float32)
    save_checkpoint(tmp_path / "c", {"w": OnlyDLPack(a), "v": a[:, 1]})  # strided view too
    ck = load_checkpoint(tmp_path / "c")
    assert np.array_equal(ck.weights["w"], a) and np.array_equal(ck.weights["v"], a[:, 1])
    assert ck.optimizer is None and ck.trainer is None


def test_overwrite_replaces_the_whole_directory(rng, tmp_path):
    w1, o1, t1, _ = random_state(rng)
    save_checkpoint(tmp_path / "c", w1, o1, t1)
    w2 = {"only": rng.standard_normal(3).astype(np.float32)}
    save_checkpoint(tmp_path / "c", w2)
    ck = load_checkpoint(tmp_path / "c")
    assert_same(ck.weights, w2)
    assert ck.optimizer is None and not (tmp_path / "c" / "optimizer.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_a_crash_while_saving_leaves_the_previous_checkpoint(rng, tmp_path, monkeypatch):
    w1, o1, t1, _ = random_state(rng)
    save_checkpoint(tmp_path / "c", w1, o1, t1)
    real = ckpt_mod.save_safetensors
    calls = []

    def crash_on_second_file(path, tensors, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            real(path, tensors, metadata)
            raise KeyboardInterrupt("killed while writing the optimizer")
        real(path, tensors, metadata)

    monkeypatch.setattr(ckpt_mod, "save_safetensors", crash_on_second_file)
    w2, o2, t2, _ = random_state(rng)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "c", w2, o2, t2)
    ck = load_checkpoint(tmp_path / "c", expected_weights=w1)
    assert_same(ck.weights, w1) and ck.trainer == t1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_not_json_trainer_state_is_refused_before_writing(tmp_path):
    with pytest.raises(TypeError, match="trainer state is not JSON-serializable"):
        save_checkpoint(tmp_path / "c", {"w": np.zeros(2)}, trainer={"x": object()})
    assert not (tmp_path / "c").exists()


# -- damaged checkpoints -------------------------------------------------------------------------


@pytest.fixture
def saved(rng, tmp_path):
    weights, optimizer, trainer, _ = random_state(rng)
    return save_checkpoint(tmp_path / "ck", weights, optimizer, trainer), weights


def test_missing_directory_and_files(saved, tmp_path):
    path, _ = saved
    with pytest.raises(FileNotFoundError, match=r"nowhere: no such checkpoint directory"):
        load_checkpoint(tmp_path / "nowhere")
    (path / "optimizer.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"optimizer.safetensors: missing \(listed in"):
        load_checkpoint(path)
    (path / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"manifest.json: missing"):
        load_checkpoint(path)


def test_truncated_file(saved):
    path, _ = saved
    f = path / "model.safetensors"
    size = f.stat().st_size
    os.truncate(f, size - 7)
    with pytest.raises(
        CheckpointError,
        match=rf"model.safetensors: truncated: {size - 7} bytes, "
        rf"expected {size}",
    ):
        load_checkpoint(path, verify_hash=False)


def test_flipped_byte_is_found_by_the_hash(saved):
    path, _ = saved
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x40
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model.safetensors: corrupt: sha256 differs"):
        load_checkpoint(path)


def test_corrupt_manifest_and_trainer(saved):
    path, _ = saved
    (path / "trainer.json").write_text('{"step": 1')
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["trainer.json"]["bytes"] = (path / "trainer.json").stat().st_size
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"trainer.json: corrupt"):
        load_checkpoint(path, verify_hash=False)
    (path / "manifest.json").write_text("{broken")
    with pytest.raises(CheckpointError, match=r"manifest.json: corrupt JSON"):
        load_checkpoint(path)
    (path / "manifest.json").write_text('{"format": "blutrain-checkpoint", "version": 99}')
    with pytest.raises(CheckpointError, match=r"version 99, expected 1"):
        load_checkpoint(path)


def test_shape_dtype_and_name_mismatches_name_the_tensor(saved):
    path, weights = saved
    exp = dict(weights)
    exp["transformer.wte.weight"] = np.zeros((38, 8), np.float32)
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors: tensor "
        r"'transformer.wte.weight' has shape \(37, 8\), expected \(38, 8\)",
    ):
        load_checkpoint(path, expected_weights=exp)
    exp = dict(weights, half=np.zeros(5, np.float32))
    with pytest.raises(CheckpointError, match=r"'half' has dtype float16, expected float32"):
        load_checkpoint(path, expected_weights=exp)
    exp = dict(weights, extra=np.zeros(1))
    with pytest.raises(CheckpointError, match=r"tensor 'extra' is missing"):
        load_checkpoint(path, expected_weights=exp)
    exp = {k: v for k, v in weights.items() if k != "mask"}
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\) \['mask'\]"):
        load_checkpoint(path, expected_weights=exp)
    load_checkpoint(path, expected_weights=exp, strict=False)
    # (shape, dtype) specs work too, dtype None meaning any.
    check_tensors({"a": np.zeros((2, 3))}, {"a": ((2, 3), None)}, "x")


def test_raw_safetensors_errors(rng, tmp_path):
    good = tmp_path / "g.safetensors"
    ckpt_mod.save_safetensors(good, {"a": rng.standard_normal((10, 10)).astype(np.float32)})
    data = good.read_bytes()
    (tmp_path / "t.safetensors").write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=r"t.safetensors: truncated: tensors need \d+ bytes"):
        load_safetensors(tmp_path / "t.safetensors")
    (tmp_path / "h.safetensors").write_bytes(data[:20])
    with pytest.raises(CheckpointError, match=r"h.safetensors: truncated or corrupt: header"):
        load_safetensors(tmp_path / "h.safetensors")
    (tmp_path / "z.safetensors").write_bytes(b"\x03")
    with pytest.raises(CheckpointError, match=r"z.safetensors: truncated: 1 bytes"):
        load_safetensors(tmp_path / "z.safetensors")
    bad = bytearray(data)
    bad[9] = ord("#")  # inside the JSON header
    (tmp_path / "j.safetensors").write_bytes(bytes(bad))
    with pytest.raises(CheckpointError, match=r"j.safetensors: corrupt"):
        load_safetensors(tmp_path / "j.safetensors")
    with pytest.raises(FileNotFoundError, match="none.safetensors"):
        load_safetensors(tmp_path / "none.safetensors")


def test_bf16_safetensors_load_as_exact_float32(rng, tmp_path):
    # Hugging Face checkpoints are often bf16; numpy has no bf16, so we upcast (exactly).
    bits = rng.integers(0, 2**16, size=(4, 6), dtype=np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] = 0x3F80  # no inf/nan: compare values
    header = json.dumps(
        {
            "w": {"dtype": "BF16", "shape": [4, 6], "data_offsets": [0, 48]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [48, 56]},
        }
    ).encode()
    b = np.array([1.5, -2.0], np.float32)
    path = tmp_path / "bf16.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bits.tobytes() + b.tobytes())
    out = load_safetensors(path)
    want = (bits.astype(np.uint32) << 16).view(np.float32)
    assert out["w"].dtype == np.float32 and np.array_equal(out["w"], want)
    assert np.array_equal(out["b"], b)


def test_an_exception_between_the_two_renames_puts_the_old_one_back(rng, tmp_path, monkeypatch):
    from blutrain.models import _io

    w1 = {"a": rng.standard_normal(4).astype(np.float32)}
    save_checkpoint(tmp_path / "c", w1)
    real = os.replace
    calls = []

    def second_rename_fails(src, dst):
        calls.append(dst)
        if len(calls) == 2:  # the first moved the old checkpoint aside
            raise OSError("disk went away")
        return real(src, dst)

    monkeypatch.setattr(_io.os, "replace", second_rename_fails)
    with pytest.raises(OSError, match="disk went away"):
        save_checkpoint(tmp_path / "c", {"a": np.zeros(4, np.float32)})
    monkeypatch.setattr(_io.os, "replace", real)
    assert_same(load_checkpoint(tmp_path / "c").weights, w1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_a_kill_between_the_renames_is_reported_and_healed(rng, tmp_path):
    w1 = {"a": rng.standard_normal(4).astype(np.float32)}
    save_checkpoint(tmp_path / "c", w1)
    # The state a SIGKILL between the two renames leaves: previous checkpoint set aside, a
    # complete new one still under its temporary name.
    (tmp_path / "c.old-x1").mkdir()
    os.replace(tmp_path / "c", tmp_path / "c.old-x1" / "c")
    (tmp_path / ".c.abc.tmp").mkdir()
    with pytest.raises(FileNotFoundError, match=r"interrupted: see \['c.old-x1'\]"):
        load_checkpoint(tmp_path / "c")
    w2 = {"a": rng.standard_normal(4).astype(np.float32)}
    save_checkpoint(tmp_path / "c", w2)
    assert_same(load_checkpoint(tmp_path / "c").weights, w2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


KILL_SCRIPT = """
import sys, numpy as np
from blutrain.models import save_checkpoint
path = sys.argv[1]
versions = [{"w": np.full((512, 1024), float(v), np.float32)} for v in range(2)]
print("ready", flush=True)
i = 0
while True:
    save_checkpoint(path, versions[i % 2], trainer={"version": i % 2})
    i += 1
"""


@pytest.mark.slow
def test_sigkill_at_a_random_moment_never_leaves_a_half_checkpoint(rng, tmp_path):
    import signal
    import subprocess
    import sys
    import time

    path = tmp_path / "ck"
    for _ in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", KILL_SCRIPT, str(path)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(float(rng.uniform(0.2, 0.8)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        try:
            ck = load_checkpoint(path)
        except FileNotFoundError as e:
            # killed between the renames (the old one is aside, named in the message), or, on a
            # slow machine, before the first save completed (no checkpoint was ever there)
            assert ".old-" in str(e) or not path.exists(), str(e)
            save_checkpoint(
                path, {"w": np.full((512, 1024), 0.0, np.float32)}, trainer={"version": 0}
            )
            ck = load_checkpoint(path)
        v = ck.trainer["version"]
        assert np.array_equal(ck.weights["w"], np.full((512, 1024), float(v), np.float32))
