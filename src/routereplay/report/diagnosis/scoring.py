"""`diagnose`: where a user's own run diverges, engine against trainer, per layer and per position.

The trainer (the given model) scores every rollout twice, in batches of `batch_size` sequences:
- `off`: its routers choose freely (recorded), as a trainer without replay would;
- `R3`: it replays the engine's routes (`Replayer.replay` with the rollouts' traces, their token ids checked).
Against the engine's routes and log-probs this gives
- routing disagreement: the share of (token, layer) rows whose expert SET differs between the engine and the
  trainer's own choice (`off`), overall, per MoE layer and per token position; under R3 the same measure is
  the residual (0 but for the rows the engine did not route, which fall back to the live router);
- log-prob mismatch (`routereplay.metrics.logprob_mismatch`: k3 KL, mean |dlogp|, F(2), ...) of `off` and of
  `R3` against the engine's log-probs, overall and per position (mean |dlogp|, k3): only where the input
  holds the engine's log-probs; otherwise `replay_shift` (R3 against off: how far replay moves the trainer's
  own log-probs) stands in, and `missing` says what was absent;
- expert load skew per layer: tokens per expert of the engine's routes and of the trainer's own choice,
  max / mean (1.0 = perfectly even) and the number of unused experts.
`summary` names the layers that diverge most and the next step (R3, engine weights, threshold, which page).

A token's log-prob is scored at its position p >= 1 when its id and every id before it are known (and, with
engine log-probs, where the engine gave one). Routes compare on attended rows where the engine has a route.
Legend: B = sequences in a batch, S = padded positions, L = MoE layers, K = top-k, E = experts,
P = positions (longest sequence), N = scored tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from routereplay.errors import ConfigError, LayerCountError, TopKMismatchError
from routereplay.metrics import logprob_mismatch
from routereplay.report.diagnosis.rollouts import Rollout

Progress = Callable[[str, int, int], None]
SCORING = "scoring (trainer: off, then R3)"
WORST_LAYERS = 3  # layers named in the summary
SKEWED = 4.0  # a layer whose busiest expert gets this many times the mean load is named in the summary
FEW_TOKENS = 1000  # fewer scored tokens than this: the summary says the log-prob figures are noisy
MIN_LOAD_MEAN = 8.0  # ...only when every layer has this many tokens per expert on average (fewer: noise)
DOCS_PAGE = "docs/diagnose.md"
REPLAY_DOCS = "docs/replay.md"


@dataclass(frozen=True, slots=True, kw_only=True)
class DiagnoseConfig:
    """How the trainer scores: device, dtype, batch size and the engine's sampling temperature."""

    device: str = "cpu"
    dtype: str = "float32"
    batch_size: int = 16
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"DiagnoseConfig.batch_size={self.batch_size!r} must be an int >= 1 (CLI: --batch-size)")
        if not self.temperature > 0:
            raise ConfigError(f"DiagnoseConfig.temperature={self.temperature!r} must be > 0 (CLI: --temperature)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(
                f"DiagnoseConfig.dtype={self.dtype!r} must be float32, bfloat16 or float16 (CLI: --dtype)"
            )


@dataclass(slots=True)
class _Tally:
    """Running sums over batches: routing per layer and position, expert loads, scored log-probs."""

    num_layers: int
    num_experts: int
    positions: int
    differ_L: np.ndarray = field(init=False)
    residual_L: np.ndarray = field(init=False)
    rows_L: np.ndarray = field(init=False)
    differ_P: np.ndarray = field(init=False)
    rows_P: np.ndarray = field(init=False)
    engine_load_LE: np.ndarray = field(init=False)
    trainer_load_LE: np.ndarray = field(init=False)
    unrouted_rows: int = 0
    fallback_rows: int = 0
    position_N: list[np.ndarray] = field(default_factory=list)
    off_N: list[np.ndarray] = field(default_factory=list)
    r3_N: list[np.ndarray] = field(default_factory=list)
    engine_N: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.differ_L = np.zeros(self.num_layers, np.int64)
        self.residual_L = np.zeros(self.num_layers, np.int64)
        self.rows_L = np.zeros(self.num_layers, np.int64)
        self.differ_P = np.zeros(self.positions, np.int64)
        self.rows_P = np.zeros(self.positions, np.int64)
        self.engine_load_LE = np.zeros((self.num_layers, self.num_experts), np.int64)
        self.trainer_load_LE = np.zeros((self.num_layers, self.num_experts), np.int64)


def diagnose(
    model: torch.nn.Module,
    rollouts: Sequence[Rollout],
    config: DiagnoseConfig | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """The diagnosis record (module docstring) of `rollouts` scored by `model` (an HF MoE model)."""
    from routereplay.runtime import attach

    config = DiagnoseConfig() if config is None else config
    report = progress or (lambda _phase, _done, _total: None)
    if not rollouts:
        raise ConfigError("diagnose got no rollouts")
    model = model.to(device=config.device, dtype=getattr(torch, config.dtype)).eval()
    replayer = attach(model)
    try:
        layers_L = tuple(replayer.layers)
        _check_logprobs_everywhere(rollouts)
        for rollout in rollouts:
            _check_fits(rollout, layers_L, replayer.num_experts, replayer.top_k, _vocab_size(model))
        tally = _Tally(len(layers_L), replayer.num_experts, max(len(r.token_ids_N) for r in rollouts))
        report(SCORING, 0, len(rollouts))
        for begin in range(0, len(rollouts), config.batch_size):
            chunk = rollouts[begin : begin + config.batch_size]
            _score_batch(model, replayer, chunk, layers_L, config, tally)
            report(SCORING, begin + len(chunk), len(rollouts))
        return _record(model, replayer, rollouts, tally, config)
    finally:
        replayer.detach()


def _check_logprobs_everywhere(rollouts: Sequence[Rollout]) -> None:
    """All inputs with the engine's log-probs, or none: a mix would compare the log-probs of some sequences only."""
    missing = [r.name for r in rollouts if r.engine_logprobs_N is None]
    if missing and len(missing) < len(rollouts):
        raise ConfigError(
            f"{len(rollouts) - len(missing)} inputs carry the engine's log-probs and {len(missing)} do not (first: "
            f"{missing[0]}); diagnose the two kinds separately, so the mismatch covers every sequence it names"
        )


def _vocab_size(model: torch.nn.Module) -> int:
    embeddings = model.get_input_embeddings()  # type: ignore[operator]
    return int(embeddings.weight.shape[0])


def _check_fits(rollout: Rollout, layers_L: tuple[int, ...], num_experts: int, top_k: int, vocab: int) -> None:
    """The rollout's routes and tokens belong to this model: refused before any forward, naming the fix."""
    trace = rollout.trace
    if trace.num_experts != num_experts:
        raise ConfigError(
            f"{rollout.name}: its routes name {trace.num_experts} experts, the model has {num_experts}; pass the "
            "model the rollouts were sampled with (--model)"
        )
    if trace.top_k != top_k:
        raise TopKMismatchError(
            f"{rollout.name}: its routes are top-{trace.top_k}, the model routes top-{top_k}; pass the model the "
            "rollouts were sampled with (--model)"
        )
    foreign = sorted(set(trace.layers) - set(layers_L))
    if foreign:
        raise LayerCountError(
            f"{rollout.name}: its routes hold layers {foreign} that are not MoE layers of the model (its MoE layers: "
            f"{list(layers_L)}); pass the model the rollouts were sampled with (--model)"
        )
    ids_N = rollout.token_ids_N
    if ids_N.size < 2:
        raise ConfigError(f"{rollout.name}: {ids_N.size} token(s); a sequence needs at least 2 to score a log-prob")
    if int(ids_N.max()) >= vocab:
        raise ConfigError(
            f"{rollout.name}: token id {int(ids_N.max())} is outside the model's vocabulary ({vocab} ids); pass the "
            "model the rollouts were sampled with (--model)"
        )
    if trace.stop > ids_N.size:
        raise ConfigError(
            f"{rollout.name}: {trace.stop} route rows but only {ids_N.size} token ids; the routes and the token ids "
            "come from different sequences"
        )


def _score_batch(
    model: torch.nn.Module,
    replayer: Any,
    chunk: Sequence[Rollout],
    layers_L: tuple[int, ...],
    config: DiagnoseConfig,
    tally: _Tally,
) -> None:
    from routereplay.engines.hf.engine import position_ids_for

    width = max(len(r.token_ids_N) for r in chunk)
    ids_BS = torch.zeros((len(chunk), width), dtype=torch.long)
    mask_BS = torch.zeros((len(chunk), width), dtype=torch.long)
    for b, rollout in enumerate(chunk):
        ids_BS[b, : len(rollout.token_ids_N)] = torch.from_numpy(rollout.token_ids_N)
        mask_BS[b, : len(rollout.token_ids_N)] = 1
    device = torch.device(config.device)
    ids_BS, mask_BS = ids_BS.to(device), mask_BS.to(device)
    inputs = {"input_ids": ids_BS, "attention_mask": mask_BS, "position_ids": position_ids_for(mask_BS)}
    traces = [rollout.trace for rollout in chunk]
    with torch.no_grad():
        with replayer.record() as natural:
            off_BS = _logprobs(model(**inputs).logits, ids_BS, config.temperature)
        replayer.stats.reset()
        with replayer.replay(traces, attention_mask=mask_BS, input_ids=ids_BS) as forced:
            r3_BS = _logprobs(model(**inputs).logits, ids_BS, config.temperature)
        tally.fallback_rows += replayer.stats.fallback_rows
    engine_BSLK = _engine_routes(traces, width, layers_L, replayer.top_k)
    _tally_routes(tally, engine_BSLK, natural.routes.cpu().long(), forced.routes.cpu().long(), mask_BS.cpu().bool())
    off_np, r3_np = off_BS.cpu().double().numpy(), r3_BS.cpu().double().numpy()
    for b, rollout in enumerate(chunk):
        scored_N = _scored_positions(rollout)
        tally.position_N.append(scored_N)
        tally.off_N.append(off_np[b, scored_N])
        tally.r3_N.append(r3_np[b, scored_N])
        if rollout.engine_logprobs_N is not None:
            tally.engine_N.append(rollout.engine_logprobs_N[scored_N])


def _logprobs(logits_BSV: torch.Tensor, ids_BS: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B, S): the log-prob of the token at s given tokens < s (0 at s = 0)."""
    logprobs_BSV = torch.log_softmax(logits_BSV.float() / temperature, dim=-1)
    next_BS = logprobs_BSV[:, :-1].gather(2, ids_BS[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros_like(next_BS[:, :1]), next_BS], dim=1)


def _scored_positions(rollout: Rollout) -> np.ndarray:
    """Positions whose log-prob is compared: p >= 1, and where the engine gave one (when it gave any)."""
    positions_N = np.arange(1, len(rollout.token_ids_N))
    if rollout.engine_logprobs_N is not None:
        positions_N = positions_N[np.isfinite(rollout.engine_logprobs_N[positions_N])]
    return positions_N


def _engine_routes(traces: Sequence[Any], width: int, layers_L: tuple[int, ...], top_k: int) -> torch.Tensor:
    """The engine's routes on the batch: (B, S, L, K) at each trace's positions and layer columns, -1 elsewhere."""
    column = {layer: index for index, layer in enumerate(layers_L)}
    routes_BSLK = torch.full((len(traces), width, len(layers_L), top_k), -1, dtype=torch.long)
    for b, trace in enumerate(traces):
        columns = [column[layer] for layer in trace.layers]
        rows = torch.from_numpy(trace.experts.astype(np.int64))
        routes_BSLK[b, trace.start : trace.stop][:, columns] = rows
    return routes_BSLK


def _tally_routes(
    tally: _Tally, engine_BSLK: torch.Tensor, off_BSLK: torch.Tensor, r3_BSLK: torch.Tensor, mask_BS: torch.Tensor
) -> None:
    rows_BSL = mask_BS[..., None] & (engine_BSLK[..., 0] >= 0)
    engine_sorted = engine_BSLK.sort(dim=-1).values
    differ_BSL = (engine_sorted != off_BSLK.sort(dim=-1).values).any(dim=-1) & rows_BSL
    residual_BSL = (engine_sorted != r3_BSLK.sort(dim=-1).values).any(dim=-1) & rows_BSL
    width = mask_BS.shape[1]
    tally.rows_L += rows_BSL.sum(dim=(0, 1)).numpy()
    tally.differ_L += differ_BSL.sum(dim=(0, 1)).numpy()
    tally.residual_L += residual_BSL.sum(dim=(0, 1)).numpy()
    tally.rows_P[:width] += rows_BSL.sum(dim=(0, 2)).numpy()
    tally.differ_P[:width] += differ_BSL.sum(dim=(0, 2)).numpy()
    tally.unrouted_rows += int((mask_BS[..., None] & ~rows_BSL).sum())
    for layer in range(tally.num_layers):
        engine_ids = engine_BSLK[:, :, layer][rows_BSL[:, :, layer]].reshape(-1)
        trainer_ids = off_BSLK[:, :, layer][mask_BS].reshape(-1)
        tally.engine_load_LE[layer] += np.bincount(engine_ids.numpy(), minlength=tally.num_experts)
        tally.trainer_load_LE[layer] += np.bincount(trainer_ids.numpy(), minlength=tally.num_experts)


def _ratio(part: float, whole: float) -> float | None:
    return float(part / whole) if whole else None


def _load(load_LE: np.ndarray, layers_L: tuple[int, ...]) -> dict[str, Any]:
    """Tokens per expert, per layer: max / mean (1.0 = even), unused experts, the busiest expert."""
    rows_L = load_LE.sum(axis=1)
    mean_L = rows_L / load_LE.shape[1]
    skew_L = np.divide(load_LE.max(axis=1), mean_L, out=np.zeros(len(layers_L)), where=mean_L > 0)
    return {
        "max_over_mean": [float(x) for x in skew_L],
        "mean_tokens_per_expert": [float(x) for x in mean_L],
        "unused_experts": [int(x) for x in (load_LE == 0).sum(axis=1)],
        "busiest_expert": [int(x) for x in load_LE.argmax(axis=1)],
        "tokens_per_expert": load_LE.tolist(),
    }


def _per_position(tally: _Tally) -> dict[str, Any]:
    """Per token position: routing disagreement, and mean |dlogp| / k3 of off and R3 against the engine."""
    table: dict[str, Any] = {
        "routed_rows": tally.rows_P.tolist(),
        "routing_disagreement": [_ratio(d, r) for d, r in zip(tally.differ_P, tally.rows_P, strict=True)],
    }
    if not tally.engine_N:
        return table
    positions_N = np.concatenate(tally.position_N)
    tokens_P = np.bincount(positions_N, minlength=tally.positions)
    engine_N = np.concatenate(tally.engine_N)
    table["scored_tokens"] = tokens_P.tolist()
    for mode, values in (("off", tally.off_N), ("R3", tally.r3_N)):
        delta_N = np.concatenate(values) - engine_N
        abs_P = np.bincount(positions_N, weights=np.abs(delta_N), minlength=tally.positions)
        k3_P = np.bincount(positions_N, weights=np.exp(delta_N) - 1 - delta_N, minlength=tally.positions)
        table[f"mean_abs_dlogp_{mode}"] = [_ratio(a, n) for a, n in zip(abs_P, tokens_P, strict=True)]
        table[f"k3_kl_{mode}"] = [_ratio(k, n) for k, n in zip(k3_P, tokens_P, strict=True)]
    return table


def _record(
    model: torch.nn.Module, replayer: Any, rollouts: Sequence[Rollout], tally: _Tally, config: DiagnoseConfig
) -> dict[str, Any]:
    layers_L = tuple(replayer.layers)
    rows, differ, residual = int(tally.rows_L.sum()), int(tally.differ_L.sum()), int(tally.residual_L.sum())
    with_logprobs = [r.name for r in rollouts if r.engine_logprobs_N is not None]
    off_N, r3_N = np.concatenate(tally.off_N), np.concatenate(tally.r3_N)
    logprobs: dict[str, Any] | None = None
    if tally.engine_N:
        engine_N = np.concatenate(tally.engine_N)
        logprobs = {mode: logprob_mismatch(values, engine_N) for mode, values in (("off", off_N), ("R3", r3_N))}
    text_config = model.config.get_text_config()  # type: ignore[union-attr, operator]
    record: dict[str, Any] = {
        "config": {
            "device": config.device,
            "dtype": config.dtype,
            "batch_size": config.batch_size,
            "temperature": config.temperature,
        },
        "model": {
            "model_type": text_config.model_type,
            "layers": list(layers_L),
            "num_experts": replayer.num_experts,
            "top_k": replayer.top_k,
            "parameters": sum(p.numel() for p in model.parameters()),
        },
        "inputs": {
            "sequences": len(rollouts),
            "tokens": int(sum(len(r.token_ids_N) for r in rollouts)),
            "scored_tokens": int(off_N.size),
            "engine_logprobs": bool(with_logprobs),
            "missing": []
            if with_logprobs
            else [
                "engine log-probs: none of the inputs holds them, so the log-prob mismatch against the engine is "
                "not computed (replay_shift stands in); save the engine's response with its log-probs (vLLM: "
                "`logprobs: 1` and `return_token_ids: true`; SGLang: `return_logprob: true`)"
            ],
        },
        "routing": {
            "routing_disagreement": _ratio(differ, rows),
            "per_layer_disagreement": [_ratio(d, r) for d, r in zip(tally.differ_L, tally.rows_L, strict=True)],
            "compared_rows": rows,
            "unrouted_rows": tally.unrouted_rows,
            "replayed_disagreement": _ratio(residual, rows),
            "fallback_rows": tally.fallback_rows,
        },
        "per_position": _per_position(tally),
        "logprobs": logprobs,
        "replay_shift": logprob_mismatch(r3_N, off_N) if off_N.size else None,
        "load": {"engine": _load(tally.engine_load_LE, layers_L), "trainer": _load(tally.trainer_load_LE, layers_L)},
    }
    record["summary"] = summarize(record)
    return record


def summarize(record: dict[str, Any]) -> dict[str, Any]:
    """The layers that diverge most, and the next steps, each a sentence naming what to do and the page."""
    layers_L = record["model"]["layers"]
    per_layer_L = record["routing"]["per_layer_disagreement"]
    ranked = sorted((i for i, value in enumerate(per_layer_L) if value), key=lambda i: per_layer_L[i], reverse=True)[
        :WORST_LAYERS
    ]
    worst = [{"layer": layers_L[i], "routing_disagreement": per_layer_L[i]} for i in ranked]
    overall = record["routing"]["routing_disagreement"]
    steps: list[str] = []
    if overall is None:
        steps.append(
            "No (token, layer) row has an engine route to compare: the inputs hold only -1 rows; capture routes "
            "with the engine's route return switched on (docs/engines.md)."
        )
    elif overall == 0:
        steps.append(
            "The trainer routes every compared row as the engine did: replaying routes (R3) changes nothing here; "
            "a log-prob mismatch that remains comes from precision or kernels, not routing."
        )
    else:
        named = ", ".join(f"{w['layer']} ({w['routing_disagreement']:.1%})" for w in worst)
        steps.append(f"Routing diverges most in layers {named}; overall {overall:.2%} of rows.")
    logprobs = record["logprobs"]
    if logprobs is not None and overall:
        off, r3 = logprobs["off"]["k3_kl"], logprobs["R3"]["k3_kl"]
        ratio = r3 / off if off > 0 else 1.0
        if ratio < 0.9:
            steps.append(
                f"R3 helps: replaying the engine's routes takes k3 KL from {off:.3g} to {r3:.3g} ({ratio:.2f}x); turn "
                f"rollout routing replay on in your trainer ({REPLAY_DOCS}; verl, SkyRL, TRL: docs/verl.md, "
                "docs/skyrl.md, docs/trl.md)."
            )
            steps.append(
                "What R3 leaves is the engine's gate weights and numerics: replaying the engine's combine weights "
                f"too (replay(weights=True)) removes the weights' share ({REPLAY_DOCS}, 'Replay options')."
            )
        else:
            steps.append(
                f"R3 barely changes the mismatch here (k3 KL {off:.3g} off, {r3:.3g} with R3, {ratio:.2f}x): most "
                "of it is outside routing (precision, kernels, the gate weights: replay(weights=True)); if the routes "
                "come from another policy version or tokenisation than the log-probs, fix that first; a threshold "
                f"(replay(threshold=...)) keeps only engine routes near the trainer's own top-k ({REPLAY_DOCS}, "
                "'Replay options')."
            )
    elif logprobs is None:
        steps.append(
            "The inputs hold no engine log-probs, so only routing is compared (and replay_shift: how far replay moves "
            "the trainer's log-probs); save the engine's log-probs to see the mismatch with and without R3."
        )
    engine_skew = record["load"]["engine"]["max_over_mean"]
    if engine_skew and min(record["load"]["engine"]["mean_tokens_per_expert"]) >= MIN_LOAD_MEAN:
        busiest = int(np.argmax(engine_skew))
        if engine_skew[busiest] >= SKEWED:
            steps.append(
                f"Expert load is skewed in layer {layers_L[busiest]} (busiest expert {engine_skew[busiest]:.1f}x the "
                "mean): disagreement concentrates where a few experts are near-tied."
            )
    scored = record["inputs"]["scored_tokens"]
    if scored < FEW_TOKENS:
        steps.append(f"Only {scored} tokens were scored: the log-prob figures are noisy; pass more rollouts.")
    steps.append(f"How to read this report: {DOCS_PAGE}.")
    return {"worst_layers": worst, "next_steps": steps}


__all__ = ["SCORING", "DiagnoseConfig", "diagnose", "summarize"]
