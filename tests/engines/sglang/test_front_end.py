"""The front end of SGLang 0.5.23 with the plugin loaded by its own `load_plugins()`: SGLang's
`TokenizerManager._create_tokenized_object` (the step every `/generate` and OpenAI request passes, hooked AFTER)
turns a `GenerateReqInput` into the request the scheduler gets; a bad blob is refused by name with a `ValueError`,
which SGLang's HTTP server answers with 400 (`http_server._create_error_response`, SGLang's own); a good one is
cache-salted by its routes. The `TokenizerManager` itself is a stand-in object with the attributes that method reads
(a real one starts the detokenizer and scheduler processes); the method, the request classes, `SamplingParams` and
`ModelConfig` are SGLang's.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("sglang.srt.managers.tokenizer_manager", reason="needs fastapi, uvicorn, uvloop, setproctitle")

from sglang.srt.entrypoints.http_server import _create_error_response
from sglang.srt.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.sampling.sampling_params import SamplingParams

from routereplay.engines.sglang.forcing import CUSTOM_KEY
from routereplay.engines.sglang.forcing.requests import REPREFILL_KEY
from routereplay.engines.vllm.forced_routes import SALT_PREFIX, encode_forced, route_digest
from routereplay.errors import ForcedRoutesError
from routereplay.trace.route_trace import RouteTrace

PROMPT = [3, 4, 5, 6, 7]


@pytest.fixture(autouse=True)
def front_end_config(published: Any) -> None:
    """SGLang's process config, published as the front-end process has it (the request checks read it)."""


def manager(model_config: Any, **server: object) -> SimpleNamespace:
    """What `_create_tokenized_object` (and the plugin's hook) read from a TokenizerManager."""
    return SimpleNamespace(
        preferred_sampling_params=None,
        sampling_params_class=SamplingParams,
        tokenizer=None,
        model_config=model_config,
        tokenized_generate_req_type=TokenizedGenerateReqInput,
        fake_bootstrap_room_counter=0,
        server_args=SimpleNamespace(**server),
        rid_to_state={"req-7": SimpleNamespace(time_stats=SimpleNamespace(set_tokenize_finish_time=lambda: None))},
    )


def tokenize(model_config: Any, custom: dict[str, Any], *, cache_salt: str | None = None, **server: object) -> Any:
    obj = GenerateReqInput(
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 4, "custom_params": custom},
        rid="req-7",
        cache_salt=cache_salt,
    )
    return TokenizerManager._create_tokenized_object(manager(model_config, **server), obj, "", PROMPT)


def trace(rows: int, *, start: int = 0) -> RouteTrace:
    experts_TLK = np.argsort(np.random.default_rng(0).random((rows, 3, 8)), axis=-1)[:, :, :2].astype(np.int16)
    return RouteTrace(experts_TLK, 8, (0, 1, 2), start=start)


def test_a_good_blob_is_salted_by_its_routes(model_config: Any, plugin: Any) -> None:
    text = encode_forced(trace(4, start=1))
    tokenized = tokenize(model_config, {CUSTOM_KEY: text}, cache_salt="mine")
    assert isinstance(tokenized, TokenizedGenerateReqInput)
    assert tokenized.cache_salt == f"mine|{SALT_PREFIX}{route_digest(text)}"
    assert tokenized.sampling_params.custom_params[CUSTOM_KEY] == text  # what the scheduler checks again
    plain = tokenize(model_config, {}, cache_salt="mine")
    assert plain.cache_salt == "mine"


@pytest.mark.parametrize(
    ("custom", "message"),
    [
        ({CUSTOM_KEY: "%%%"}, "not base64"),
        ({CUSTOM_KEY: encode_forced(trace(6))}, "only prompt positions can be forced"),
        ({CUSTOM_KEY: encode_forced(RouteTrace(np.tile(np.int16([0, 1]), (2, 3, 1)), 16, (0, 1, 2)))}, "E=16"),
        ({REPREFILL_KEY: "maybe"}, REPREFILL_KEY),
    ],
)
def test_a_bad_request_is_refused_by_name_with_http_400(
    model_config: Any, plugin: Any, custom: dict[str, Any], message: str
) -> None:
    with pytest.raises(ForcedRoutesError, match=message) as caught:
        tokenize(model_config, custom)
    assert "SGLang request 'req-7'" in str(caught.value)
    response = _create_error_response(caught.value)  # what SGLang's /generate answers a ValueError with
    assert response.status_code == HTTPStatus.BAD_REQUEST
    assert "sampling_params.custom_params" in json.loads(response.body)["error"]["message"]


def test_a_server_that_cannot_force_refuses_by_name(model_config: Any, plugin: Any) -> None:
    with pytest.raises(ForcedRoutesError, match="cannot force routes: DP attention"):
        tokenize(model_config, {CUSTOM_KEY: encode_forced(trace(2))}, enable_dp_attention=True)
    with pytest.raises(ForcedRoutesError, match="speculative decoding"):
        tokenize(model_config, {REPREFILL_KEY: True}, speculative_algorithm="EAGLE")
