"""The `visar` command line: generate images, list models and methods, evaluate, benchmark, train.

Each command lives in its own module under `visar.apps.commands`; this module assembles them.
User errors (unknown names, bad options, missing or unwritable files, a full disk, an optional dependency not
installed) print one line and exit with code 2; a closed stdout (`visar models | head`) ends the command quietly.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import VisarError, missing_dependency
from .commands import bench, demo, evaluate, generate, methods, models, serve, train
from .commands.common import (  # noqa: F401  (re-exported: `from visar.apps.cli import load_pipeline` keeps working)
    add_model_args,
    add_sampling_args,
    generate_kwargs,
    load_pipeline,
    parse_option,
    run_settings,
)

COMMANDS = (generate, demo, serve, models, evaluate, bench, train, methods)  # in the order `visar --help` lists them


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="visar",
        description="Faster sampling for image autoregressive models. Every command runs on the embedded "
        "default model when no --model is given.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, not at exit: a reader that closed the pipe is one this handler sees
        return code
    except VisarError as err:
        print(f"visar: error: {err.cli or err}", file=sys.stderr)
        return 2
    except ImportError as err:  # an optional dependency imported without `require`: the same sentence
        missing = missing_dependency(err)
        if missing is None:
            raise
        print(f"visar: error: {missing}", file=sys.stderr)
        return 2
    except OSError as err:  # a file or folder the command was pointed at: missing, unwritable, a full disk
        if isinstance(err, BrokenPipeError) and err.filename is None:  # the reader of stdout stopped (`| head`)
            # What is left unprinted goes nowhere, and the command ends quietly, as `ls | head` does.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141  # 128 + SIGPIPE: what a shell reports for a command stopped so
        where = f"{err.filename}: " if err.filename else ""
        print(f"visar: error: {where}{err.strerror or err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("visar: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
