"""The rollouts `routereplay diagnose` reads: routes, token ids and, where present, the engine's log-probs.

Each input file gives one or more sequences (`Rollout`):
- a vLLM response saved as JSON (completions or chat, `--enable-return-routed-experts`): every choice is a
  sequence; its token ids are `prompt_token_ids` (the choice's, else the response's) + the choice's
  `token_ids` (`return_token_ids: true`), its log-probs `logprobs.token_logprobs` (completions, `logprobs: 1`)
  or `logprobs.content[].logprob` (chat, `logprobs: true`);
- an SGLang `/generate` response: `output_ids` after the request's `input_ids` (SGLang does not echo them:
  add the request's `input_ids` to the saved JSON), log-probs from `meta_info.output_token_logprobs`;
- a codec file (`.rrt`): its rows' token ids (`RouteTrace.token_ids`; the last sampled token is not among
  them, so its log-prob is not scored); no engine log-probs;
- a route store file (`RouteStore.save`): every sample, with its full token ids; no engine log-probs.

`sniff_inputs` reads only the files' first bytes and sizes (before the model is loaded); `read_rollouts`
decodes them with the model's geometry (`Geometry`) filled in where an engine payload leaves it out.
Legend: N = tokens of a sequence, T = route rows, L = MoE layers, K = top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from routereplay.errors import ConfigError, MissingRoutesError, PayloadError
from routereplay.trace.route_trace import RouteTrace

STORE_MAGIC = b"RRST"  # a route store file (routereplay.store.file)


@dataclass(frozen=True, slots=True)
class Geometry:
    """What the model says about its routing: filled in where an engine payload leaves it out."""

    num_experts: int
    num_layers: int  # decoder layers (an all-layer vLLM / SGLang payload has this many)
    top_k: int
    moe_layers: tuple[int, ...]  # the global numbers of the routed layers


@dataclass(frozen=True, slots=True)
class Rollout:
    """One sequence: its routes, every token id from position 0, and the engine's log-probs where known.

    `token_ids_N`: int64, positions 0..N-1. `engine_logprobs_N`: float64 of length N, the engine's
    log-prob of the token at each position (NaN where the engine gave none: prompt tokens), or None when
    the input holds no log-probs at all."""

    name: str
    trace: RouteTrace
    token_ids_N: np.ndarray
    engine_logprobs_N: np.ndarray | None


def sniff_inputs(paths: Sequence[str]) -> list[Path]:
    """Refuse a missing path, a folder or an empty file before any model is loaded (cheap: stat only)."""
    if not paths:
        raise ConfigError("diagnose needs at least one rollout file (.rrt, a route store, or a JSON engine response)")
    checked = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            raise ConfigError(
                f"{name} is a folder; pass the rollout files in it (a shell glob: {name}/*.json or {name}/*.rrt)"
            )
        if not path.exists():
            raise FileNotFoundError(2, "No such file or directory", name)
        if path.stat().st_size == 0:
            raise PayloadError(f"{name} is empty; pass a .rrt file, a route store file or a JSON engine response")
        checked.append(path)
    return checked


def read_rollouts(paths: Sequence[Path], geometry: Geometry) -> list[Rollout]:
    """Every sequence of every file, in order (see the module docstring)."""
    rollouts: list[Rollout] = []
    for path in paths:
        with path.open("rb") as stream:
            head = stream.read(4)
        if head == STORE_MAGIC:
            rollouts.extend(_store_rollouts(path))
        else:
            rollouts.extend(_file_rollouts(path, geometry))
    return rollouts


def _store_rollouts(path: Path) -> list[Rollout]:
    from routereplay.store.route_store import RouteStore

    store = RouteStore.load(path)
    rollouts = []
    for sample_id in store:
        trace = store.trace(sample_id)
        ids_N = np.asarray(store.tokens(sample_id), dtype=np.int64)
        rollouts.append(Rollout(f"{path.name}[{sample_id!r}]", trace, ids_N, None))
    if not rollouts:
        raise MissingRoutesError(f"{path}: the route store holds no samples; pass a store that add_turn filled")
    return rollouts


def _file_rollouts(path: Path, geometry: Geometry) -> list[Rollout]:
    from routereplay.tracefile.format import FileFormat, sniff
    from routereplay.tracefile.io import read_trace
    from routereplay.tracefile.payload import PayloadHints

    found, document = sniff(path.read_bytes())
    if found is FileFormat.CODEC:
        trace, _ = read_trace(path, engine=found)
        return [Rollout(path.name, trace, _codec_token_ids(trace, path), None)]
    if found not in (FileFormat.VLLM, FileFormat.SGLANG):
        raise ConfigError(
            f"{path}: a {found} file holds routes but no token ids, which the trainer needs to score the "
            "sequence; pass a .rrt with token ids, a route store, or the vLLM / SGLang response"
        )
    choices = _choices(document, found, path)
    rollouts = []
    for index, choice in enumerate(choices):
        hints = PayloadHints(
            num_experts=geometry.num_experts,
            num_layers=geometry.num_layers,
            top_k=geometry.top_k,
            moe_layers=_moe_layers(document, geometry),
            index=index,
        )
        trace, _ = read_trace(path, hints, engine=found)
        if found is FileFormat.VLLM:
            ids_N, engine_N = _vllm_tokens(document, choice, path, index)
        else:
            ids_N, engine_N = _sglang_tokens(choice, path, index)
        rollouts.append(Rollout(f"{path.name}[{index}]" if len(choices) > 1 else path.name, trace, ids_N, engine_N))
    return rollouts


def _moe_layers(document: Any, geometry: Geometry) -> tuple[int, ...] | None:
    """The model's MoE layers, unless the payload carries its own layers (written by routereplay)."""
    from routereplay.tracefile.payload import CARRIED_FIELD

    if isinstance(document, dict) and isinstance(document.get(CARRIED_FIELD), dict):
        return None
    return geometry.moe_layers


def _choices(document: Any, found: Any, path: Path) -> list[dict[str, Any]]:
    from routereplay.tracefile.format import FileFormat

    if found is FileFormat.VLLM:
        choices = document.get("choices") if isinstance(document, dict) else None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, dict) for c in choices):
            raise PayloadError(f"{path}: a vLLM response needs a non-empty 'choices' list of objects")
        return choices
    items = document if isinstance(document, list) else [document]
    if not all(isinstance(item, dict) for item in items):
        raise PayloadError(f"{path}: an SGLang response must be an object (or a list of them, one per request)")
    return items


def _codec_token_ids(trace: RouteTrace, path: Path) -> np.ndarray:
    """A codec file's token ids from position 0 (its rows' ids; the last sampled token is not a row)."""
    ids = trace.token_ids
    if ids is None:
        raise MissingRoutesError(
            f"{path}: the codec file names no token ids, so the trainer cannot score its sequence; write it from "
            "a trace that has them (RouteTrace.with_token_ids(ids), or RouteStore.trace), or pass the engine's response"
        )
    if trace.start != 0 or (ids < 0).any():
        unknown = int(trace.start + (ids < 0).sum())
        raise MissingRoutesError(
            f"{path}: {unknown} token ids before or among its rows are unknown (start={trace.start}, -1 ids); the "
            "trainer needs every token from position 0: pass the route store or the engine response of the whole "
            "sequence"
        )
    return np.asarray(ids, dtype=np.int64)


def _vllm_tokens(document: Any, choice: dict[str, Any], path: Path, index: int) -> tuple[np.ndarray, np.ndarray | None]:
    prompt = choice.get("prompt_token_ids") or document.get("prompt_token_ids")
    output = choice.get("token_ids")
    if not isinstance(prompt, list) or not isinstance(output, list):
        missing = "prompt_token_ids" if not isinstance(prompt, list) else "choices[].token_ids"
        raise MissingRoutesError(
            f"{path}, choice {index}: the response has no {missing}, so the trainer cannot score the sequence; ask "
            "vLLM for them with `return_token_ids: true` in the request"
        )
    ids_N = _ids(prompt + output, path, index)
    values = _vllm_logprobs(choice.get("logprobs"), len(output), path, index)
    return ids_N, _placed(values, len(prompt), len(ids_N))


def _vllm_logprobs(logprobs: Any, count: int, path: Path, index: int) -> list[Any] | None:
    if logprobs is None:
        return None
    if isinstance(logprobs, dict) and isinstance(logprobs.get("token_logprobs"), list):
        values = logprobs["token_logprobs"]
    elif isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
        values = [item.get("logprob") if isinstance(item, dict) else None for item in logprobs["content"]]
    else:
        raise PayloadError(
            f"{path}, choice {index}: 'logprobs' is neither completions' {{token_logprobs: [...]}} nor chat's "
            "{content: [{logprob}]}"
        )
    if len(values) != count:
        raise PayloadError(f"{path}, choice {index}: {len(values)} log-probs for {count} sampled tokens")
    return values


def _sglang_tokens(item: dict[str, Any], path: Path, index: int) -> tuple[np.ndarray, np.ndarray | None]:
    prompt, output = item.get("input_ids"), item.get("output_ids")
    if not isinstance(prompt, list) or not isinstance(output, list):
        missing = "input_ids" if not isinstance(prompt, list) else "output_ids"
        raise MissingRoutesError(
            f"{path}, request {index}: the response has no {missing}; SGLang does not echo the prompt: save the "
            "request's input_ids in the same JSON object as the response"
        )
    ids_N = _ids(prompt + output, path, index)
    meta = item.get("meta_info")
    triples = meta.get("output_token_logprobs") if isinstance(meta, dict) else None
    values = None if triples is None else [t[0] if isinstance(t, list) and t else None for t in triples]
    if values is not None and len(values) != len(output):
        raise PayloadError(f"{path}, request {index}: {len(values)} log-probs for {len(output)} output_ids")
    return ids_N, _placed(values, len(prompt), len(ids_N))


def _ids(values: list[Any], path: Path, index: int) -> np.ndarray:
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise PayloadError(f"{path}, sequence {index}: token ids must be non-negative integers")
    return np.asarray(values, dtype=np.int64)


def _placed(values: list[Any] | None, start: int, length: int) -> np.ndarray | None:
    """Log-probs of the tokens from `start` laid out on positions 0..length-1, NaN elsewhere (and for nulls)."""
    if values is None:
        return None
    placed_N = np.full(length, np.nan, dtype=np.float64)
    placed_N[start : start + len(values)] = [np.nan if v is None else float(v) for v in values]
    return placed_N


__all__ = ["Geometry", "Rollout", "read_rollouts", "sniff_inputs"]
