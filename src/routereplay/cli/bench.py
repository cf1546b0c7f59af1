"""`routereplay bench SUITE`: measured figures (medians of repeated runs), as a table or --json.

`bench all` runs every suite in one process and writes BENCHMARKS.md (and, with --readme, the
README's summary table) from those records.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import ModuleType
from typing import Any

from routereplay.cli.arguments import add_json_argument, non_negative_int, positive_int, seed_int
from routereplay.cli.threads import add_threads_argument

SUITES = ("codec", "layout", "store", "delivery", "indexer", "replay", "engine")  # what `bench all` runs
# run on their own: `load` spins busy processes and needs an otherwise quiet machine; `vllm` needs routereplay[vllm];
# `async` trains the demo model (cached) and runs nine GRPO runs
SEPARATE_SUITES = ("load", "vllm", "async", "verl", "skyrl", "replay-options")
MODEL_SUITES = ("replay", "engine", "load", "async", "replay-options", "vllm")  # they build transformers models


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="run a benchmark suite (codec, layout, store, delivery, indexer, replay, engine, load, vllm, async, "
        "verl, skyrl, replay-options, all) and print medians",
        description=(
            "Run a benchmark suite; every ratio is measured side by side in the same run. "
            "`codec`: bytes per (token, layer) row and encode/decode speed of routereplay's codec against JSON lists, "
            "SGLang base64 int32, vLLM base64 .npy and raw uint8 on the same random routes. "
            "`layout`: pack + Ulysses SP shard of a padded batch of routes (64 x 4096 tokens, 48 layers, top-8) with "
            "routereplay's vectorised transforms against the per-sequence loop framework glue uses. "
            "`store`: driver memory of a 512-sample x 8k-token Qwen3-30B-A3B batch's routes in the compact RouteStore "
            "(encoded) against one int16 array per sample and dense padded int16/int32 tensors, and its encode time. "
            "`delivery`: random-access decode of one rank's rows against the whole sample; DP=4 delivery over 4 gloo "
            "processes of per-rank compact bundles against a broadcast of the dense padded batch (bytes per rank, "
            "wall time); vLLM HTTP responses to every SP rank's replay-ready tensor, rows/s and each stage's share. "
            "`indexer`: bytes of the compact DSA indexer choices (IndexerTrace blob) against dense int32 on a "
            "recency-biased and a uniform synthetic case, and encode/decode speed. "
            "`replay`: forward + backward step time of a Qwen3-MoE-shaped model with routers off, recording and "
            "replaying. `engine`: the built-in engine's generation time with and without route capture. "
            "`load`: the demo model's training steps, the demo and one GRPO step, quiet and with --busy processes "
            "spinning on the cores (loaded / quiet; not part of `all`). "
            "`vllm`: a real in-process vLLM's generation time with route capture on and off (interleaved), and "
            "its colocated sync_weights time (needs routereplay[vllm]; not part of `all`). "
            "`async`: fully-async GRPO's resume-route policies (latest, first, prefix-replay) under off, R2 and R3 "
            "on one seeded schedule, and async vs sync samples per second (not part of `all`). "
            "`verl`: bytes per sample of a verl batch's routes, routereplay's compact blobs against verl 0.9.1's dense "
            "and jagged int16 (Qwen3-30B-A3B shape; no verl needed; not part of `all`). "
            "`skyrl`: bytes per sample of a SkyRL 0.4.0 batch's routes, routereplay's compact blobs against SkyRL's "
            "wire envelope, generator array and packed batch field (Qwen3-30B-A3B shape; no SkyRL needed; not part of "
            "`all`). "
            "`replay-options`: the demo's engine / trainer mismatch (k3 KL, mean |delta log p|, routing disagreement, "
            "replace rate) under off, R3 ids, R3 ids + combine weights and threshold replay, side by side, and the "
            "bytes per row of the weights (not part of `all`). "
            "`all`: every suite, then BENCHMARKS.md (--output) and the README table (--readme). "
            "Every suite runs torch on --threads N intra-op threads (default: OMP_NUM_THREADS if set, else 1) and "
            "prints the load average at its start and end; how long each suite takes: docs/benchmarks.md. "
            "Progress goes to stderr, with the time left once a repeat has finished."
        ),
    )
    parser.add_argument("suite", choices=(*SUITES, *SEPARATE_SUITES, "all"), help="which benchmark to run")
    sizes = parser.add_argument_group("sizes (defaults are the figures quoted in BENCHMARKS.md)")
    sizes.add_argument("--tokens", type=positive_int, default=32768, help="codec: tokens T (default 32768)")
    sizes.add_argument(
        "--layers", type=positive_int, default=48, help="codec, layout, store, skyrl: MoE layers L (default 48)"
    )
    sizes.add_argument("--top-k", type=positive_int, default=8, help="top-k K (default 8)")
    sizes.add_argument("--experts", type=positive_int, default=128, help="experts E (default 128)")
    sizes.add_argument("--batch", type=positive_int, default=8, help="replay: batch rows (default 8)")
    sizes.add_argument("--seq", type=positive_int, help="replay: tokens per row (256); layout: padded length (4096)")
    sizes.add_argument("--sequences", type=positive_int, default=64, help="layout: sequences in the batch (default 64)")
    sizes.add_argument(
        "--sp", type=positive_int, default=4, help="layout, delivery: Ulysses sequence-parallel size (default 4)"
    )
    sizes.add_argument("--dp", type=positive_int, default=4, help="delivery: data-parallel gloo ranks (default 4)")
    sizes.add_argument(
        "--samples", type=positive_int, help="store: samples in the batch (default 512); delivery, skyrl: (default 64)"
    )
    sizes.add_argument(
        "--max-len",
        type=positive_int,
        default=8192,
        help="store, delivery, skyrl: longest sample in tokens (default 8192)",
    )
    sizes.add_argument(
        "--shape", choices=("tiny", "qwen3-30b-a3b"), default="tiny", help="replay: model layer shapes (default tiny)"
    )
    sizes.add_argument("--replay-layers", type=positive_int, default=8, help="replay: decoder layers (default 8)")
    sizes.add_argument("--device", default="cpu", help="replay, layout: torch device, e.g. cuda (default cpu)")
    sizes.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="replay: dtype")
    sizes.add_argument("--repeats", type=positive_int, help="timed repeats per measurement (default: per suite)")
    sizes.add_argument("--seed", type=seed_int, default=0, help="seed of the random routes and inputs")
    sizes.add_argument("--quick", action="store_true", help="small sizes for a smoke run (figures not comparable)")
    sizes.add_argument(
        "--rl-steps", type=positive_int, default=24, help="async: trainer steps per resume-policy run (default 24)"
    )
    sizes.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="async: the rollout engine of the resume-policy runs: hf (built-in) or vllm (in-process vLLM; "
        "prefix-replay forced inside vLLM; no throughput part); replay-options: the built-in engine (hf) or an "
        "in-process vLLM on CPU whose plugin captures the combine weights (vllm)",
    )
    load = parser.add_argument_group("load")
    load.add_argument(
        "--busy", type=non_negative_int, default=2, help="load: busy processes started for the loaded half (default 2)"
    )
    add_threads_argument(parser)  # every suite (`bench.conditions.run_suite`)
    out = parser.add_argument_group("output")
    out.add_argument("--markdown", action="store_true", help="print the markdown tables (the default unless --json)")
    out.add_argument("--output", type=Path, default=Path("BENCHMARKS.md"), help="all: file to write (BENCHMARKS.md)")
    out.add_argument("--readme", type=Path, help="all: also replace the README table between the bench markers")
    add_json_argument(parser)
    parser.set_defaults(func=run)


def _suite(name: str, args: argparse.Namespace) -> tuple[ModuleType, Any]:
    """The benchmark module of `name` and its config from the command line."""
    from routereplay.bench import codec, delivery, engine, layout, load, replay, store

    quick = args.quick
    repeats = args.repeats or (2 if quick else None)
    if name == "codec":
        return codec, codec.CodecBenchConfig(
            num_tokens=512 if quick else args.tokens,
            num_layers=args.layers,
            top_k=args.top_k,
            num_experts=args.experts,
            repeats=repeats or 5,
            seed=args.seed,
        )
    if name == "layout":
        return layout, layout.LayoutBenchConfig(
            sequences=4 if quick else args.sequences,
            seq=64 if quick else args.seq or 4096,
            layers=args.layers,
            top_k=args.top_k,
            experts=args.experts,
            sp=args.sp,
            rank=min(1, max(args.sp - 1, 0)),
            repeats=repeats or 7,
            seed=args.seed,
            device=args.device,
        )
    if name == "store":
        return store, store.StoreBenchConfig(
            samples=4 if quick else args.samples or 512,
            seq=256 if quick else args.max_len,
            min_len=32 if quick else min(1024, args.max_len),
            layers=args.layers,
            top_k=args.top_k,
            experts=args.experts,
            repeats=repeats or 3,
            seed=args.seed,
        )
    if name == "delivery":
        return delivery, delivery.DeliveryBenchConfig(
            samples=max(4, args.dp) if quick else args.samples or 64,
            seq=256 if quick else args.max_len,
            min_len=32 if quick else min(1024, args.max_len),
            layers=args.layers,
            top_k=args.top_k,
            experts=args.experts,
            dp=args.dp,
            sp=args.sp,
            window=16 if quick else 64,
            repeats=repeats or 5,
            access_repeats=repeats or 11,
            seed=args.seed,
        )
    if name == "indexer":
        from routereplay.bench import indexer

        return indexer, indexer.IndexerBenchConfig(
            num_tokens=256 if quick else 4096,
            index_topk=32 if quick else 512,
            repeats=repeats or 5,
            seed=args.seed,
        )
    if name == "load":
        return load, load.LoadBenchConfig(
            repeats=repeats or 3,
            busy_processes=args.busy,
            train_steps=2 if quick else 5,
            prompts=8 if quick else 64,
            grpo_prompts=4 if quick else 8,
            threads=args.threads,
            seed=args.seed,
        )
    if name == "async":
        from routereplay.bench import fully_async

        if args.engine == "vllm":
            from routereplay.cli.train import vllm_logs_to_stderr

            vllm_logs_to_stderr()
        return fully_async, fully_async.AsyncBenchConfig(
            engine=args.engine,
            steps=2 if quick else args.rl_steps,
            prompts_per_step=4 if quick else 16,
            throughput_steps=2 if quick else 6,
            repeats=repeats or 3,
            seed=args.seed,
        )
    if name == "replay-options":
        if args.engine == "vllm":
            from routereplay.bench import colocated_options
            from routereplay.cli.train import vllm_logs_to_stderr

            vllm_logs_to_stderr()
            return colocated_options, colocated_options.VLLMOptionsBenchConfig(
                prompts=16 if quick else 1024, max_new_tokens=3 if quick else 5, seed=args.seed
            )
        from routereplay.bench import options

        return options, options.OptionsBenchConfig(
            engine=args.engine, prompts=64 if quick else 1024, max_new_tokens=3 if quick else 5, seed=args.seed
        )
    if name == "engine":
        return engine, engine.EngineBenchConfig(prompts=8 if quick else 256, repeats=repeats or 11, seed=args.seed)
    if name == "verl":
        from routereplay.bench import verl_routes

        return verl_routes, verl_routes.VerlRoutesBenchConfig(samples=4 if quick else 64, seed=args.seed)
    if name == "skyrl":
        from routereplay.bench import skyrl_routes

        return skyrl_routes, skyrl_routes.SkyRLRoutesBenchConfig(
            layers=args.layers,
            top_k=args.top_k,
            experts=args.experts,
            samples=4 if quick else args.samples or 64,
            min_tokens=min(1024, args.max_len),
            max_tokens=args.max_len,
            seed=args.seed,
        )
    if name == "vllm":
        from routereplay.bench import vllm
        from routereplay.cli.train import vllm_logs_to_stderr

        vllm_logs_to_stderr()

        return vllm, vllm.VLLMBenchConfig(
            prompts=4 if quick else 64,
            max_new_tokens=4 if quick else 16,
            repeats=repeats or 5,
            sync_repeats=repeats or 5,
            seed=args.seed,
        )
    return replay, replay.ReplayBenchConfig(
        batch=1 if quick else args.batch,
        seq=16 if quick else args.seq or 256,
        layers=args.replay_layers,
        repeats=repeats or 21,
        seed=args.seed,
        shape=args.shape,
        device=args.device,
        dtype=args.dtype,
    )


def run(args: argparse.Namespace) -> int:
    from routereplay.errors import ConfigError

    _check_vllm(args)  # before any heavy import: a missing vLLM is named at once, not after minutes
    if args.suite == "async" and args.threads is not None:
        raise ConfigError(
            f"--threads {args.threads}: bench async times fixed thread counts side by side (synchronous GRPO on 1 and "
            "on 2 intra-op threads, fully-async on 1), so it takes no --threads: drop it"
        )
    if args.suite == "all":  # BENCHMARKS.md (and the README) are written after minutes of measuring
        from routereplay.cli.outputs import check_output_file

        check_output_file("--output", args.output)
        if args.readme is not None:
            check_output_file("--readme", args.readme)
            _check_readme(args.readme)
    elif args.readme is not None:
        raise ConfigError(f"--readme {args.readme}: only `bench all` writes the README table; drop --readme")
    names = SUITES if args.suite == "all" else (args.suite,)
    try:
        suites = {name: _suite(name, args) for name in names}
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    from routereplay.bench import record
    from routereplay.bench.conditions import run_suite
    from routereplay.cli.progress import RepeatClock, phase_progress

    if set(names) & set(MODEL_SUITES):
        _quiet_transformers()
    results: dict[str, dict[str, Any]] = {}
    clock = RepeatClock()
    with phase_progress() as progress:
        for name, (module, config) in suites.items():
            phase = f"bench {name}"

            def report(step: str, phase: str = phase) -> None:
                progress(phase, 0, None, clock.annotate(phase, step))

            progress(phase, 0, None)
            results[name] = run_suite(module, config, report, threads=args.threads)
            progress.end(phase)
    if args.quick:
        record.ungrade(results, "--quick sizes are not comparable with the targets")
    if args.suite == "all":
        renderers = {name: module.markdown for name, (module, _) in suites.items()}
        command = "routereplay bench all" + (" --quick" if args.quick else "")
        args.output.write_text(record.benchmarks_markdown(results, renderers, command), encoding="utf-8")
        if args.readme is not None:
            record.write_readme_table(args.readme, record.summary_table(results))
    if args.json:
        print(json.dumps(results if args.suite == "all" else results[args.suite], indent=2))
        return 0
    for name, (module, _) in suites.items():
        print(record.conditions_line(results[name]))
        print()
        print(module.markdown(results[name]))
        print()
        for goal_name, goal in results[name]["targets"].items():
            mark = record.grade(goal)
            print(f"target {goal_name}: {goal['value']:.4g} {goal['direction']} {goal['target']}  [{mark}]")
        print()
    if args.suite == "all":
        print(f"wrote {args.output}" + (f" and the table in {args.readme}" if args.readme else ""))
    return 0


MAX_README_BYTES = 16 << 20  # a README larger than this is not the one meant


def _check_vllm(args: argparse.Namespace) -> None:
    """The suites that run a real vLLM: vLLM found (without importing it) before anything heavy is imported."""
    from routereplay.cli.extras import require_vllm

    if args.suite == "vllm":
        require_vllm("bench vllm", "(a real vLLM's route capture)")
    elif args.suite in ("async", "replay-options") and args.engine == "vllm":
        require_vllm(f"bench {args.suite} --engine vllm", "(an in-process vLLM)")


def _quiet_transformers() -> None:
    """transformers' own progress bars ("Loading weights") off: the bench draws its own progress on stderr."""
    try:
        import transformers
    except ImportError:  # the suites that need it say so
        return
    transformers.utils.logging.disable_progress_bar()


def _check_readme(path: Path) -> None:
    """`--readme PATH` must already hold the bench markers: refused now, not after the whole run."""
    from routereplay.bench.record import BEGIN, END
    from routereplay.errors import ConfigError

    if not path.is_file():
        raise ConfigError(
            f"--readme {path} does not exist (or is not a file); `bench all --readme` replaces the table between "
            f"the {BEGIN} ... {END} markers of an existing README: name that file"
        )
    if path.stat().st_size > MAX_README_BYTES:
        raise ConfigError(f"--readme {path} is above {MAX_README_BYTES} bytes: not a README; name the README")
    text = path.read_text(encoding="utf-8", errors="replace")
    if BEGIN not in text or END not in text or text.index(BEGIN) > text.index(END):
        raise ConfigError(
            f"--readme {path} has no {BEGIN} ... {END} markers (in that order); add them where the table belongs, "
            "or drop --readme"
        )
