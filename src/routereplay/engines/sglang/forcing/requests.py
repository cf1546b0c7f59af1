"""Routes one SGLang request asks to have forced: where they travel, how they are checked, how the cache is salted.

A request asks by carrying `sampling_params.custom_params[CUSTOM_KEY]`: the same codec blob as the vLLM plugin
(`routereplay.engines.vllm.encode_forced(trace)`, base64 text; CRC, geometry and limits checked by the shared
`ForcedRoutes.parse`). SGLang passes `custom_params` through `/generate` and the OpenAI endpoints to the
scheduler's `Req.sampling_params` (JSON-safe values: a str survives its msgpack IPC). Row i of the blob forces
prompt position `start + i`; -1 rows route live; its layers are the served model's MoE layers by global number.

Checked twice, each time before anything is sized by the blob: in the front end (`TokenizerManager`, where
SGLang's HTTP server answers a `ValueError` with 400: `ForcedRoutesError` is one) and in the scheduler when the
request is queued (`forcing.hooks`), which keeps the checked `ForcedRoutes` on the `Req` and uses only that.

Prefix cache: SGLang keys its radix tree by token ids within a request's `extra_key` / `cache_salt` namespace.
A forced request gets `cache_salt = salted(its salt, digest of its routes)` (the vLLM plugin's salt), so its KV is
shared only with requests forcing the same routes; an unforced request whose own salt carries the reserved
prefix is refused (it would reuse KV computed under forced routes).

Re-prefill after a retraction: `custom_params[REPREFILL_KEY]` (true / false) asks that the request's re-prefill be
forced with its sampling-time rows; `REPREFILL_ENV=1` makes that the server's default (a request's false wins).

Legend: T = forced rows, L = MoE layers, K = top-k.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from routereplay.engines.vllm.forced_routes import (
    SALT_PREFIX,
    XARG_KEY,
    ForcedRoutes,
    ServedRouting,
    moe_layers_of,
    salted,
    weights_flag,
)
from routereplay.errors import ForcedRoutesError

CUSTOM_KEY = XARG_KEY  # sampling_params.custom_params[CUSTOM_KEY] = encode_forced(trace)
CARRIER = "sampling_params.custom_params"
REPREFILL_KEY = "routereplay_force_reprefill"  # custom_params[REPREFILL_KEY] = true: force a retracted re-prefill
REPREFILL_ENV = "ROUTEREPLAY_SGLANG_FORCE_REPREFILL"  # =1: every request's re-prefill forced (unless it says false)
EXPERT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "moe_topk", "moe_k")


def served_routing(text_config: Any) -> ServedRouting:
    """The served model's routing geometry from its HF text config (SGLang's `ModelConfig.hf_text_config`).

    `ForcedRoutesError` when the config names no expert count or top-k (not an MoE model): nothing can be forced."""
    num_experts = _first_int(text_config, EXPERT_FIELDS)
    top_k = _first_int(text_config, TOP_K_FIELDS)
    if num_experts is None or top_k is None:
        raise ForcedRoutesError(
            f"the served model's config has no expert count ({'/'.join(EXPERT_FIELDS)}) or top-k "
            f"({'/'.join(TOP_K_FIELDS)}): it is not an MoE model the routereplay SGLang plugin can force"
        )
    num_layers = int(text_config.num_hidden_layers)
    return ServedRouting(num_experts, top_k, num_layers, moe_layers_of(text_config, num_layers))


def asked_routes(custom_params: Any) -> object | None:
    """The forced-routes value a request's `custom_params` carries (None when it asks for none)."""
    if not isinstance(custom_params, dict):
        return None
    return custom_params.get(CUSTOM_KEY)


def parse_request(value: object, served: ServedRouting, prompt: list[int] | None, *, where: str) -> ForcedRoutes:
    """A request's routes checked against the model and prompt (`ForcedRoutes.parse`), named as SGLang carries
    them: `ForcedRoutesError` naming the request, what and how to fix."""
    return ForcedRoutes.parse(value, served, prompt, where=where, carrier=CARRIER)


def server_reprefill(environ: Mapping[str, str]) -> bool:
    """The server's default for forcing re-prefills (`REPREFILL_ENV`: 1 / 0, true / false; unset: off).

    `ForcedRoutesError` for any other value (at start-up, naming the variable)."""
    value = environ.get(REPREFILL_ENV, "").strip()
    if not value:
        return False
    flag = weights_flag(int(value) if value in ("0", "1") else value)
    if flag is None:
        raise ForcedRoutesError(
            f"environment variable {REPREFILL_ENV}={value!r}: set it to 1 (force every retracted request's "
            "re-prefill with its sampling-time routes) or 0 / unset it (off)"
        )
    return flag


def asks_reprefill(custom_params: Any, default: bool, *, where: str) -> bool:
    """Whether a request's re-prefill after a retraction is forced with its sampling-time rows: its own
    `custom_params[REPREFILL_KEY]` (true / false, 1 / 0, "true" / "false") where given, the server's `default`
    otherwise. `ForcedRoutesError` for any other value."""
    if not isinstance(custom_params, dict) or REPREFILL_KEY not in custom_params:
        return default
    flag = weights_flag(custom_params[REPREFILL_KEY])
    if flag is None:
        raise ForcedRoutesError(
            f"{where}: {CARRIER} {REPREFILL_KEY!r}={custom_params[REPREFILL_KEY]!r} must be true (force the "
            "re-prefill after a retraction with the sampling-time routes) or false (JSON true / false, 1 / 0)"
        )
    return flag


def request_salt(value: object, cache_salt: str | None, *, where: str) -> str | None:
    """The cache salt a request runs with: salted by its routes when it forces, its own otherwise; an unforced
    request whose salt carries the reserved prefix is refused (`ForcedRoutesError`)."""
    if value is None:
        if cache_salt and SALT_PREFIX in cache_salt:
            raise ForcedRoutesError(
                f"{where}: cache_salt {cache_salt[:80]!r} carries {SALT_PREFIX!r}, which the routereplay plugin "
                "reserves for requests that force routes; choose another salt"
            )
        return cache_salt
    return salted(cache_salt, value if isinstance(value, str) else repr(value))


def _first_int(config: Any, fields: tuple[str, ...]) -> int | None:
    for field in fields:
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


__all__ = [
    "CARRIER",
    "CUSTOM_KEY",
    "REPREFILL_ENV",
    "REPREFILL_KEY",
    "asked_routes",
    "asks_reprefill",
    "parse_request",
    "request_salt",
    "served_routing",
    "server_reprefill",
]
