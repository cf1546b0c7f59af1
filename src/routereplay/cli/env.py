"""`routereplay env`: versions and platform facts to paste into a bug report."""

from __future__ import annotations

import argparse
import json
import platform
from importlib import metadata
from typing import Any

from routereplay.cli.arguments import add_json_argument

PACKAGES = ("routereplay", "numpy", "torch", "transformers", "megatron-core", "httpx", "zstandard", "rich")


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "env",
        help="print versions and platform facts for bug reports",
        description="Print versions and platform facts.",
    )
    add_json_argument(parser)
    parser.set_defaults(func=run)


def collect() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
    }
    for name in PACKAGES:
        try:
            info[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info[name] = None
    try:
        import torch

        info["cuda_available"] = bool(torch.cuda.is_available())
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:  # pragma: no cover - torch is a core dependency
        info["cuda_available"] = False
    return info


def run(args: argparse.Namespace) -> int:
    info = collect()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        width = max(len(k) for k in info)
        for key, value in info.items():
            print(f"{key:<{width}}  {'not installed' if value is None else value}")
    return 0
