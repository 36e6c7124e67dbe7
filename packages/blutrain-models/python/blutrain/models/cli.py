"""The `blutrain` command: prepare, train, sample, eval, bench.

Each subcommand is a `Command` in COMMANDS: a name, a help line, a function that adds its
arguments to an argparse subparser, and a function that runs it. A verb that runs tensors
(all but `prepare`) first calls `start(threads)`: blutrain-tensor is imported and checked,
then the CPU threads are set, before the verb reads a model or writes anything. `train`'s flags are
made from TrainConfig's fields by `add_config_flags` (name, type, default and help written once,
in train_config.py).

Errors a user can cause (a bad flag, a missing file, a checkpoint that does not fit) print one
line, `blutrain VERB: error: [where] what was wrong ... what to do`, and exit with status 2;
they never leave a traceback or a changed file behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from .train_config import (
    DEFAULT_DATA,
    DEFAULT_OUT,
    RESIDUAL_DTYPES,
    TrainConfig,
    field_types,
    flag_name,
    read_config_file,
)

EXIT_USAGE = 2  # bad input: flags, files, configs, checkpoints (argparse's own code too)
EXIT_FAILED = 1  # a run that failed on its own (a diverged loss)
TENSOR_INSTALL = (
    "needs blutrain-tensor, which is not installed: pip install --no-build-isolation "
    "packages/blutrain-tensor (or `nox -s train`, which builds every package)"
)


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class UsageError(ValueError):
    """A command-line value that is not allowed (the message says which and why)."""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `blutrain VERB: error: ... (see blutrain VERB --help)`."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# -- argument types ------------------------------------------------------------------------------


def bounded(kind: type, lo: float | None = None, gt: float | None = None) -> Callable[[str], Any]:
    """An argparse type: an int or float with `lo` <= value (or `gt` < value)."""

    def parse(text: str) -> Any:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an int' if kind is int else 'a number'}"
            ) from None
        if isinstance(v, float) and not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number")
        if lo is not None and v < lo:
            raise argparse.ArgumentTypeError(f"{text}: must be >= {lo:g}")
        if gt is not None and v <= gt:
            raise argparse.ArgumentTypeError(f"{text}: must be > {gt:g}")
        return v

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _shown(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return repr(v) if isinstance(v, str) and (not v or v.isspace()) else str(v)


def add_config_flags(p: argparse.ArgumentParser, cls: type = TrainConfig) -> None:
    """One flag per dataclass field: --field-name, its type, its help and its default.

    Flags default to None (not given), so a --config file's values stand unless a flag is
    given; the dataclass then checks every value (ConfigError names field, flag and value)."""
    hints = typing.get_type_hints(cls)
    defaults = cls()
    for f in dataclasses.fields(cls):
        types = field_types(hints[f.name])
        meta = f.metadata
        default = getattr(defaults, f.name)
        help_ = meta.get("help", "").replace("%", "%%")  # argparse formats help with %
        if default is not None:
            help_ += f" (default: {_shown(default)})"
        kw: dict[str, Any] = {"dest": f.name, "default": None, "help": help_}
        if "cli_value" in meta:  # --resume, or --resume auto
            word = meta["cli_value"]

            def only(text: str, word: str = word) -> str:
                if text != word:
                    raise argparse.ArgumentTypeError(f"{text!r}: the only value is {word!r}")
                return text

            p.add_argument(flag_name(f.name), nargs="?", const=True, type=only, metavar=word, **kw)
        elif bool in types:
            p.add_argument(flag_name(f.name), action=argparse.BooleanOptionalAction, **kw)
        else:
            base = next(t for t in types if t is not type(None))
            metavar = meta.get("metavar") or {int: "N", float: "X"}.get(base, f.name.upper())
            p.add_argument(flag_name(f.name), type=base, metavar=metavar, **kw)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig from defaults < the resumed run's own config < --config FILE < flags."""
    from .run_dir import RunDir
    from .run_state import saved_train_config

    names = [f.name for f in dataclasses.fields(TrainConfig)]
    given = {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}
    values = read_config_file(args.config) if args.config else {}
    values.update(given)
    resume = values.get("resume", False)
    if resume is True or resume == "auto":
        # a resumed run keeps its settings: only what is given here changes
        ck = RunDir(values.get("out_dir", DEFAULT_OUT)).checkpoint
        if (ck / "trainer.json").exists():
            saved = {k: v for k, v in saved_train_config(ck).items() if k in names}
            saved.pop("resume", None)
            values = {**saved, **values}
    return TrainConfig.from_dict(values, where="flags" if not args.config else args.config)


def start(threads: int) -> None:
    """What every verb that runs tensors does first: import blutrain.tensor through
    models._tensor, so a missing, too old or misconfigured one stops the verb here (see main),
    then set the CPU thread budget that the op loops and the BLAS share."""
    from . import _tensor  # noqa: F401
    from .device import set_threads

    set_threads(threads)


# -- train ---------------------------------------------------------------------------------------


def _train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="a JSON file of TrainConfig fields (flags override it)",
    )
    add_config_flags(p)


def _train_run(args: argparse.Namespace) -> int:
    from rich.console import Console

    cfg = config_from_args(args)
    start(cfg.threads)
    from .trainer import train

    train(cfg, console=Console())
    return 0


# -- sample, eval: a model from a checkpoint, a Hugging Face directory or a preset ----------------


def _model_source_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        default=None,
        help="a training checkpoint directory (or the run directory holding one)",
    )
    p.add_argument("--hf", default=None, help="a Hugging Face GPT-2 directory")
    p.add_argument(
        "--model",
        default=None,
        help=f"a preset with random weights (default: the run in {DEFAULT_OUT})",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--threads",
        type=bounded(int, lo=0),
        default=0,
        help="CPU threads (0: $OMP_NUM_THREADS, else all usable CPUs)",
    )


def load_model(
    checkpoint: str | None = None,
    hf: str | None = None,
    model: str = "tiny",
    device: str = "cpu",
    vocab_multiple: int = 1,
):
    """A model from a training checkpoint directory (or a run directory holding one; GPT-2 or
    LLaMA, as it was trained), a Hugging Face GPT-2 directory, or a fresh preset (random
    weights)."""
    from .config import model_config
    from .gpt2 import GPT2
    from .zoo import build_model, model_from_checkpoint

    if checkpoint:
        return model_from_checkpoint(checkpoint, device=device)
    if hf:
        return GPT2.from_pretrained(hf, vocab_multiple=vocab_multiple, device=device)
    return build_model(model_config(model, vocab_multiple), device=device)


def _model_from_args(args: argparse.Namespace):
    from .device import resolve_device

    given = [n for n in ("checkpoint", "hf", "model") if getattr(args, n)]
    if len(given) > 1:
        raise UsageError(
            f"[{args.command}] give one of --checkpoint, --hf, --model (got "
            f"{', '.join('--' + n for n in given)})"
        )
    if not given:
        default = Path(DEFAULT_OUT) / "checkpoint"
        if not default.exists():
            raise FileNotFoundError(
                f"[{args.command}] no --checkpoint, --hf or --model given and {default} does not "
                "exist (run `blutrain train` first)"
            )
        args.checkpoint = str(default)
    device = resolve_device(args.device)
    return load_model(args.checkpoint, args.hf, args.model or "tiny", device)


def _sample_arguments(p: argparse.ArgumentParser) -> None:
    _model_source_arguments(p)
    p.add_argument("--prompt", default="\n", help="text to continue")
    p.add_argument(
        "-n", "--max-new-tokens", type=bounded(int, lo=0), default=200, help="tokens to sample"
    )
    p.add_argument("--num-samples", type=bounded(int, lo=1), default=1)
    p.add_argument(
        "--temperature",
        type=bounded(float, gt=0),
        default=0.8,
        help="> 0; lower is more conservative (--top-k 1 is greedy)",
    )
    p.add_argument(
        "--top-k", type=bounded(int, lo=1), default=40, help="sample from the k likeliest tokens"
    )
    p.add_argument("--seed", type=bounded(int, lo=0), default=0)


def _sample_run(args: argparse.Namespace) -> int:
    start(args.threads)
    import numpy as np

    from .config import EOT_TOKEN
    from .tokenizer import get_encoding

    enc = get_encoding()
    ids = enc.encode_ordinary(args.prompt) or [EOT_TOKEN]
    model = _model_from_args(args)
    V = model.config.vocab_size
    if max(ids) >= V:
        bad = sorted({t for t in ids if t >= V})
        raise UsageError(
            f"[sample] the prompt's token(s) {bad[:5]} lie outside the model's vocabulary of {V} "
            "tokens (it was not trained on GPT-2's tokenizer); use a prompt of tokens below "
            f"{V}" + (" (an empty prompt starts from <|endoftext|>)" if EOT_TOKEN >= V else "")
        )
    for i in range(args.num_samples):
        out = model.generate(
            np.array(ids),
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed + i,
        )
        if i:
            print("---")
        print(args.prompt + enc.decode([int(t) for t in out[len(ids) :]]))
    return 0


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    _model_source_arguments(p)
    p.add_argument("--data", default=None, help=f"shard directory (default {DEFAULT_DATA})")
    p.add_argument("--split", default="val", choices=["train", "val"])
    p.add_argument("--batch-size", type=bounded(int, lo=1), default=8)
    p.add_argument(
        "--seq-len", type=bounded(int, lo=1), default=None, help="default: min(block size, 1024)"
    )
    p.add_argument(
        "--batches", type=bounded(int, lo=0), default=0, help="batches to average (0: all)"
    )


def _eval_run(args: argparse.Namespace) -> int:
    start(args.threads)
    from .data import DataLoader
    from .trainer import evaluate_loss, find_data

    find_data(args.data, prepare_default=False)  # a missing --data fails before the model
    model = _model_from_args(args)
    data = find_data(args.data)
    T = args.seq_len or min(model.config.block_size, 1024)
    if T > model.config.block_size:
        raise UsageError(
            f"[eval] --seq-len {T} is longer than the model's block size {model.config.block_size}"
        )
    loader = DataLoader(
        data,
        args.batch_size,
        T,
        split=args.split,
        shuffle=False,
        vocab_size=model.config.vocab_size,
    )
    n = min(args.batches or loader.batches_per_epoch, loader.batches_per_epoch)
    t0 = time.perf_counter()
    loss = evaluate_loss(model, loader, n)
    dt = time.perf_counter() - t0
    record = {
        "split": args.split,
        "loss": loss,
        "perplexity": math.exp(loss),
        "batches": n,
        "tokens": n * args.batch_size * T,
        "seconds": dt,
    }
    print(json.dumps(record))
    return 0


# -- bench ---------------------------------------------------------------------------------------


def _bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="tiny", help="a GPT-2 or LLaMA (llama-*) preset, or a JSON config"
    )
    p.add_argument("--batch-size", type=bounded(int, lo=1), default=8)
    p.add_argument("--seq-len", type=bounded(int, lo=1), default=128)
    p.add_argument("--steps", type=bounded(int, lo=1), default=10, help="timed steps")
    p.add_argument("--warmup", type=bounded(int, lo=0), default=2, help="untimed steps first")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--precision",
        default="auto",
        help="comma-separated modes to run: fp32, tf32, bf16 (auto: bf16 on a GPU, fp32 on the "
        "CPU)",
    )
    p.add_argument(
        "--recompute",
        default="auto",
        help="auto (ln for fp32 on a GPU, else none), none, gelu, ln, attn, block, or ln+gelu",
    )
    p.add_argument(
        "--residual-dtype",
        default="float32",
        choices=RESIDUAL_DTYPES,
        help="GPT-2's residual stream under bf16: float32 (autocast's) or compute (bf16: faster "
        "and lighter, trains off the fp32 trajectory) (default: float32)",
    )
    p.add_argument(
        "--threads",
        type=bounded(int, lo=0),
        default=0,
        help="CPU threads (0: $OMP_NUM_THREADS, else all usable CPUs)",
    )
    p.add_argument(
        "--gemm-autotune",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a GPU, time cuBLASLt's algorithms per GEMM shape once (default: on)",
    )
    p.add_argument(
        "--cuda-graph",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="on a GPU, replay the whole step as one captured CUDA graph (default: off)",
    )
    p.add_argument("--json", default=None, help="also write the result to this JSON file")


def _bench_run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ._io import atomic_write_bytes
    from .bench import bench

    start(args.threads)
    from .device import fmt_bytes
    from .gpt2 import precision_name

    modes = [s.strip() for s in str(args.precision).split(",") if s.strip()] or ["auto"]
    for m in modes:
        if m.lower() != "auto":
            precision_name(m)  # a bad mode fails before any run
    rows = [
        bench(
            args.model,
            args.batch_size,
            args.seq_len,
            args.steps,
            args.warmup,
            args.device,
            precision=mode,
            recompute=args.recompute,
            gemm_autotune=args.gemm_autotune,
            cuda_graph=args.cuda_graph,
            residual_dtype=args.residual_dtype,
        )
        for mode in modes
    ]
    r = rows[0]
    table = Table(
        title=f"blutrain bench: GPT-2 {r['model']} ({r['n_params'] / 1e6:.1f}M), "
        f"B={r['batch_size']} T={r['seq_len']}, {r['device']}"
        + (", CUDA graph" if r["cuda_graph"] else ""),
        show_edge=False,
    )
    for col in ("precision", "tokens/s", "step (mean)", "peak memory", "MFU"):
        table.add_column(col, justify="right")
    for r in rows:
        bf16_stream = (r["precision"], r["residual_dtype"]) == ("bf16", "compute")
        table.add_row(
            r["precision"]
            + ("" if r["recompute"] == "none" else f" +{r['recompute']}")
            + (" (bf16 stream)" if bf16_stream else ""),
            f"{r['tokens_per_s']:,.0f}",
            f"{r['step_ms_median']:.1f} ms",
            fmt_bytes(r["peak_mem_bytes"]),
            f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a",
        )
    Console().print(table)
    if args.json:
        out = rows[0] if len(rows) == 1 else rows
        atomic_write_bytes(args.json, (json.dumps(out, indent=2) + "\n").encode())
    return 0


# -- prepare -------------------------------------------------------------------------------------


def _prepare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "inputs",
        nargs="*",
        help="text files, directories (their *.txt) or glob patterns; none: the shipped Tiny "
        "Shakespeare",
    )
    p.add_argument(
        "-o",
        "--out",
        default=None,
        help="output directory (default: ./data/shakespeare, or ./data/<name>)",
    )
    p.add_argument(
        "--name",
        default=None,
        help="shard file prefix (default: shakespeare, or data for your files)",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.1,
        help="share of tokens, from the start, for validation (default 0.1)",
    )
    p.add_argument(
        "--val-tokens",
        type=int,
        default=None,
        help="exact number of validation tokens (overrides --val-fraction)",
    )
    p.add_argument(
        "--doc-split",
        choices=["file", "paragraph", "line"],
        default=None,
        help="what makes a document (default: paragraph for Shakespeare, else file)",
    )
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=100_000_000,
        help="maximum tokens per shard file (default 100M, as llm.c)",
    )
    p.add_argument("--encoding", default="utf-8", help="text encoding of the inputs")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def _prepare_run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from .data import prepare

    console = Console(stderr=False)
    default = not args.inputs
    name = args.name or ("shakespeare" if default else "data")
    out = args.out or f"data/{name}"
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=args.quiet,
        transient=True,
    )
    tasks: dict[str, int] = {}

    def report(what: str, done: int, total: int) -> None:
        if what not in tasks:
            label = {"tokenize": "tokenizing", "write": "writing shards"}.get(what, what)
            tasks[what] = progress.add_task(label, total=total)
        progress.update(tasks[what], completed=done, total=total)

    with progress:
        result = prepare(
            None if default else args.inputs,
            out,
            args.val_fraction,
            val_tokens=args.val_tokens,
            name=name,
            doc_split=args.doc_split,
            shard_tokens=args.shard_tokens,
            encoding=args.encoding,
            progress=report,
        )
    table = Table(title=f"blutrain prepare -> {result.out_dir}", show_edge=False)
    table.add_column("split")
    table.add_column("tokens", justify="right")
    table.add_column("shards", justify="right")
    table.add_column("files")
    for split, n, files in (
        ("train", result.train_tokens, result.train_files),
        ("val", result.val_tokens, result.val_files),
    ):
        shown = ", ".join(f.name for f in files[:2]) + (" ..." if len(files) > 2 else "")
        table.add_row(split, f"{n:,}", str(len(files)), shown)
    table.add_row(
        "total",
        f"{result.total_tokens:,}",
        "",
        f"{result.documents:,} documents from {len(result.input_files)} file(s)",
    )
    console.print(table)
    return 0


COMMANDS: list[Command] = [
    Command(
        "prepare",
        "tokenize text into llm.c token shards (default: Tiny Shakespeare)",
        _prepare_arguments,
        _prepare_run,
    ),
    Command(
        "train",
        "train GPT-2 (default: a small one on the shipped Tiny Shakespeare)",
        _train_arguments,
        _train_run,
    ),
    Command(
        "sample",
        "generate text from a checkpoint, a Hugging Face directory or a preset",
        _sample_arguments,
        _sample_run,
    ),
    Command("eval", "validation loss of a model on token shards", _eval_arguments, _eval_run),
    Command("bench", "tokens/s and peak memory of N training steps", _bench_arguments, _bench_run),
]


# -- main ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("blutrain-models")
    except PackageNotFoundError:
        ver = "unknown"
    parser = _Parser(
        prog="blutrain", description="BluTrain: GPT-2 data, training, sampling and checkpoints."
    )
    parser.add_argument("--version", action="version", version=f"blutrain-models {ver}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_command=cmd)
    return parser


def _tensor_missing(e: ImportError) -> bool:
    return isinstance(e, ModuleNotFoundError) and (e.name or "") in ("blutrain", "blutrain.tensor")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cmd: Command | None = getattr(args, "_command", None)
    if cmd is None:
        parser.print_help()
        return EXIT_USAGE
    prog = f"blutrain {cmd.name}"
    try:
        return int(cmd.run(args) or 0)
    except ImportError as e:
        # blutrain-tensor missing, too old (models._tensor), or refusing its settings at import
        # (a bad BLUTRAIN_ALLOC_CONF): what to do, in one line
        if _tensor_missing(e):
            why = TENSOR_INSTALL
        elif type(e).__name__ == "TensorVersionError" or str(e).startswith("["):
            why = _one_line(e)
        else:
            raise
        print(f"{prog}: error: {why}", file=sys.stderr)
        return _end_job(prog, EXIT_USAGE)
    except (OSError, ValueError) as e:
        # Our errors name the file, flag or tensor and what was expected: one line, no traceback.
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return _end_job(prog, EXIT_USAGE)
    except FloatingPointError as e:
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return _end_job(prog, EXIT_FAILED)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return _end_job(prog, 130)


def _end_job(prog: str, code: int) -> int:
    """`code`; in a distributed run, first end every rank (the others would wait for this one
    until their timeout: blutrain.dist's Note [a rank that leaves])."""
    dist = sys.modules.get("blutrain.dist")
    if dist is not None and dist.is_initialized() and dist.world_size() > 1:
        dist.abort(f"{prog} stopped on the error above", code)
    return code


def _one_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, OSError) and e.filename and str(e.filename) not in text:
        text = f"{e.filename}: {text}"
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
