"""verl 0.9.1's own SGLang server on an SGLang 0.5.23 response: verl's route code fails, routereplay's server decodes.

What runs is verl's: its `SGLangHttpServer` built by its own `__init__` (verl's rollout config from its generated
`ppo_trainer` YAML, its `HFModelConfig` loading a Qwen3-30B-A3B-shaped checkpoint folder: 48 MoE layers, top-8 of
128), its `launch_server` (ServerArgs built by verl, SGLang's subprocesses launched through `Engine`), its
`generate` (the `GenerateReqInput` verl builds, the output it post-processes into `TokenOutput`), and its
`RolloutReplicaRegistry`. SGLang 0.5.23 itself does not import in verl's venv (its `sglang.srt.entrypoints.
http_server` chain needs uvloop, uvicorn, fastapi, setproctitle, torchvision's operators and transformers 5.19
against verl's <5.11: docs/verl.md), so `sglang_0_5_23` stands in for exactly the names verl imports, in
0.5.23's module layout (`sglang.srt.state_capturer.routed_experts` present, `sglang.srt.layers.moe.
routed_experts_capturer` absent), and its tokenizer manager answers with the example response of
`routereplay/examples/qwen3_30b_a3b_sglang.json`: `meta_info.routed_experts` a base64 str of raw int32 (0.5.23's
wire form with and without `skip_tokenizer_init`), only when the request asked `return_routed_experts`.
verl's uvicorn front end (`run_uvicorn`) is the one verl function replaced: it would open a port.

Legend: T rows (prompt + output - 1), A every hidden layer (48), K top-k (8).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import os
import sys
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from routereplay.errors import ConfigError, RowCountError
from routereplay.integrations.verl import AgentLoopRoutes, RouteGeometry

pytest.importorskip("verl")

EXAMPLE = "qwen3_30b_a3b_sglang.json"
NUM_LAYERS, TOP_K, NUM_EXPERTS = 48, 8, 128
VOCAB = 1000


@dataclasses.dataclass(init=False)
class ServerArgs:  # SGLang's ServerArgs is a dataclass; verl reads its fields and passes ~30 keyword arguments
    enable_weights_cpu_backup: bool = False
    enable_return_routed_experts: bool = False
    enable_metrics: bool = False

    def __init__(self, **kwargs: Any) -> None:
        self.__dict__.update(kwargs)


@dataclasses.dataclass
class GenerateReqInput:  # the fields verl 0.9.1 sets, named and defaulted as in SGLang 0.5.23's io_struct.py
    rid: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    image_data: Any = None
    video_data: Any = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    lora_path: str | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


class ScriptedTokenizerManager:
    """Answers `generate_request` like SGLang 0.5.23's TokenizerManager: one final output dict per request."""

    def __init__(self, meta_info: dict[str, Any], output_ids: list[int]) -> None:
        self.meta_info, self.output_ids = meta_info, output_ids
        self.requests: list[Any] = []
        self.server_status: Any = None

    async def generate_request(self, obj: Any, request: Any = None) -> Any:
        self.requests.append(obj)
        meta = {k: v for k, v in self.meta_info.items() if k != "routed_experts" or obj.return_routed_experts}
        yield {"text": " 42", "output_ids": list(self.output_ids), "meta_info": meta}


def sglang_0_5_23(manager: ScriptedTokenizerManager) -> dict[str, ModuleType]:
    """The modules verl's SGLang server imports, in SGLang 0.5.23's layout; `Engine` launches `manager`."""

    def module(name: str, **attrs: Any) -> ModuleType:
        mod = ModuleType(name)
        mod.__path__ = []  # a package: a submodule not listed here is ModuleNotFoundError, as in the wheel
        mod.__dict__.update(attrs)
        return mod

    class Engine:
        @staticmethod
        def _launch_subprocesses(server_args: ServerArgs, **functions: Any) -> tuple[Any, ...]:
            manager.server_args = server_args  # type: ignore[attr-defined]
            return manager, None, {}

    def extract_routed_experts_from_meta_info(data: dict[str, Any]) -> np.ndarray:  # 0.5.23's, :166-174
        return np.frombuffer(base64.b64decode(data["meta_info"]["routed_experts"]), dtype=np.int32)

    def noop(*args: Any, **kwargs: Any) -> None:
        return None

    class Named:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.args, self.kwargs = args, kwargs

    app = type("App", (), {})()
    mods = [
        module("sglang", __version__="0.5.23"),
        module("sglang.srt"),
        module("sglang.srt.entrypoints"),
        module(
            "sglang.srt.entrypoints.engine",
            _set_envs_and_config=noop,
            init_tokenizer_manager=noop,
            run_scheduler_process=noop,
            run_detokenizer_process=noop,
        ),
        module(
            "sglang.srt.entrypoints.http_server",
            ServerArgs=ServerArgs,
            _GlobalState=Named,
            app=app,
            set_global_state=noop,
            launch_server=noop,
            Engine=Engine,
        ),
        module("sglang.srt.entrypoints.EngineBase", EngineBase=object),
        module("sglang.srt.managers"),
        module(
            "sglang.srt.managers.io_struct",
            GenerateReqInput=GenerateReqInput,
            **{
                name: Named
                for name in (
                    "ContinueGenerationReqInput",
                    "PauseGenerationReqInput",
                    "ReleaseMemoryOccupationReqInput",
                    "ResumeMemoryOccupationReqInput",
                    "UpdateWeightsFromTensorReqInput",
                )
            },
        ),
        module("sglang.srt.managers.tokenizer_manager", ServerStatus=type("ServerStatus", (), {"Up": "Up"})),
        module("sglang.srt.server_args", ServerArgs=ServerArgs),
        module(
            "sglang.srt.utils",
            **{
                name: noop
                for name in ("MultiprocessingSerializer", "assert_pkg_version", "is_cuda", "kill_process_tree")
            },
            set_prometheus_multiproc_dir=noop,
            set_ulimit=noop,
        ),
        module("sglang.srt.weight_sync"),
        module("sglang.srt.weight_sync.utils", _preprocess_tensor_for_update_weights=noop, update_weights=noop),
        module("sglang.srt.state_capturer"),
        module(
            "sglang.srt.state_capturer.routed_experts",
            extract_routed_experts_from_meta_info=extract_routed_experts_from_meta_info,
        ),
    ]
    tree = {m.__name__: m for m in mods}
    for name, mod in tree.items():  # each submodule an attribute of its parent, as after a real import
        parent, _, leaf = name.rpartition(".")
        if parent:
            setattr(tree[parent], leaf, mod)
    return tree


def example() -> tuple[dict[str, Any], list[int], list[int], np.ndarray]:
    """The example's meta_info, prompt and output ids of its token counts, and the rows it encodes (T, A, K)."""
    text = resources.files("routereplay.examples").joinpath(EXAMPLE).read_text()
    meta = json.loads(text)["meta_info"]
    rows_TAK = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32).reshape(-1, NUM_LAYERS, TOP_K)
    generator = np.random.default_rng(0)
    prompt = generator.integers(20, VOCAB, size=meta["prompt_tokens"]).tolist()
    output = generator.integers(20, VOCAB, size=meta["completion_tokens"]).tolist()
    assert len(rows_TAK) == len(prompt) + len(output) - 1
    return meta, prompt, output, rows_TAK


def model_folder(folder: Path) -> Path:
    """A Qwen3-30B-A3B-shaped checkpoint folder (config and tokenizer, no weights) for verl's HFModelConfig."""
    from transformers import Qwen3MoeConfig

    from tests.integrations.verl.agent_loop_case import chatml_tokenizer

    Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=NUM_EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=4096,
        architectures=["Qwen3MoeForCausalLM"],
    ).save_pretrained(folder)
    chatml_tokenizer(VOCAB).save_pretrained(folder)
    return folder


def rollout_config(folder: Path, *, skip_tokenizer_init: bool) -> Any:
    import verl
    from omegaconf import OmegaConf

    config: Any = OmegaConf.load(
        os.path.join(os.path.dirname(verl.__file__), "trainer/config/_generated_ppo_trainer.yaml")
    )
    model, rollout = config.actor_rollout_ref.model, config.actor_rollout_ref.rollout
    model.path = str(folder)
    rollout.name = "sglang"
    rollout.prompt_length, rollout.response_length = 256, 256
    rollout.enable_rollout_routing_replay = True
    rollout.skip_tokenizer_init = skip_tokenizer_init
    return config


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """verl's SGLang server module imported against the 0.5.23 stand-in, and routereplay's on top of it."""
    meta, prompt, output, rows_TAK = example()
    manager = ScriptedTokenizerManager(meta, output)
    folder = model_folder(tmp_path_factory.mktemp("qwen3_30b_a3b"))
    before = set(sys.modules)
    with pytest.MonkeyPatch.context() as patch:
        for name, mod in sglang_0_5_23(manager).items():
            patch.setitem(sys.modules, name, mod)
        patch.setenv("CUDA_VISIBLE_DEVICES", "")
        import verl.workers.rollout.sglang_rollout.async_sglang_server as verl_server

        from routereplay.integrations.verl import sglang_server

        async def run_uvicorn(app: Any, server_args: Any, address: str) -> tuple[int, None]:
            return 0, None  # verl's HTTP front end: no port opened here

        patch.setattr(verl_server, "run_uvicorn", run_uvicorn)
        yield dict(
            verl_server=verl_server,
            ours=sglang_server,
            manager=manager,
            folder=folder,
            prompt=prompt,
            output=output,
            rows=rows_TAK,
            meta=meta,
        )
    for name in set(sys.modules) - before:  # verl's SGLang modules hold the stand-in: no other test sees them
        if name.startswith(
            ("sglang", "verl.workers.rollout.sglang_rollout", "routereplay.integrations.verl.sglang_server")
        ):
            del sys.modules[name]


def launched(case: Any, cls: type, *, skip_tokenizer_init: bool) -> Any:
    """`cls` (verl's server or routereplay's) built by verl's __init__ and launched by its launch_server."""
    from verl.workers.rollout.replica import RolloutMode

    config = rollout_config(case["folder"], skip_tokenizer_init=skip_tokenizer_init).actor_rollout_ref
    server = cls(config.rollout, config.model, RolloutMode.HYBRID, [], 0, 0, 1, "", 0)
    asyncio.run(server.launch_server())
    return server


def generate(server: Any, case: Any, request_id: str = "sample-0") -> Any:
    return asyncio.run(server.generate(list(case["prompt"]), {"max_tokens": 200}, request_id))


@pytest.mark.parametrize("skip_tokenizer_init", [True, False])
def test_verls_own_route_code_fails_on_an_sglang_0_5_23_response(case: Any, skip_tokenizer_init: bool) -> None:
    server = launched(case, case["verl_server"].SGLangHttpServer, skip_tokenizer_init=skip_tokenizer_init)
    assert case["manager"].server_args.enable_return_routed_experts  # verl started SGLang for R3
    if skip_tokenizer_init:  # verl's default: .numpy() on the base64 str 0.5.23 sends
        with pytest.raises(AttributeError, match="numpy"):
            generate(server, case)
    else:  # verl imports 0.5.12's module, which 0.5.23 moved to sglang.srt.state_capturer.routed_experts
        with pytest.raises(ModuleNotFoundError, match="sglang.srt.layers"):
            generate(server, case)


@pytest.mark.parametrize("skip_tokenizer_init", [True, False])
def test_routereplays_server_hands_verls_agent_loop_the_rows_sglang_encoded(
    case: Any, skip_tokenizer_init: bool
) -> None:
    server = launched(case, case["ours"].RouteReplaySGLangHttpServer, skip_tokenizer_init=skip_tokenizer_init)
    assert case["manager"].server_args.enable_return_routed_experts
    output = generate(server, case)
    assert case["manager"].requests[-1].return_routed_experts  # the request verl built asked for the routes
    assert output.token_ids == case["output"]
    rows_TAK = case["rows"]
    routes_TAK = output.routed_experts
    assert routes_TAK.dtype == np.int32 and routes_TAK.shape == rows_TAK.shape
    assert all(
        set(a) == set(b) for a, b in zip(routes_TAK.reshape(-1, TOP_K), rows_TAK.reshape(-1, TOP_K), strict=True)
    )
    # what verl's (routereplay-checked) agent loop makes of that TokenOutput: the same rows, naming their tokens
    geometry = RouteGeometry.from_hf_config(server.model_config.hf_config)
    sample = AgentLoopRoutes(geometry, engine="sglang")
    sample.add_output(case["prompt"], output)
    trace = sample.trace(case["prompt"] + case["output"])
    assert trace.layers == tuple(range(NUM_LAYERS)) and (trace.start, trace.stop) == (0, len(rows_TAK))
    assert all(
        set(a) == set(b) for a, b in zip(trace.experts.reshape(-1, TOP_K), rows_TAK.reshape(-1, TOP_K), strict=True)
    )
    assert list(trace.token_ids) == (case["prompt"] + case["output"])[:-1]
    assert asyncio.run(server.get_route_stats()) == {"decoded": 1, "missing": 0, "dropped": 0}


def test_routes_that_do_not_fit_the_call_raise_by_name(case: Any) -> None:
    server = launched(case, case["ours"].RouteReplaySGLangHttpServer, skip_tokenizer_init=True)
    short = list(case["prompt"])[:-1]  # one prompt token fewer than the 300 rows SGLang sent cover
    with pytest.raises(RowCountError, match="sample-1"):
        asyncio.run(server.generate(short, {"max_tokens": 200}, "sample-1"))
    assert server.tokenizer_manager.outputs == {}  # nothing kept for the failed call


def test_a_response_without_routes_is_a_counted_none(case: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    server = launched(case, case["ours"].RouteReplaySGLangHttpServer, skip_tokenizer_init=True)
    monkeypatch.setitem(case["manager"].meta_info, "routed_experts", None)  # aborted before any forward pass
    output = generate(server, case)
    assert output.routed_experts is None
    assert server.route_stats.missing == 1 and server.route_stats.decoded == 0


def test_verls_replica_registry_names_routereplays_sglang_server(case: Any) -> None:
    from verl.workers.rollout.replica import RolloutReplicaRegistry, get_rollout_replica_class

    from routereplay.integrations.verl.tokenizer_routes import register_sglang_replica

    verl_loader = RolloutReplicaRegistry._registry["sglang"]
    try:
        load = register_sglang_replica()
        assert register_sglang_replica() is load  # idempotent
        replica = get_rollout_replica_class("sglang")
        assert replica is case["ours"].RouteReplaySGLangReplica
        assert issubclass(replica, case["verl_server"].SGLangReplica)
        assert "SGLANG_USE_CPU_ENGINE" not in os.environ  # verl's loader ran (it sets and clears it)
    finally:
        RolloutReplicaRegistry.register("sglang", verl_loader)


def test_a_verl_without_an_sglang_loader_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from routereplay.integrations.verl.tokenizer_routes import register_sglang_replica

    monkeypatch.setattr(RolloutReplicaRegistry, "_registry", {})
    with pytest.raises(ConfigError, match="no 'sglang' loader"):
        register_sglang_replica()
