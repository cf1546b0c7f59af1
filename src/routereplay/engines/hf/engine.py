"""The built-in rollout engine: batched sampling with a KV cache for any HF causal-LM MoE model.

It plays the part of vLLM or SGLang in R3, and it is honest about mismatch. The engine runs its own
copy of the weights in its own precision (default bf16, as production engines do), while the
trainer computes in fp32. So routing and log-probs differ between the two for real numerical
reasons, not because noise was injected. It returns what vLLM returns:
- the sampled token ids;
- the engine's log-prob of every sampled token, under the sampling distribution (temperature,
  top-p);
- a `RouteTrace` per sequence of prompt + response - 1 rows, since the last sampled token is never
  fed back.

Fully-async RL needs two more things of `generate`, and both are keyword arguments:
- `stop(sampled) -> bool` is asked at every token boundary (before the prefill with 0, then after each
  sampled token). When it says yes, the call ends there, every unfinished sequence comes back with
  `aborted=True`, and nothing already sampled is lost: the tokens, their log-probs and the routes of
  every fed position. A call stopped before its prefill returns empty responses and no traces.
  `TokenBudget(n)` is the stop rule "n tokens sampled" as plain data: an engine in another process
  (`process.py`) evaluates it there, exactly, where an arbitrary callable can only be asked
  from the parent.
- `prefix_routes` (one `RouteTrace` or None per prompt) is engine-side prefix replay. The prefill of a
  resumed request (prompt + everything generated so far) replays the routes those positions were
  computed with when they were first fed, so the KV cache and the continuation use one consistent
  routing. -1 rows, and the position the first call never fed, route live. The traces' token ids are
  checked against the prompts (`TokenMismatchError`). The returned trace holds the routes used,
  forced or live.

Prompts are left-padded and position ids count attended tokens only. Build the trainer batch the
same way (`position_ids_for`) so that trainer and engine compute the same function. Legend:
B = sequences, P = padded prompt length, V = vocabulary, S = positions fed.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from routereplay.enums import Source
from routereplay.errors import ConfigError
from routereplay.layout.padding import unpad
from routereplay.runtime import Recording, attach
from routereplay.trace.provenance import Segment
from routereplay.trace.route_trace import RouteTrace
from routereplay.trace.validation import canonical_dtype


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How the engine samples. Log-probs are taken under this distribution (temperature, top-p)."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    eos_token_id: int | None = None
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature <= 0:
            raise ConfigError(f"temperature={self.temperature} must be > 0 (use a small value for near-greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1]")


def checked_params(params: object, engine: str) -> SamplingParams:
    """`params` of an engine's `generate`: routereplay's `SamplingParams`; anything else (vLLM's own
    `vllm.SamplingParams` above all) is a `ConfigError` naming the class and, for vLLM's, its equivalent."""
    if isinstance(params, SamplingParams):
        return params
    kind = type(params)
    hint = ""
    if all(hasattr(params, name) for name in ("max_tokens", "temperature", "top_p", "seed")):  # vllm.SamplingParams
        values: Any = params
        temperature = values.temperature if values.temperature > 0 else 1e-5  # vLLM's 0 = greedy
        hint = (
            f"; the equivalent of this one is SamplingParams(max_new_tokens={values.max_tokens or 16}, "
            f"temperature={temperature}, top_p={values.top_p}, seed={values.seed or 0}, eos_token_id=<your EOS id>) "
            "(one sample per prompt: n, top_k, stop strings and penalties have no equivalent)"
        )
    raise ConfigError(
        f"{engine}.generate: params is a {kind.__module__}.{kind.__qualname__}; pass "
        "routereplay.engines.hf.SamplingParams(max_new_tokens, temperature, top_p, seed, eos_token_id): the engine "
        f"builds vLLM's own per request (seed + index, the sampled token's log-prob, EOS as the stop id){hint}"
    )


@dataclass(frozen=True, slots=True)
class TokenBudget:
    """The `stop` rule "stop once `tokens` tokens are sampled", as picklable data (see the module docstring)."""

    tokens: int

    def __post_init__(self) -> None:
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens < 0:
            raise ConfigError(f"TokenBudget(tokens={self.tokens!r}): the budget must be an integer >= 0")

    def __call__(self, sampled: int) -> bool:
        return sampled >= self.tokens


def check_prompts(prompts: Sequence[Sequence[int]]) -> None:
    """What every engine's `generate` refuses up front: no prompt at all, or an empty prompt."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ConfigError("generate needs at least one prompt, and every prompt at least one token")


def checked_prefix_routes(
    prefix_routes: Sequence[RouteTrace | None] | None, prompts: Sequence[Sequence[int]]
) -> list[RouteTrace | None]:
    """`generate(prefix_routes=)` of any engine: a list of one `RouteTrace` (or None) per prompt, else `ConfigError`."""
    if prefix_routes is None:
        return [None] * len(prompts)
    if not isinstance(prefix_routes, (list, tuple)):
        raise ConfigError(
            f"prefix_routes is a {type(prefix_routes).__name__}; give a list of one RouteTrace (or None) per prompt"
        )
    if len(prefix_routes) != len(prompts):
        raise ConfigError(
            f"prefix_routes has {len(prefix_routes)} entries for {len(prompts)} prompts; give one (or None) each"
        )
    for i, trace in enumerate(prefix_routes):
        if trace is not None and not isinstance(trace, RouteTrace):
            raise ConfigError(f"prefix_routes[{i}] is a {type(trace).__name__}; give a RouteTrace or None")
    return list(prefix_routes)


@dataclass(slots=True)
class Rollout:
    """One sampled sequence: prompt, response (up to and including EOS), engine log-probs, routes."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # engine log-prob of each response token
    trace: RouteTrace | None  # prompt + response - 1 rows; None when capture is off or stopped before the prefill
    finished: bool = field(default=False)  # ended with EOS (else cut at max_new_tokens, or aborted)
    aborted: bool = field(default=False)  # stopped early by `stop` (not finished, fewer than max_new_tokens)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids


class HFEngine:
    """Samples from its own copy of `model`, cast to `dtype`, capturing routes like vLLM does."""

    supports_prefix_replay = True  # `generate(prefix_routes=...)` forces a resumed prefix's routes

    def __init__(
        self,
        model: nn.Module,
        *,
        dtype: torch.dtype = torch.bfloat16,
        capture: bool = True,
        policy_version: int | None = None,
        capture_weights: bool = False,
    ) -> None:
        if capture_weights and not capture:
            raise ConfigError("capture_weights=True records the combine weights beside the routes: needs capture=True")
        self.model = copy.deepcopy(model).to(dtype).eval()
        self.capture_weights = capture_weights  # traces carry the combine weights the experts received
        self.dtype = dtype
        self.policy_version = policy_version
        self.replayer = attach(self.model) if capture else None

    def sync_weights(self, model: nn.Module, policy_version: int | None = None) -> None:
        """Load the trainer's current weights, cast to the engine dtype (the RL weight sync)."""
        self.load_weights(model.state_dict(), policy_version)

    def load_weights(self, state: Mapping[str, torch.Tensor], policy_version: int | None = None) -> None:
        """Load a state dict (any dtype and device), cast to the engine dtype; `sync_weights` without the model."""
        self.model.load_state_dict({k: v.to(self.dtype) for k, v in state.items()})
        self.policy_version = policy_version

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        progress: Callable[[int, int], None] | None = None,
        *,
        stop: Callable[[int], bool] | None = None,
        prefix_routes: Sequence[RouteTrace | None] | None = None,
    ) -> list[Rollout]:
        """Sample one response per prompt; `stop` and `prefix_routes` are described in the module docstring."""
        params = checked_params(params, type(self).__name__)
        check_prompts(prompts)
        if prefix_routes is not None and self.replayer is None:
            raise ConfigError("prefix_routes needs route capture: build the HFEngine with capture=True")
        if prefix_routes is not None and len(prefix_routes) != len(prompts):
            raise ConfigError(
                f"prefix_routes has {len(prefix_routes)} entries for {len(prompts)} prompts; give one (or None) each"
            )
        ids_BP, mask_BP = left_pad(prompts, params.pad_token_id)
        if stop is not None and stop(0):  # aborted before any forward: nothing computed, nothing to lose
            return [Rollout(list(p), [], [], None, aborted=True) for p in prompts]
        generator = torch.Generator().manual_seed(params.seed)
        tokens_BR, logprobs_BR, routes, weights = self._sample(
            ids_BP, mask_BP, params, generator, progress, stop, prefix_routes
        )
        rollouts = self._rollouts(prompts, mask_BP, tokens_BR, logprobs_BR, routes, params, weights)
        if tokens_BR.shape[1] < params.max_new_tokens:
            for rollout in rollouts:
                rollout.aborted = not rollout.finished
        return rollouts

    def _sample(
        self,
        ids_BP: torch.Tensor,
        mask_BP: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator,
        progress: Callable[[int, int], None] | None,
        stop: Callable[[int], bool] | None,
        prefix_routes: Sequence[RouteTrace | None] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Tokens (B, R), their log-probs (B, R), the routes used (B, P + R - 1, L, K), or None without capture,
        and their combine weights (same shape, float32), or None unless `capture_weights` (and no prefix replay)."""
        mask = mask_BP
        with self._prefill_routing(ids_BP, mask_BP, prefix_routes) as prefill:
            output = self.model(
                input_ids=ids_BP, attention_mask=mask, position_ids=position_ids_for(mask), use_cache=True
            )
        tokens, logprobs = [], []
        recording = self.replayer.record(weights=self.capture_weights) if self.replayer is not None else nullcontext()
        with recording as decode:
            # transformers 5.24 renamed the KV cache argument and output field `past_key_values` -> `cache`
            cache_name = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
            for step in range(params.max_new_tokens):
                token_B, logprob_B = sample_tokens(output.logits[:, -1].float(), params, generator)
                tokens.append(token_B)
                logprobs.append(logprob_B)
                if progress is not None:
                    progress(step + 1, params.max_new_tokens)
                if step + 1 == params.max_new_tokens or (stop is not None and stop(step + 1)):
                    break  # the last sampled token is never fed back (engines return num_tokens - 1 rows)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                positions = position_ids_for(mask)[:, -1:]
                output = self.model(
                    input_ids=token_B[:, None],
                    attention_mask=mask,
                    position_ids=positions,
                    use_cache=True,
                    **{cache_name: getattr(output, cache_name)},
                )
        routes = weights = None
        if prefill is not None and decode is not None:
            fed = [prefill.routes] + ([decode.routes] if decode.steps else [])
            routes = torch.cat(fed, dim=1)  # (B, P + R - 1, L, K): prefill plus every fed sampled token
            if self.capture_weights and prefix_routes is None:
                weights = torch.cat([prefill.weights] + ([decode.weights] if decode.steps else []), dim=1)
        return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1), routes, weights

    def _prefill_routing(
        self, ids_BP: torch.Tensor, mask_BP: torch.Tensor, prefix_routes: Sequence[RouteTrace | None] | None
    ) -> AbstractContextManager[Recording | None]:
        """Record the prefill's routing, or replay `prefix_routes` over it (engine-side prefix replay)."""
        if self.replayer is None:
            return nullcontext()
        if prefix_routes is None:
            return self.replayer.record(weights=self.capture_weights)
        lengths = mask_BP.sum(dim=1).tolist()
        traces = [self._unrouted(n) if t is None else t for t, n in zip(prefix_routes, lengths, strict=True)]
        return self.replayer.replay(traces, mask_BP, input_ids=ids_BP)

    def _unrouted(self, tokens: int) -> RouteTrace:
        """An all -1 trace of a prompt without prefix routes: its whole prefill routes live."""
        assert self.replayer is not None
        rows = max(tokens - 1, 0)
        experts = np.full((rows, len(self.replayer.layers), self.replayer.top_k), -1, np.int16)
        return RouteTrace(experts, self.replayer.num_experts, self.replayer.layers)

    def _rollouts(
        self,
        prompts: Sequence[Sequence[int]],
        mask_BP: torch.Tensor,
        tokens_BR: torch.Tensor,
        logprobs_BR: torch.Tensor,
        routes: torch.Tensor | None,
        params: SamplingParams,
        weights: torch.Tensor | None = None,
    ) -> list[Rollout]:
        responses = tokens_BR.tolist()
        finished = [params.eos_token_id is not None and params.eos_token_id in r for r in responses]
        lengths = [r.index(params.eos_token_id) + 1 if f else len(r) for r, f in zip(responses, finished, strict=True)]
        traces = self._traces(prompts, mask_BP.shape[1], lengths, routes, responses, weights)
        return [
            Rollout(
                list(prompt),
                response[:length],
                logprobs_BR[b, :length].tolist(),
                traces[b],
                finished[b],
            )
            for b, (prompt, response, length) in enumerate(zip(prompts, responses, lengths, strict=True))
        ]

    def _traces(
        self,
        prompts: Sequence[Sequence[int]],
        prompt_width: int,
        lengths: list[int],
        routes: torch.Tensor | None,
        responses: list[list[int]],
        weights: torch.Tensor | None = None,
    ) -> list[RouteTrace | None]:
        """Each sequence's fed positions (its prompt, then its response but the last token) cut from the
        batch routes in one gather and one cast, then viewed per sequence; each carries its token ids."""
        if routes is None or self.replayer is None:
            return [None] * len(prompts)
        prompt_B = torch.tensor([len(p) for p in prompts])
        stop_B = prompt_width + torch.tensor(lengths) - 1
        positions_S = torch.arange(routes.shape[1])
        fed_BS = (positions_S >= (prompt_width - prompt_B)[:, None]) & (positions_S < stop_B[:, None])
        ragged = unpad(routes, attention_mask=fed_BS)
        num_experts, layers = self.replayer.num_experts, self.replayer.layers
        experts_NLK = ragged.values.numpy().astype(canonical_dtype(num_experts))
        weights_NLK = None if weights is None else unpad(weights, attention_mask=fed_BS).values.numpy()
        cu = ragged.cu_seqlens.tolist()
        traces: list[RouteTrace | None] = []
        for b in range(len(prompts)):
            rows = cu[b + 1] - cu[b]
            assert rows == len(prompts[b]) + lengths[b] - 1
            segments = (Segment(0, rows, Source.HF, self.policy_version),) if rows else ()
            token_ids = [*prompts[b], *responses[b][: lengths[b] - 1]]  # the fed tokens, one per row
            trace = RouteTrace(experts_NLK[cu[b] : cu[b + 1]], num_experts, layers, 0, segments, token_ids)
            traces.append(trace if weights_NLK is None else trace.with_weights(weights_NLK[cu[b] : cu[b + 1]]))
        return traces


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, P) ids and attention mask with every prompt right-aligned."""
    width = max(len(p) for p in prompts)
    ids_BP = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask_BP = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, prompt in enumerate(prompts):
        ids_BP[b, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        mask_BP[b, width - len(prompt) :] = 1
    return ids_BP, mask_BP


def position_ids_for(mask_BS: torch.Tensor) -> torch.Tensor:
    """Positions counting attended tokens only (0 at each sequence's first token), padding at 0."""
    return (mask_BS.long().cumsum(dim=1) - 1).clamp(min=0)


def sample_tokens(
    logits_BV: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row with temperature and top-p; return it and its log-prob."""
    logprobs_BV = torch.log_softmax(logits_BV / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_BV, order_BV = logprobs_BV.sort(dim=-1, descending=True)
        keep_BV = sorted_BV.exp().cumsum(dim=-1) - sorted_BV.exp() < params.top_p  # always keeps the top token
        filtered_BV = torch.full_like(logprobs_BV, float("-inf")).scatter(
            1, order_BV, sorted_BV.masked_fill(~keep_BV, float("-inf"))
        )
        logprobs_BV = torch.log_softmax(filtered_BV, dim=-1)
    token_B = torch.multinomial(logprobs_BV.exp(), 1, generator=generator)[:, 0]
    return token_B, logprobs_BV.gather(1, token_B[:, None])[:, 0]


__all__ = [
    "HFEngine",
    "Rollout",
    "SamplingParams",
    "TokenBudget",
    "check_prompts",
    "checked_params",
    "left_pad",
    "position_ids_for",
    "sample_tokens",
]
