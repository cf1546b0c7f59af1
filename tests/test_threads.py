"""Thread policy of the CPU paths (issue 11 item 25): 1 intra-op thread for the tiny models by default,
the user's OMP_NUM_THREADS / threads= kept, xdist workers sharing the cores instead of oversubscribing.

Subprocesses run with a controlled environment, because torch reads the thread variables once, at
import, and this test process has its own (conftest sets them per xdist worker).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from routereplay.cli.main import build_parser
from routereplay.errors import ConfigError
from routereplay.threads import THREAD_ENVIRONMENT_VARIABLES, ThreadPolicy, ThreadSource

APPLY = """
import json, torch
from routereplay.threads import ThreadPolicy
choice = ThreadPolicy(threads={threads}).apply()
print(json.dumps({{"threads": torch.get_num_threads(), "source": choice.source.value}}))
"""

TRAIN = """
import json, torch
from routereplay.rl.model import train_demo_model
torch.set_num_threads(2)
seen = []
train_demo_model("qwen3_moe", steps=2, batch=4, num_hidden_layers=1, num_experts=8, threads={threads},
                 progress=lambda step, steps, loss: seen.append(torch.get_num_threads()))
print(json.dumps({{"during": seen, "after": torch.get_num_threads()}}))
"""


def _run(code: str, **environment: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENVIRONMENT_VARIABLES}
    env.update(environment)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_default_is_one_thread_without_user_choice() -> None:
    """Resource exhaustion (issue 11 item 25): with nothing set, torch's default (one thread per core)
    oversubscribes a shared machine; the policy runs the tiny-model paths with 1 thread."""
    assert _run(APPLY.format(threads=None)) == {"threads": 1, "source": "default"}


@pytest.mark.parametrize("variable", THREAD_ENVIRONMENT_VARIABLES)
def test_user_environment_variable_is_kept(variable: str) -> None:
    """Resource exhaustion (issue 11 item 25): the user's OMP_NUM_THREADS / MKL_NUM_THREADS is respected,
    not overridden by the default of 1."""
    plain = _run("import json, torch; print(json.dumps({'threads': torch.get_num_threads()}))", **{variable: "2"})
    assert _run(APPLY.format(threads=None), **{variable: "2"}) == {**plain, "source": "environment"}


def test_explicit_threads_win_over_the_environment() -> None:
    """Resource exhaustion (issue 11 item 25): `threads=` (the library's and `--threads`) beats OMP_NUM_THREADS."""
    assert _run(APPLY.format(threads=3), OMP_NUM_THREADS="2") == {"threads": 3, "source": "explicit"}


def test_train_demo_model_trains_with_one_thread_and_restores_the_callers_count() -> None:
    """Resource exhaustion (issue 11 item 25): `train_demo_model` ran with torch's default threads
    (250 s instead of 20 s for 20 steps under contention); it now trains with 1 thread and gives the
    caller back the count it had."""
    assert _run(TRAIN.format(threads=None)) == {"during": [1, 1], "after": 2}
    assert _run(TRAIN.format(threads=None), OMP_NUM_THREADS="2") == {"during": [2, 2], "after": 2}


def test_applied_restores_the_previous_count() -> None:
    """Resource exhaustion (issue 11 item 25): a library call leaves the caller's thread count as it found it."""
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    with ThreadPolicy(threads=target).applied() as choice:
        assert torch.get_num_threads() == target
        assert choice.source is ThreadSource.EXPLICIT
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("threads", [0, -1, True])
def test_bad_thread_count_is_refused(threads: int) -> None:
    """Error that is not a RouteReplayError (issue 11 item 25): torch.set_num_threads(0) raises a bare
    RuntimeError deep inside a run; the policy refuses the count up front, naming the fix."""
    with pytest.raises(ConfigError, match=r"threads=.*must be an integer >= 1"):
        ThreadPolicy(threads=threads)


def test_choose_reads_the_given_environment() -> None:
    """Resource exhaustion (issue 11 item 25): the choice follows threads=, the environment, torch's count."""
    policy = ThreadPolicy()
    assert policy.choose(4, environ={}).threads == 1
    assert policy.choose(4, environ={"OMP_NUM_THREADS": "6"}).threads == 4  # kept: torch honoured it at start
    assert policy.choose(4, environ={"OMP_NUM_THREADS": "  "}).source is ThreadSource.DEFAULT


@pytest.mark.parametrize(("workers", "cores", "expected"), [(1, 2, 2), (2, 2, 1), (8, 2, 1), (4, 16, 4), (0, 2, 2)])
def test_per_worker_share(workers: int, cores: int, expected: int) -> None:
    """Resource exhaustion (issue 11 item 25): xdist workers x threads each must not exceed the cores."""
    assert ThreadPolicy.per_worker(workers, cores) == expected


def test_conftest_shares_the_cores_between_xdist_workers() -> None:
    """Resource exhaustion (issue 11 item 25): `make test` ran xdist workers x 2 threads on 2 cores;
    conftest sets the thread variables so torch runs its share of the cores in every worker."""
    chosen = [os.environ[name] for name in THREAD_ENVIRONMENT_VARIABLES if os.environ.get(name, "").strip()]
    assert chosen, "conftest sets OMP_NUM_THREADS / MKL_NUM_THREADS when the user set neither"
    assert torch.get_num_threads() <= int(chosen[0])  # torch follows it (capped at the physical cores)


@pytest.mark.parametrize("command", ["demo", "train"])
def test_threads_flag(command: str) -> None:
    """Misleading message (issue 11 item 25): `--threads 0` is refused by the parser, `--threads 3` reaches the run."""
    parser = build_parser()
    assert parser.parse_args([command, "--threads", "3"]).threads == 3
    assert parser.parse_args([command]).threads is None
    with pytest.raises(SystemExit):
        parser.parse_args([command, "--threads", "0"])
