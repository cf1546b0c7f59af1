"""DSA indexer choices on the whole R2/R3 path: Replayer record -> RouteTrace.indexer -> codec / store -> replay.

`test_indexer_replay.py` covers `IndexerReplayer` alone (attended keys, fallback, recompute, threads);
these guard what carries its choices between passes: the traces `Recording.traces` returns, the codec
blob and the route store (save/load and per-turn merges), SGLang's `indexer_topk` payload, and the
refusals when choices meet a model or rows they were not made for.
"""

from __future__ import annotations

import base64
import zlib

import numpy as np
import pytest
import torch

from routereplay.codec import blob as codec
from routereplay.errors import CodecFormatError, ConfigError
from routereplay.indexer.trace import IndexerTrace
from routereplay.store.route_store import RouteStore
from routereplay.wire.indexer_topk import decode_sglang_indexer

pytestmark = pytest.mark.hf

hf_tiny = pytest.importorskip(
    "routereplay.testing.hf.models", reason="needs transformers (pip install 'routereplay[hf]')"
)
DSA_TYPES = ("deepseek_v32", "glm_moe_dsa")


def _model(model_type: str):  # type: ignore[no-untyped-def]
    from routereplay.runtime import attach

    model = hf_tiny.tiny_model(model_type)
    return model, attach(model)


def _batch(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, hf_tiny.text_vocab_size(model), (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding: batch columns != token positions
    return ids, mask


def _recorded(model_type: str):  # type: ignore[no-untyped-def]
    model, replayer = _model(model_type)
    ids, mask = _batch(model)
    with replayer.record() as rec:
        natural = model(input_ids=ids, attention_mask=mask).logits
    return model, replayer, ids, mask, natural, rec.traces(mask, input_ids=ids)


def _attended(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return logits[mask.bool()]


@pytest.mark.parametrize("model_type", DSA_TYPES)
def test_traces_carry_indexer_choices_through_codec_and_store(model_type: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Choices dropped by a blob or a store file would let the indexer pick live keys on replay."""
    model, replayer, ids, mask, natural, traces = _recorded(model_type)
    assert replayer.indexer is not None and all(t.indexer is not None for t in traces)
    assert traces[1].indexer.num_tokens == 8 and traces[1].indexer.to_dense().max() < 8  # token positions
    blobs = [codec.decode(codec.encode(t, mode="ordered")) for t in traces]
    assert [t.indexer for t in blobs] == [t.indexer for t in traces]
    store = RouteStore()
    for b, trace in enumerate(traces):
        store.add_turn(b, [*ids[b][mask[b].bool()].tolist(), 0], trace)
    store.save(tmp_path / "routes.rrs")
    loaded = RouteStore.load(tmp_path / "routes.rrs")
    assert loaded == store
    for carried in (blobs, [loaded.trace(b) for b in range(2)]):
        replayer.indexer.stats.reset()
        with replayer.replay(carried, mask, input_ids=ids):
            assert torch.equal(
                _attended(model(input_ids=ids, attention_mask=mask).logits, mask), _attended(natural, mask)
            )
        assert replayer.indexer.stats.replayed_rows == int(mask.sum()) * len(replayer.indexer.layers)
        assert replayer.indexer.stats.fallback_rows == 0


@pytest.mark.parametrize("model_type", DSA_TYPES)
def test_forced_indexer_choices_from_traces_change_attention(model_type: str) -> None:
    """The traces' choices must be what the indexers use: other choices give other logits."""
    model, replayer, ids, mask, natural, traces = _recorded(model_type)
    changed = []
    for trace in traces:  # each query past the first index_topk keys attends its first keys instead
        dense = trace.indexer.to_dense()
        top = dense.shape[2]
        for t in range(top, dense.shape[0]):
            dense[t] = np.arange(top, dtype=np.int32)
        changed.append(trace.with_indexer(IndexerTrace.from_dense(dense, trace.indexer.layers, top)))
    with replayer.replay(changed, mask, input_ids=ids):
        forced = model(input_ids=ids, attention_mask=mask).logits
    assert not torch.allclose(_attended(forced, mask), _attended(natural, mask))
    with replayer.replay(traces, mask, input_ids=ids):  # and the recorded ones give the natural logits back
        assert torch.equal(_attended(model(input_ids=ids, attention_mask=mask).logits, mask), _attended(natural, mask))


def test_store_merges_indexer_choices_by_the_turn_policy() -> None:
    """A resumed turn must not overwrite the choices its prefix was sampled with (policy keep)."""
    _, _, ids, _, _, traces = _recorded("deepseek_v32")
    trace, tokens = traces[0], [*ids[0].tolist(), 0]
    dense = trace.indexer.to_dense()
    other = dense.copy()
    other[6:, :, :] = np.sort(np.stack([np.arange(t - 3, t + 1) for t in range(6, 12)]), axis=1)[:, None, :]
    resent = trace.with_indexer(IndexerTrace.from_dense(other, trace.indexer.layers, dense.shape[2]))
    for policy, expected in (("keep", dense), ("replace", other)):
        store = RouteStore()
        store.add_turn("s", tokens, trace.slice(0, 8))
        store.add_turn("s", tokens, resent, policy=policy)
        got = store.trace("s").indexer.to_dense()
        assert np.array_equal(got[:8], expected[:8]) and np.array_equal(got[8:], other[8:]), policy


def test_sglang_indexer_payload_replays_like_the_recording() -> None:
    """SGLang's base64 int32 (rows, layers, index_topk) with -1 padding must decode to the same choices."""
    model, replayer, ids, _, _, traces = _recorded("deepseek_v32")
    trace = traces[0]
    dense = trace.indexer.to_dense()[:-1]  # SGLang sends no row for the last token
    meta = {"indexer_topk": base64.b64encode(dense.astype("<i4").tobytes()).decode(), "prompt_tokens": 11}
    meta["completion_tokens"] = 1
    decoded = decode_sglang_indexer({"meta_info": meta}, num_layers=3, index_topk=dense.shape[2])
    assert np.array_equal(decoded.to_dense(), dense)
    extended = trace.with_indexer(None).slice(0, 11).with_indexer(decoded)
    one = torch.ones(1, 12, dtype=torch.long)
    with replayer.replay([extended], one, input_ids=ids[:1]):
        replayed = model(input_ids=ids[:1], attention_mask=one).logits
    with replayer.record():
        alone = model(input_ids=ids[:1], attention_mask=one).logits
    assert torch.equal(replayed, alone)


def test_indexer_choices_for_another_model_or_rows_are_refused() -> None:
    """Choices meant for a DSA model must not be dropped silently by a model without indexers."""
    _, _, _, mask, _, traces = _recorded("deepseek_v32")
    _, replayer = _model("qwen3_moe")
    with pytest.raises(ConfigError, match="no DSA indexer"):
        with replayer.replay([traces[0]], mask[:1]):
            pass
    with pytest.raises(ConfigError, match="indexer choices cover tokens"):
        traces[0].slice(0, 5).with_indexer(traces[0].indexer)


def test_a_forged_indexer_section_in_a_blob_is_refused() -> None:
    """A blob whose indexer section is cut or forged must fail with a codec error, not decode garbage."""
    _, _, _, _, _, traces = _recorded("glm_moe_dsa")
    blob = bytearray(codec.encode(traces[0]))
    at = blob.index(traces[0].indexer.encode())
    forged = bytearray(blob)
    forged[at + 8] ^= 0xFF  # inside the indexer blob: its own checksum catches it
    forged[-4:] = zlib.crc32(bytes(forged[:-4])).to_bytes(4, "little")
    with pytest.raises(CodecFormatError):
        codec.decode(bytes(forged))


@pytest.mark.parametrize(("model_type", "kind"), [("deepseek_v4", "compressed KV blocks"), ("glm5_next", "pooled")])
def test_indexers_of_another_kind_stay_live_and_are_named(model_type: str, kind: str) -> None:
    """An indexer that does not pick token positions must not be bound as one (wrong keys), nor go unmentioned."""
    model, replayer = _model(model_type)
    assert replayer.indexer is None
    assert "live indexer" in replayer.describe() and kind in replayer.describe()
    ids = torch.randint(0, hf_tiny.text_vocab_size(model), (2, 8), generator=torch.Generator().manual_seed(1))
    with replayer.record() as rec:
        natural = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert rec.indexer is None
    with replayer.replay(rec.routes):
        assert torch.equal(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, natural)
