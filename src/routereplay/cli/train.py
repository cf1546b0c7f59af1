"""`routereplay train`: GRPO on the demo task with router replay off, R2 or R3.

The built-in engine (bf16, weights synced every step) samples by default. `--engine vllm` without
`--url` runs a real vLLM in this process (`engines.vllm.colocated.VLLMEngine`, routes on) and syncs
the trainer's weights into it every step; the model must be one vLLM's CPU backend serves (the demo
models are served through their vLLM-servable variant, head_dim 64, cached under its own key;
deepseek_v3 has none, so pass `--model`). `--engine vllm|sglang --url URL`
samples from a remote server started with `--enable-return-routed-experts` instead; that server's
weights are not updated (a note says so), so its rollouts come from a fixed policy. Per step the
command reports reward, engine-vs-trainer routing disagreement and k3 KL, routing drift from the
old-log-prob pass to the updates, ppo_kl, clip fraction, grad norm, fallback rows and time. It can
also write a JSONL log and a per-step plot.

`--async` trains fully-asynchronously (`rl.async_grpo`): the engine keeps sampling while the trainer
updates, each weight sync aborts the in-flight requests at a token boundary and resumes them under
the new version, and the trainer takes groups at most `--max-staleness` versions old. How a resumed
prefix's routes are kept is `--resume-routes` (default: prefix-replay, with the built-in engine and
with vLLM alike: the resumed prefill is forced to the prefix's sampling routes, inside vLLM through the
routereplay vLLM plugin).
The table then adds the policy version, stale rows, aborts, resumes, prefix conflicts, dropped groups
and samples per second. `--schedule seeded` makes the aborts land where a seeded schedule says. With
the built-in engine, `--async` runs it in a child process (`engines.hf.HFProcessEngine`), so
rollouts and training overlap instead of sharing the GIL; `--rollout-in-thread` keeps it in this
process (the rollout thread's engine, as before).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from routereplay.cli.arguments import (
    add_json_argument,
    any_case,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    seed_int,
    token_range,
)
from routereplay.cli.step_tables import render, render_async, step_rows
from routereplay.cli.threads import add_threads_argument

# stdout carries the command's table or --json: vLLM's own log (stdout by default) goes to stderr; its level is
# ERROR unless VLLM_LOGGING_LEVEL is set (engines.vllm.workarounds.quiet_vllm_logs, when vLLM is imported)
VLLM_CLI_LOGGING = {"VLLM_LOGGING_STREAM": "ext://sys.stderr"}
MODES = ("off", "R2", "R3")  # --mode, spelled in any case


def vllm_logs_to_stderr() -> None:
    """vLLM's own log to stderr (`VLLM_CLI_LOGGING`, unless the user set it): stdout carries the table / --json.

    Called before vLLM is imported (it configures its logging on import) by every command that runs vLLM.
    """
    for variable, value in VLLM_CLI_LOGGING.items():
        os.environ.setdefault(variable, value)


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "train",
        help="GRPO on the demo task with router replay off, R2 or R3",
        description=(
            "Train the demo model (or --model) with a small GRPO: rollouts -> old log-probs -> several update "
            "mini-steps. --mode R2 replays the trainer's own old-log-prob routing in every mini-step; --mode R3 "
            "replays the engine's routes in the old-log-prob pass and every mini-step; off routes naturally."
        ),
        epilog=(
            "examples:\n  routereplay train --mode R3 --steps 5\n"
            "  routereplay train --mode R2 --steps 3 --log r2.jsonl --plot r2.png\n"
            "  routereplay train --mode R3 --engine vllm --model ./ckpt   (colocated vLLM, weights synced)\n"
            "  routereplay train --mode R3 --engine sglang --url http://127.0.0.1:30000 --model ./ckpt"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--mode",
        type=any_case(*MODES),
        choices=MODES,
        default="off",
        help="router replay: off (default), R2 (the trainer's own routing) or R3 (the engine's routes), in any case",
    )
    parser.add_argument("--steps", type=positive_int, default=4, help="training steps (default 4)")
    group = parser.add_argument_group("model and engine")
    group.add_argument(
        "--arch", choices=["qwen3_moe", "deepseek_v3"], default="qwen3_moe", help="demo model architecture"
    )
    group.add_argument("--model", help="a local HF MoE checkpoint folder (with tokenizer) instead of the demo model")
    group.add_argument(
        "--train-steps", type=positive_int, default=800, help="supervised steps of the demo model (default 800)"
    )
    group.add_argument("--engine", choices=["hf", "vllm", "sglang"], default="hf", help="rollout engine (default hf)")
    group.add_argument(
        "--url",
        help="server URL for --engine sglang (needed) or vllm (optional: without it vLLM runs in this process, "
        "weights synced every step; a remote server's weights are never synced); refused with --engine hf",
    )
    group.add_argument("--served-model", help="model name the remote server serves (default: --model's folder name)")
    rl = parser.add_argument_group("GRPO")
    rl.add_argument("--prompts-per-step", type=positive_int, default=32, help="prompts per step (default 32)")
    rl.add_argument("--group-size", type=positive_int, default=4, help="samples per prompt (default 4)")
    rl.add_argument("--mini-steps", type=positive_int, default=4, help="policy-update mini-steps per batch (default 4)")
    rl.add_argument("--lr", type=positive_float, default=3e-4, help="AdamW learning rate (default 3e-4)")
    rl.add_argument(
        "--kl-coef", type=non_negative_float, default=0.0, help="k3 KL to a frozen reference (default 0: off)"
    )
    rl.add_argument(
        "--reference-routing", choices=["natural", "replay"], default="natural", help="how the reference model routes"
    )
    rl.add_argument("--max-new-tokens", type=positive_int, default=5, help="tokens sampled per prompt (default 5)")
    rl.add_argument("--seed", type=seed_int, default=0, help="seed of prompts and sampling")
    fully = parser.add_argument_group("fully-async (--async)")
    fully.add_argument(
        "--async",
        dest="fully_async",
        action="store_true",
        help="sample on while the trainer trains; weight syncs abort and resume in-flight requests",
    )
    fully.add_argument(
        "--max-staleness",
        type=non_negative_int,
        default=1,
        help="train on groups whose oldest token is at most this many policy versions old (default 1)",
    )
    fully.add_argument(
        "--resume-routes",
        choices=["prefix-replay", "first", "latest"],
        help="routes of a resumed prefix: prefix-replay (the engine forces them on the resumed prefill), first "
        "(routes at sampling), latest (the resumed call's, verl's fix). Default: the best the engine supports",
    )
    fully.add_argument(
        "--schedule",
        choices=["threaded", "seeded"],
        default="threaded",
        help="threaded: a real rollout thread (default); seeded: aborts where a seeded schedule says (reproducible)",
    )
    fully.add_argument(
        "--sync-tokens",
        type=token_range,
        default=(1, 3),
        metavar="LOW,HIGH",
        help="seeded schedule: engine tokens one trainer step lasts, drawn in [LOW, HIGH] (default 1,3)",
    )
    fully.add_argument(
        "--rollout-in-thread",
        action="store_true",
        help="--engine hf: run the engine in this process (a rollout thread) instead of a child process (default)",
    )
    fully.add_argument(
        "--in-flight",
        type=positive_int,
        help="prompt groups kept in flight (default 2 x --prompts-per-step)",
    )
    out = parser.add_argument_group("output")
    out.add_argument(
        "--log",
        help='append to this JSONL file a run record ({"run": ...}: start time, version, every option), then '
        "one JSON record per step; earlier runs in the file are kept (checked before any work, as are the next)",
    )
    out.add_argument("--plot", help="write a per-step plot (PNG) here, after the table")
    out.add_argument("--tensorboard", help="also log scalars to this tensorboard folder (needs tensorboard)")
    add_threads_argument(group)
    add_json_argument(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from routereplay.cli.extras import require, require_vllm

    needs = {"transformers": "the model and the trainer"}
    if args.plot:
        needs["matplotlib"] = f"--plot {args.plot}"
    if args.tensorboard:
        needs["tensorboard"] = f"--tensorboard {args.tensorboard}"
    if args.engine != "hf" and args.url:
        needs["httpx"] = f"--engine {args.engine} (the remote client)"
    _check_engine(args)
    _check_async(args)
    colocated = args.engine == "vllm" and not args.url
    if colocated:  # looked up before any heavy import (vLLM's takes seconds)
        require_vllm("train --engine vllm", "(an in-process vLLM; or pass --url for a server)")
    require("train", needs)  # before training the demo model, not after
    _check_outputs(args)
    if colocated:
        _check_colocated(args)  # vLLM importable, the demo model servable: before any training

    import transformers

    from routereplay.cli.progress import phase_progress
    from routereplay.rl.grpo import GRPOConfig, GRPOTrainer
    from routereplay.rl.model import load_checkpoint, load_or_train
    from routereplay.rl.tasks import AdditionTask
    from routereplay.threads import ThreadPolicy

    ThreadPolicy(threads=args.threads).apply()  # the whole command: training, engine and GRPO steps
    transformers.utils.logging.disable_progress_bar()
    config = GRPOConfig(
        mode=args.mode,
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        mini_steps=args.mini_steps,
        lr=args.lr,
        kl_coef=args.kl_coef,
        reference_routing=args.reference_routing,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
    )
    if args.url:
        print(
            f"note: --url {args.url}: the remote {args.engine} server's weights are not synced with the trainer, "
            "so every step samples from the policy it was started with"
            + (
                " (drop --url to run vLLM in this process with weights synced every step)"
                if args.engine == "vllm"
                else ""
            ),
            file=sys.stderr,
        )
    if args.log:
        _log_run_start(args)
    with phase_progress() as report:
        if args.model:
            model, tokenizer = load_checkpoint(args.model)
        else:
            model, tokenizer, _ = load_or_train(
                args.arch,
                vllm=colocated,  # the servable variant (head_dim 64, own cache key) for the in-process vLLM
                threads=args.threads,
                steps=args.train_steps,
                progress=lambda step, steps, _loss: report("training the demo model (cached)", step, steps),
            )
        task = AdditionTask(tokenizer)
        engine = _engine(args, model, tokenizer)
        owned = colocated or _engine_process(args)  # engines this command started and must stop
        try:
            trainer: Any
            if not args.fully_async:
                trainer = GRPOTrainer(model, task, engine, config, log_path=args.log, tensorboard_dir=args.tensorboard)
            else:
                from routereplay.rl.async_grpo import AsyncConfig, AsyncGRPOTrainer

                fully = AsyncConfig(
                    max_staleness=args.max_staleness,
                    in_flight_groups=args.in_flight or 0,
                    resume_routes=args.resume_routes,
                    schedule=args.schedule,
                    sync_tokens=args.sync_tokens,
                )
                trainer = AsyncGRPOTrainer(
                    model, task, engine, config, fully, log_path=args.log, tensorboard_dir=args.tensorboard
                )
            phase = f"{'async ' if args.fully_async else ''}GRPO steps ({config.mode})"
            report(phase, 0, config.steps)
            history = trainer.train(lambda _phase, done, total: report(phase, done, total))  # one bar, up to its total
        finally:
            if owned:
                engine.close()
    # the numbers first: a plot that cannot be written (disk full) must not lose the steps' table
    if args.json:
        print(json.dumps(history, indent=2), flush=True)
    elif args.fully_async:
        render_async(history)
    else:
        render(history)
    if args.plot:
        from pathlib import Path

        from routereplay.cli.failure import naming
        from routereplay.report.plots import plot_steps

        with naming(args.plot):
            plot_steps({"modes": {config.mode: {}}, "steps": step_rows(history)}, Path(args.plot))
    return 0


def _check_outputs(args: argparse.Namespace) -> None:
    """--log, --plot and --tensorboard refused before any work when they cannot be written (`cli/outputs.py`)."""
    from routereplay.cli.outputs import check_output_file, check_output_folder

    if args.log:
        check_output_file("--log", args.log, appends=True)
    if args.plot:
        check_output_file("--plot", args.plot)
    if args.tensorboard:
        check_output_folder("--tensorboard", args.tensorboard)


def _check_async(args: argparse.Namespace) -> None:
    """Refuse async options without --async, and --async with a remote server, before any work."""
    from routereplay.errors import ConfigError

    given = [
        flag
        for flag, value, default in (
            ("--resume-routes", args.resume_routes, None),
            ("--schedule", args.schedule, "threaded"),
            ("--sync-tokens", args.sync_tokens, (1, 3)),
            ("--in-flight", args.in_flight, None),
            ("--max-staleness", args.max_staleness, 1),
            ("--rollout-in-thread", args.rollout_in_thread, False),
        )
        if value != default
    ]
    if given and not args.fully_async:
        verb = "applies" if len(given) == 1 else "apply"
        raise ConfigError(f"{', '.join(given)} only {verb} to fully-async training: add --async")
    if args.rollout_in_thread and args.engine != "hf":
        raise ConfigError(
            f"--rollout-in-thread chooses where the built-in engine runs; --engine {args.engine} runs where it "
            "always does: drop --rollout-in-thread"
        )
    if args.fully_async and args.url:
        raise ConfigError(
            f"--async syncs weights into the engine while it samples, and a remote server's (--url {args.url}) "
            "never are: drop --url (built-in engine, or --engine vllm in this process)"
        )


def _check_engine(args: argparse.Namespace) -> None:
    """Refuse, before any work, an engine choice and a --url that contradict each other."""
    from routereplay.errors import ConfigError

    if args.url is not None and not args.url.strip():
        raise ConfigError(
            f"--url {args.url!r} is empty: pass the server's URL (with --engine vllm or --engine sglang), or drop "
            "--url for the built-in engine"
        )
    if args.url and not args.url.startswith(("http://", "https://")):
        raise ConfigError(
            f"--url {args.url}: a server URL starts with http:// or https:// (e.g. http://127.0.0.1:8000, where "
            "`vllm serve` or SGLang's server listens); pass the URL the server printed"
        )
    if args.url and args.engine == "hf":
        raise ConfigError(
            f"--url {args.url} names a remote server, but --engine is hf (the default: the built-in engine in "
            "this process, which would ignore it); add --engine vllm or --engine sglang for that server, or drop --url"
        )
    if args.engine == "sglang" and not args.url:
        raise ConfigError("--engine sglang needs --url (the server started with --enable-return-routed-experts)")


def _log_run_start(args: argparse.Namespace) -> None:
    """Append the run record that starts this run's lines in --log (earlier runs in the file are kept)."""
    import datetime

    from routereplay import __version__
    from routereplay.cli.failure import naming

    record = {
        "run": {
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "routereplay": __version__,
            "options": {name: value for name, value in sorted(vars(args).items()) if name not in ("func", "command")},
        }
    }
    with naming(args.log), open(args.log, "a", encoding="utf-8") as stream:
        stream.write(json.dumps(record) + "\n")


def _check_colocated(args: argparse.Namespace) -> None:
    """Refuse `--engine vllm` without `--url` early: vLLM missing, or a demo arch without a servable variant."""
    from routereplay.engines.vllm.colocated import import_vllm

    vllm_logs_to_stderr()
    import_vllm()  # MissingDependencyError naming the extra
    if args.model:
        return  # checked when the engine starts (VLLMEngine), after loading
    from routereplay.rl.model import vllm_overrides

    vllm_overrides(args.arch)  # the demo model's vLLM-servable variant; UnservableModelError if the arch has none


def _engine_process(args: argparse.Namespace) -> bool:
    """Whether the built-in engine runs in a child process: --async with --engine hf, unless --rollout-in-thread."""
    return args.engine == "hf" and args.fully_async and not args.rollout_in_thread


def _engine(args: argparse.Namespace, model: Any, tokenizer: Any) -> Any:
    from pathlib import Path

    from routereplay.engines.hf import HFEngine
    from routereplay.runtime import attach

    if _engine_process(args):
        from routereplay.engines.hf import HFProcessEngine

        return HFProcessEngine(model, threads=args.threads)  # the rollouts overlap training outside the GIL
    if args.engine == "hf":
        return HFEngine(model)
    if args.engine == "vllm" and not args.url:
        from routereplay.engines.vllm.colocated import VLLMEngine

        return VLLMEngine(model, tokenizer, policy_version=0)
    probe = attach(model)
    layers, top_k, num_experts = probe.layers, probe.top_k, probe.num_experts
    probe.detach()
    served = args.served_model or (Path(args.model).name if args.model else "routereplay-demo")
    if args.engine == "vllm":
        from routereplay.engines.remote import VLLMClient

        client: Any = VLLMClient(args.url, model=served, num_experts=num_experts, moe_layers=layers, top_k=top_k)
    else:
        from routereplay.engines.remote import SGLangClient

        num_layers = model.config.get_text_config().num_hidden_layers
        client = SGLangClient(
            args.url, model=served, num_layers=num_layers, top_k=top_k, num_experts=num_experts, moe_layers=layers
        )
    client.check_server()
    return client
