"""Route forcing on vLLM 0.31-0.33's Model Runner V2: which runner the plugin hooks, and the hooks.

`forcing_path(version)` chooses by the vLLM found: 0.30 keeps the V1 model runner hook
(`forcing.worker`, wrapped `_model_forward`, eager only); 0.31-0.33 get the Model Runner V2 hook below;
any other version is refused by name (`VLLMVersionError`), never run unforced.

Model Runner V2 (`vllm/v1/worker/gpu/model_runner.py`, `GPUModelRunner`) is wrapped in three methods:
- `load_model`: after vLLM builds the model and before it compiles or captures any CUDA graph, the set-up
  is checked (`refusals`: configuration, kernels, and every MoE router must be one `forcing.router` can
  force; `ForcingSetupError` names each problem and its fix, so the engine stops before it serves), the
  forcing buffers are allocated once (`ForcingBuffers`, sized by `max_num_batched_tokens`) and every MoE
  router is wrapped to read them. A model without routed experts gets nothing.
- `execute_model`: before vLLM updates its request states, the step's finished requests drop their forced
  routes and its new ones (first schedules and resumptions after preemption) are checked (`RowMap.admit`);
  a dummy run (profiling, CUDA-graph capture, warm-up) routes live, so the buffers are cleared.
- `prepare_inputs`: the narrowest per-step method that returns the step's `InputBatch`; right after it,
  before any forward, the step's forced rows are loaded into the buffers (`RowMap.rows_of`), or the
  buffers are cleared when the step forces none. The forward, eager, compiled or replayed from a CUDA
  graph, then reads them from the same addresses.

Legend: N = forced token rows of one step, L = MoE layers, K = top-k.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from routereplay.engines.vllm.forced_routes import ServedRouting
from routereplay.engines.vllm.forcing.buffers import ForcingBuffers
from routereplay.engines.vllm.forcing.router import LayerForcing
from routereplay.engines.vllm.mrv2.refusals import config_problems, forcing_enabled, kernel_problems, refuse
from routereplay.engines.vllm.mrv2.row_map import RowMap
from routereplay.enums import StrEnum
from routereplay.errors import VLLMVersionError

RUNNER_ATTR = "_routereplay_mrv2"  # the runner's `MRv2Forcing`
PATCHED_MARK = "_routereplay_patched"
SERVED_VERSIONS = "0.30, 0.31, 0.32, 0.33"


class ForcingPath(StrEnum):
    """Which vLLM model runner route forcing hooks."""

    V1 = "v1"  # vLLM 0.30: the V1 model runner, eager (`forcing.worker`)
    MRV2 = "mrv2"  # vLLM 0.31-0.33: Model Runner V2, eager, compiled or under CUDA graphs (this module)


def forcing_path(version: str) -> ForcingPath:
    """The runner hook for a vLLM version string (`vllm.__version__`: "0.32.0", "0.33.0+cu129", "0.31.1rc1")."""
    match = re.match(r"^\s*v?(\d+)\.(\d+)(?:\D|$)", str(version))
    if match is not None:
        major, minor = int(match.group(1)), int(match.group(2))
        if (major, minor) == (0, 30):
            return ForcingPath.V1
        if major == 0 and 31 <= minor <= 33:
            return ForcingPath.MRV2
    raise VLLMVersionError(
        f"the routereplay vLLM plugin found vLLM {version!r}; route forcing is built for vLLM {SERVED_VERSIONS} "
        "(0.30: V1 model runner; 0.31-0.33: Model Runner V2): install one of those (pip install 'vllm>=0.30,<0.34'), "
        "or uninstall routereplay's vLLM plugin from this environment"
    )


@dataclass(slots=True)
class MRv2Forcing:
    """One MRv2 runner's forcing: its requests' forced routes, the buffers its wrapped routers read."""

    rows: RowMap
    buffers: ForcingBuffers
    layers: dict[int, LayerForcing]
    model_id: int

    @classmethod
    def for_model(cls, vllm_config: Any, model: Any, device: Any) -> MRv2Forcing | None:
        """Check the set-up (`ForcingSetupError` by name), allocate the buffers, wrap every MoE router; None for a
        model without routed experts."""
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        where = f"vLLM {type(model).__name__}"
        model_config = vllm_config.model_config
        layers: dict[int, LayerForcing] = {}
        for module in model.modules():
            if isinstance(module, MoERunner):
                forcing = LayerForcing.of(int(module.layer_id), module.router)
                layers[forcing.layer] = forcing
        if not layers:
            return None
        problems = config_problems(vllm_config) + kernel_problems(model)
        problems += [
            f"MoE layer {layer}'s router cannot be forced ({forcing.unsupported})"
            for layer, forcing in sorted(layers.items())
            if forcing.rule is None
        ]
        refuse(problems, where=where)
        top_k = int(model_config.get_num_experts_per_tok())
        served = ServedRouting(
            int(model_config.get_num_experts()),
            top_k,
            int(model_config.get_total_num_hidden_layers()),
            tuple(sorted(layers)),
        )
        max_tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        buffers = ForcingBuffers(
            max_tokens, served.moe_layers, top_k, device, num_experts=served.num_experts, num_layers=served.num_layers
        )
        for forcing in layers.values():
            forcing.install(buffers)
        return cls(RowMap(served), buffers, layers, id(model))

    def begin_step(self, scheduler_output: Any) -> None:
        """Requests that finished drop their routes; requests scheduled as new have theirs checked."""
        self.rows.forget(getattr(scheduler_output, "finished_req_ids", None) or ())
        self.rows.admit(getattr(scheduler_output, "scheduled_new_reqs", None) or ())

    def fill(self, batch: Any) -> bool:
        """Load the step's forced rows into the buffers (or clear them); True when some row is forced."""
        step = self.rows.rows_of(batch)
        if step is None:
            self.buffers.clear()
            return False
        self.buffers.load(step.rows_N, step.experts_NLK)
        return True

    def counters(self) -> dict[str, int]:
        """What was forced so far (rows counted when loaded: under CUDA graphs no Python runs in the router)."""
        return self.rows.counters()


def install() -> None:
    """Wrap MRv2's `GPUModelRunner` (idempotent); nothing when `ROUTEREPLAY_FORCING=off`."""
    if not forcing_enabled():
        return
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    wrap_once(GPUModelRunner, "load_model", _forcing_load_model)
    wrap_once(GPUModelRunner, "execute_model", _forcing_execute_model)
    wrap_once(GPUModelRunner, "prepare_inputs", _forcing_prepare_inputs)


def is_installed() -> bool:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    return getattr(GPUModelRunner.prepare_inputs, PATCHED_MARK, False) is True


def wrap_once(owner: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """`owner.name` replaced by `make(owner.name)`, marked `PATCHED_MARK`; nothing where it already is.

    The plugin's wrappers (front end, vLLM 0.30's runner) are put in place the same way.
    """
    original = getattr(owner, name)
    if getattr(original, PATCHED_MARK, False):
        return
    wrapped = functools.wraps(original)(make(original))
    setattr(wrapped, PATCHED_MARK, True)
    setattr(owner, name, wrapped)


def _forcing_load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        setattr(self, RUNNER_ATTR, MRv2Forcing.for_model(self.vllm_config, self.model, self.device))
        return result

    return load_model


def _forcing_execute_model(original: Callable[..., Any]) -> Callable[..., Any]:
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        forcing: MRv2Forcing | None = getattr(self, RUNNER_ATTR, None)
        if forcing is not None:
            dummy_run = kwargs.get("dummy_run", args[1] if len(args) > 1 else False)
            if dummy_run:
                forcing.buffers.clear()
            else:
                forcing.begin_step(scheduler_output)
        return original(self, scheduler_output, *args, **kwargs)

    return execute_model


def _forcing_prepare_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    def prepare_inputs(self: Any, *args: Any, **kwargs: Any) -> Any:
        batch = original(self, *args, **kwargs)
        forcing: MRv2Forcing | None = getattr(self, RUNNER_ATTR, None)
        if forcing is not None:
            forcing.fill(batch)
        return batch

    return prepare_inputs


def runner_counters(runner: Any) -> dict[str, int]:
    """An MRv2 runner's forcing counters (zeros when it forces nothing)."""
    forcing: MRv2Forcing | None = getattr(runner, RUNNER_ATTR, None)
    if forcing is None:
        return {"forced_requests": 0, "refused_requests": 0, "forced_rows": 0, "steps_forced": 0}
    return forcing.counters()


__all__ = [
    "PATCHED_MARK",
    "RUNNER_ATTR",
    "SERVED_VERSIONS",
    "ForcingPath",
    "MRv2Forcing",
    "forcing_path",
    "install",
    "is_installed",
    "runner_counters",
    "wrap_once",
]
