"""Engine payloads of trace files: the model facts they leave out, and the ones routereplay writes.

Engine payloads do not say how many experts the model has (nor, for SGLang, the layer count and
top-k): those come from `PayloadHints`, and `required_hint` names the flag that gives a missing one.

Engine payloads written here (`engine_payload`) are in the engine's own wire form, so a trace's
global layer numbers survive: vLLM and SGLang send every hidden layer (dense layers zero-filled),
so layers 1-26 of a dense-first model are written as 27 layers with layer 0 zero-filled; Megatron
sends its MoE layers only. Every written payload also carries a `"routereplay"` object (layers,
num_experts, top_k, start, num_layers) that `read_trace` uses where `PayloadHints` say nothing, so
`convert a.rrt b.json --to vllm` then `inspect b.json` shows the same layers as `a.rrt`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from routereplay.errors import ConfigError, LayerCountError, PayloadEncodingError
from routereplay.trace.route_trace import RouteTrace
from routereplay.trace.summary import compact_ranges
from routereplay.tracefile.format import FileFormat
from routereplay.wire.limits import is_int
from routereplay.wire.payload import npy_bytes

CARRIED_FIELD = "routereplay"  # the object engine payloads written here carry: layers, geometry, start
MAX_CARRIED_LAYERS = 4096  # a model with more decoder layers than this does not exist


@dataclass(frozen=True, slots=True, kw_only=True)
class PayloadHints:
    """Model facts an engine payload does not carry (None = unknown). Types are checked here."""

    num_experts: int | None = None
    num_layers: int | None = None
    top_k: int | None = None
    moe_layers: Sequence[int] | None = None
    layers: Sequence[int] | None = None
    num_tokens: int | None = None
    start: int = 0
    index: int = 0  # choice / request index inside a response

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_layers", "top_k", "num_tokens"):
            value = getattr(self, name)
            if value is not None and not (is_int(value) and value >= 1):
                raise ConfigError(f"{name}={value!r} must be a positive int or None (CLI: {_flag(name)})")
        for name in ("start", "index"):
            value = getattr(self, name)
            if not (is_int(value) and value >= 0):
                raise ConfigError(f"{name}={value!r} must be a non-negative int (CLI: {_flag(name)})")
        for name in ("moe_layers", "layers"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, (str, bytes))
                or not isinstance(value, (Sequence, np.ndarray))
                or not all(is_int(x) and x >= 0 for x in value)
            ):
                raise ConfigError(
                    f"{name}={value!r} must be a sequence of non-negative global layer numbers or None "
                    f"(CLI: {_flag(name)} 1-26)"
                )


def engine_payload(trace: RouteTrace, fmt: FileFormat | str) -> dict[str, Any]:
    """The JSON response an engine would send for this trace, in that engine's exact wire form.

    vLLM and SGLang payloads hold every hidden layer 0..max(layers), dense layers zero-filled (as
    those engines send them); Megatron's holds the trace's layers in order. Each carries the
    `"routereplay"` object, so `read_trace` restores the global layer numbers and the start.
    """
    import base64

    fmt = FileFormat(fmt)
    carried: dict[str, Any] = {
        "layers": list(trace.layers),
        "num_experts": trace.num_experts,
        "top_k": trace.top_k,
        "start": trace.start,
    }
    if fmt is FileFormat.MEGATRON:
        return {"moe_topk_indices": trace.experts.tolist(), CARRIED_FIELD: carried}
    if fmt not in (FileFormat.VLLM, FileFormat.SGLANG):
        raise ConfigError(f"{fmt} is not an engine payload format")
    num_layers = max(trace.layers, default=-1) + 1
    if num_layers > MAX_CARRIED_LAYERS:
        raise ConfigError(
            f"layer number {num_layers - 1} is above {MAX_CARRIED_LAYERS - 1}: an all-layer {fmt} payload would hold "
            f"{num_layers} layers; write codec (.rrt) instead"
        )
    carried["num_layers"] = num_layers
    if fmt is FileFormat.VLLM:
        if not trace.routed_mask.all():
            raise ConfigError(
                "vLLM >= 0.22's wire form (uint8/uint16 .npy) has no -1 sentinel, and this trace has "
                f"{int((~trace.routed_mask).sum())} unrouted rows; write codec (.rrt) or sglang instead"
            )
        wire = _all_layers(trace, num_layers, np.dtype(np.uint8 if trace.num_experts <= 256 else np.uint16))
        text = base64.b64encode(npy_bytes(wire)).decode("ascii")
        return {"object": "text_completion", "choices": [{"index": 0, "routed_experts": text}], CARRIED_FIELD: carried}
    text = base64.b64encode(_all_layers(trace, num_layers, np.dtype("<i4")).tobytes()).decode("ascii")
    return {"meta_info": {"routed_experts": text}, CARRIED_FIELD: carried}


def _all_layers(trace: RouteTrace, num_layers: int, dtype: np.dtype[Any]) -> np.ndarray:
    """(T, num_layers, K) in `dtype`: the trace's layers at their global numbers, zeros elsewhere."""
    if trace.layers == tuple(range(num_layers)):
        return np.ascontiguousarray(trace.experts, dtype=dtype)
    experts_TLK = np.zeros((trace.num_tokens, num_layers, trace.top_k), dtype)
    experts_TLK[:, list(trace.layers)] = trace.experts
    return experts_TLK


def check_required(hints: PayloadHints, names: Sequence[str], path: Path) -> None:
    """One ConfigError naming every hint in `names` that is missing, so a user adds them all at once."""
    missing = [name for name in names if getattr(hints, name) is None]
    if missing:
        said = ", ".join(missing[:-1]) + (" or " if len(missing) > 1 else "") + missing[-1]
        advice = [f"{name}= (CLI: {_flag(name)})" for name in missing]
        passed = ", ".join(advice[:-1]) + (" and " if len(advice) > 1 else "") + advice[-1]
        raise ConfigError(
            f"{path.name}: the payload does not record {said}; pass {passed}, taken from the model's config.json"
        )


def required_hint(value: int | None, name: str, path: Path) -> int:
    if value is None:
        raise ConfigError(
            f"{path.name}: the payload does not record {name}; pass {name}= (CLI: {_flag(name)}), taken from the "
            "model's config.json"
        )
    return value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_recorded(hints: PayloadHints, trace: RouteTrace, where: str) -> None:
    """A codec file records its model facts: a hint that contradicts them is refused, never ignored."""
    recorded: dict[str, Any] = {
        "num_experts": trace.num_experts,
        "num_layers": trace.num_layers,
        "top_k": trace.top_k,
        "moe_layers": list(trace.layers),
        "layers": list(trace.layers),
    }
    told = (
        "the file records {name}={shown} but {flag} says {asked}; a codec file carries its own model facts: "
        "drop {flag} (or pass {shown})"
    )
    _refuse_contradiction(hints, recorded, where, told)


def _refuse_contradiction(hints: PayloadHints, recorded: dict[str, Any], where: str, told: str) -> None:
    """A ConfigError for the first given hint that differs from `recorded`. Its message is `where`, then
    `told` filled with the hint's name, its recorded value (`shown`), the hint's value (`asked`), layer
    lists as compact ranges, and its flag."""
    for name, value in recorded.items():
        given = getattr(hints, name)
        if given is None:
            continue
        given = [int(x) for x in given] if isinstance(value, list) else int(given)
        if given != value:
            shown = compact_ranges(value) if isinstance(value, list) else value
            asked = compact_ranges(given) if isinstance(given, list) else given
            raise ConfigError(f"{where}: " + told.format(name=name, shown=shown, asked=asked, flag=_flag(name)))


def with_carried(hints: PayloadHints, document: Any, found: FileFormat, where: str) -> PayloadHints:
    """Fill what `hints` leave unsaid from the `"routereplay"` object of a payload `engine_payload` wrote."""
    carried = document.get(CARRIED_FIELD) if isinstance(document, dict) else None
    if carried is None:
        return hints
    problem = _carried_problem(carried)
    if problem:
        raise PayloadEncodingError(
            f"{where}: the '{CARRIED_FIELD}' object is malformed ({problem}); remove it and pass --num-experts, "
            "--moe-layers (and for SGLang --num-layers, --top-k)"
        )
    layers = [int(x) for x in carried["layers"]]
    _check_carried(hints, carried, layers, where)
    written = carried.get("num_layers")
    if found is not FileFormat.MEGATRON and None not in (hints.num_layers, written) and hints.num_layers != written:
        raise LayerCountError(
            f"{where}: num_layers={hints.num_layers} (CLI: --num-layers), but routereplay wrote this payload with "
            f"{written} layers (every hidden layer; MoE layers {compact_ranges(layers)} in its '{CARRIED_FIELD}' "
            "object); leave --num-layers out"
        )
    update: dict[str, Any] = {
        "num_experts": hints.num_experts if hints.num_experts is not None else carried["num_experts"],
        "top_k": hints.top_k if hints.top_k is not None else carried["top_k"],
        "start": hints.start if hints.start else carried["start"],
    }
    if hints.moe_layers is None and hints.layers is None:
        update["layers" if found is FileFormat.MEGATRON else "moe_layers"] = layers
    if found is not FileFormat.MEGATRON and hints.num_layers is None:
        update["num_layers"] = carried.get("num_layers", max(layers) + 1)
    return replace(hints, **update)


def _check_carried(hints: PayloadHints, carried: dict[str, Any], layers: list[int], where: str) -> None:
    """A hint that contradicts the model facts routereplay wrote into the payload is refused, never used
    over them (as for a codec file: `check_recorded`)."""
    recorded: dict[str, Any] = {"num_experts": carried["num_experts"], "top_k": carried["top_k"]}
    recorded.update(moe_layers=layers, layers=layers)
    told = (
        "routereplay wrote this payload with {name}={shown} (its '" + CARRIED_FIELD + "' object) but {flag} "
        "says {asked}; drop {flag} (or pass {shown})"
    )
    _refuse_contradiction(hints, recorded, where, told)
    if hints.start and hints.start != carried["start"]:
        raise ConfigError(
            f"{where}: routereplay wrote this payload with start={carried['start']} (its '{CARRIED_FIELD}' object) but "
            f"--start says {hints.start}; drop --start (or pass {carried['start']})"
        )


def _carried_problem(carried: Any) -> str:
    """What is wrong with a `"routereplay"` object ("" when nothing)."""
    if not isinstance(carried, dict):
        return f"a {type(carried).__name__}, expected an object"
    layers = carried.get("layers")
    if not isinstance(layers, list) or not 0 < len(layers) <= MAX_CARRIED_LAYERS:
        return f"'layers' must be a list of 1 to {MAX_CARRIED_LAYERS} layer numbers"
    if not all(is_int(x) and 0 <= x < MAX_CARRIED_LAYERS for x in layers) or len(set(layers)) != len(layers):
        return f"'layers' must hold distinct layer numbers in [0, {MAX_CARRIED_LAYERS})"
    for name in ("num_experts", "top_k"):
        if not (is_int(carried.get(name)) and carried[name] >= 1):
            return f"'{name}' must be a positive int"
    if not (is_int(carried.get("start")) and carried["start"] >= 0):
        return "'start' must be a non-negative int"
    if "num_layers" in carried and not (
        is_int(carried["num_layers"]) and max(layers) < carried["num_layers"] <= MAX_CARRIED_LAYERS
    ):
        return f"'num_layers' must be an int above every layer number, at most {MAX_CARRIED_LAYERS}"
    return ""
