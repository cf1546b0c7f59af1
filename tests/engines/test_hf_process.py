"""The built-in engine in a child process: the same rollouts as in process, stops, prefix replay, weight
syncs, errors carried back, a killed child, and no child left behind."""

from __future__ import annotations

import copy
import gc
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from routereplay.cli.main import EXIT_ERROR
from routereplay.engines.hf import HFEngine, HFProcessEngine, Rollout, SamplingParams, TokenBudget
from routereplay.errors import (
    ConfigError,
    EngineProcessDiedError,
    EngineProcessError,
    EngineProcessRaisedError,
    NoRoutersError,
    TokenMismatchError,
    WeightSyncError,
)
from routereplay.threads import ThreadPolicy
from routereplay.trace.route_trace import RouteTrace
from tests.engines.raising_model import RaisingModel
from tests.runtime.models import tiny_qwen3

pytestmark = pytest.mark.hf

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
PARAMS = [
    SamplingParams(max_new_tokens=6, seed=3),
    SamplingParams(max_new_tokens=8, seed=1, eos_token_id=3, temperature=2.0),
    SamplingParams(max_new_tokens=5, seed=7, top_p=0.8, pad_token_id=1),
]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_qwen3()


@pytest.fixture(scope="module")
def engines(model: torch.nn.Module) -> Iterator[tuple[HFProcessEngine, HFEngine]]:
    """One engine process and one in-process engine built from the same model and dtype (bf16)."""
    with HFProcessEngine(model) as process:
        yield process, HFEngine(model)


def _recorder(calls: list[tuple[int, int]]) -> Callable[[int, int], None]:
    """A progress callback that appends each (step, total) to `calls`."""

    def record(step: int, total: int) -> None:
        calls.append((step, total))

    return record


def _engine_children() -> set[int | None]:
    return {p.pid for p in multiprocessing.active_children() if p.name == "routereplay-engine"}


def test_same_seed_same_rollouts_as_in_process(engines: tuple[HFProcessEngine, HFEngine]) -> None:
    """A child that computes otherwise (other weights, dtype, threads or sampling state): with the same seed
    the engine process returns exactly the in-process engine's tokens, log-probs, traces and flags."""
    process, local = engines
    for params in PARAMS:
        assert process.generate(PROMPTS, params) == local.generate(PROMPTS, params)
    assert process.child_threads == process.threads == ThreadPolicy().choose(torch.get_num_threads()).threads


def test_dtype_capture_and_version_options_reach_the_child(model: torch.nn.Module) -> None:
    """Options dropped on the way to the child: fp32 without capture and a starting policy version give
    what HFEngine gives with the same options (no traces), and prefix replay is refused alike."""
    local = HFEngine(model, dtype=torch.float32, capture=False, policy_version=4)
    with HFProcessEngine(model, dtype=torch.float32, capture=False, policy_version=4, threads=2) as process:
        assert process.child_threads == 2 and process.policy_version == 4
        rollouts = process.generate(PROMPTS, PARAMS[0])
        assert rollouts == local.generate(PROMPTS, PARAMS[0]) and all(r.trace is None for r in rollouts)
        with pytest.raises(ConfigError, match="prefix_routes needs route capture"):
            process.generate(PROMPTS, PARAMS[0], prefix_routes=[None] * 3)


def test_token_budget_stops_exactly_where_in_process_does(engines: tuple[HFProcessEngine, HFEngine]) -> None:
    """Inexact async schedule with the engine process: a TokenBudget is evaluated in the child, so the
    partial rollouts (aborted flags, routes of every fed position) equal the in-process engine's."""
    process, local = engines
    params = PARAMS[0]
    for tokens in (0, 1, 3, params.max_new_tokens):
        stopped = process.generate(PROMPTS, params, stop=TokenBudget(tokens))
        assert stopped == local.generate(PROMPTS, params, stop=TokenBudget(tokens))
        assert all(len(r.response_ids) == tokens for r in stopped)
        assert all(r.aborted == (tokens < params.max_new_tokens) for r in stopped)
    with pytest.raises(ConfigError, match="budget must be an integer >= 0"):
        TokenBudget(-1)


def test_callable_stop_lands_one_boundary_after_the_decision(engines: tuple[HFProcessEngine, HFEngine]) -> None:
    """A stop the child never sees, or that lands anywhere: the parent's callable is asked at every
    boundary the child reaches, and its yes at boundary k ends the call at boundary k + 1, exactly;
    progress comes back step by step as in process."""
    process, local = engines
    params = PARAMS[0]
    for decision in (0, 2):
        asked: list[int] = []
        steps: list[tuple[int, int]] = []

        def stop(sampled: int, decision: int = decision, asked: list[int] = asked) -> bool:
            asked.append(sampled)
            return sampled >= decision

        rollouts = process.generate(PROMPTS, params, _recorder(steps), stop=stop)
        local_steps: list[tuple[int, int]] = []
        expected = local.generate(PROMPTS, params, _recorder(local_steps), stop=TokenBudget(decision + 1))
        assert rollouts == expected and steps == local_steps
        assert asked == list(range(decision + 2))


def test_a_failing_stop_or_progress_raises_and_the_engine_goes_on(engines: tuple[HFProcessEngine, HFEngine]) -> None:
    """A caller's exception lost in the pipe, or leaving a verdict behind for the next call: it raises in
    the parent, and the next call is answered as if nothing had happened."""
    process, local = engines

    def stop(sampled: int) -> bool:
        if sampled == 2:
            raise KeyError("stop failed")
        return False

    def progress(step: int, total: int) -> None:
        raise LookupError("progress failed")

    with pytest.raises(KeyError, match="stop failed"):
        process.generate(PROMPTS, PARAMS[0], stop=stop)
    with pytest.raises(LookupError, match="progress failed"):
        process.generate(PROMPTS, PARAMS[0], progress)
    assert process.generate(PROMPTS, PARAMS[1]) == local.generate(PROMPTS, PARAMS[1])


def test_prefix_routes_replay_the_resumed_prefix(engines: tuple[HFProcessEngine, HFEngine]) -> None:
    """Engine-side prefix replay lost across the process boundary: a resumed call's prefill replays the
    first call's routes (its trace's rows equal them) and the continuation equals the in-process one."""
    process, local = engines
    params = PARAMS[0]
    first = process.generate(PROMPTS, params, stop=TokenBudget(2))
    resumed = [r.prompt_ids + r.response_ids for r in first]
    prefix: list[RouteTrace | None] = [r.trace for r in first]
    prefix[2] = None  # a prompt without prefix routes routes live
    again = process.generate(resumed, params, prefix_routes=prefix)
    assert again == local.generate(resumed, params, prefix_routes=prefix)
    for before, after in zip(first[:2], again[:2], strict=True):
        assert before.trace is not None and after.trace is not None
        rows = before.trace.num_tokens
        np.testing.assert_array_equal(after.trace.experts[:rows], before.trace.experts)


def test_sync_weights_then_generate_matches_in_process(
    engines: tuple[HFProcessEngine, HFEngine], model: torch.nn.Module
) -> None:
    """Stale or half-loaded weights in the child: after the same sync, generate equals the in-process
    engine's, under the synced policy version; syncing the first weights back restores the first rollouts;
    a model of another architecture is refused before anything is copied."""
    process, local = engines
    before = process.generate(PROMPTS, PARAMS[0])
    trained = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    try:
        process.sync_weights(trained, policy_version=3)
        fresh = HFEngine(model)
        fresh.sync_weights(trained, policy_version=3)
        after = process.generate(PROMPTS, PARAMS[0])
        assert after == fresh.generate(PROMPTS, PARAMS[0]) and after != before
        assert process.policy_version == 3
        assert all(s.policy_version == 3 for r in after if r.trace is not None for s in r.trace.segments)
        with pytest.raises(WeightSyncError, match="does not match the engine's"):
            process.sync_weights(tiny_qwen3(layers=2), policy_version=4)
        assert process.policy_version == 3
    finally:
        process.sync_weights(model, policy_version=None)
    assert process.generate(PROMPTS, PARAMS[0]) == before == local.generate(PROMPTS, PARAMS[0])


def test_child_errors_reraise_as_themselves(engines: tuple[HFProcessEngine, HFEngine]) -> None:
    """Errors flattened by the process boundary: what the engine raises in the child (misaligned prefix
    routes, a bad argument) raises in the parent with the same type and message, the child's traceback
    as its cause, and the engine keeps working."""
    process, local = engines
    params = PARAMS[0]
    first = local.generate(PROMPTS, params, stop=TokenBudget(2))
    shifted = [[t + 1 for t in r.prompt_ids + r.response_ids] for r in first]  # other tokens than the traces name
    prefix = [r.trace for r in first]
    for prompts, routes, error in (
        (shifted, prefix, TokenMismatchError),
        (PROMPTS, prefix[:1], ConfigError),
    ):
        with pytest.raises(error) as expected:
            local.generate(prompts, params, prefix_routes=routes)
        with pytest.raises(error) as raised:
            process.generate(prompts, params, prefix_routes=routes)
        assert type(raised.value) is type(expected.value) and str(raised.value) == str(expected.value)
        assert isinstance(raised.value.__cause__, EngineProcessError)
        assert "Traceback" in str(raised.value.__cause__)
    assert process.generate(PROMPTS, params) == local.generate(PROMPTS, params)


def test_an_unpicklable_child_error_arrives_named_with_its_traceback() -> None:
    """An error that cannot cross the pipe must not hang or vanish: it arrives as EngineProcessRaisedError
    naming its type, message and the child's traceback."""
    with HFProcessEngine(RaisingModel(), capture=False) as process:
        with pytest.raises(EngineProcessRaisedError, match="UnpicklableError: the forward failed on purpose") as info:
            process.generate(PROMPTS, PARAMS[0])
        assert info.value.type_name.endswith("raising_model.UnpicklableError")
        assert "in forward" in info.value.traceback_text


def test_a_failed_start_reraises_and_leaves_no_child() -> None:
    """A child that fails to build its engine must not leave the caller waiting or a process behind."""
    before = _engine_children()
    with pytest.raises(NoRoutersError):
        HFProcessEngine(torch.nn.Linear(2, 2))
    assert _engine_children() == before


def test_a_killed_child_raises_the_named_error_instead_of_hanging(model: torch.nn.Module) -> None:
    """Hang on a dead engine: a child killed with SIGKILL in the middle of a call raises
    EngineProcessDiedError with its exit code; the engine is closed and refuses further work."""
    process = HFProcessEngine(model)
    pid = process.pid
    assert pid is not None

    def kill(sampled: int) -> bool:
        os.kill(pid, signal.SIGKILL)
        return False

    with pytest.raises(EngineProcessDiedError, match="died with exit code -9 .SIGKILL.") as info:
        process.generate(PROMPTS, PARAMS[0], stop=kill)
    assert info.value.exitcode == -signal.SIGKILL
    assert not process.alive and pid not in _engine_children()
    with pytest.raises(EngineProcessError, match="closed"):
        process.generate(PROMPTS, PARAMS[0])


def test_close_and_garbage_collection_leave_no_live_child(model: torch.nn.Module) -> None:
    """Leaked engine processes: close() (or leaving `with`) and dropping the last reference each stop and
    join the child; a closed engine refuses work by name."""
    with HFProcessEngine(model) as process:
        pid = process.pid
        assert process.alive and pid in _engine_children()
    assert not process.alive and pid not in _engine_children()
    process.close()  # idempotent
    with pytest.raises(EngineProcessError, match="closed"):
        process.sync_weights(model)
    dropped: Any = HFProcessEngine(model)
    pid = dropped.pid
    assert pid in _engine_children()
    del dropped
    gc.collect()
    assert pid not in _engine_children()


def test_seeded_async_training_is_exact_with_the_engine_process() -> None:
    """The async loop's seeded schedule drifting with an engine process: with TokenBudget stops the run is
    record for record the in-process engine's (aborts, resumes, routes, training)."""
    from routereplay.rl.async_grpo import AsyncConfig, AsyncGRPOTrainer
    from routereplay.rl.grpo import GRPOConfig
    from routereplay.rl.model import train_demo_model
    from routereplay.rl.tasks import AdditionTask

    trained, tokenizer = train_demo_model("qwen3_moe", steps=30, num_experts=16, num_hidden_layers=3)
    config = GRPOConfig(mode="R3", steps=3, prompts_per_step=4, group_size=2, mini_steps=2, max_new_tokens=6, seed=3)
    fully = AsyncConfig(schedule="seeded", sync_tokens=(1, 2), max_staleness=2)
    timings = ("seconds", "samples_per_second", "elapsed")

    def run(engine_type: Any) -> list[dict[str, Any]]:
        policy = copy.deepcopy(trained)
        engine = engine_type(policy)
        try:
            history = AsyncGRPOTrainer(policy, AdditionTask(tokenizer), engine, config, fully).train()
        finally:
            if isinstance(engine, HFProcessEngine):
                engine.close()
        return [{k: v for k, v in r.items() if k not in timings} for r in history]

    in_process = run(HFEngine)
    assert run(HFProcessEngine) == in_process
    assert sum(r["aborts"] for r in in_process) > 0, "the schedule aborted nothing: the test would prove little"


def test_rollouts_pickle_whole(engines: tuple[HFProcessEngine, HFEngine]) -> None:
    """Rollouts that lose fields on the way back (traces' token ids, segments): what the child sends is
    what the in-process engine holds, attribute by attribute."""
    process, local = engines
    for got, want in zip(process.generate(PROMPTS, PARAMS[1]), local.generate(PROMPTS, PARAMS[1]), strict=True):
        assert isinstance(got, Rollout) and got.trace is not None and want.trace is not None
        assert got.trace.segments == want.trace.segments
        np.testing.assert_array_equal(got.trace.token_ids, want.trace.token_ids)


@pytest.mark.parametrize(
    ("flags", "engine_type"),
    [
        (["--async"], HFProcessEngine),
        (["--async", "--rollout-in-thread"], HFEngine),
        ([], HFEngine),
    ],
)
def test_train_cli_runs_the_async_engine_in_a_child_process(
    flags: list[str], engine_type: type, model: torch.nn.Module
) -> None:
    """The GIL-bound rollout thread as the CLI's default: `train --async --engine hf` builds the engine
    process, `--rollout-in-thread` (and synchronous training) the in-process engine."""
    from routereplay.cli import train
    from routereplay.cli.main import build_parser

    args = build_parser().parse_args(["train", *flags])
    engine = train._engine(args, model, None)
    try:
        assert type(engine) is engine_type
    finally:
        if isinstance(engine, HFProcessEngine):
            engine.close()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--rollout-in-thread"], "--rollout-in-thread only applies to fully-async training: add --async"),
        (["--async", "--rollout-in-thread", "--engine", "vllm"], "--engine vllm runs where it always does"),
    ],
)
def test_train_cli_refuses_rollout_in_thread_where_it_means_nothing(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Silent no-op flag: --rollout-in-thread without --async, or with another engine than hf, is refused
    before any model is trained."""
    from routereplay.cli.main import main

    assert main(["train", *extra]) == EXIT_ERROR
    assert message in capsys.readouterr().err


def test_interpreter_exit_leaves_no_live_child(tmp_path: Any) -> None:
    """Leaked engine processes, or an exit that hangs on its child: a script that builds the engine and exits
    without closing it ends, and leaves no child behind (closed and joined at interpreter exit)."""
    import subprocess
    import sys

    script = tmp_path / "leave.py"
    script.write_text(
        "from routereplay.engines.hf import HFProcessEngine\n"
        "from tests.runtime.models import tiny_qwen3\n"
        "if __name__ == '__main__':\n"
        "    engine = HFProcessEngine(tiny_qwen3())\n"
        "    print(engine.pid, flush=True)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, check=True, timeout=300
    )
    pid = int(done.stdout.split()[-1])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
