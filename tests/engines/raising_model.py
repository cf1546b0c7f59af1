"""A model whose forward raises an exception that does not survive pickling: for the engine-process tests.

It lives in its own importable module because the engine's child process (started with `spawn`)
unpickles the model by its class's import path.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn


class UnpicklableError(RuntimeError):
    """An error holding a lock (locks do not pickle), as errors that carry live resources do."""

    def __init__(self, message: str, *, lock: Any) -> None:
        super().__init__(message)
        self.lock = lock


class RaisingModel(nn.Module):
    """Any forward raises `UnpicklableError`; build the engine with capture=False (it has no routers)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(2))

    def forward(self, **_inputs: Any) -> Any:
        raise UnpicklableError("the forward failed on purpose", lock=threading.Lock())
