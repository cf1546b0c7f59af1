"""The one error hierarchy of routereplay.

Every error the library raises on bad input is a `RouteReplayError`. Errors caused by a bad value
are also `ValueError`s, so callers that already catch `ValueError` keep working. Each message says
what is wrong, where (sequence, token, row, layer) and how to fix it; `location()` formats the
"where" part the same way everywhere.
"""

from __future__ import annotations


class RouteReplayError(Exception):
    """Base class of every error routereplay raises on bad input or misuse."""


class ConfigError(RouteReplayError, ValueError):
    """An argument or setting is invalid (wrong type, out of range, contradicts another)."""


# --- payloads: the bytes / lists / arrays an engine sent --------------------------------------


class MissingRoutesError(RouteReplayError, ValueError):
    """The payload carries no routes: `None` (aborted request, flag off) or the field is absent."""


class StreamedResponseError(MissingRoutesError):
    """A streamed (`stream=true`) response or chunk without routes: a completions / chat stream (no chunk carries
    them), or a mid-stream chunk of vLLM >= 0.31's /inference/v1/generate stream (only its final chunk does)."""


class PayloadError(RouteReplayError, ValueError):
    """The payload cannot be turned into an integer (T, L, K) array."""


class PayloadEncodingError(PayloadError):
    """Corrupt or truncated base64, or bytes that are not the declared container (e.g. `.npy`)."""


class PayloadSizeError(PayloadError):
    """Byte length does not fit the declared shape, or the declared size is implausibly large."""


class PickleRefusedError(PayloadError):
    """The payload would need unpickling (object `.npy` or a raw pickle); it is never executed."""


class DtypeError(PayloadError):
    """Routes must be integers; a float, bool or object array is refused."""


class JsonDocumentError(PayloadEncodingError):
    """A JSON document is invalid (says line/column/character), too large, nested too deep, or holds a
    too-long or non-finite number (`routereplay.jsondocument.JsonLimits`)."""


class PayloadLimitError(PayloadSizeError):
    """A declared shape exceeds a `WireLimits` bound (rows, layers, top-k, dimensions): refused unallocated."""


class AmbiguousChoiceError(PayloadError):
    """A multi-choice response's routes cannot be shown to belong to the asked choice (SGLang n > 1)."""


# --- shape of a trace -------------------------------------------------------------------------


class TraceShapeError(RouteReplayError, ValueError):
    """The (T, L, K) shape disagrees with what the caller or the model expects."""


class RowCountError(TraceShapeError):
    """Row count != num_tokens - 1 - start (duplicated prefix, truncated capture, wrong offset)."""


class DuplicatedPrefixError(RowCountError):
    """The routes hold a prefix twice (the verl #6029 partial-rollout concatenation bug): an exact
    repeat, or an excess of rows equal to the rows the store already holds for the sample (the
    prefix re-sent after a weight update routes differently), or token ids that repeat the prefix."""


class LayerCountError(TraceShapeError):
    """Layer axis length != the expected number of (MoE or all) layers."""


class TopKMismatchError(TraceShapeError):
    """Last axis length != the model's top-k."""


class IndexerRouteError(TraceShapeError):
    """DSA indexer choices are impossible: a future key, a repeat, unsorted, -1 mid-row, a partial row."""


# --- content of a trace -----------------------------------------------------------------------


class RouteValueError(RouteReplayError, ValueError):
    """A route's expert ids are impossible for the model."""


class ExpertIdRangeError(RouteValueError):
    """An expert id is outside [0, num_experts) and is not the -1 sentinel."""


class PartialRowError(RouteValueError):
    """A (token, layer) row mixes -1 with real ids; a row is either fully routed or fully -1."""


class DuplicateExpertError(RouteValueError):
    """A (token, layer) row names the same expert twice (zero-padding replayed as expert 0)."""


class ZeroLayerError(RouteValueError):
    """Every routed row of an MoE layer is all zeros: the engine's capture failed for that layer."""


class WeightsError(RouteValueError):
    """Combine weights given to `replay(weights=...)` (or carried by traces) are impossible for the routes."""


class WeightsShapeError(WeightsError):
    """Combine weights whose shape or dtype differ from the routes they belong to ((B, S, L, K) float)."""


class WeightsValueError(WeightsError):
    """A combine weight is NaN, infinite or negative, or is non-zero on a row whose route is -1."""


class WeightsSumError(WeightsError):
    """A row of combine weights does not sum as its router normalises (norm_topk_prob: to the scaling factor)."""


class WeightsUnsupportedError(ConfigError):
    """Weights replay (or threshold replay) asked of a router whose experts' gate weights cannot be reached."""


# --- the compact codec ------------------------------------------------------------------------


class CodecError(RouteReplayError, ValueError):
    """A codec blob is corrupt, truncated, tampered with, or of an unknown version."""


class CodecFormatError(CodecError):
    """Bad magic, malformed or truncated header/payload, sizes that do not add up."""


class CodecVersionError(CodecError):
    """The blob was written by a codec version this release cannot read."""


class ChecksumError(CodecError):
    """The stored checksum does not match the bytes: the blob was corrupted or tampered with."""


class CodecLimitError(CodecError):
    """A blob declares more than a `CodecLimits` bound allows (ids, expansion, set-mode table).

    Refused before anything is allocated; raise the named limit if the blob is trusted."""


class StoreHeaderError(CodecFormatError):
    """A route store file's JSON header is invalid, nested too deep, holds a too-long or non-finite
    number, or has fields of the wrong type (even under a valid CRC)."""


# --- the replay runtime ------------------------------------------------------------------------


class AttachError(RouteReplayError):
    """`attach(model)` cannot give this model faithful replay."""


class NoRoutersError(AttachError, ValueError):
    """The model has no top-k router module at all (a dense model, or an unknown router class)."""


class UnsupportedRouterError(AttachError):
    """Some routers cannot be replayed honestly (non-top-k selection, two routers in one layer)."""


class AlreadyAttachedError(AttachError):
    """The model already has a Replayer attached; detach it first."""


class KernelBypassError(AttachError):
    """A fused or hub kernel runs the router outside Python, where replay cannot reach it."""


class BatchShapeError(TraceShapeError):
    """Routes given to replay do not match the batch the model is called with."""


class ReplayStateError(RouteReplayError):
    """A replay/record context was misused: nested, reused, or backward ran after it closed."""


class RecomputeError(ReplayStateError):
    """An activation-checkpoint recompute found no routes to reuse, so it would route differently."""


class AlignmentError(BatchShapeError):
    """Replay routes are not aligned with the batch's tokens (padding side, coverage, token ids)."""


class PaddingMismatchError(AlignmentError):
    """Routes laid out for another padding: routed rows on padding, or -1 rows on attended tokens."""


class TokenMismatchError(AlignmentError):
    """The batch's token ids differ from the ids a trace routed (an extra or stripped BOS, re-tokenisation)."""


class ForeignThreadError(ReplayStateError):
    """A thread tried to open a context on a Replayer whose context another thread holds."""


class OutputPathError(ConfigError):
    """An output cannot be written where asked: a FIFO, device or socket, a directory, `-`, or an existing
    file or non-empty folder without --force."""


class OrderLostError(ConfigError):
    """Replay was asked to force the routes' top-k order, but the routes kept only the expert set."""


class ModalityMismatchError(AlignmentError):
    """Routes name a router that does not run for the token (a text route on a vision token, or the reverse)."""


# --- the Megatron-core adapter ------------------------------------------------------------------


class MissingLayerError(LayerCountError):
    """A replay payload does not cover a layer whose router this model (stage, chunk) owns."""


class MicroBatchCountError(ReplayStateError):
    """A replay schedule was not consumed exactly once per micro-batch (a leftover or missing entry)."""


class LayerRenumberedError(ReplayStateError):
    """A bound router's `layer_number` changed after attach; it would replay another layer's routes."""


class NativeReplayConflictError(ReplayStateError):
    """Megatron's own `RouterReplay` has an action set on a router that a routereplay context drives."""


# --- training layouts: padding, packing, parallel shards, pipeline stages ----------------------


class LayoutError(RouteReplayError, ValueError):
    """Routes cannot be put into (or taken out of) the trainer's token or layer layout as asked."""


class DivisibilityError(LayoutError):
    """A length does not divide by the parallel size a split needs (SP, CP zigzag, TP-SP scatter)."""


class StageLayerError(LayoutError):
    """A layer was asked of a pipeline stage that does not own it, or is not a replayed MoE layer."""


# --- delivering routes to trainer ranks (transport/, integrations/ray_routes.py) ------------------


class DeliveryError(RouteReplayError, ValueError):
    """Routes cannot be delivered to the trainer ranks as asked (a bundle per rank missing, or not bytes)."""


class DeliveryLimitError(DeliveryError):
    """A rank was announced more bytes than its `max_bytes` allows: refused before anything is allocated."""


# --- remote inference servers (engines/remote/) ---------------------------------------------------


class EngineRequestError(RouteReplayError):
    """An HTTP request to an inference server failed (after retries, when the failure is transient)."""

    def __init__(self, message: str, *, url: str = "", status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.url, self.status, self.body = url, status, body


class EngineTimeoutError(EngineRequestError):
    """Every attempt of a request timed out (raise `timeout=`, or check that the server is alive)."""


class DeadlineExceededError(EngineTimeoutError):
    """No attempt finished (connect, headers, whole body) within the client's `deadline` seconds."""

    def __init__(self, message: str, *, url: str, deadline: float, elapsed: float, received: int) -> None:
        super().__init__(message, url=url)
        self.deadline, self.elapsed, self.received = deadline, elapsed, received


class ResponseTooLargeError(EngineRequestError, ValueError):
    """A response body (declared or streamed) is larger than the client's `max_response_bytes`."""

    def __init__(self, message: str, *, url: str, limit: int, size: int) -> None:
        super().__init__(message, url=url)
        self.limit, self.size = limit, size


class ResponseFieldError(PayloadError):
    """A field of an engine's response has the wrong type or an impossible value (token ids, log-probs)."""


class EngineModelError(ConfigError):
    """The server serves a different model than the client was configured for."""


class ModelMismatchError(EngineModelError):
    """A response's `"model"` names another model than the one the client asked for."""


class EngineDeadError(EngineRequestError):
    """The inference server answered that its engine died (vLLM: HTTP 500 "EngineCore encountered an issue")."""


class UnservableModelError(ConfigError):
    """vLLM cannot serve this model as configured (a shape its CPU kernels refuse, a family it lacks)."""


class UnsupportedByEngineError(ConfigError):
    """The engine or mode cannot do what was asked (a remote client whose server cannot force routes, R3 through a
    path that returns no routes); the message names an engine or setting that can."""


class DraftRoutesError(ConfigError):
    """An engine set-up would mix a speculative-decoding draft model's (MTP) routes into the target's: routes on
    with speculative decoding under a vLLM that captures the draft's router choices too (before 0.26)."""


class ForcedRoutesError(ConfigError):
    """Routes a request asks the engine to force do not fit it: a bad blob (checksum, format, limits), another
    expert count, top-k or set of MoE layers than the served model, rows beyond the prompt, token ids that are not
    the prompt's, or an engine that cannot force (not eager, data parallel). The request fails; the engine serves on."""


class ForcingNotAppliedError(RouteReplayError):
    """An engine was asked to force routes and its own capture reports other experts on forced rows: the server
    lacks the routereplay vLLM plugin, or a layer's router is one the plugin cannot force. The message names rows."""


class ForcingSetupError(ConfigError):
    """A vLLM engine is set up so that route forcing cannot serve it (a monolithic MoE kernel that routes inside
    the kernel, speculative decoding, data parallel > 1, micro-batching): refused at start-up, before it serves;
    the message names the layer or setting and the fix."""


class VLLMVersionError(ConfigError):
    """The vLLM found is a version the routereplay plugin has no route-forcing path for (it serves 0.30 and
    0.31-0.33); the message names the version found and those served."""


class WeightsCaptureError(RouteReplayError):
    """An engine's captured combine weights do not belong to its routes: the ids captured beside them differ from
    the engine's own routed experts on some row, or a routed row has no weights. The message names the rows."""


class EngineStartError(RouteReplayError):
    """A local inference server did not start (it exited, or was not ready in time); the message has its log."""


class WeightSyncError(RouteReplayError):
    """Loading the trainer's weights into a running engine left parameters unloaded or stale KV in its cache."""


# --- the built-in engine in a child process (engines/hf/process.py) -------------------------------


class EngineProcessError(RouteReplayError, RuntimeError):
    """The built-in engine's child process failed: it did not start in time, or stopped answering."""


class EngineProcessDiedError(EngineProcessError):
    """The engine's child process exited (killed, out of memory, crashed); `exitcode` is its exit code
    (negative: the signal that ended it). Its state is lost: build a new engine."""

    def __init__(self, message: str, *, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.exitcode = exitcode


class EngineProcessRaisedError(EngineProcessError):
    """The engine's child process raised an exception that could not be sent back as itself (it does not
    pickle); `type_name` names its type and the message carries the child's traceback."""

    def __init__(self, message: str, *, type_name: str = "", traceback_text: str = "") -> None:
        super().__init__(message)
        self.type_name, self.traceback_text = type_name, traceback_text


# --- optional dependencies -------------------------------------------------------------------------


class MissingDependencyError(RouteReplayError, ImportError):
    """An optional package a command needs is not installed; the message names the extra to install."""


def location(
    sequence: str | int | None = None,
    *,
    row: int | None = None,
    layer: int | None = None,
    start: int = 0,
) -> str:
    """Format the "where" of an error message: sequence, token (and row when offset), layer.

    `row` is the trace row; the token position is `start + row`. `layer` is a global layer number.
    """
    parts: list[str] = []
    if sequence is not None:
        parts.append(f"sequence {sequence!r}" if isinstance(sequence, str) else f"sequence {sequence}")
    if row is not None:
        parts.append(f"token {start + row} (row {row})" if start else f"token {row}")
    if layer is not None:
        parts.append(f"layer {layer}")
    return ", ".join(parts) if parts else "trace"


# --- verl batches (routereplay.integrations.verl) ------------------------------------------------


class BatchFieldError(ConfigError):
    """A field of a trainer's batch (verl's `DataProto` / `TensorDict`) is missing, of the wrong type, shape or
    dtype, or holds impossible values (a NaN or non-0/1 mask, a gap in the padding, a blob that is not bytes)."""


class BatchGeometryError(TraceShapeError):
    """A sample's routes disagree with the other samples of its batch or with the model (layers, experts, top-k),
    or declare a shape beyond the readers' limits: refused before anything is allocated from them."""


class UncheckedRoutesError(AlignmentError):
    """Dense routes (verl's `routed_experts`) carry nothing that ties them to the batch's tokens (no digest): a
    shifted, cut or reordered tensor would replay silently, so they are refused unless the caller opts out."""


class DenseLayerRouteError(RouteValueError):
    """A dense (router-less) layer's column of an all-layer payload holds expert ids: the payload's layer axis is
    not the model's, or another layer's routes sit there."""


# --- vLLM on CPU: its processes and kernels (engines/vllm/server.py, engines/vllm/cpu_kernels.py) --------


class ServerDiedError(RouteReplayError, RuntimeError):
    """A vLLM server that was ready stopped serving: its leader exited or one of its processes (engine core,
    worker) died. The message names the process, its exit code or signal, and the end of the server's log;
    `exitcode` is the leader's (None while it still runs; negative: the signal that ended it)."""

    def __init__(self, message: str, *, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.exitcode = exitcode


class AmxPermissionError(RouteReplayError, RuntimeError):
    """The CPU has AMX, so vLLM's CPU backend picks its AMX kernels, but Linux refused this process the AMX tile
    permission (arch_prctl ARCH_REQ_XCOMP_PERM): the first tile instruction would kill it with SIGILL."""


class CheckpointError(ConfigError):
    """A model checkpoint folder cannot be loaded: truncated or corrupt weights (an interrupted copy or save), or a
    config transformers does not know. The message names the folder and, for the demo model's cache, the folder to
    delete so that the model is trained again."""


class LogProbValueError(RouteReplayError, ValueError):
    """A log-prob that no distribution gives: NaN, infinite, or above 0 (a probability above 1), at a position the
    mask counts. The message names the argument, the position and the value."""
