"""The child process's side of `HFProcessEngine` (engines/hf/process.py): the messages, the engine server.

The parent starts `serve` with the `spawn` context. The child hides CUDA, sets torch's intra-op
threads to the parent's choice, builds the model (`ModelRecipe`: a transformers model from its class
and config plus the shared weights, any other module unpickled whole) and an `HFEngine` on it, says
READY, and answers GENERATE and SYNC requests one at a time until CLOSE, or EOF when the parent is
gone; then it exits at once (`os._exit`: the interpreter's teardown would add about 1 s to
`close()`). A callable `stop` that stays in the parent is `ParentStop` here: each token boundary is
reported (STEP) and answered with the parent's verdict on the previous boundary (VERDICT), so a stop
lands exactly one boundary after the parent's yes. An exception goes back as an ERROR message:
pickled when it survives a pickle round trip, with its type name, message and traceback text.
Legend: none (no tensors are shaped here).
"""

from __future__ import annotations

import copy
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
from torch import nn

from routereplay.engines.hf.engine import HFEngine
from routereplay.enums import StrEnum
from routereplay.errors import EngineProcessError


class Message(StrEnum):
    """The first element of every message on the pipe."""

    READY = "ready"  # child -> parent: the engine is built; {"pid", "threads"}
    GENERATE = "generate"  # parent -> child: prompts, params, budget, asks_parent, reports_progress, prefix routes
    STEP = "step"  # child -> parent: a token boundary reached (tokens sampled so far); asks `stop`
    VERDICT = "verdict"  # parent -> child: the parent's `stop` answer to a STEP
    PROGRESS = "progress"  # child -> parent: progress(step, total)
    RESULT = "result"  # child -> parent: the rollouts
    SYNC = "sync"  # parent -> child: load the shared weights, with this policy version
    SYNCED = "synced"  # child -> parent: loaded
    ERROR = "error"  # child -> parent: pickled exception (or None), type name, message, traceback text
    CLOSE = "close"  # parent -> child: exit


@dataclass(frozen=True, slots=True)
class ModelRecipe:
    """How the child gets the model: a transformers model is rebuilt from its class and config and loads
    the shared weights (its live hooks, e.g. transformers' output-capturing closures, do not pickle);
    any other module is pickled whole (CPU copy)."""

    model_class: type[nn.Module] | None
    config: Any
    module: nn.Module | None

    @classmethod
    def of(cls, model: nn.Module) -> ModelRecipe:
        try:
            from transformers import PreTrainedModel
        except ImportError:  # no transformers: no transformers model either
            pretrained = False
        else:
            pretrained = isinstance(model, PreTrainedModel)
        if pretrained:
            return cls(type(model), copy.deepcopy(model.config), None)
        return cls(None, None, copy.deepcopy(model).to("cpu"))  # inert and unattached, like HFEngine's own copy

    def build(self, shared: Mapping[str, torch.Tensor]) -> nn.Module:
        if self.module is not None:
            return self.module
        assert self.model_class is not None
        model = self.model_class(self.config)
        model.load_state_dict(shared)  # bf16 values widen exactly; HFEngine casts them back
        return model.eval()


@dataclass(frozen=True, slots=True)
class ChildOptions:
    """What the child needs besides the model and the shared weights."""

    dtype: torch.dtype
    capture: bool
    policy_version: int | None
    threads: int


class ParentStop:
    """The child's `stop` for a callable that stays in the parent: report each boundary, and answer
    with the parent's verdict on the previous one (so a stop lands exactly one boundary late)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.reported = 0
        self.answered = 0

    def __call__(self, sampled: int) -> bool:
        self.conn.send((Message.STEP, sampled))
        self.reported += 1
        if self.reported == 1:
            return False  # nothing decided yet: the first verdict is read at the next boundary
        return self._verdict()

    def drain(self) -> None:
        """Read the verdicts still due, so none is left on the pipe for the next request."""
        while self.answered < self.reported:
            self._verdict()

    def _verdict(self) -> bool:
        kind, verdict = self.conn.recv()
        if kind != Message.VERDICT:
            raise EngineProcessError(f"the engine process expected a stop verdict from its parent, got {kind!r}")
        self.answered += 1
        return bool(verdict)


class EngineChild:
    """The child's side: an `HFEngine` answering the parent's requests until CLOSE or EOF."""

    def __init__(self, conn: Connection, engine: HFEngine, shared: Mapping[str, torch.Tensor]) -> None:
        self.conn, self.engine, self.shared = conn, engine, shared

    def run(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                return  # the parent is gone
            if message[0] == Message.CLOSE:
                return
            try:
                reply = self._handle(message)
            except Exception as error:
                self.conn.send(error_message(error))
            else:
                self.conn.send(reply)

    def _handle(self, message: tuple[Any, ...]) -> tuple[Any, ...]:
        kind = message[0]
        if kind == Message.SYNC:
            self.engine.load_weights(self.shared, message[1])
            return (Message.SYNCED,)
        if kind != Message.GENERATE:
            raise EngineProcessError(f"the engine process got an unknown request {kind!r}")
        prompts, params, budget, asks_parent, reports_progress, prefix_routes = message[1:]
        stop: Callable[[int], bool] | None = ParentStop(self.conn) if asks_parent else budget
        progress = self._progress if reports_progress else None
        try:
            rollouts = self.engine.generate(prompts, params, progress, stop=stop, prefix_routes=prefix_routes)
        finally:
            if isinstance(stop, ParentStop):
                stop.drain()
        return (Message.RESULT, rollouts)

    def _progress(self, step: int, total: int) -> None:
        self.conn.send((Message.PROGRESS, step, total))


def error_message(error: BaseException) -> tuple[Any, ...]:
    """An exception as an ERROR message: pickled when it survives a pickle round trip, else None."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    payload: bytes | None
    try:
        payload = pickle.dumps(error)
        pickle.loads(payload)
    except Exception:
        payload = None
    return (Message.ERROR, payload, f"{type(error).__module__}.{type(error).__qualname__}", str(error), text)


def serve(conn: Connection, recipe: ModelRecipe, shared: Mapping[str, torch.Tensor], options: ChildOptions) -> None:
    """The child process's entry point (importable, as `spawn` needs)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # never touch the parent's GPUs; CUDA is initialised lazily
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent decides
    torch.set_num_threads(options.threads)
    try:
        model = recipe.build(shared)
        engine = HFEngine(model, dtype=options.dtype, capture=options.capture, policy_version=options.policy_version)
    except Exception as error:
        conn.send(error_message(error))
        return
    del model, recipe
    conn.send((Message.READY, {"pid": os.getpid(), "threads": torch.get_num_threads()}))
    EngineChild(conn, engine, shared).run()
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown (about 1 s with transformers imported): nothing is left to do


__all__ = ["ChildOptions", "EngineChild", "Message", "ModelRecipe", "ParentStop", "error_message", "serve"]
