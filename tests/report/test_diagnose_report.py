"""`report.diagnosis` (`routereplay diagnose`) on the demo model: the record's numbers equal an independent
computation (the demo's own scoring path and `routereplay.metrics`), from a vLLM wire payload, a `.rrt` file and
a route store; the page is one self-contained HTML file. Legend: B = sequences, S = positions, L = layers, K = top-k."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from routereplay.errors import ConfigError, MissingRoutesError, TopKMismatchError
from routereplay.metrics import logprob_mismatch, routing_agreement

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def demo() -> dict[str, Any]:
    """The cached demo model and 12 rollouts of its bf16 engine (routes, token ids, log-probs)."""
    from routereplay.engines.hf import HFEngine
    from routereplay.rl.model import load_or_train
    from routereplay.rl.tasks import AdditionTask

    model, tokenizer, _ = load_or_train("qwen3_moe")
    task = AdditionTask(tokenizer)
    problems = task.problems(12, seed=5)
    params = task.sampling(max_new_tokens=5, seed=3, temperature=1.0, top_p=1.0)
    rollouts = HFEngine(model, dtype=torch.bfloat16, policy_version=0).generate(task.prompt_ids(problems), params)
    return {"model": model, "rollouts": rollouts, "pad": task.pad_token_id}


def vllm_payload(rollout: Any) -> dict[str, Any]:
    """A vLLM completions response for one rollout: routed_experts, prompt_token_ids, token_ids, token_logprobs."""
    from routereplay.tracefile.payload import engine_payload

    payload = engine_payload(rollout.trace, "vllm")
    choice = payload["choices"][0]
    choice.update(
        prompt_token_ids=rollout.prompt_ids,
        token_ids=rollout.response_ids,
        logprobs={"token_logprobs": rollout.logprobs},
    )
    return payload


def write_inputs(rollouts: Any, folder: Path) -> tuple[list[Path], list[Path]]:
    from routereplay.tracefile.io import write_trace

    folder.mkdir(parents=True, exist_ok=True)
    payloads, codec_files = [], []
    for i, rollout in enumerate(rollouts):
        payloads.append(folder / f"seq{i}.json")
        payloads[-1].write_text(json.dumps(vllm_payload(rollout)))
        codec_files.append(folder / f"seq{i}.rrt")
        write_trace(rollout.trace.with_token_ids(np.array(rollout.token_ids[:-1])), codec_files[-1], "rrt")
    return payloads, codec_files


def geometry_of(model: Any) -> Any:
    from routereplay.cli.diagnose import _geometry

    return _geometry(model)


def independent(demo: dict[str, Any]) -> dict[str, Any]:
    """The demo's own path: `rl.scoring.score` off and with R3, engine routes and log-probs laid out by it."""
    from routereplay.rl.scoring import engine_logprobs, engine_routes, score
    from routereplay.runtime import attach

    model, rollouts = demo["model"], demo["rollouts"]
    replayer = attach(model)
    try:
        off = score(model, rollouts, demo["pad"], replayer=replayer)
        r3 = score(model, rollouts, demo["pad"], replayer=replayer, replay=True)
        engine_BSLK = engine_routes(rollouts, off.ids_BS.shape, len(replayer.layers), replayer.top_k)
    finally:
        replayer.detach()
    infer_BS = engine_logprobs(rollouts, off.ids_BS.shape)
    assert off.routes_BSLK is not None
    return {
        "routing": routing_agreement(off.routes_BSLK, engine_BSLK, off.mask_BS.bool()),
        "off": logprob_mismatch(off.logprobs_BS, infer_BS, off.response_BS),
        "R3": logprob_mismatch(r3.logprobs_BS, infer_BS, r3.response_BS),
        "engine_BSLK": engine_BSLK,
        "mask_BS": off.mask_BS.bool(),
    }


def test_diagnose_from_vllm_payloads_matches_the_demo_scoring_path(demo: dict[str, Any], tmp_path: Path) -> None:
    from routereplay.report.diagnosis.rollouts import read_rollouts
    from routereplay.report.diagnosis.scoring import DiagnoseConfig, diagnose

    payloads, _ = write_inputs(demo["rollouts"], tmp_path)
    rollouts = read_rollouts(payloads, geometry_of(demo["model"]))
    record = diagnose(demo["model"], rollouts, DiagnoseConfig(batch_size=5))  # 3 batches: sums must carry over
    truth = independent(demo)
    routing = record["routing"]
    assert truth["routing"]["routing_disagreement"] > 0, "the fixture must show some disagreement to be a test"
    assert routing["routing_disagreement"] == pytest.approx(truth["routing"]["routing_disagreement"])
    assert routing["per_layer_disagreement"] == pytest.approx(truth["routing"]["per_layer_disagreement"])
    assert routing["compared_rows"] == truth["routing"]["compared_rows"]
    assert routing["replayed_disagreement"] == 0.0
    assert routing["fallback_rows"] == len(demo["rollouts"]) * len(record["model"]["layers"])  # the last token's row
    # fp32 logits of a batch of 5 and of 12 (other padded widths) differ in the last bits: k3 ~ 2e-4 to 1e-3
    for mode in ("off", "R3"):
        for key in ("tokens", "k3_kl", "mean_abs_dlogp", "extreme_frac_2"):
            assert record["logprobs"][mode][key] == pytest.approx(truth[mode][key], rel=1e-3, abs=1e-9), (mode, key)
    assert record["logprobs"]["R3"]["k3_kl"] != record["logprobs"]["off"]["k3_kl"]
    # per position: rows compared and sets differing at each position, counted here from the laid-out routes
    engine_BSLK, mask_BS = truth["engine_BSLK"], truth["mask_BS"]
    positions = engine_BSLK.shape[1]
    expected = []
    for s in range(positions):
        a = routing_agreement(
            torch.as_tensor(np.stack([off_row for off_row in _trainer_rows(demo, s)])), engine_BSLK[:, s], mask_BS[:, s]
        )
        expected.append(a["routing_disagreement"] if a["compared_rows"] else None)
    got = record["per_position"]["routing_disagreement"]
    assert len(got) == positions
    assert [None if v is None else round(v, 9) for v in got] == [None if v is None else round(v, 9) for v in expected]
    assert sum(record["per_position"]["scored_tokens"]) == truth["off"]["tokens"]
    load = record["load"]["engine"]["tokens_per_expert"]
    for column in range(len(record["model"]["layers"])):
        ids = engine_BSLK[:, :, column][mask_BS & (engine_BSLK[:, :, column, 0] >= 0)].reshape(-1)
        assert load[column] == np.bincount(ids.numpy(), minlength=record["model"]["num_experts"]).tolist()


def _trainer_rows(demo: dict[str, Any], position: int) -> list[np.ndarray]:
    """The trainer's own routes at `position` for every sequence, from a fresh recording (independent of diagnose)."""
    cache = demo.setdefault("_recorded", None)
    if cache is None:
        from routereplay.rl.scoring import score
        from routereplay.runtime import attach

        replayer = attach(demo["model"])
        try:
            scored = score(demo["model"], demo["rollouts"], demo["pad"], replayer=replayer)
        finally:
            replayer.detach()
        assert scored.routes_BSLK is not None
        cache = demo["_recorded"] = scored.routes_BSLK.numpy()
    return list(cache[:, position])


def test_diagnose_from_rrt_files_compares_routing_and_says_log_probs_are_missing(
    demo: dict[str, Any], tmp_path: Path
) -> None:
    from routereplay.report.diagnosis.rollouts import read_rollouts
    from routereplay.report.diagnosis.scoring import diagnose

    payloads, codec_files = write_inputs(demo["rollouts"], tmp_path)
    geometry = geometry_of(demo["model"])
    from_payload = diagnose(demo["model"], read_rollouts(payloads, geometry))
    record = diagnose(demo["model"], read_rollouts(codec_files, geometry))
    assert record["logprobs"] is None
    assert record["inputs"]["engine_logprobs"] is False
    assert any("engine log-probs" in line for line in record["inputs"]["missing"])
    assert any("no engine log-probs" in step for step in record["summary"]["next_steps"])
    # the .rrt rows are the payload's rows (its last token is not a row in either): the same routing numbers
    assert record["routing"]["per_layer_disagreement"] == from_payload["routing"]["per_layer_disagreement"]
    assert record["routing"]["routing_disagreement"] == from_payload["routing"]["routing_disagreement"]
    shift = record["replay_shift"]
    assert shift is not None and shift["tokens"] == sum(len(r.token_ids) - 2 for r in demo["rollouts"])


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[tuple[str, str, str]] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        for name, value in attrs:
            if name in ("src", "href") and value is not None:
                self.urls.append((tag, name, value))


def check_self_contained(page: str) -> list[str]:
    """The page's image sources (all data: URIs); fails on any network URL, script or external stylesheet."""
    parser = _Links()
    parser.feed(page)
    assert "script" not in parser.tags and "link" not in parser.tags
    assert "http://" not in page and "https://" not in page
    sources = [value for tag, name, value in parser.urls if tag == "img" and name == "src"]
    assert all(value.startswith("data:image/png;base64,") for value in sources), [v[:40] for v in sources]
    assert {value for _tag, _name, value in parser.urls} == set(sources), "the page links to something else"
    return sources


def test_diagnosis_page_is_one_self_contained_html_file(demo: dict[str, Any], tmp_path: Path) -> None:
    import base64

    from routereplay.report.diagnosis.page import write_diagnosis
    from routereplay.report.diagnosis.rollouts import read_rollouts
    from routereplay.report.diagnosis.scoring import diagnose

    payloads, _ = write_inputs(demo["rollouts"], tmp_path / "in")
    record = diagnose(demo["model"], read_rollouts(payloads, geometry_of(demo["model"])))
    path = write_diagnosis(record, tmp_path / "diag.html")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["diag.html", "in"], "the report is one file"
    sources = check_self_contained(path.read_text(encoding="utf-8"))
    assert len(sources) == 3  # per layer, per position (with log-probs), load skew
    for source in sources:
        assert base64.b64decode(source.split(",", 1)[1]).startswith(b"\x89PNG\r\n\x1a\n")
    page = path.read_text(encoding="utf-8")
    worst = record["summary"]["worst_layers"][0]["layer"]
    assert f"layers {worst} (" in page  # the summary names the layer that diverges most
    assert "docs/diagnose.md" in page


def test_diagnose_refuses_routes_of_another_model_before_scoring(demo: dict[str, Any], tmp_path: Path) -> None:
    from routereplay.report.diagnosis.rollouts import Rollout, read_rollouts
    from routereplay.report.diagnosis.scoring import diagnose
    from routereplay.trace.route_trace import RouteTrace
    from routereplay.tracefile.io import write_trace

    payloads, _ = write_inputs(demo["rollouts"][:1], tmp_path)
    geometry = geometry_of(demo["model"])
    rollout = read_rollouts(payloads, geometry)[0]
    trace = rollout.trace
    top_1 = RouteTrace(
        np.where(trace.experts[..., :1] < 0, -1, trace.experts[..., :1]), trace.num_experts, trace.layers
    )
    with pytest.raises(TopKMismatchError, match="top-1, the model routes top-2; pass the model"):
        diagnose(demo["model"], [Rollout("top1", top_1, rollout.token_ids_N, None)])
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        diagnose(demo["model"], [Rollout("big", trace, rollout.token_ids_N + 10_000, None)])
    mixed = [rollout, Rollout("plain", trace, rollout.token_ids_N, None)]
    with pytest.raises(ConfigError, match="1 inputs carry the engine's log-probs and 1 do not"):
        diagnose(demo["model"], mixed)
    bare = tmp_path / "bare.rrt"
    write_trace(RouteTrace(trace.experts, trace.num_experts, trace.layers), bare, "rrt")  # no token ids
    with pytest.raises(MissingRoutesError, match="names no token ids"):
        read_rollouts([bare], geometry)


def test_diagnose_from_a_route_store_file_routes_like_the_payloads(demo: dict[str, Any], tmp_path: Path) -> None:
    from routereplay.report.diagnosis.rollouts import read_rollouts
    from routereplay.report.diagnosis.scoring import diagnose
    from routereplay.store.route_store import RouteStore

    payloads, _ = write_inputs(demo["rollouts"], tmp_path)
    geometry = geometry_of(demo["model"])
    store = RouteStore()
    for i, rollout in enumerate(demo["rollouts"]):
        store.add_turn(i, rollout.token_ids, rollout.trace)
    store.save(tmp_path / "batch.rrs")
    rollouts = read_rollouts([tmp_path / "batch.rrs"], geometry)
    assert [r.token_ids_N.tolist() for r in rollouts] == [r.token_ids for r in demo["rollouts"]]
    record = diagnose(demo["model"], rollouts)
    from_payload = diagnose(demo["model"], read_rollouts(payloads, geometry))
    assert record["routing"]["per_layer_disagreement"] == from_payload["routing"]["per_layer_disagreement"]
    assert record["logprobs"] is None and record["inputs"]["missing"]
