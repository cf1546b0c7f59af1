"""`routereplay env`: versions and platform facts to paste into a bug report."""

from __future__ import annotations

import argparse
import json
from typing import Any

from routereplay.cli.arguments import add_json_argument


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "env",
        help="print versions and platform facts for bug reports",
        description="Print Python, platform, CPU, package versions and CUDA availability (paste into bug reports).",
    )
    add_json_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from routereplay.bench.environment import collect

    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for key, value in info.items():
            print(f"{key:<{width}}  {'not installed' if value is None else value}")
    return 0
