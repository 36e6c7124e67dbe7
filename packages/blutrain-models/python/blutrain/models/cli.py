"""The `blutrain` command.

Each subcommand is a `Command` in COMMANDS: a name, a help line, a function that adds its
arguments to an argparse subparser, and a function that runs it: `prepare` here, and the
trainer's `train`, `sample`, `eval` and `bench` (trainer.commands()).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# -- prepare ----------------------------------------------------------------------------------


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
]

# trainer.py imports blutrain.tensor lazily, so `blutrain prepare` works without it.
from .trainer import commands as _trainer_commands  # noqa: E402

COMMANDS.extend(_trainer_commands())


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import PackageNotFoundError, version

    try:
        ver = version("blutrain-models")
    except PackageNotFoundError:
        ver = "unknown"
    parser = argparse.ArgumentParser(
        prog="blutrain", description="BluTrain: GPT-2 data, training, sampling and checkpoints."
    )
    parser.add_argument("--version", action="version", version=f"blutrain-models {ver}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except (OSError, ValueError) as e:
        # Our errors name the file or tensor and what was expected: show them without a traceback.
        print(f"blutrain {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"blutrain {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
