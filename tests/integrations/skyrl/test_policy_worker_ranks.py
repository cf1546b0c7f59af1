"""routereplay's SkyRL worker on 2 spawned gloo ranks (`worker_ranks.py`): data parallel, then Ulysses SP."""

from __future__ import annotations

import pytest
import torch

from routereplay import layout
from tests.integrations.skyrl import worker_case as case

pytestmark = [
    pytest.mark.skyrl,
    pytest.mark.filterwarnings("ignore:CUDA is not available or torch_xla is imported:UserWarning"),
]


def test_two_ranks_data_parallel_and_ulysses_sp_replay_and_record_like_one_rank(tmp_path: object) -> None:
    pytest.importorskip("skyrl")
    import torch.multiprocessing as mp

    from tests.integrations.skyrl import worker_ranks

    mp.spawn(worker_ranks.rank_main, args=(case.free_port(), str(tmp_path)), nprocs=worker_ranks.WORLD, join=True)
    ranks = [torch.load(f"{tmp_path}/rank{r}.pt", weights_only=False) for r in range(worker_ranks.WORLD)]
    seqs = case.sequences()
    routes = case.random_routes(seqs)
    per = len(seqs) // worker_ranks.WORLD

    # data parallel, R3: each rank's experts get exactly its half's rollout routes, in the forward pass and update
    for rank, result in enumerate(ranks):
        mine = slice(rank * per, (rank + 1) * per)
        for m in case.MOE_LAYERS:
            want = case.sorted_rows(case.expected_rows(routes[mine], seqs[mine], m))
            routed = (want >= 0).all(-1)
            for seen in result["dp_r3"]:
                assert torch.equal(seen[m][routed], want[routed]), f"rank {rank} layer {m}"

    # data parallel, R2: two updates of the other half replay what the other rank recorded (shared over dp)
    for rank, result in enumerate(ranks):
        assert result["dp_r2_recorded_samples"] == len(seqs)  # its own half and the other rank's
        other = ranks[1 - rank]["dp_r2_forward"]
        for seen in result["dp_r2_updates_other_half"]:
            for m in case.MOE_LAYERS:
                assert torch.equal(seen[m], other[m]), f"rank {rank} layer {m}"

    # Ulysses SP 2: each rank's experts get its shard of the packed row's routes; log-probs and R2's recording
    # gathered over the SP group equal one rank's
    total = sum(len(p) + len(r) for p, r in seqs)  # the packed row: every attended token
    captured = torch.ones(total, dtype=torch.bool)
    captured[torch.tensor([len(p) + len(r) for p, r in seqs]).cumsum(0) - 1] = False  # final tokens route live
    for rank, result in enumerate(ranks):
        assert result["sp_recorded"].keys() == result["one_recorded"].keys()
        for key, rows in result["one_recorded"].items():
            assert torch.equal(result["sp_recorded"][key], rows)
        for sp_out, one_out in zip(result["sp_log_probs"], result["one_log_probs"], strict=True):
            torch.testing.assert_close(torch.tensor(sp_out["logprobs"]), torch.tensor(one_out["logprobs"]),
                                       rtol=1e-5, atol=1e-5)  # fmt: skip
        for m in case.MOE_LAYERS:
            one_NK = case.sorted_rows(result["one_dispatched"][m][:total])
            want_sK = layout.ulysses_shard(one_NK, worker_ranks.WORLD, rank)
            held_s = layout.ulysses_shard(captured, worker_ranks.WORLD, rank, fill=0)
            routed_s = held_s.bool()
            for key in ("sp_dispatched", "sp_update_dispatched"):  # the old-log-prob pass and an update
                got_sK = case.sorted_rows(result[key][m])
                assert got_sK.shape == want_sK.shape, f"rank {rank} layer {m}: its shard of the packed row"
                assert torch.equal(got_sK[routed_s], want_sK[routed_s]), f"rank {rank} layer {m} {key}"
