"""vLLM's CPU kernel paths on AMX CPUs (`engines/vllm/cpu_kernels`), reached on a CPU without AMX by forcing
vLLM's one probe, `torch.cpu._is_amx_tile_supported()` (issue 30 item 0).

What runs where: this suite's machine is an AMD EPYC with AVX-512 and no AMX. vLLM has no switch of its own
for its AMX paths, so the probe is patched in this process (in-process engines only). With it, vLLM really
selects AMX_MLA, the AMX MoE experts and the sgl-kernels linears, and really packs their weights at load;
that reproduces the DeepSeek-V3 sync failure seen on the AMX Xeon, bit for bit. Running a forward there is
not possible: the AMX kernels' tile instructions raise SIGILL on this CPU (what `/tmp` trials showed: exit
status 132), so the forced engines are compared tensor by tensor, never sampled. The tile permission
request is a real arch_prctl here; Linux refuses it on this CPU (EOPNOTSUPP), and a grant is faked where
a forced engine must start. Legend: none (no tensors are named by shape).
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from routereplay.engines.vllm import cpu_kernels
from routereplay.engines.vllm.cpu_kernels import MLA_BACKEND, AmxTiles, CpuKernels
from routereplay.errors import AmxPermissionError


def _cpu_has_amx() -> bool:
    flags = Path("/proc/cpuinfo").read_text().split()
    return "amx_tile" in flags


def test_the_tile_permission_is_asked_of_linux_and_answered_as_the_cpu_allows() -> None:
    """The request is the real system call: granted on a CPU with AMX, refused by Linux on one without (this
    suite's AMD EPYC: EOPNOTSUPP). Without AMX in vLLM's probe nothing is asked and vLLM picks no AMX kernel."""
    code = cpu_kernels.request_tile_data()
    if _cpu_has_amx():
        assert code == 0 and cpu_kernels.tile_data_permitted()
        assert cpu_kernels.amx_tiles("here") is AmxTiles.GRANTED
    else:
        assert code in (errno.EOPNOTSUPP, errno.EINVAL), f"Linux answered {errno.errorcode.get(code, code)}"
        assert not cpu_kernels.tile_data_permitted()
        assert not cpu_kernels.vllm_sees_amx() and cpu_kernels.amx_tiles("here") is AmxTiles.ABSENT


def test_an_amx_cpu_whose_linux_refuses_the_permission_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGILL (issue 30 item 0): where vLLM sees AMX and Linux refuses the tile permission, the first AMX tile
    instruction would kill the process; the refusal names the process, Linux's answer and the fix instead."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(cpu_kernels, "request_tile_data", lambda: errno.EPERM)
    with pytest.raises(AmxPermissionError, match=r"my engine: .*Operation not permitted.*SIGILL.*Linux >= 5\.16"):
        cpu_kernels.amx_tiles("my engine")
    monkeypatch.setattr(cpu_kernels, "request_tile_data", lambda: 0)
    monkeypatch.setattr(cpu_kernels, "tile_data_permitted", lambda: True)
    assert cpu_kernels.amx_tiles("my engine") is AmxTiles.GRANTED


def test_mla_models_ask_for_the_reference_backend_and_others_leave_it_to_vllm() -> None:
    """Only MLA models (a `kv_lora_rank`) get `CPU_MLA`; the choice reaches `vllm.LLM` as its argument."""
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    assert cpu_kernels.mla_backend(DeepseekV3Config(kv_lora_rank=512)) == MLA_BACKEND == "CPU_MLA"
    assert cpu_kernels.mla_backend(Qwen3MoeConfig()) is None
    assert CpuKernels(AmxTiles.ABSENT, MLA_BACKEND).llm_kwargs() == {"attention_backend": "CPU_MLA"}
    assert CpuKernels(AmxTiles.GRANTED, None).llm_kwargs() == {}


# --- real vLLM engines with the AMX probe forced --------------------------------------------------------


@pytest.fixture
def forced_amx(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """vLLM's AMX probe says yes in this process, and Linux's grant is faked (it cannot be had on this CPU)."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(cpu_kernels, "request_tile_data", lambda: 0)
    monkeypatch.setattr(cpu_kernels, "tile_data_permitted", lambda: True)
    try:
        yield
    finally:  # vLLM caches the backend it selected per (asked backend, layer config): drop the forced ones
        from vllm.v1.attention.selector import _cached_get_attn_backend

        _cached_get_attn_backend.cache_clear()


def _mla_impls(served: nn.Module) -> set[str]:
    return {type(m.impl).__name__ for m in served.modules() if hasattr(m, "impl") and hasattr(m, "kv_b_proj")}


def _tensors(served: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in [*served.named_parameters(), *served.named_buffers()]}


@pytest.mark.vllm
@pytest.mark.hf
@pytest.mark.xdist_group("vllm-live")
def test_an_amx_refusal_stops_the_engine_before_vllm_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGILL (issue 30 item 0): `VLLMEngine` asks for the tile permission before anything is written or
    started, and the routereplay plugin (which vLLM runs in each of its processes) refuses the same way."""
    from routereplay.engines.vllm.colocated import VLLMEngine
    from routereplay.engines.vllm.plugin import register
    from routereplay.testing.vllm_models import tiny_vllm_model, word_tokenizer

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(cpu_kernels, "request_tile_data", lambda: errno.EPERM)
    written: list[object] = []
    monkeypatch.setattr("routereplay.engines.vllm.colocated.write_checkpoint", lambda *a, **k: written.append(a))
    with pytest.raises(AmxPermissionError, match="VLLMEngine for Qwen3MoeForCausalLM"):
        VLLMEngine(tiny_vllm_model("qwen3_moe"), word_tokenizer())
    assert not written, "the refusal came after the checkpoint was written"
    with pytest.raises(AmxPermissionError, match="routereplay vLLM plugin in process"):
        register()


@pytest.mark.vllm
@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.xdist_group("vllm-live")
def test_deepseek_v3_sync_on_an_amx_cpu_takes_the_reference_mla_backend(forced_amx: None) -> None:
    """Issue 30 item 0: on an AMX CPU vLLM picks AMX_MLA, which empties `kv_b_proj.weight` after packing it,
    and the first `sync_weights` failed ("size of tensor a (0) must match ... (512)"): reproduced here with
    vLLM's own choice (negative control). The engine asks for CPU_MLA instead: the weight is kept, the sync
    loads, and every served tensor then equals that of an engine started on the new weights (same forcing)."""
    from routereplay.engines.vllm.colocated import EngineConfig, VLLMEngine
    from routereplay.testing.vllm_models import tiny_vllm_model, word_tokenizer
    from tests.engines.colocated_engine import MAX_MODEL_LEN, bf16_rounded, perturbed

    model = bf16_rounded(tiny_vllm_model("deepseek_v3"))
    trainer = perturbed(model, seed=2)
    config = EngineConfig(max_model_len=MAX_MODEL_LEN)
    with pytest.MonkeyPatch.context() as vllms_choice:
        vllms_choice.setattr(cpu_kernels, "mla_backend", lambda config: None)
        with VLLMEngine(model, word_tokenizer(), config=config) as engine:
            assert engine.cpu_kernels == CpuKernels(AmxTiles.GRANTED, None)
            assert engine.llm.apply_model(_mla_impls)[0] == {"AMXMLAImpl"}, "the probe did not reach vLLM"
            with pytest.raises(RuntimeError, match=r"size of tensor a \(0\) must match the size of tensor b \(512\)"):
                engine.sync_weights(trainer, policy_version=1)
    with VLLMEngine(model, word_tokenizer(), config=config, policy_version=0) as engine:
        assert engine.cpu_kernels == CpuKernels(AmxTiles.GRANTED, MLA_BACKEND)
        assert engine.llm.apply_model(_mla_impls)[0] == {"CPUMLAImpl"}
        engine.sync_weights(trainer, policy_version=1)
        synced = engine.llm.apply_model(_tensors)[0]
    with VLLMEngine(trainer, word_tokenizer(), config=config, policy_version=1) as engine:
        fresh = engine.llm.apply_model(_tensors)[0]
    assert synced.keys() == fresh.keys()
    differ = [name for name in fresh if not torch.equal(synced[name], fresh[name])]
    assert not differ, f"after the sync {len(differ)} tensors differ from a fresh engine's: {differ[:4]}"
    kv_b = [name for name in fresh if name.endswith("kv_b_proj.weight")]
    assert kv_b and all(fresh[name].shape == (256, 512) for name in kv_b)
