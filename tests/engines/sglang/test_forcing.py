"""SGLang 0.5.23's own `select_experts` (torch-native paths, CPU) with the forcing hook applied by SGLang's own
`HookRegistry`: exactly the forced rows change, every other row is bit-identical, and SGLang's routed-experts
capture (called inside `_post_process_topk_ids`) sees the forced ids.

Legend: N = token rows, E = experts, K = top-k.
"""

from __future__ import annotations

import importlib.util
import pkgutil
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("sglang.srt.layers.moe.topk")

import torch
from sglang.srt.layers.moe import topk
from sglang.srt.layers.moe.topk import TopKConfig, TopKOutputFormat, select_experts
from sglang.srt.plugins.hook_registry import HookRegistry

from routereplay.engines.sglang.forcing import ForcedBatch, SGLangForcing, install, rule_of
from routereplay.engines.sglang.forcing.hooks import SRT

N, E, K, LAYER = 12, 16, 4, 3
FORCED_ROWS = (1, 5, 7, 11)


class CaptureProbe:
    """Stands where SGLang's `RoutedExpertsCapturer` stands: `_post_process_topk_ids` calls `capture` with the ids
    it hands to capture (what the request gets back)."""

    def __init__(self) -> None:
        self.ids: dict[int, torch.Tensor] = {}

    def capture(self, layer_id: int, topk_indices: torch.Tensor) -> None:
        self.ids[layer_id] = topk_indices.clone()


@pytest.fixture
def forcing(monkeypatch: pytest.MonkeyPatch) -> Iterator[SGLangForcing]:
    """The hooks installed through SGLang's HookRegistry and applied; every patched target restored after."""
    state = SGLangForcing()
    HookRegistry.reset()
    install(HookRegistry, state)
    targets = list(HookRegistry._hooks)
    saved = []
    for target in targets:  # a target whose module does not import here is left unpatched
        owner_path, name = target.rsplit(".", 1)
        try:
            owner = pkgutil.resolve_name(owner_path)
        except (ImportError, AttributeError):
            HookRegistry._patched.add(target)
            continue
        saved.append((owner, name, owner.__dict__[name]))
    HookRegistry.apply_hooks()
    try:
        yield state
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
        HookRegistry.reset()


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> CaptureProbe:
    found = CaptureProbe()
    monkeypatch.setattr(topk, "get_global_experts_capturer", lambda: found)
    return found


def forced_batch(forced_NK: torch.Tensor, rows: tuple[int, ...], layer: int = LAYER) -> ForcedBatch:
    mask_N = torch.zeros(N, dtype=torch.bool)
    mask_N[list(rows)] = True
    full_NK = torch.full((N, K), -1, dtype=torch.int32)
    full_NK[mask_N] = forced_NK[mask_N].to(torch.int32)
    return ForcedBatch(N, {layer: 0}, full_NK[None], mask_N[None], len(rows), ("r0",))


def other_experts(live_NK: torch.Tensor, seed: int) -> torch.Tensor:
    """For each row K distinct experts, at least one not in the live choice."""
    generator = np.random.default_rng(seed)
    rows = []
    for live in live_NK.tolist():
        while True:
            pick = generator.choice(E, size=K, replace=False)
            if set(pick.tolist()) != set(live):
                rows.append(pick)
                break
    return torch.tensor(np.stack(rows), dtype=torch.int32)


def expected_weights(logits_NE: torch.Tensor, ids_NK: torch.Tensor, scoring: str, scale: float) -> torch.Tensor:
    scores_NE = torch.softmax(logits_NE.float(), -1) if scoring == "softmax" else logits_NE.float().sigmoid()
    chosen_NK = scores_NE.gather(1, ids_NK.long())
    return chosen_NK / (chosen_NK.sum(-1, keepdim=True) + 1e-20) * scale


CONFIGS = {
    "softmax_topk": (dict(top_k=K, renormalize=True, torch_native=True), "softmax", 1.0),
    "grouped": (
        dict(top_k=K, renormalize=True, use_grouped_topk=True, num_expert_group=4, topk_group=2, torch_native=True),
        "softmax",
        1.0,
    ),
    "biased_grouped": (
        dict(
            top_k=K,
            renormalize=True,
            use_grouped_topk=True,
            num_expert_group=4,
            topk_group=2,
            scoring_func="sigmoid",
            routed_scaling_factor=2.5,
            apply_routed_scaling_factor_on_output=True,
            torch_native=True,
        ),
        "sigmoid",
        2.5,
    ),
}


def make_config(kind: str) -> tuple[TopKConfig, str, float]:
    settings, scoring, scale = CONFIGS[kind]
    config = TopKConfig(**settings)
    if kind == "biased_grouped":
        config.correction_bias = torch.linspace(-0.5, 0.5, E)
    return config, scoring, scale


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_select_experts_forces_exactly_the_forced_rows(kind: str, forcing: SGLangForcing, probe: CaptureProbe) -> None:
    config, scoring, scale = make_config(kind)
    generator = torch.Generator().manual_seed(7)
    hidden_ND = torch.randn(N, 8, generator=generator)
    logits_NE = torch.randn(N, E, generator=generator)
    live = select_experts(hidden_ND, logits_NE.clone(), config, layer_id=LAYER)
    assert torch.equal(probe.ids[LAYER], live.topk_ids), "SGLang's capture sees the live ids without forcing"

    forced_NK = other_experts(live.topk_ids, seed=1)
    forcing.current = forced_batch(forced_NK, FORCED_ROWS)
    got = select_experts(hidden_ND, logits_NE.clone(), config, layer_id=LAYER)
    forcing.current = None

    others = [n for n in range(N) if n not in FORCED_ROWS]
    assert torch.equal(got.topk_ids[others], live.topk_ids[others])
    assert torch.equal(got.topk_weights[others], live.topk_weights[others])
    for n in FORCED_ROWS:
        assert set(got.topk_ids[n].tolist()) == set(forced_NK[n].tolist())
        assert set(probe.ids[LAYER][n].tolist()) == set(forced_NK[n].tolist()), "capture must see the forced ids"
    want_NK = expected_weights(logits_NE, got.topk_ids, scoring, scale)
    torch.testing.assert_close(got.topk_weights[list(FORCED_ROWS)], want_NK[list(FORCED_ROWS)])
    assert got.topk_weights.dtype == live.topk_weights.dtype and got.topk_ids.dtype == live.topk_ids.dtype


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_forcing_a_row_to_its_live_set_keeps_it_bit_identical(kind: str, forcing: SGLangForcing) -> None:
    config, _, _ = make_config(kind)
    generator = torch.Generator().manual_seed(3)
    hidden_ND, logits_NE = torch.randn(N, 8, generator=generator), torch.randn(N, E, generator=generator)
    live = select_experts(hidden_ND, logits_NE.clone(), config, layer_id=LAYER)
    forcing.current = forced_batch(live.topk_ids.flip(-1), tuple(range(N)))  # same sets, another order
    got = select_experts(hidden_ND, logits_NE.clone(), config, layer_id=LAYER)
    forcing.current = None
    for n in range(N):
        order = {e: i for i, e in enumerate(live.topk_ids[n].tolist())}
        back = [order[e] for e in got.topk_ids[n].tolist()]
        assert torch.equal(got.topk_weights[n], live.topk_weights[n][back])


def test_other_layers_and_no_current_forward_route_live(forcing: SGLangForcing, probe: CaptureProbe) -> None:
    config, _, _ = make_config("softmax_topk")
    generator = torch.Generator().manual_seed(5)
    hidden_ND, logits_NE = torch.randn(N, 8, generator=generator), torch.randn(N, E, generator=generator)
    live = select_experts(hidden_ND, logits_NE.clone(), config, layer_id=LAYER)
    forcing.current = forced_batch(other_experts(live.topk_ids, seed=2), FORCED_ROWS, layer=LAYER + 1)
    got = select_experts(hidden_ND, logits_NE.clone(), config, layer_id=LAYER)
    forcing.current = None
    assert torch.equal(got.topk_ids, live.topk_ids) and torch.equal(got.topk_weights, live.topk_weights)
    assert forcing.stats.layers_unforced == 0


def test_a_layer_that_cannot_be_forced_routes_live_and_is_counted(forcing: SGLangForcing) -> None:
    config = TopKConfig(top_k=K, renormalize=True, torch_native=True, scoring_func="sqrtsoftplus")
    generator = torch.Generator().manual_seed(9)
    hidden_ND, logits_NE = torch.randn(N, 8, generator=generator), torch.randn(N, E, generator=generator)
    live = select_experts(hidden_ND, logits_NE.clone(), config, layer_id=LAYER)
    forcing.current = forced_batch(other_experts(live.topk_ids, seed=4), FORCED_ROWS)
    got = select_experts(hidden_ND, logits_NE.clone(), config, layer_id=LAYER)
    forcing.current = None
    assert torch.equal(got.topk_ids, live.topk_ids)
    assert forcing.stats.layers_unforced == 1


def custom(hidden_states, gating_output, topk, renormalize):  # type: ignore[no-untyped-def]
    return torch.topk(gating_output.softmax(-1), topk)


@pytest.mark.parametrize(
    ("settings", "reason"),
    [
        (dict(custom_routing_function=custom), "custom routing function .*custom"),
        (dict(scoring_func="sqrtsoftplus"), "scoring 'sqrtsoftplus'"),
        (dict(output_format=TopKOutputFormat.BYPASSED), "output format BYPASSED"),
        (dict(output_format=TopKOutputFormat.TRITON_KERNEL), "output format TRITON_KERNEL"),
        (dict(fused_gate_packed_ids=True), "fused_gate_packed_ids"),
    ],
)
def test_rule_of_refuses_by_name(settings: dict, reason: str) -> None:
    rule, why = rule_of(TopKConfig(top_k=K, **settings))
    assert rule is None
    assert re.search(reason, why), why


def test_install_registers_every_hook_on_sglang_targets() -> None:
    class Recorder:
        def __init__(self) -> None:
            self.targets: list[str] = []

        def register(self, target: str, hook: object, kind: object) -> None:
            self.targets.append(target)

    recorder = Recorder()
    install(recorder)
    assert all(t.startswith(SRT) for t in recorder.targets)
    for target in recorder.targets:  # each target is defined in this SGLang (read from source, no import)
        owner, name = target.rsplit(".", 1)
        module_name = owner if _is_module(owner) else owner.rsplit(".", 1)[0]
        spec = importlib.util.find_spec(module_name)
        assert spec is not None and spec.origin is not None, target
        assert f"def {name}(" in Path(spec.origin).read_text(), target


def _is_module(dotted: str) -> bool:
    try:
        return importlib.util.find_spec(dotted) is not None
    except ModuleNotFoundError:
        return False
