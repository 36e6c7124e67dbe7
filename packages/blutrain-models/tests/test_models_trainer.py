"""The trainer: loss falls, logs and plots are written, resume is bit-exact, the CLI runs."""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
import pytest

bt = pytest.importorskip("blutrain.tensor")

from blutrain.models import GPT2Config, load_checkpoint, prepare  # noqa: E402
from blutrain.models.tokenizer import SHAKESPEARE_FILE  # noqa: E402
from blutrain.models.trainer import (  # noqa: E402
    TrainConfig,
    Trainer,
    add_commands,
    bench,
    commands,
    load_model,
    train,
)

SMALL = GPT2Config(block_size=32, n_layer=1, n_head=2, n_embd=16)  # GPT-2's vocabulary


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    text = d / "shakespeare.txt"
    text.write_text(SHAKESPEARE_FILE.read_text()[:60_000])
    prepare([text], d / "shards", val_fraction=0.1, doc_split="paragraph")
    return d / "shards"


@pytest.fixture(scope="module")
def model_json(tmp_path_factory):
    p = tmp_path_factory.mktemp("cfg") / "small.json"
    SMALL.to_json(p)
    return str(p)


def config(tmp_path, data_dir, model_json, **kw):
    base = dict(
        model=model_json,
        data=str(data_dir),
        batch_size=4,
        seq_len=32,
        max_steps=6,
        lr=3e-3,
        warmup_steps=2,
        eval_interval=3,
        eval_batches=2,
        sample_interval=0,
        out_dir=str(tmp_path / "run"),
        progress=False,
        plot=False,
        log_interval=0,
    )
    base.update(kw)
    return TrainConfig(**base)


def final_weights(out_dir):
    return load_checkpoint(out_dir / "checkpoint").weights


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_resume_is_bit_exact(tmp_path, data_dir, model_json, grad_accum):
    full = config(tmp_path / "a", data_dir, model_json, grad_accum=grad_accum)
    sa = train(full)
    assert sa["steps"] == 6
    split = config(tmp_path / "b", data_dir, model_json, grad_accum=grad_accum)
    Trainer(split).fit(until=3)
    ck = load_checkpoint(tmp_path / "b" / "run" / "checkpoint")
    assert ck.trainer["step"] == 3 and ck.optimizer
    resumed = Trainer(
        config(tmp_path / "b", data_dir, model_json, grad_accum=grad_accum, resume=True)
    )
    assert resumed.step == 3
    sb = resumed.fit()
    assert sb["steps"] == 6
    wa, wb = final_weights(tmp_path / "a" / "run"), final_weights(tmp_path / "b" / "run")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert np.array_equal(wa[k], wb[k]), f"{k} differs after resume"
    oa = load_checkpoint(tmp_path / "a" / "run" / "checkpoint").optimizer
    ob = load_checkpoint(tmp_path / "b" / "run" / "checkpoint").optimizer
    for k in oa:
        assert np.array_equal(oa[k], ob[k]), k

    def losses(path):
        recs = [json.loads(line) for line in open(path / "run" / "metrics.jsonl")]
        return {r["step"]: r["loss"] for r in recs if "loss" in r}

    la, lb = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert la == lb and sorted(la) == [1, 2, 3, 4, 5, 6]


def test_loss_falls_and_logs_are_written(tmp_path, data_dir, model_json):
    cfg = config(
        tmp_path,
        data_dir,
        model_json,
        max_steps=30,
        lr=1e-2,
        eval_interval=10,
        sample_interval=15,
        sample_tokens=8,
        plot=True,
        log_interval=10,
    )
    s = train(cfg)
    assert s["first_loss"] > 10.0  # ~ln(50257) at init
    assert s["final_loss"] < s["first_loss"] - 2.0, s
    assert s["val_loss"] < 9.0
    assert s["tokens_per_s"] > 0
    out = tmp_path / "run"
    recs = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert recs[0]["event"] == "start" and recs[-1]["event"] == "end"
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    for key in ("lr", "grad_norm", "tokens_per_s", "mem_bytes", "dt_ms"):
        assert all(np.isfinite(r[key]) for r in steps), key
    vals = [r for r in recs if "val_loss" in r and "event" not in r]
    assert [r["step"] for r in vals] == [0, 10, 20, 30]
    samples = [r for r in recs if "sample" in r]
    assert [r["step"] for r in samples] == [15, 30] and all(
        isinstance(r["sample"], str) for r in samples
    )
    png = out / "loss.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the lr followed the schedule: warmup, then down
    lrs = [r["lr"] for r in steps]
    assert lrs[0] < lrs[1] == pytest.approx(1e-2) and lrs[-1] < lrs[2]
    # load_model reads the run directory's checkpoint
    m = load_model(str(out))
    assert m.config == dataclasses.replace(SMALL, vocab_multiple=128)  # TrainConfig's default


def test_resume_refuses_another_model(tmp_path, data_dir, model_json):
    Trainer(config(tmp_path, data_dir, model_json)).fit(until=1)
    other = tmp_path / "other.json"
    GPT2Config(block_size=32, n_layer=1, n_head=2, n_embd=32).to_json(other)
    with pytest.raises(ValueError, match="differs from this run"):
        Trainer(config(tmp_path, data_dir, model_json, model=str(other), resume=True))


def test_config_errors(tmp_path, data_dir, model_json):
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="precision 'fp16' is not one of"):
        TrainConfig(precision="fp16")
    with pytest.raises(ValueError, match="recompute 'all' is not one of"):
        TrainConfig(recompute="all")
    with pytest.raises(ValueError, match="bf16 needs a CUDA device"):
        Trainer(config(tmp_path, data_dir, model_json, precision="bf16", device="cpu"))
    with pytest.raises(ValueError, match="seq_len 64 is longer than the model's block size 32"):
        Trainer(config(tmp_path, data_dir, model_json, seq_len=64))
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        Trainer(config(tmp_path, data_dir, model_json, data=str(tmp_path / "nope")))
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"batch_sise": 3}))
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['batch_sise'\]"):
        TrainConfig.from_json(bad)


def run_cli(argv):
    parser = argparse.ArgumentParser(prog="blutrain")
    sub = parser.add_subparsers(dest="command")
    add_commands(sub)
    args = parser.parse_args(argv)
    return args._run(args)


def test_cli_commands(tmp_path, data_dir, model_json, capsys):
    assert [c.name for c in commands()] == ["train", "sample", "eval", "bench"]
    out = tmp_path / "cli"
    rc = run_cli(
        [
            "train",
            "--model",
            model_json,
            "--data",
            str(data_dir),
            "--batch-size",
            "2",
            "--seq-len",
            "16",
            "--max-steps",
            "3",
            "--eval-interval",
            "0",
            "--sample-interval",
            "0",
            "--out-dir",
            str(out),
            "--no-progress",
            "--no-plot",
        ]
    )
    assert rc == 0
    assert load_checkpoint(out / "checkpoint").trainer["step"] == 3
    capsys.readouterr()
    assert (
        run_cli(
            [
                "sample",
                "--checkpoint",
                str(out),
                "--prompt",
                "ROMEO:",
                "-n",
                "5",
                "--seed",
                "1",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    first = capsys.readouterr().out
    assert first.startswith("ROMEO:")
    run_cli(["sample", "--checkpoint", str(out), "--prompt", "ROMEO:", "-n", "5", "--seed", "1"])
    assert capsys.readouterr().out == first  # seeded: the same text again
    assert (
        run_cli(
            [
                "eval",
                "--checkpoint",
                str(out / "checkpoint"),
                "--data",
                str(data_dir),
                "--batch-size",
                "2",
                "--seq-len",
                "16",
                "--batches",
                "3",
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out)
    assert res["batches"] == 3 and 0 < res["loss"] < 12
    js = tmp_path / "bench.json"
    assert (
        run_cli(
            [
                "bench",
                "--model",
                model_json,
                "--batch-size",
                "2",
                "--seq-len",
                "16",
                "--steps",
                "2",
                "--warmup",
                "1",
                "--json",
                str(js),
            ]
        )
        == 0
    )
    r = json.loads(js.read_text())
    assert r["tokens_per_s"] > 0 and r["peak_mem_bytes"] > 0 and r["steps"] == 2
    # a config file, with flags overriding it
    cfgfile = tmp_path / "train.json"
    cfgfile.write_text(
        json.dumps(
            {
                "model": model_json,
                "data": str(data_dir),
                "batch_size": 2,
                "seq_len": 16,
                "max_steps": 50,
                "eval_interval": 0,
                "sample_interval": 0,
                "progress": False,
                "plot": False,
                "out_dir": str(tmp_path / "cfgrun"),
            }
        )
    )
    assert run_cli(["train", "--config", str(cfgfile), "--max-steps", "2"]) == 0
    assert load_checkpoint(tmp_path / "cfgrun" / "checkpoint").trainer["step"] == 2


def test_bench_function(model_json):
    r = bench(model_json, batch_size=2, seq_len=8, steps=2, warmup=0, device="cpu")
    assert r["device"] == "cpu" and r["tokens_per_s"] > 0 and r["mfu"] is None
    assert r["cuda_graph"] is False
    with pytest.raises(ValueError, match=r"\[bench\] cuda_graph needs a CUDA device, not cpu"):
        bench(model_json, batch_size=2, seq_len=8, steps=1, device="cpu", cuda_graph=True)


def test_set_threads_sets_the_one_budget():
    """Auto threads: every CPU the process may use, unless OMP_NUM_THREADS is set; explicit n
    wins, before or after blutrain.tensor is imported; the BLAS follows the budget."""
    import os
    import subprocess
    import sys

    code = (
        "import sys; import blutrain.tensor as bt; from blutrain.models.trainer import "
        "set_threads, threads_note; n = set_threads(int(sys.argv[1])); "
        "import blutrain.linalg as la; "
        "print(n, bt.get_num_threads(), la.get_option('num_threads'), repr(threads_note('cpu')))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}

    def run(arg, **extra):
        out = subprocess.run(
            [sys.executable, "-c", code, str(arg)],
            env={**env, **extra},
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip().split(maxsplit=3)

    import blutrain.tensor as bt

    cpus = bt.available_cpus()
    assert run(0) == [str(cpus)] * 3 + [
        repr(f", {cpus} thread{'s' * (cpus > 1)} of {cpus} CPU{'s' * (cpus > 1)}")
    ]
    assert run(0, OMP_NUM_THREADS="3")[:3] == ["3", "3", "3"]
    assert run(2, OMP_NUM_THREADS="3")[:3] == ["2", "2", "2"]
    assert run(1)[3] == repr(f", 1 thread of {cpus} CPU{'s' * (cpus > 1)}")


def test_cli_errors_are_clear(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="run `blutrain train` first"):
        run_cli(["sample", "-n", "2"])
    with pytest.raises(FileNotFoundError, match="no such checkpoint directory"):
        run_cli(["eval", "--checkpoint", str(tmp_path / "none")])
    with pytest.raises(ValueError, match="unknown model 'gpt5'"):
        run_cli(["bench", "--model", "gpt5"])


def test_init_from_hugging_face(tmp_path, data_dir, model_json):
    """Fine-tuning starts from the HF weights: the first loss is the HF model's loss."""
    from blutrain.models import GPT2

    src = GPT2(SMALL)
    src.save_pretrained(tmp_path / "hf")
    t = Trainer(config(tmp_path, data_dir, model_json, init_from=str(tmp_path / "hf")))
    assert t.model.config == dataclasses.replace(SMALL, vocab_multiple=128)
    x, y = t.train_loader.next_batch()
    t.train_loader.reset()
    expected = float(src(x, y)[1].item())
    m = t.train_step()
    assert m["loss"] == pytest.approx(expected, rel=1e-6)
