"""Remote inference servers (vLLM, SGLang) as rollout engines: one bounded HTTP request per prompt.

Files:
- `clients.py`  `VLLMClient` / `SGLangClient`: the built-in engine's interface over a server's HTTP API,
                responses decoded and checked, forced prefix routes sent along
- `engine.py`   `RemoteEngine`: what both clients share: the request loop, the model check, response fields
- `http.py`     `BoundedHTTP` / `HTTPPolicy`: silence timeout, deadline per attempt, size cap, retries

The errors a client raises are `routereplay.errors`' classes, re-exported here as `clients.py` did.
"""

from routereplay.engines.remote.clients import SGLangClient, VLLMClient
from routereplay.engines.remote.engine import RemoteEngine
from routereplay.engines.remote.http import BoundedHTTP, HTTPPolicy
from routereplay.errors import (
    DeadlineExceededError,
    EngineDeadError,
    EngineModelError,
    EngineRequestError,
    EngineTimeoutError,
    ModelMismatchError,
    ResponseFieldError,
    ResponseTooLargeError,
)

__all__ = [
    "BoundedHTTP",
    "DeadlineExceededError",
    "EngineDeadError",
    "EngineModelError",
    "EngineRequestError",
    "EngineTimeoutError",
    "HTTPPolicy",
    "ModelMismatchError",
    "RemoteEngine",
    "ResponseFieldError",
    "ResponseTooLargeError",
    "SGLangClient",
    "VLLMClient",
]
