"""Layers holding several routers: one (layer, slot) column each, through trace, codec, store and replay.

JetMoE routes attention experts and MLP experts in every layer; Ernie-4.5-VL hands each token to its
text or its vision router by `moe_mm_token_type_ids`. The battery of `test_families.py` covers both;
these tests guard what a column per router adds: stable slot names, their survival through every
serialised form, refusals of routes meant for another router layout, and modality splits.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from routereplay.codec import blob as codec
from routereplay.errors import (
    CodecFormatError,
    ConfigError,
    LayerCountError,
    ModalityMismatchError,
)
from routereplay.store.route_store import RouteStore
from routereplay.trace.route_trace import RouteTrace

pytestmark = pytest.mark.hf

hf_tiny = pytest.importorskip(
    "routereplay.testing.hf.models", reason="needs transformers (pip install 'routereplay[hf]')"
)

JETMOE_SLOTS = ("mlp.router", "self_attention.experts.router")
ERNIE_SLOTS = ("mlp.text_moe.gate", "mlp.vision_moe.gate")


def _model(model_type: str):  # type: ignore[no-untyped-def]
    from routereplay.runtime import attach

    model = hf_tiny.tiny_model(model_type)
    return model, attach(model)


def _batch(model: torch.nn.Module, vision: slice | None = None) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, hf_tiny.text_vocab_size(model), (2, 10), generator=torch.Generator().manual_seed(3))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if vision is not None:
        types = torch.zeros_like(ids)
        types[:, vision] = 1
        inputs["moe_mm_token_type_ids"] = types
    return inputs


def test_jetmoe_binds_two_named_slots_per_layer() -> None:
    """A layer with attention and MLP routers must bind both, named by their paths, in module order."""
    _, replayer = _model("jetmoe")
    assert replayer.columns == tuple((layer, slot) for layer in (0, 1) for slot in JETMOE_SLOTS)
    assert [b.name for b in replayer.bindings][:2] == [f"model.layers.0.{slot}" for slot in JETMOE_SLOTS]
    assert "layer 0 [self_attention.experts.router]" in replayer.describe()


@pytest.mark.parametrize("mode", ["set", "ordered"])
def test_slots_survive_codec_and_store_and_replay_bit_exact(mode: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Slot names lost in a blob or a store file would make replay refuse (or misplace) the columns."""
    model, replayer = _model("jetmoe")
    inputs = _batch(model)
    with replayer.record() as rec:
        natural = model(**inputs).logits
    traces = rec.traces(inputs["attention_mask"], input_ids=inputs["input_ids"])
    assert traces[0].slots == JETMOE_SLOTS * 2
    decoded = [codec.decode(codec.encode(t, mode=mode)) for t in traces]
    assert [t.columns for t in decoded] == [t.columns for t in traces]
    store = RouteStore(codec_mode=mode)
    for index, trace in enumerate(traces):
        store.add_turn(index, [*inputs["input_ids"][index].tolist(), 0], trace)
    store.save(tmp_path / "routes.rrs")
    loaded = RouteStore.load(tmp_path / "routes.rrs")
    stored = [loaded.trace(i) for i in range(2)]
    assert all(t.slots == JETMOE_SLOTS * 2 for t in stored)
    for replayed in (decoded, stored):
        with replayer.replay(replayed, inputs["attention_mask"], input_ids=inputs["input_ids"]):
            assert torch.equal(model(**inputs).logits, natural)


def test_routes_without_slots_are_refused_by_a_two_router_model() -> None:
    """An engine trace (one route per layer) must not be spread over two routers' columns silently."""
    model, replayer = _model("jetmoe")
    inputs = _batch(model)
    one_per_layer = RouteTrace(np.zeros((10, 2, 2), np.int16) + np.array([0, 1], np.int16), 8, layers=(0, 1))
    with pytest.raises(LayerCountError, match="router slots"):
        with replayer.replay([one_per_layer] * 2, inputs["attention_mask"]):
            pass


def test_store_refuses_traces_of_another_slot_layout() -> None:
    """A store mixing slotted and unslotted traces would hold routes of two different models."""
    slotted = RouteTrace(np.zeros((3, 2, 1), np.int16), 4, layers=(0, 0), slots=("a", "b"))
    store = RouteStore()
    store.add_turn("s", [1, 2, 3, 4], slotted)
    other = RouteTrace(np.zeros((3, 2, 1), np.int16), 4, layers=(0, 0), slots=("a", "c"))
    with pytest.raises(LayerCountError, match="router slots"):
        store.add_turn("t", [1, 2, 3, 4], other)


def test_trace_slots_are_checked_and_selectable() -> None:
    """A repeated (layer, slot) column or a layer repeated without slots is ambiguous routing."""
    rows = np.arange(12, dtype=np.int16).reshape(2, 3, 2) % 8
    with pytest.raises(ConfigError, match="distinct non-negative"):
        RouteTrace(rows, 8, layers=(0, 0, 1))
    with pytest.raises(ConfigError, match="repeat"):
        RouteTrace(rows, 8, layers=(0, 0, 1), slots=("x", "x", ""))
    trace = RouteTrace(rows, 8, layers=(0, 0, 1), slots=("x", "y", ""))
    assert trace.select_layers([0]).columns == ((0, "x"), (0, "y"))
    picked = trace.select_columns([(0, "y"), (1, "")])
    assert np.array_equal(picked.experts, rows[:, [1, 2]])
    with pytest.raises(ConfigError, match=r"\(0, 'z'\)"):
        trace.select_columns([(0, "z")])
    with pytest.raises(LayerCountError, match="router slots"):
        trace.merge(RouteTrace(rows, 8, layers=(0, 0, 1), slots=("x", "w", "")))


def test_forged_slot_names_in_a_blob_are_refused() -> None:
    """A blob whose slot names repeat a column or are not UTF-8 must not decode into a trace."""
    trace = RouteTrace(np.array([[[1], [2]]], np.int16), 4, layers=(5, 5), slots=("ab", "cd"))
    blob = bytearray(codec.encode(trace))
    at = blob.index(b"cd")
    for forged, message in ((b"ab", "repeat"), (b"\xff\xfe", "not UTF-8")):
        bad = bytearray(blob)
        bad[at : at + 2] = forged
        bad[-4:] = zlib.crc32(bytes(bad[:-4])).to_bytes(4, "little")
        with pytest.raises(CodecFormatError, match=message):
            codec.decode(bytes(bad))


def test_ernie_tokens_replay_in_the_router_of_their_modality() -> None:
    """Each token's route must reach the router that runs for it; the other column stays -1."""
    model, replayer = _model("ernie4_5_vl_moe")
    inputs = _batch(model, vision=slice(2, 6))
    with replayer.record() as rec:
        natural = model(**inputs).logits
    routes = rec.routes  # (B, S, 4, K): columns text, vision of layers 1 and 2
    vision = inputs["moe_mm_token_type_ids"].bool()
    assert bool((routes[:, :, 0, 0] >= 0).eq(~vision).all()) and bool((routes[:, :, 1, 0] >= 0).eq(vision).all())
    with replayer.replay(routes) as used:
        assert torch.equal(model(**inputs).logits, natural)
    assert used.stats.replayed_rows == 2 * 10 * 2 and used.stats.fallback_rows == 0  # each token once per layer


def test_ernie_routes_of_another_modality_split_are_refused() -> None:
    """Routes recorded with other token types would force text routes into the vision router's tokens."""
    model, replayer = _model("ernie4_5_vl_moe")
    with replayer.record() as rec:
        model(**_batch(model, vision=slice(2, 6)))
    with pytest.raises(ModalityMismatchError, match="vision router does not run"):
        with replayer.replay(rec.routes):
            model(**_batch(model))  # text only: the vision router never runs
    with pytest.raises(ModalityMismatchError, match="text router does not run"):
        with replayer.replay(rec.routes):
            model(**_batch(model, vision=slice(0, 6)))


def test_ernie_text_only_batch_records_minus_one_in_vision_columns() -> None:
    """A router that saw no token must leave -1 rows, not fail the recording or invent routes."""
    model, replayer = _model("ernie4_5_vl_moe")
    inputs = _batch(model)
    with replayer.record() as rec:
        natural = model(**inputs).logits
    assert bool((rec.routes[:, :, 1::2] == -1).all()) and bool((rec.routes[:, :, 0::2] >= 0).all())
    with replayer.replay(rec.routes):
        assert torch.equal(model(**inputs).logits, natural)


def test_ernie_record_under_checkpointing_reuses_its_modality_rows() -> None:
    """A recompute of a modality router must reuse its own tokens' recorded choice, not all tokens'."""
    model, replayer = _model("ernie4_5_vl_moe")
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    inputs = _batch(model, vision=slice(2, 6))
    with replayer.record() as plain:
        model(**inputs)
    replayer.stats.reset()
    with replayer.record() as rec:
        model(**inputs).logits.float().pow(2).mean().backward()
    assert replayer.stats.recompute_calls >= 4  # both routers of both layers ran again in backward
    assert torch.equal(rec.routes, plain.routes)
