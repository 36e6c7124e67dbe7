"""The `blutrain` command, and the package standing alone."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np

from blutrain.models import cli, load_shard
from blutrain.models.data import read_shard_header


def test_prepare_default_is_shakespeare(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["prepare", "-q"]) == 0
    out = capsys.readouterr().out
    files = sorted(p.name for p in (tmp_path / "data" / "shakespeare").iterdir())
    assert files == ["shakespeare_train_000001.bin", "shakespeare_val_000000.bin"]
    counts = {f: read_shard_header(tmp_path / "data" / "shakespeare" / f).num_tokens for f in files}
    assert sum(counts.values()) == 338_028  # what llm.c's script writes for Tiny Shakespeare
    for n in counts.values():
        assert f"{n:,}" in out
    assert "338,028" in out and "train" in out and "val" in out


def test_prepare_files_with_options(tmp_path, rng, capsys):
    words = np.array(["alpha", "beta", "gamma", "delta", "\n"])
    for i in range(2):
        (tmp_path / f"f{i}.txt").write_text(" ".join(rng.choice(words, 3000)))
    out_dir = tmp_path / "shards"
    rc = cli.main(
        [
            "prepare",
            str(tmp_path / "f0.txt"),
            str(tmp_path / "f1.txt"),
            "-o",
            str(out_dir),
            "--val-tokens",
            "100",
            "--shard-tokens",
            "1000",
            "--name",
            "mine",
            "-q",
        ]
    )
    assert rc == 0
    val = load_shard(out_dir / "mine_val_000000.bin")
    assert val.size == 100 and val[0] == 50256
    assert len(list(out_dir.glob("mine_train_*.bin"))) > 2
    assert "2 file(s)" in capsys.readouterr().out


def test_errors_are_one_clear_line(tmp_path, capsys):
    assert cli.main(["prepare", str(tmp_path / "missing.txt"), "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("blutrain prepare: error: [prepare]") and "missing.txt" in err
    assert "Traceback" not in err


def test_an_error_in_a_distributed_run_ends_every_rank(monkeypatch, capsys):
    # blutrain.dist's Note [a rank that leaves]: the other ranks must not wait for this one
    ended = []
    fake = types.SimpleNamespace(
        is_initialized=lambda: True, world_size=lambda: 4, abort=lambda *a: ended.append(a)
    )

    def run(args):
        raise OSError(f"[hello] disk full writing {args.who}")

    extra = cli.Command("hello", "fail", lambda p: p.add_argument("--who", default="x"), run)
    cli.COMMANDS.append(extra)
    monkeypatch.setitem(sys.modules, "blutrain.dist", fake)
    try:
        assert cli.main(["hello", "--who", "ckpt"]) == 2
        assert ended == [("blutrain hello stopped on the error above", 2)]
        fake.world_size = lambda: 1  # one rank: nothing to end
        assert cli.main(["hello"]) == 2 and len(ended) == 1
    finally:
        cli.COMMANDS.remove(extra)
    assert "blutrain hello: error: [hello] disk full writing ckpt" in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert cli.main([]) == 2
    assert "prepare" in capsys.readouterr().out


def test_commands_plug_in_through_the_registry(capsys):
    seen = {}

    def run(args):
        seen["who"] = args.who
        return 0

    extra = cli.Command("hello", "say hello", lambda p: p.add_argument("--who", default="x"), run)
    cli.COMMANDS.append(extra)
    try:
        assert cli.main(["hello", "--who", "bt"]) == 0
    finally:
        cli.COMMANDS.remove(extra)
    assert seen == {"who": "bt"}
    assert "hello" not in [c.name for c in cli.COMMANDS] and cli.COMMANDS[0].name == "prepare"


def test_console_script_and_module_entry_points(tmp_path):
    cmds = [[sys.executable, "-m", "blutrain.models"]]
    exe = Path(sys.executable).parent / "blutrain"  # the console script, where pip put it
    if exe.exists():
        cmds.append([str(exe)])
    for cmd in cmds:
        r = subprocess.run(
            cmd + ["prepare", "--help"], capture_output=True, text=True, cwd=tmp_path
        )
        assert r.returncode == 0 and "--val-fraction" in r.stdout, r.stderr


def test_imports_without_the_tensor_library():
    # The model and trainer will import blutrain.tensor; this part must not need it.
    code = (
        "import sys, blutrain.models, blutrain.models.cli; "
        "assert 'blutrain.tensor' not in sys.modules, 'tensor imported'; "
        "import blutrain; assert getattr(blutrain, '__file__', None) is None"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    pkg_root = Path(cli.__file__).resolve().parents[1]
    assert not (pkg_root / "__init__.py").exists()  # blutrain stays a PEP 420 namespace


def test_the_model_is_imported_lazily():
    code = (
        "import importlib.util, sys\n"
        "import blutrain.models as m\n"
        "assert 'GPT2' in dir(m)\n"
        "if importlib.util.find_spec('blutrain.tensor') is None:\n"
        "    try:\n"
        "        m.GPT2\n"
        "    except ImportError as e:\n"
        "        assert 'needs blutrain-tensor' in str(e), e\n"
        "    else:\n"
        "        raise AssertionError('GPT2 without blutrain.tensor')\n"
        "try:\n"
        "    m.NoSuchThing\n"
        "except AttributeError:\n"
        "    pass\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_threads_flag_sets_the_one_budget(tmp_path):
    """--threads reaches the one CPU budget that the op loops and the BLAS share, whether or
    not blutrain.tensor was imported before the verb ran."""
    code = (
        "import sys\n"
        "from blutrain.models import cli\n"
        "assert 'blutrain.tensor' not in sys.modules\n"
        "rc = cli.main(['sample', '--model', 'tiny', '-n', '1', '--threads', '3', "
        "'--device', 'cpu'])\n"
        "import blutrain.tensor as bt, blutrain.linalg as la\n"
        "print(rc, bt.get_num_threads(), la.get_option('num_threads'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[-3:] == ["0", "3", "3"], r.stdout
