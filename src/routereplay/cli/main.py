"""`routereplay` entry point: builds the parser from one module per subcommand and dispatches.

Every subcommand module exposes `add_parser(subparsers)` (which sets `func` on its parser) and keeps
its heavy imports inside `run`. Library errors and OS errors (missing file, a directory, permission
denied, disk full) print as one line naming the path and the cause, and exit 2; a failed validation
verdict exits 1; success exits 0 (`cli/failure.py` documents the statuses).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from routereplay import __version__
from routereplay.cli import bench, convert, demo, diagnose, env, inspect, train
from routereplay.cli.arguments import CommandParser
from routereplay.cli.failure import ExitCode, cli_message, os_error_line
from routereplay.errors import RouteReplayError

EXIT_OK, EXIT_INVALID, EXIT_ERROR = ExitCode.OK, ExitCode.INVALID, ExitCode.ERROR
COMMANDS = (demo, train, diagnose, inspect, convert, bench, env)


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="routereplay",
        description=(
            "Router replay (R2/R3) for Mixture-of-Experts RL: decode, validate, store and inspect the "
            "routed experts that vLLM, SGLang and Megatron return."
        ),
        epilog="Run `routereplay COMMAND --help` for the options of each command.",
    )
    parser.add_argument("--version", action="version", version=f"routereplay {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_ERROR
    try:
        return int(args.func(args))
    except RouteReplayError as exc:
        print(f"routereplay {args.command}: {type(exc).__name__}: {cli_message(str(exc))}", file=sys.stderr)
        return EXIT_ERROR
    except ImportError as exc:  # an optional package a file or flag needs (e.g. zstandard for a zstd codec file)
        print(f"routereplay {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as exc:  # disk full, permission denied, a directory where a file was meant: no traceback
        print(f"routereplay {args.command}: {os_error_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"routereplay {args.command}: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
