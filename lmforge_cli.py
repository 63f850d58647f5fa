"""The ``lmforge`` command line.

Each subcommand lives in the module that owns its stage and exposes two functions:

* ``add_arguments(parser: argparse.ArgumentParser) -> None`` declares its flags;
* ``run(args: argparse.Namespace) -> int`` does the work and returns the exit status.

Only the chosen subcommand's module is imported, so ``lmforge --help`` stays fast.

Errors are reported in one place (``main``): a ``engine.errors.LmforgeError`` prints
``error: <message>; <fix>`` on stderr and exits with its ``exit_code`` (2: usage, 1: failure); an
``OSError`` (unreadable, unwritable or missing path) prints the path and exits 1; Ctrl-C exits
130; anything else is a bug, reported in one line. ``--debug`` (anywhere on the line) shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from dataclasses import dataclass

from engine.errors import LmforgeError


@dataclass(frozen=True)
class Command:
    """One ``lmforge`` subcommand: its name, the module that implements it, and a one-line help."""

    name: str
    module: str
    help: str


COMMANDS: tuple[Command, ...] = (
    Command("info", "engine.checkpoint.store", "Resolve a checkpoint (converting GGUF once) and print its manifest."),
    Command("generate", "engine.cli", "Generate a completion with the engine (or --backend hf for transformers)."),
    Command("data", "compress.data.prepare", "Load, deduplicate, filter and split dialog or text data."),
    Command("finetune", "compress.train.finetune", "Fine-tune a checkpoint (AdamW, warmup+cosine, LoRA optional)."),
    Command("distill", "compress.train.distill", "Distill a teacher checkpoint into a smaller student."),
    Command(
        "quantize",
        "compress.quantize.methods",
        "INT8-quantize a checkpoint (int8-weight-only, w8a8, llm-int8, onnx-int8).",
    ),
    Command(
        "evaluate", "compress.evaluate.quality", "Compare checkpoints: perplexity, agreement, size, decode latency."
    ),
    Command("export", "deploy.export", "Export a checkpoint into a Triton model repository."),
    Command("serve", "deploy.serve", "Start (or --stop) the Triton Inference Server on a model repository."),
    Command("loadtest", "bench.loadtest", "Load-test a served model with Locust and write a report."),
    Command("bench", "bench.cli", "Benchmarks: engine throughput and latency, compression figures."),
    Command("demo", "bench.demo", "The whole job: compress, evaluate, export, serve, load-test, report."),
    Command("plan", "compress.scale.plan", "Plan memory and parallelism for training or inference at scale."),
    Command("diagnose", "compress.scale.diagnose", "Find the cause of a misbehaving training run from its metrics."),
    Command("render", "deploy.render", "Render container / Kubernetes deployment files for a model."),
    Command("deploy", "bench.container_smoke", "Build the CPU container image (podman), run it and its k8s manifests."),
)


def build_parser(commands: list[Command], chosen: str | None) -> argparse.ArgumentParser:
    """Build the top-level parser; only ``chosen`` gets its full argument set (imports its module)."""
    parser = argparse.ArgumentParser(
        prog="lmforge",
        description="Compress, run, serve on Triton and load-test large language models.",
    )
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in commands:
        p = sub.add_parser(command.name, help=command.help, description=command.help)
        if command.name == chosen:
            importlib.import_module(command.module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lmforge`` console script; returns the process exit status.

    Exit statuses: 0 success, 1 failure, 2 usage error (argparse's too), 130 interrupted.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # accepted anywhere on the line, also after the subcommand
    argv = [a for a in argv if a != "--debug"]
    try:
        return _dispatch(argv)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # every error ends here: one line on stderr, no traceback
        if debug:
            traceback.print_exc()
        print(f"error: {describe_error(exc)}", file=sys.stderr)
        return exc.exit_code if isinstance(exc, LmforgeError) else 1


def describe_error(exc: BaseException) -> str:
    """The one-line message ``lmforge`` prints for ``exc`` (after ``error: ``)."""
    if isinstance(exc, LmforgeError):
        return str(exc)
    if isinstance(exc, OSError) and exc.filename is not None:
        target = f" -> {exc.filename2}" if exc.filename2 else ""
        return f"{exc.filename}{target}: {exc.strerror or exc}"
    if isinstance(exc, (OSError, ValueError, UnicodeError)):
        return str(exc) or type(exc).__name__
    return f"unexpected {type(exc).__name__}: {exc} (rerun with --debug for the traceback and report it)"


def _dispatch(argv: list[str]) -> int:
    """Parse ``argv`` and run the chosen subcommand (errors propagate to ``main``)."""
    commands = list(COMMANDS)
    names = {c.name: c for c in commands}
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(commands, chosen if chosen in names else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(names[args.command].module)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
