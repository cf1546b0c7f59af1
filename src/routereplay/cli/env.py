"""`routereplay env`: versions and platform facts to paste into a bug report.

`torch_threads` is the intra-op thread count routereplay's commands run with (`routereplay.threads`:
`--threads N`, else OMP_NUM_THREADS / MKL_NUM_THREADS, else 1), not torch's own default of one thread per
core, which `torch_default_threads` shows beside it; `torch_threads_reason` says where the count came from.
"""

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
    info = facts()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for key, value in info.items():
            print(f"{key:<{width}}  {'not installed' if value is None else value}")
    return 0


def facts() -> dict[str, Any]:
    """`bench.environment.collect()` with the thread count taken under the commands' thread policy."""
    import torch

    from routereplay.bench.environment import collect
    from routereplay.threads import ThreadPolicy

    default = torch.get_num_threads()
    with ThreadPolicy().applied() as choice:
        info = collect()
    ordered: dict[str, Any] = {}
    for key, value in info.items():
        ordered[key] = value
        if key == "torch_threads":
            ordered["torch_threads_reason"] = choice.reason
            ordered["torch_default_threads"] = default
    return ordered
