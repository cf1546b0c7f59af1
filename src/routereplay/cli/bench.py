"""`routereplay bench SUITE`: measured figures (medians of repeated runs), as a table or --json."""

from __future__ import annotations

import argparse
import json
from typing import Any

from routereplay.cli.arguments import add_json_argument

SUITES = ("codec", "layout", "replay", "engine")


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="run a benchmark suite (codec, layout, replay, engine) and print medians of repeated runs",
        description=(
            "Run a benchmark suite. `codec`: bytes per (token, layer) row and encode/decode throughput of "
            "routereplay's codec against JSON lists, SGLang base64 int32, vLLM base64 .npy and raw uint8, "
            "all measured in the same run on the same random routes. `layout`: pack + Ulysses SP shard of a padded "
            "batch of routes (default 64 x 4096 tokens, 48 layers, top-8) with routereplay's vectorised transforms "
            "against the per-sequence loop framework glue uses, checked equal, interleaved. "
            "`replay`: forward + backward step time of a "
            "Qwen3-MoE-shaped model with routers off, recording and replaying (interleaved). `engine`: the built-in "
            "engine's generation time with and without route capture. Progress goes to stderr."
        ),
    )
    parser.add_argument("suite", choices=SUITES, help="which benchmark to run")
    parser.add_argument("--tokens", type=int, default=32768, help="tokens T (default 32768)")
    parser.add_argument("--layers", type=int, default=48, help="MoE layers L (default 48)")
    parser.add_argument("--top-k", type=int, default=8, help="top-k K (default 8)")
    parser.add_argument("--experts", type=int, default=128, help="experts E (default 128)")
    parser.add_argument("--batch", type=int, default=8, help="replay: batch rows (default 8)")
    parser.add_argument("--seq", type=int, help="replay: tokens per row (default 256); layout: padded length (4096)")
    parser.add_argument("--sequences", type=int, default=64, help="layout: sequences in the batch (default 64)")
    parser.add_argument("--sp", type=int, default=4, help="layout: Ulysses sequence-parallel size (default 4)")
    parser.add_argument("--repeats", type=int, help="timed repeats per measurement (default: codec 5, replay 7)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random routes")
    parser.add_argument("--markdown", action="store_true", help="print the markdown table used in README/BENCHMARKS.md")
    add_json_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from routereplay.bench import codec as codec_bench
    from routereplay.bench import engine as engine_bench
    from routereplay.bench import layout as layout_bench
    from routereplay.bench import replay as replay_bench
    from routereplay.errors import ConfigError

    suite: Any
    try:
        if args.suite == "codec":
            suite = codec_bench
            config: Any = codec_bench.CodecBenchConfig(
                num_tokens=args.tokens,
                num_layers=args.layers,
                top_k=args.top_k,
                num_experts=args.experts,
                repeats=args.repeats or 5,
                seed=args.seed,
            )
        elif args.suite == "layout":
            suite = layout_bench
            config = layout_bench.LayoutBenchConfig(
                sequences=args.sequences,
                seq=args.seq or 4096,
                layers=args.layers,
                top_k=args.top_k,
                experts=args.experts,
                sp=args.sp,
                rank=min(1, args.sp - 1),
                repeats=args.repeats or 7,
                seed=args.seed,
            )
        elif args.suite == "engine":
            suite = engine_bench
            config = engine_bench.EngineBenchConfig(repeats=args.repeats or 5, seed=args.seed)
        else:
            suite = replay_bench
            config = replay_bench.ReplayBenchConfig(
                batch=args.batch, seq=args.seq or 256, repeats=args.repeats or 7, seed=args.seed
            )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as progress:
        task = progress.add_task(f"bench {args.suite}", total=None)
        result = suite.run(config, lambda name: progress.update(task, description=f"{args.suite}: {name}"))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(suite.markdown(result))
        print()
        for name, target in result["targets"].items():
            mark = "met" if target["met"] else "MISSED"
            print(f"target {name}: {target['value']:.4g} {target['direction']} {target['target']}  [{mark}]")
    return 0
