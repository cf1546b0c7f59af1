"""`routereplay bench async` (issue 13 item 4): every policy x mode run and the throughput part land in
one record, R3 is exact under every resume policy, and bad sizes are refused."""

from __future__ import annotations

import pytest

from routereplay.bench import fully_async
from routereplay.cli.main import EXIT_ERROR, main

pytestmark = pytest.mark.hf


def _assert_r3_agrees_with_the_engine(result: dict) -> None:
    """The nine policy x mode runs are all there; under R3 the disagreement with the engine is 0 for every
    resume policy, and prefix-replay has no prefix conflict."""
    runs = {(r["mode"], r["resume_routes"]): r for r in result["policies"]}
    assert set(runs) == {(m, p) for m in fully_async.MODES for p in fully_async.POLICIES}
    for policy in fully_async.POLICIES:
        assert runs[("R3", policy)]["disagreement_old"] == 0.0 == runs[("R3", policy)]["disagreement_update"]
    assert runs[("R3", "prefix-replay")]["prefix_conflicts"] == 0


def test_bench_async_records_every_policy_and_mode(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Missing figures: the record holds the nine policy x mode runs and the four throughput runs (the engine
    process's among them) side by side, R3's disagreement with the engine is 0 under every resume policy,
    and the markdown names them."""
    monkeypatch.setenv("ROUTEREPLAY_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
    config = fully_async.AsyncBenchConfig(
        steps=2, prompts_per_step=2, group_size=2, mini_steps=2, throughput_steps=2, repeats=1, train_steps=25
    )
    result = fully_async.run(config)
    _assert_r3_agrees_with_the_engine(result)
    workloads = {"sync_1_thread", "sync_2_threads", "async_threaded", "async_process"}
    for key in ("samples_per_second", "steady_samples_per_second"):
        assert set(result["throughput"][key]) == workloads
        assert all(rate > 0 for rate in result["throughput"][key].values())
    pairs = {f"{a}_over_{b}" for a in ("async", "process") for b in ("sync_1_thread", "sync_2_threads")}
    pairs.add("process_over_async_threaded")
    assert set(result["ratios"]) == pairs | {f"steady_{pair}" for pair in pairs}
    text = fully_async.markdown(result)
    assert "| R3 | prefix-replay |" in text and "async / sync samples per second" in text
    assert "| async_process |" in text and "engine in a child process" in text


def test_bench_async_refuses_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    """Bad input: a zero size is refused by the config, and by the CLI when the flag is parsed."""
    with pytest.raises(ValueError, match="steps=0 must be >= 1"):
        fully_async.AsyncBenchConfig(steps=0)
    with pytest.raises(ValueError, match="throughput_steps=1 must be >= 2"):
        fully_async.AsyncBenchConfig(throughput_steps=1)
    with pytest.raises(SystemExit) as info:
        main(["bench", "async", "--rl-steps", "0"])
    assert info.value.code == EXIT_ERROR
    assert "argument --rl-steps: must be an integer >= 1" in capsys.readouterr().err


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm-live")
def test_bench_async_with_vllm_records_the_policies_on_a_real_vllm(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 24 item 5: `--engine vllm` runs the nine policy x mode runs on one in-process vLLM; under R3 the
    disagreement with vLLM is 0 for every policy and prefix-replay (forced inside vLLM) has no prefix conflict;
    the throughput part (the built-in engine's) is left out and the markdown says which engine ran."""
    monkeypatch.setenv("ROUTEREPLAY_CACHE", str(tmp_path_factory.getbasetemp() / "cache-vllm"))
    config = fully_async.AsyncBenchConfig(
        engine="vllm", steps=2, prompts_per_step=2, group_size=2, mini_steps=2, repeats=1, train_steps=25
    )
    result = fully_async.run(config)
    _assert_r3_agrees_with_the_engine(result)
    assert result["throughput"] is None and result["machine"]["vllm"].startswith("0.30")
    text = fully_async.markdown(result)
    assert "in-process vLLM (bf16)" in text and "| R3 | prefix-replay |" in text and "Throughput" not in text
    with pytest.raises(ValueError, match="engine='sglang' must be 'hf' or 'vllm'"):
        fully_async.AsyncBenchConfig(engine="sglang")
