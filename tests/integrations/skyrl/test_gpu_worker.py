"""GPU only (a lent CUDA device with SkyRL 0.4's own stack: Python 3.12, flash-attn, Ray; never run in CI).

SkyRL builds the worker itself: `install()` puts routereplay's class behind SkyRL's `fsdp_worker.PolicyWorker`,
which is what `main_base._setup_trainer` hands `build_models`; here that Ray actor class is started directly
(one GPU), `init_worker_process_group` and `init_model` run SkyRL's own CUDA path (FSDP2 sharding, flash-attn
varlen, its optimizer and scheduler) on a tiny dense-first Qwen3-MoE saved to disk, and the trainer step is
SkyRL's: the old-log-prob `forward`, `forward_backward`, `optim_step`. R3 replays the batch's
`rollout_expert_indices` in both passes: every captured row replayed, each final token live.

Not covered here: a vLLM rollout producing the routes (the batch's routes are SkyRL-preprocessed random routes,
as in the CPU tests) and SkyRL's full `RayPPOTrainer.train()` loop.
"""

from __future__ import annotations

import pytest

from tests.integrations.skyrl import worker_case as case

pytestmark = [pytest.mark.gpu, pytest.mark.skyrl, pytest.mark.ray]


def test_gpu_skyrl_builds_the_routereplay_worker_and_replays_r3_in_a_trainer_step(tmp_path: object) -> None:
    import ray

    from routereplay.integrations.skyrl.policy_worker import WORKER_NAME, install

    model = case.tiny_model()
    model.save_pretrained(str(tmp_path))
    cfg = case.trainer_config()
    cfg.policy.model.path = str(tmp_path)
    cfg.flash_attn = True
    cfg.remove_microbatch_padding = True
    seqs = case.sequences()
    data = case.training_batch(seqs, case.random_routes(seqs))

    install()
    from skyrl.backends.skyrl_train.workers.fsdp import fsdp_worker

    ray.init(num_gpus=1, include_dashboard=False)
    try:
        actor = fsdp_worker.PolicyWorker.remote(
            cfg=cfg, world_size=1, rank=0, local_rank=0, master_addr=None, master_port=None, sequence_parallel_size=1
        )
        ray.get(actor.init_worker_process_group.remote())
        ray.get(actor.init_model.remote(str(tmp_path), num_training_steps=1))
        ray.get(actor.forward.remote(data))
        ray.get(actor.forward_backward.remote(data))
        ray.get(actor.optim_step.remote())
        stats = ray.get(actor.routereplay_stats.remote())
        name = ray.get(actor.__ray_call__.remote(lambda worker: type(worker).__name__))
    finally:
        ray.shutdown()
    assert name == WORKER_NAME
    tokens = sum(len(p) + len(r) for p, r in seqs)
    moe = len(case.MOE_LAYERS)
    assert stats["mode"] == "R3"
    assert stats["replayed_rows"] == 2 * (tokens - len(seqs)) * moe  # two passes: every captured row
    assert stats["fallback_rows"] == 2 * len(seqs) * moe  # each final token, live
