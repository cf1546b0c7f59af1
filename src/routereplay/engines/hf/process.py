"""The built-in engine in a child process: rollouts that run beside the trainer, not under its GIL.

Fully-async RL keeps the engine sampling while the trainer trains. In one process the two share
the GIL, and the tiny demo model's forwards are Python-bound, so a rollout thread and the trainer
take turns instead of overlapping (`routereplay bench async`: async ~1.0x sync on 2 cores). Real
fully-async systems run the engine elsewhere (another process, another GPU). `HFProcessEngine` runs
an `HFEngine` (same dtype and capture options, the same seeded sampling, so the same rollouts) in a
child process started with the `spawn` context, behind the same interface: `generate`,
`sync_weights`, `supports_prefix_replay`, `policy_version`, plus `close()` and `with`.

How the parent and the child talk (one duplex pipe, one request at a time):
- `generate` sends the prompts, the `SamplingParams` and the prefix routes; the child answers with
  the pickled `Rollout`s (their `RouteTrace`s pickle). `progress` callbacks come back as messages.
- `stop`: a `TokenBudget` is plain data, so it is sent and evaluated in the child, exactly where the
  in-process engine would (the seeded async schedule stays exact). Any other callable stays in the
  parent: the child reports each token boundary it reaches (`stop(n)` is asked in the parent on each
  report) and, at its next boundary, waits for the parent's verdict on the previous one. So a stop
  lands exactly one boundary later than in-process (a yes at boundary 0 lets the prefill run and one
  token be sampled), whatever the scheduling, while the child never waits for a verdict it has not
  had a whole decoding step to receive.
- `sync_weights` copies the trainer's state dict into one persistent shared-memory buffer (engine
  dtype, made at start) and tells the child to load it. For the 6.5M-parameter demo model a sync
  took 5.6 ms this way, against 39 ms pickling a bf16 state dict through the pipe (72 ms fp32) and
  47 ms sending tensors through torch.multiprocessing (a fresh shared-memory segment per send).
- The model reaches the child as a `ModelRecipe`: a transformers model is rebuilt there from its
  class and config and loads the shared weights (a model that has run a forward carries
  transformers' output-capturing hooks, closures that do not pickle); any other module is pickled
  whole. The child's side (messages, server, `ParentStop`) is `engines/hf/child.py`.
- The child sets torch's intra-op threads to the parent's `ThreadPolicy` choice (1 by default), and
  hides CUDA (`CUDA_VISIBLE_DEVICES=""`; every tensor it receives is on the CPU).
- An exception in the child re-raises in the parent as itself (same type, same message; the child's
  traceback is its `__cause__`), or, when it does not pickle, as `EngineProcessRaisedError` carrying
  the traceback text. A child that dies raises `EngineProcessDiedError` with its exit code: the parent
  waits on the pipe and the process sentinel together (in slices, checking `is_alive()`), never on the
  pipe alone, so a dead child cannot hang it. The engine is closed after that.

Lifetime: the child is a daemon; `close()` (also on garbage collection and at interpreter exit) asks
it to exit, then terminates and finally kills it, and joins it. A child whose parent dies reads EOF
on the pipe and exits. As with any `spawn` child, a script that builds this engine at import time must
guard its entry point with `if __name__ == "__main__":`. Legend: none (no tensors are shaped here).
"""

from __future__ import annotations

import multiprocessing
import pickle
import signal
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
from torch import nn

from routereplay.engines.hf.child import ChildOptions, Message, ModelRecipe, serve
from routereplay.engines.hf.engine import Rollout, SamplingParams, TokenBudget, check_prompts
from routereplay.errors import (
    ConfigError,
    EngineProcessDiedError,
    EngineProcessError,
    EngineProcessRaisedError,
    WeightSyncError,
)
from routereplay.threads import ThreadPolicy
from routereplay.trace.route_trace import RouteTrace

WAIT_SLICE_SECONDS = 1.0  # the parent re-checks that the child is alive at least this often while it waits
CLOSE_SECONDS = 5.0  # how long close() lets the child exit by itself, then after terminate(), before kill()


def shutdown(process: multiprocessing.process.BaseProcess, conn: Connection) -> None:
    """Ask the child to exit, then terminate, then kill it; join it; close the pipe (idempotent)."""
    if process.is_alive():
        try:
            conn.send((Message.CLOSE,))
        except (OSError, ValueError):
            pass
        process.join(CLOSE_SECONDS)
    if process.is_alive():
        process.terminate()
        process.join(CLOSE_SECONDS)
    if process.is_alive():
        process.kill()
        process.join()
    conn.close()


class HFProcessEngine:
    """`HFEngine(model, dtype=, capture=, policy_version=)` run in a child process (module docstring)."""

    supports_prefix_replay = True  # `generate(prefix_routes=...)`, as HFEngine

    def __init__(
        self,
        model: nn.Module,
        *,
        dtype: torch.dtype = torch.bfloat16,
        capture: bool = True,
        policy_version: int | None = None,
        threads: int | None = None,
        start_timeout: float = 300.0,
        reply_timeout: float | None = None,
    ) -> None:
        if start_timeout <= 0 or (reply_timeout is not None and reply_timeout <= 0):
            raise ConfigError(
                f"start_timeout={start_timeout} and reply_timeout={reply_timeout} must be > 0 (reply_timeout None: "
                "wait as long as the engine process lives)"
            )
        self.dtype, self.capture, self.policy_version = dtype, capture, policy_version
        self.threads = ThreadPolicy(threads=threads).choose(torch.get_num_threads()).threads
        self.reply_timeout = reply_timeout
        self._lock = threading.RLock()  # one request at a time; sync_weights holds it across its copy
        self._shared = {  # the weights, in the engine dtype, in shared memory: every sync goes through it
            name: value.detach().to("cpu", dtype if value.is_floating_point() else value.dtype, copy=True)
            for name, value in model.state_dict().items()
        }
        for value in self._shared.values():
            value.share_memory_()
        recipe = ModelRecipe.of(model)
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe(duplex=True)
        options = ChildOptions(dtype, capture, policy_version, self.threads)
        self._process = context.Process(
            target=serve,
            args=(child_conn, recipe, self._shared, options),
            name="routereplay-engine",
            daemon=True,
        )
        self._process.start()
        child_conn.close()
        del recipe
        self._finalizer = weakref.finalize(self, shutdown, self._process, self._conn)
        self._closed = False
        ready: dict[str, int] = self._request((Message.READY,), "start", start_timeout, send=False)
        self.child_threads = ready["threads"]  # torch's intra-op threads in the child: `threads`

    # --- the engine interface --------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        progress: Callable[[int, int], None] | None = None,
        *,
        stop: Callable[[int], bool] | None = None,
        prefix_routes: Sequence[RouteTrace | None] | None = None,
    ) -> list[Rollout]:
        """`HFEngine.generate` in the child; a callable `stop` other than `TokenBudget` lands one boundary late."""
        check_prompts(prompts)
        budget = stop if isinstance(stop, TokenBudget) else None
        asks_parent = stop is not None and budget is None
        message = (
            Message.GENERATE,
            [list(p) for p in prompts],
            params,
            budget,
            asks_parent,
            progress is not None,
            None if prefix_routes is None else list(prefix_routes),
        )
        rollouts: list[Rollout] = self._request(
            message, "generate", self.reply_timeout, stop=stop if asks_parent else None, progress=progress
        )
        return rollouts

    def sync_weights(self, model: nn.Module, policy_version: int | None = None) -> None:
        """Copy the trainer's weights into the shared buffer (cast to the engine dtype); the child loads them."""
        state = model.state_dict()
        missing, unexpected = sorted(self._shared.keys() - state.keys()), sorted(state.keys() - self._shared.keys())
        if missing or unexpected:
            raise WeightSyncError(
                f"sync_weights: the model's state dict does not match the engine's (missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}): sync the same architecture the engine was built from"
            )
        shapes = [name for name, value in state.items() if value.shape != self._shared[name].shape]
        if shapes:
            raise WeightSyncError(
                f"sync_weights: {shapes[:5]} have other shapes than the engine's: sync the same architecture"
            )
        with self._lock:
            self._check_open("sync_weights")
            with torch.no_grad():
                for name, value in state.items():
                    self._shared[name].copy_(value.detach())
            self._request((Message.SYNC, policy_version), "sync_weights", self.reply_timeout)
            self.policy_version = policy_version

    # --- lifetime ----------------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The child process's id."""
        return self._process.pid

    @property
    def alive(self) -> bool:
        return not self._closed and self._process.is_alive()

    def close(self) -> None:
        """Stop the child process and join it (idempotent)."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> HFProcessEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- the pipe ---------------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise EngineProcessError(
                f"{what}: this HFProcessEngine is closed (closed by the caller, or after its process failed): "
                "build a new one"
            )

    def _request(
        self,
        message: tuple[Any, ...],
        what: str,
        timeout: float | None,
        *,
        send: bool = True,
        stop: Callable[[int], bool] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> Any:
        """Send `message` (unless `send` is False), answer the child's STEPs and PROGRESSes, and return the
        reply's value; the child's exception is raised as itself. Anything else going wrong mid-request
        leaves the child's state unknown: it is closed."""
        with self._lock:
            self._check_open(what)
            if send:
                try:
                    payload = pickle.dumps(message)
                except Exception as unpicklable:
                    raise ConfigError(
                        f"{what}: the request cannot be sent to the engine process: {unpicklable}"
                    ) from unpicklable
            try:
                if send:
                    self._send(payload, what)
                reply, failure = self._exchange(what, timeout, stop, progress)
            except BaseException:
                self.close()
                raise
        if reply[0] == Message.ERROR:
            raised = remote_error(reply, self._process.pid)
            if what == "start":
                self.close()
            raise raised
        if failure is not None:  # the caller's stop or progress raised; the child finished the call cleanly
            raise failure
        return reply[1] if len(reply) > 1 else None

    def _exchange(
        self,
        what: str,
        timeout: float | None,
        stop: Callable[[int], bool] | None,
        progress: Callable[[int, int], None] | None,
    ) -> tuple[tuple[Any, ...], Exception | None]:
        failure: Exception | None = None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            reply = self._receive(what, deadline, timeout)
            if reply[0] == Message.STEP:
                verdict = True  # after a failure of the caller's stop: end the call at the next boundary
                if failure is None and stop is not None:
                    try:
                        verdict = bool(stop(reply[1]))
                    except Exception as error:
                        failure = error
                self._send(pickle.dumps((Message.VERDICT, verdict)), what)
            elif reply[0] == Message.PROGRESS:
                if failure is None and progress is not None:
                    try:
                        progress(reply[1], reply[2])
                    except Exception as error:
                        failure = error
            else:
                return reply, failure

    def _send(self, payload: bytes, what: str) -> None:
        try:
            self._conn.send_bytes(payload)
        except (OSError, ValueError):  # a broken pipe: the child is gone
            raise self._died(what) from None

    def _receive(self, what: str, deadline: float | None, timeout: float | None) -> tuple[Any, ...]:
        """The child's next message; a dead child raises `EngineProcessDiedError`, a silent one past the
        deadline `EngineProcessError` (after it is terminated)."""
        while True:
            left = WAIT_SLICE_SECONDS if deadline is None else min(WAIT_SLICE_SECONDS, deadline - time.monotonic())
            if left <= 0:
                raise EngineProcessError(
                    f"{what}: the engine process (pid {self._process.pid}) did not answer within {timeout:g} s; it "
                    "was terminated. Raise start_timeout/reply_timeout if the machine is just slow"
                )
            ready = wait([self._conn, self._process.sentinel], timeout=left)
            if self._conn in ready:
                try:
                    reply: tuple[Any, ...] = self._conn.recv()
                except (EOFError, OSError):
                    raise self._died(what) from None
                return reply
            if ready or not self._process.is_alive():
                raise self._died(what)

    def _died(self, what: str) -> EngineProcessDiedError:
        self._process.join(CLOSE_SECONDS)
        code = self._process.exitcode
        self.close()  # terminates a child that broke the pipe without exiting
        code = self._process.exitcode if code is None else code
        how = f"exit code {code}"
        if code is not None and code < 0 and -code in signal.valid_signals():
            how += f" ({signal.Signals(-code).name})"
        return EngineProcessDiedError(
            f"{what}: the engine process (pid {self._process.pid}) died with {how}; its state is lost, so this "
            "engine is closed: build a new HFProcessEngine (its own traceback, if any, went to stderr)",
            exitcode=code,
        )


def remote_error(reply: tuple[Any, ...], pid: int | None) -> BaseException:
    """The child's exception from an ERROR message: itself (its traceback as the cause), else a named stand-in."""
    _, payload, type_name, message, text = reply
    if payload is not None:
        try:
            error = pickle.loads(payload)
        except Exception:
            error = None
        if isinstance(error, BaseException):
            error.__cause__ = EngineProcessError(f"raised in the engine process (pid {pid}):\n{text}")
            error.__suppress_context__ = True
            return error
    return EngineProcessRaisedError(
        f"the engine process (pid {pid}) raised {type_name}: {message} (it could not be sent back as itself); "
        f"its traceback:\n{text}",
        type_name=type_name,
        traceback_text=text,
    )


__all__ = ["HFProcessEngine", "remote_error", "shutdown"]
