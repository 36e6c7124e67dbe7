"""The trainer: loss falls, logs and plots are written, resume is bit-exact, the CLI runs."""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from blutrain.models import GPT2Config, cli, load_checkpoint, prepare
from blutrain.models.bench import bench
from blutrain.models.cli import load_model
from blutrain.models.tokenizer import SHAKESPEARE_FILE
from blutrain.models.train_config import TrainConfig
from blutrain.models.trainer import Trainer, train

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


def metrics(run):
    return [json.loads(line) for line in open(run / "metrics.jsonl")]


def per_step(run, key):
    return {r["step"]: r[key] for r in metrics(run) if key in r and "event" not in r}


def assert_same_run(a, b):
    """Two run directories end with the same weights, optimizer state, step and loader
    position, and logged the same losses, gradient norms and learning rates at every step."""
    ca, cb = load_checkpoint(a / "checkpoint"), load_checkpoint(b / "checkpoint")
    for part in ("weights", "optimizer"):
        ta, tb = getattr(ca, part), getattr(cb, part)
        assert ta.keys() == tb.keys()
        for k in ta:
            assert np.array_equal(ta[k], tb[k]), f"{part} {k} differs after resume"
    for key in ("step", "loader", "optimizer", "schedule"):
        assert ca.trainer[key] == cb.trainer[key], key
    for key in ("loss", "grad_norm", "lr"):
        assert per_step(a, key) == per_step(b, key), key


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_resume_is_bit_exact(tmp_path, data_dir, model_json, grad_accum):
    """Train 3 of 6 steps and resume to 6 == 6 straight: weights, AdamW moments, losses, lr,
    data order (the loader's position), bit for bit."""
    train(config(tmp_path / "a", data_dir, model_json, grad_accum=grad_accum))
    split = config(tmp_path / "b", data_dir, model_json, grad_accum=grad_accum)
    Trainer(split).fit(until=3)
    ck = load_checkpoint(tmp_path / "b" / "run" / "checkpoint")
    assert ck.trainer["step"] == 3 and ck.optimizer
    resumed = Trainer(dataclasses.replace(split, resume=True))
    assert resumed.step == 3
    assert resumed.fit()["steps"] == 6
    assert_same_run(tmp_path / "a" / "run", tmp_path / "b" / "run")
    assert sorted(per_step(tmp_path / "b" / "run", "loss")) == [1, 2, 3, 4, 5, 6]


def test_resume_after_a_crash_drops_the_lost_steps(tmp_path, data_dir, model_json):
    """A run that went on past its last checkpoint and died: the resumed run redoes those
    steps (the metrics of the lost ones are dropped, not duplicated) and ends bit for bit as
    the run that never stopped."""
    train(config(tmp_path / "a", data_dir, model_json))
    run = tmp_path / "b" / "run"
    cfg = config(tmp_path / "b", data_dir, model_json)
    Trainer(cfg).fit(until=2)
    shutil.copytree(run / "checkpoint", tmp_path / "at2")
    Trainer(dataclasses.replace(cfg, resume=True)).fit(until=4)
    shutil.rmtree(run / "checkpoint")  # the crash: steps 3, 4 logged, the checkpoint at 2
    shutil.copytree(tmp_path / "at2", run / "checkpoint")
    Trainer(dataclasses.replace(cfg, resume="auto")).fit()
    assert [r["step"] for r in metrics(run) if "loss" in r] == [1, 2, 3, 4, 5, 6]
    assert_same_run(tmp_path / "a" / "run", run)


def test_extending_a_run_continues_its_schedule(tmp_path, data_dir, model_json, capsys):
    """--resume with a larger --max-steps: the cosine restarts from the learning rate reached,
    down to min_lr at the new end; it never rises. Through the CLI, which keeps every setting
    of the run that is not given again."""
    out = tmp_path / "run"
    flags = ["--data", str(data_dir), "--model", model_json, "--batch-size", "2"]
    flags += ["--seq-len", "16", "--eval-interval", "0", "--sample-interval", "0"]
    flags += ["--warmup-steps", "2", "--no-progress", "--no-plot", "--out-dir", str(out)]
    assert cli.main(["train", *flags, "--max-steps", "4"]) == 0
    # an unfinished run stopped at 4 of 10 (its own schedule), extended to 14
    t = Trainer(config(tmp_path / "u", data_dir, model_json, max_steps=10, warmup_steps=2))
    t.fit(until=4)
    lr_at_4 = t.schedule(4)
    ext = ["--out-dir", str(tmp_path / "u" / "run"), "--resume", "--max-steps", "14"]
    assert cli.main(["train", *ext, "--no-progress"]) == 0
    lrs = per_step(tmp_path / "u" / "run", "lr")
    tail = [lrs[s] for s in range(5, 15)]  # step s ran at schedule(s - 1)
    assert tail[0] == lr_at_4  # continuous: the first extended step keeps the reached lr
    assert all(a >= b for a, b in zip(tail, tail[1:])), tail  # never up
    assert tail[-1] > 3e-4 > tail[-1] * 0.5  # cosine to lr / 10 = 3e-4 at step 14
    # a finished run extended: its schedule has reached min_lr (lr / 10 = 2e-4) at its end and
    # stays there (no jump back up) ...
    assert cli.main(["train", "--out-dir", str(out), "--resume", "--max-steps", "6"]) == 0
    lrs = per_step(out, "lr")
    assert lrs[4] > 2e-4 and [lrs[s] for s in (5, 6)] == [2e-4] * 2
    # ... unless a lower --min-lr asks it to decay further, from where it is
    assert cli.main(["train", "--out-dir", str(out), "--resume", "--max-steps", "9",
                     "--min-lr", "1e-4"]) == 0  # fmt: skip
    lrs = per_step(out, "lr")
    assert lrs[7] == 2e-4 and 2e-4 > lrs[8] > lrs[9] > 1e-4
    s = load_checkpoint(out / "checkpoint").trainer["schedule"]
    assert (s["decay_start"], s["decay_start_lr"], s["max_steps"], s["min_lr"]) == (
        6,
        2e-4,
        9,
        1e-4,
    )
    capsys.readouterr()


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
    with pytest.raises(ValueError, match=r"holds another model: n_embd 16 \(this run: 32\)"):
        Trainer(config(tmp_path, data_dir, model_json, model=str(other), resume=True))


def test_config_errors(tmp_path, data_dir, model_json):
    with pytest.raises(ValueError, match=r"batch_size \(--batch-size\) = 0: must be an int >= 1"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="precision .* = 'fp16': must be one of auto, fp32"):
        TrainConfig(precision="fp16")
    with pytest.raises(ValueError, match="recompute .* = 'all': must be auto, none, gelu"):
        TrainConfig(recompute="all")
    with pytest.raises(ValueError, match="bf16 needs a CUDA device"):
        Trainer(config(tmp_path, data_dir, model_json, precision="bf16", device="cpu"))
    with pytest.raises(ValueError, match="seq_len .* = 64: must be at most the model's block size"):
        Trainer(config(tmp_path, data_dir, model_json, seq_len=64))
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        Trainer(config(tmp_path, data_dir, model_json, data=str(tmp_path / "nope")))
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"batch_sise": 3}))
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['batch_sise'\]"):
        TrainConfig.from_json(bad)


def run_cli(argv):
    return cli.main(argv)


def test_cli_commands(tmp_path, data_dir, model_json, capsys):
    assert [c.name for c in cli.COMMANDS] == ["prepare", "train", "sample", "eval", "bench"]
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
            "--warmup-steps",
            "1",
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
                "warmup_steps": 1,
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
        "import sys; import blutrain.tensor as bt; from blutrain.models.device import "
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


def test_cli_errors_are_clear(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run_cli(["sample", "-n", "2"]) == 2
    assert "run `blutrain train` first" in capsys.readouterr().err
    assert run_cli(["eval", "--checkpoint", str(tmp_path / "none")]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err
    assert run_cli(["bench", "--model", "gpt5"]) == 2
    assert "unknown model 'gpt5'" in capsys.readouterr().err


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
