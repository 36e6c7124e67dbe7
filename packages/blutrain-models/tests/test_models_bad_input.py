"""Every bad input a user can hit through the `blutrain` command, answered cleanly.

Each case runs the command in-process on a shared small world (token shards, model configs, a
run stopped half-way, a finished run, checkpoints damaged in every way) and asserts: exit status
2, one line on stderr that starts `blutrain VERB: error:` and names what was wrong (the
fragments listed), no traceback, and every file and directory of the world byte for byte as it
was (sha256 of each). A missing or too old blutrain-tensor and a bad BLUTRAIN_ALLOC_CONF run in
subprocesses, every verb that needs the tensor library in each.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from blutrain.models import GPT2Config, cli, prepare, save_checkpoint
from blutrain.models._tensor import REQUIRED_API_LEVEL
from blutrain.models.data import write_shard
from blutrain.models.tokenizer import SHAKESPEARE_FILE
from blutrain.models.train_config import TrainConfig
from blutrain.models.trainer import Trainer

SMALL = GPT2Config(block_size=32, n_layer=1, n_head=2, n_embd=16)


def _fit(out: Path, data: Path, model: Path, max_steps: int, until: int) -> None:
    cfg = TrainConfig(
        model=str(model),
        data=str(data),
        batch_size=2,
        seq_len=16,
        max_steps=max_steps,
        warmup_steps=1,
        eval_interval=0,
        sample_interval=0,
        log_interval=0,
        progress=False,
        plot=False,
        out_dir=str(out),
    )
    t = Trainer(cfg)
    t.fit(until=until)
    t.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    w = tmp_path_factory.mktemp("world")
    text = w / "text.txt"
    text.write_text(SHAKESPEARE_FILE.read_text()[:30_000])
    prepare([text], w / "data", val_fraction=0.1, doc_split="paragraph")
    SMALL.to_json(w / "model.json")
    GPT2Config(block_size=32, n_layer=1, n_head=2, n_embd=32).to_json(w / "wide.json")
    _fit(w / "half", w / "data", w / "model.json", max_steps=4, until=2)  # resumable
    _fit(w / "done", w / "data", w / "model.json", max_steps=2, until=2)  # finished
    (w / "empty").mkdir()
    (w / "empty_data").mkdir()
    (w / "zero_shard").mkdir()
    write_shard(w / "zero_shard" / "x_train_000000.bin", np.zeros(0, np.uint16))
    (w / "val_only").mkdir()
    shutil.copy(next((w / "data").glob("*_val_*.bin")), w / "val_only")
    (w / "cut_shard").mkdir()
    src = next((w / "data").glob("*_train_*.bin"))
    (w / "cut_shard" / src.name).write_bytes(src.read_bytes()[:-10])
    (w / "metrics_only").mkdir()
    (w / "metrics_only" / "metrics.jsonl").write_text('{"event": "start"}\n')
    # a checkpoint of a 97-token model: GPT-2's tokens of a prompt fall outside it
    from blutrain.models.gpt2 import GPT2

    tiny_vocab = GPT2Config(block_size=16, vocab_size=97, n_layer=1, n_head=1, n_embd=8)
    m = GPT2(tiny_vocab)
    save_checkpoint(w / "vocab97", m.state_dict(), trainer={"model_config": tiny_vocab.to_dict()})
    (w / "bad.json").write_text("{not json")
    (w / "list.json").write_text("[1, 2]")
    for name, fields in {
        "unknown.json": {"batch_sise": 8},
        "strtype.json": {"batch_size": "8"},
        "booltype.json": {"max_steps": True},
        "nulllr.json": {"lr": None},
        "range.json": {"warmup_steps": -1},
    }.items():
        (w / name).write_text(json.dumps(fields))
    return w


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file, and every directory, under root."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = "dir"
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


# -- checkpoint damage: each copies the half-way run and damages its copy ------------------------


def _manifest(ck: Path) -> dict:
    return json.loads((ck / "manifest.json").read_text())


def _rehash(ck: Path, name: str) -> None:
    """Record `name`'s new size and hash in the manifest (damage the manifest cannot see)."""
    m = _manifest(ck)
    data = (ck / name).read_bytes()
    m["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ck / "manifest.json").write_text(json.dumps(m))


def _edit_manifest(fn: Callable[[dict], object]) -> Callable[[Path], None]:
    def edit(ck: Path) -> None:
        m = _manifest(ck)
        fn(m)
        (ck / "manifest.json").write_text(json.dumps(m))

    return edit


def _edit_trainer(fn: Callable[[dict], object]) -> Callable[[Path], None]:
    def edit(ck: Path) -> None:
        t = json.loads((ck / "trainer.json").read_text())
        fn(t)
        (ck / "trainer.json").write_text(json.dumps(t))
        _rehash(ck, "trainer.json")

    return edit


def _flip_byte(name: str, at: int) -> Callable[[Path], None]:
    def edit(ck: Path) -> None:
        data = bytearray((ck / name).read_bytes())
        data[at] ^= 0xFF
        (ck / name).write_bytes(bytes(data))

    return edit


def _truncate(name: str) -> Callable[[Path], None]:
    def edit(ck: Path) -> None:
        data = (ck / name).read_bytes()
        (ck / name).write_bytes(data[: len(data) // 2])

    return edit


def _drop_optimizer_tensor(ck: Path) -> None:
    from safetensors.numpy import load_file, save_file

    t = load_file(str(ck / "optimizer.safetensors"))
    t.pop(sorted(t)[0])
    save_file(t, str(ck / "optimizer.safetensors"))
    _rehash(ck, "optimizer.safetensors")


def _nan_weight(ck: Path) -> None:
    from safetensors.numpy import load_file, save_file

    t = load_file(str(ck / "model.safetensors"))
    t["transformer.ln_f.weight"][0] = np.nan
    save_file(t, str(ck / "model.safetensors"))
    _rehash(ck, "model.safetensors")


DAMAGE: dict[str, tuple[Callable[[Path], None], list[str]]] = {
    "manifest-not-json": (
        lambda ck: (ck / "manifest.json").write_text("{oops"),
        ["manifest.json: corrupt JSON"],
    ),
    "manifest-truncated": (_truncate("manifest.json"), ["manifest.json: corrupt JSON"]),
    "manifest-missing": (lambda ck: (ck / "manifest.json").unlink(), ["manifest.json: missing"]),
    "manifest-not-object": (
        lambda ck: (ck / "manifest.json").write_text("[]"),
        ["manifest.json: format is not"],
    ),
    "manifest-wrong-format": (
        _edit_manifest(lambda m: m.update(format="zip")),
        ["format is not 'blutrain-checkpoint'"],
    ),
    "manifest-wrong-version": (_edit_manifest(lambda m: m.update(version=99)), ["version 99"]),
    "manifest-no-files": (_edit_manifest(lambda m: m.pop("files")), ["'files' is not a JSON"]),
    "manifest-files-list": (
        _edit_manifest(lambda m: m.update(files=["model.safetensors"])),
        ["'files' is not a JSON object"],
    ),
    "manifest-entry-no-hash": (
        _edit_manifest(lambda m: m["files"]["model.safetensors"].pop("sha256")),
        ["entry of model.safetensors", "sha256"],
    ),
    "manifest-bytes-string": (
        _edit_manifest(lambda m: m["files"]["trainer.json"].update(bytes="12")),
        ["entry of trainer.json"],
    ),
    "manifest-unknown-file": (
        _edit_manifest(lambda m: m["files"].update({"../evil": m["files"]["trainer.json"]})),
        ["lists '../evil'"],
    ),
    "manifest-no-weights": (
        _edit_manifest(lambda m: m["files"].pop("model.safetensors")),
        ["lists no model.safetensors"],
    ),
    "weights-flipped-byte": (_flip_byte("model.safetensors", -5), ["model.safetensors: corrupt"]),
    "weights-truncated": (_truncate("model.safetensors"), ["model.safetensors: truncated"]),
    "weights-missing": (
        lambda ck: (ck / "model.safetensors").unlink(),
        ["model.safetensors: missing"],
    ),
    "weights-nan": (_nan_weight, ["transformer.ln_f.weight", "NaN"]),
    "optimizer-flipped-byte": (
        _flip_byte("optimizer.safetensors", -3),
        ["optimizer.safetensors: corrupt"],
    ),
    "optimizer-tensor-missing": (_drop_optimizer_tensor, ["[AdamW] load_state_dict", "missing"]),
    "trainer-not-json": (
        lambda ck: ((ck / "trainer.json").write_text("{"), _rehash(ck, "trainer.json")),
        ["trainer.json: cannot read it", "intact checkpoint"],
    ),
    "trainer-no-step": (_edit_trainer(lambda t: t.pop("step")), ["'step' is missing"]),
    "trainer-step-string": (_edit_trainer(lambda t: t.update(step="2")), ["'step' is '2'"]),
    "trainer-step-negative": (_edit_trainer(lambda t: t.update(step=-1)), ["step is -1"]),
    "trainer-no-loader": (_edit_trainer(lambda t: t.pop("loader")), ["'loader' is missing"]),
    "trainer-bad-loader": (
        _edit_trainer(lambda t: t["loader"].update(rows_consumed="x")),
        ["DataLoader", "rows_consumed"],
    ),
    "trainer-bad-model-config": (
        _edit_trainer(lambda t: t["model_config"].update(n_head=3)),
        ["model_config", "divisible"],
    ),
    "trainer-bad-optimizer-meta": (
        _edit_trainer(lambda t: t["optimizer"].update(hyperparameters=5)),
        ["[AdamW] load_state_dict: not an AdamW state"],
    ),
    "trainer-bad-schedule": (
        _edit_trainer(lambda t: t["schedule"].pop("max_lr")),
        ["not a schedule state"],
    ),
    "trainer-bad-history": (
        _edit_trainer(lambda t: t["history"].update(train=[["a", 1.0]])),
        ["history.train"],
    ),
}


@dataclass
class Case:
    id: str
    argv: list[str]  # {w}: the world directory
    expect: list[str]  # fragments of the one error line
    damage: str | None = None  # a DAMAGE entry, applied to a copy of the half-way run at {ck}


TRAIN = ["train", "--data", "{w}/data", "--model", "{w}/model.json", "--seq-len", "16"]
TRAIN_NEW = [*TRAIN, "--out-dir", "{w}/empty/new"]
RESUME = [*TRAIN, "--out-dir", "{ck}", "--resume"]

CASES = [
    # --config and flag values, every kind of field
    Case("batch-size-0", [*TRAIN_NEW, "--batch-size", "0"], ["batch_size", "= 0", "int >= 1"]),
    Case("batch-size-neg", [*TRAIN_NEW, "--batch-size", "-3"], ["batch_size", "= -3"]),
    Case("batch-size-text", [*TRAIN_NEW, "--batch-size", "abc"], ["--batch-size", "'abc'"]),
    Case("seq-len-0", [*TRAIN_NEW, "--seq-len", "0"], ["seq_len", "= 0", "int >= 1"]),
    Case("seq-len-over-block", [*TRAIN_NEW, "--seq-len", "64"], ["seq_len", "block size 32"]),
    Case("grad-accum-0", [*TRAIN_NEW, "--grad-accum", "0"], ["grad_accum", "= 0"]),
    Case("max-steps-0", [*TRAIN_NEW, "--max-steps", "0"], ["max_steps", "= 0"]),
    Case("lr-0", [*TRAIN_NEW, "--lr", "0"], ["lr (--lr) = 0", "> 0"]),
    Case("lr-neg", [*TRAIN_NEW, "--lr", "-0.001"], ["lr (--lr) = -0.001", "> 0"]),
    Case("lr-nan", [*TRAIN_NEW, "--lr", "nan"], ["lr (--lr) = nan", "finite"]),
    Case(
        "min-lr-over-lr", [*TRAIN_NEW, "--lr", "1e-3", "--min-lr", "1e-2"], ["min_lr", "at most lr"]
    ),
    Case("min-lr-neg", [*TRAIN_NEW, "--min-lr", "-1"], ["min_lr", ">= 0"]),
    Case(
        "warmup-over-run",
        [*TRAIN_NEW, "--max-steps", "10", "--warmup-steps", "50"],
        ["warmup_steps", "= 50", "at most max_steps (10)"],
    ),
    Case("warmup-neg", [*TRAIN_NEW, "--warmup-steps", "-2"], ["warmup_steps", "= -2"]),
    Case("beta1-1", [*TRAIN_NEW, "--beta1", "1"], ["beta1", "< 1"]),
    Case("beta2-neg", [*TRAIN_NEW, "--beta2", "-0.1"], ["beta2", ">= 0"]),
    Case("weight-decay-neg", [*TRAIN_NEW, "--weight-decay", "-1"], ["weight_decay", ">= 0"]),
    Case("grad-clip-neg", [*TRAIN_NEW, "--grad-clip", "-1"], ["grad_clip", ">= 0"]),
    Case("precision", [*TRAIN_NEW, "--precision", "fp16"], ["precision", "'fp16'", "bf16"]),
    Case("bf16-on-cpu", [*TRAIN_NEW, "--device", "cpu", "--precision", "bf16"], ["bf16 needs"]),
    Case("recompute", [*TRAIN_NEW, "--recompute", "all"], ["recompute", "'all'", "ln+gelu"]),
    Case(
        "residual-dtype",
        [*TRAIN_NEW, "--residual-dtype", "bf16"],
        ["residual_dtype", "'bf16'", "float32", "compute"],
    ),
    Case("device", [*TRAIN_NEW, "--device", "gpu"], ["device", "'gpu'", "cuda:N"]),
    Case("step", [*TRAIN_NEW, "--step", "warp"], ["step (--step) = 'warp'", "eager"]),
    Case("dist", [*TRAIN_NEW, "--dist", "fsdp"], ["dist (--dist) = 'fsdp'", "ddp, zero1, zero2"]),
    Case(
        "dist-and-cuda-graph",
        [*TRAIN_NEW, "--dist", "ddp", "--step", "cuda-graph"],
        ["dist (--dist) = 'ddp'", "step (--step) = 'cuda-graph'", "not supported yet"],
    ),
    Case(
        "dist-and-compile",
        [*TRAIN_NEW, "--dist", "zero2", "--compile"],
        ["dist (--dist) = 'zero2'", "compile (--compile)"],
    ),
    Case("eval-batches-0", [*TRAIN_NEW, "--eval-batches", "0"], ["eval_batches", "= 0"]),
    Case("threads-neg", [*TRAIN_NEW, "--threads", "-1"], ["threads", "= -1"]),
    Case("seed-neg", [*TRAIN_NEW, "--seed", "-1"], ["seed", "= -1"]),
    Case("vocab-multiple-0", [*TRAIN_NEW, "--vocab-multiple", "0"], ["vocab_multiple", "= 0"]),
    Case("model-unknown", [*TRAIN_NEW, "--model", "gpt5"], ["unknown model 'gpt5'", "known"]),
    Case("model-file-missing", [*TRAIN_NEW, "--model", "{w}/nope.json"], ["nope.json"]),
    Case("init-from-missing", [*TRAIN_NEW, "--init-from", "{w}/nohf"], ["nohf", "config.json"]),
    Case(
        "config-not-json", [*TRAIN_NEW, "--config", "{w}/bad.json"], ["bad.json", "not valid JSON"]
    ),
    Case("config-list", [*TRAIN_NEW, "--config", "{w}/list.json"], ["expected a JSON object"]),
    Case(
        "config-missing", [*TRAIN_NEW, "--config", "{w}/none.json"], ["none.json", "no such file"]
    ),
    Case("config-unknown-key", [*TRAIN_NEW, "--config", "{w}/unknown.json"], ["'batch_sise'"]),
    Case("config-str-for-int", [*TRAIN_NEW, "--config", "{w}/strtype.json"], ["'8'", "an int"]),
    Case("config-bool-for-int", [*TRAIN_NEW, "--config", "{w}/booltype.json"], ["max_steps"]),
    Case("config-null-lr", [*TRAIN_NEW, "--config", "{w}/nulllr.json"], ["lr", "a number"]),
    Case("config-out-of-range", [*TRAIN_NEW, "--config", "{w}/range.json"], ["warmup_steps"]),
    # data
    Case("data-missing", [*TRAIN_NEW, "--data", "{w}/nodata"], ["nodata", "blutrain prepare"]),
    Case("data-empty-dir", [*TRAIN_NEW, "--data", "{w}/empty_data"], ["no shards", "prepare"]),
    Case("data-empty-shard", [*TRAIN_NEW, "--data", "{w}/zero_shard"], ["0 tokens", "prepare"]),
    Case("data-no-train-split", [*TRAIN_NEW, "--data", "{w}/val_only"], ["no shards matching"]),
    Case("data-truncated-shard", [*TRAIN_NEW, "--data", "{w}/cut_shard"], ["truncated"]),
    # the output directory and --resume
    Case(
        "fresh-into-a-run", [*TRAIN, "--out-dir", "{w}/half"], ["already holds a run", "--resume"]
    ),
    Case(
        "auto-into-stale-metrics",
        [*TRAIN, "--out-dir", "{w}/metrics_only", "--resume", "auto"],
        ["metrics", "no checkpoint"],
    ),
    Case(
        "fresh-into-stale-metrics",
        [*TRAIN, "--out-dir", "{w}/metrics_only"],
        ["already holds a run"],
    ),
    Case(
        "resume-nothing", [*TRAIN, "--out-dir", "{w}/empty", "--resume"], ["no checkpoint", "auto"]
    ),
    Case("resume-bad-value", [*TRAIN, "--resume", "yes"], ["--resume", "'yes'", "'auto'"]),
    Case(
        "resume-other-model",
        [*TRAIN, "--out-dir", "{w}/half", "--resume", "--model", "{w}/wide.json"],
        ["holds another model", "n_embd 16 (this run: 32)"],
    ),
    Case(
        "resume-other-data",
        [*TRAIN, "--out-dir", "{w}/half", "--resume", "--data", "{w}/val_only"],
        ["no shards matching"],
    ),
    Case(
        "resume-other-seq-len",
        [*TRAIN, "--out-dir", "{w}/half", "--resume", "--seq-len", "8"],
        ["cannot resume", "seq_len was 16"],
    ),
    Case(
        "resume-changed-lr",
        [*TRAIN, "--out-dir", "{w}/half", "--resume", "--lr", "1e-2"],
        ["lr (--lr) = 0.01 differs", "start a new run"],
    ),
    Case(
        "resume-finished",
        [*TRAIN, "--out-dir", "{w}/done", "--resume"],
        ["finished (step 2 of max_steps 2)", "larger --max-steps"],
    ),
    Case(
        "extend-with-higher-min-lr",
        [*TRAIN, "--out-dir", "{w}/done", "--resume", "--max-steps", "4", "--min-lr", "1e-3"],
        ["min_lr 0.001 is above", "never raises"],
    ),
    *[Case(f"resume-{k}", RESUME, v[1], damage=k) for k, v in DAMAGE.items()],
    # sample
    Case("sample-no-checkpoint", ["sample", "--checkpoint", "{w}/nope"], ["no such checkpoint"]),
    Case("sample-default-missing", ["sample"], ["runs/shakespeare/checkpoint", "blutrain train"]),
    Case("sample-not-a-run", ["sample", "--checkpoint", "{w}/empty"], ["manifest.json: missing"]),
    Case("sample-top-k-0", ["sample", "--model", "tiny", "--top-k", "0"], ["--top-k", ">= 1"]),
    Case("sample-top-k-neg", ["sample", "--model", "tiny", "--top-k", "-5"], ["--top-k", ">= 1"]),
    Case("sample-temp-0", ["sample", "--model", "tiny", "--temperature", "0"], ["> 0"]),
    Case("sample-temp-neg", ["sample", "--model", "tiny", "--temperature", "-1"], ["> 0"]),
    Case("sample-n-neg", ["sample", "--model", "tiny", "-n", "-1"], ["--max-new-tokens", ">= 0"]),
    Case(
        "sample-two-sources",
        ["sample", "--model", "tiny", "--checkpoint", "{w}/half"],
        ["one of --checkpoint, --hf, --model"],
    ),
    Case(
        "sample-prompt-outside-vocab",
        ["sample", "--checkpoint", "{w}/vocab97", "--prompt", "ROMEO:"],
        ["outside the model's vocabulary of 97"],
    ),
    # eval
    Case("eval-no-checkpoint", ["eval", "--checkpoint", "{w}/nope"], ["no such checkpoint"]),
    Case(
        "eval-batch-size-0",
        ["eval", "--checkpoint", "{w}/half", "--batch-size", "0"],
        ["--batch-size", ">= 1"],
    ),
    Case(
        "eval-seq-len-over-block",
        ["eval", "--checkpoint", "{w}/half", "--data", "{w}/data", "--seq-len", "64"],
        ["--seq-len 64", "block size 32"],
    ),
    Case("eval-split", ["eval", "--checkpoint", "{w}/half", "--split", "test"], ["'test'"]),
    Case(
        "eval-data-missing",
        ["eval", "--checkpoint", "{w}/half", "--data", "{w}/nodata"],
        ["nodata", "blutrain prepare"],
    ),
    # bench
    Case("bench-steps-0", ["bench", "--steps", "0"], ["--steps", ">= 1"]),
    Case("bench-precision", ["bench", "--device", "cpu", "--precision", "fp8"], ["'fp8'"]),
    Case("bench-seq-len-over-block", ["bench", "--seq-len", "999"], ["block size 256"]),
    Case("bench-residual-dtype", ["bench", "--residual-dtype", "bf16"], ["'bf16'", "compute"]),
    Case(
        "bench-llama-residual-dtype",
        ["bench", "--model", "llama-tiny", "--device", "cpu", "--residual-dtype", "compute"],
        ["[bench] residual_dtype 'compute'", "GPT-2 models only", "drop it"],
    ),
]


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    return rc, capsys.readouterr().err


def assert_one_clean_line(err: str, verb: str, expect: list[str]) -> None:
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1, err
    assert lines[0].startswith(f"blutrain {verb}: error: "), err
    assert "Traceback" not in err
    for fragment in expect:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(case, world, capsys, monkeypatch):
    monkeypatch.chdir(world)  # defaults (data/shakespeare, runs/shakespeare) are absent here
    ck = None
    if case.damage:
        ck = world / "damaged" / case.id
        shutil.copytree(world / "half", ck)
        DAMAGE[case.damage][0](ck / "checkpoint")
    argv = [a.format(w=world, ck=ck) for a in case.argv]
    before = snapshot(world)
    rc, err = run_cli(argv, capsys)
    after = snapshot(world)
    assert rc == 2, (rc, err)
    assert_one_clean_line(err, argv[0], case.expect)
    assert after == before, sorted(set(after.items()) ^ set(before.items()))


TENSOR_CASES = ["train", "sample", "eval", "bench"]

_WITHOUT_TENSOR = """
import sys
sys.modules["blutrain.tensor"] = None  # as if blutrain-tensor were not installed
from blutrain.models import cli
for verb in sys.argv[1:]:
    rc = cli.main([verb])
    print(verb, rc, file=sys.stderr)
"""

_OLD_TENSOR = """
import sys
import blutrain.tensor
blutrain.tensor.API_LEVEL = 0  # as an older build
from blutrain.models import cli
for verb in sys.argv[1:]:
    rc = cli.main([verb])
    print(verb, rc, file=sys.stderr)
"""


_BAD_ALLOC_CONF = """
import sys
from blutrain.models import cli
for verb in sys.argv[1:]:
    rc = cli.main([verb])
    print(verb, rc, file=sys.stderr)
"""


@pytest.mark.parametrize(
    "script", [_WITHOUT_TENSOR, _OLD_TENSOR, _BAD_ALLOC_CONF], ids=["missing", "too-old", "conf"]
)
def test_every_verb_without_a_usable_tensor_package(script, tmp_path):
    """blutrain-models without (a recent enough, or a well configured) blutrain-tensor: each
    tensor verb says what to do, exits 2 and writes nothing; `prepare` still works."""
    env = dict(os.environ)
    if script is _BAD_ALLOC_CONF:
        env["BLUTRAIN_ALLOC_CONF"] = "expandable_segments:1,cachin:0"  # a typo of caching
    r = subprocess.run(
        [sys.executable, "-c", script, *TENSOR_CASES],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    lines = r.stderr.strip().split("\n")
    assert r.returncode == 0 and len(lines) == 2 * len(TENSOR_CASES), r.stderr
    for i, verb in enumerate(TENSOR_CASES):
        msg, status = lines[2 * i], lines[2 * i + 1]
        assert status == f"{verb} 2", r.stderr
        assert msg.startswith(f"blutrain {verb}: error: "), msg
        if script is _WITHOUT_TENSOR:
            assert "needs blutrain-tensor, which is not installed: pip install" in msg
        elif script is _OLD_TENSOR:
            need = f"API level >= {REQUIRED_API_LEVEL}"
            assert need in msg and "has level 0" in msg and "reinstall" in msg
        else:
            assert "[BLUTRAIN_ALLOC_CONF] unknown key 'cachin' (did you mean 'caching'?)" in msg
            assert "allowed keys" in msg
    assert "Traceback" not in r.stderr
    assert list(tmp_path.iterdir()) == []
    r = subprocess.run(
        [sys.executable, "-c", script, "prepare"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.stderr.strip().endswith("prepare 0"), r.stderr


@pytest.mark.parametrize(
    "damage", ["weights-nan", "optimizer-tensor-missing", "trainer-bad-loader", "manifest-no-files"]
)
def test_a_failed_load_changes_nothing(damage, world, tmp_path):
    """Trainer.load checks the whole checkpoint (the optimizer's state last, by the step)
    before it changes anything: weights, AdamW moments and steps, the loader's position, the
    step and the schedule are those of before the failed load."""
    cfg = TrainConfig(
        model=str(world / "model.json"),
        data=str(world / "data"),
        batch_size=2,
        seq_len=16,
        max_steps=4,
        warmup_steps=1,
        eval_interval=0,
        sample_interval=0,
        log_interval=0,
        progress=False,
        plot=False,
        out_dir=str(tmp_path / "run"),
    )
    t = Trainer(cfg)
    t.train_step()  # some optimizer state and a loader position of its own
    before = (
        {k: v.copy() for k, v in t.model.state_dict().items()},
        t.stepper.state_dict(),
        t.train_loader.state_dict(),
        t.step,
        t.schedule.state_dict(),
    )
    ck = tmp_path / "damaged"
    shutil.copytree(world / "half" / "checkpoint", ck)
    DAMAGE[damage][0](ck)
    with pytest.raises(ValueError, match=r"\[resume\]"):
        t.load(ck)
    weights, opt, loader, step, schedule = before
    for k, v in t.model.state_dict().items():
        assert np.array_equal(v, weights[k]), k
    now = t.stepper.state_dict()
    assert now["meta"] == opt["meta"]
    for k, v in now["tensors"].items():
        assert np.array_equal(v, opt["tensors"][k]), k
    assert t.train_loader.state_dict() == loader and t.step == step
    assert t.schedule.state_dict() == schedule
    t.load(world / "half" / "checkpoint")  # an intact one loads
    assert t.step == 2
