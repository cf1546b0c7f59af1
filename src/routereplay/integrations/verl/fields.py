"""The fields of a verl batch as the route readers use them: each checked before use, each sample against the rest.

verl hands the readers a `DataProto` (`batch` tensors, `non_tensor_batch` numpy columns) or a `TensorDict`
(after `left_right_2_no_padding`: `input_ids` a jagged NestedTensor). Every field the readers touch is
checked here first, so a malformed batch raises `BatchFieldError` naming the field, the sample and the fix
instead of a bare `KeyError` / `IndexError` / `TypeError` from deep inside torch:

- `input_ids`: a torch integer tensor, (B, S) padded or jagged (B, j);
- `attention_mask`: a torch tensor of 0/1 (bool, int or a finite float) of `input_ids`' shape, verl's layout:
  the prompt left padded (zeros then ones over `[0, P)`), the response right padded (ones then zeros after);
- `prompts`: a torch tensor (B, P) with 0 < P < S;
- `routed_experts`: a strided or jagged 4-d tensor of int8 / uint8 / int16 / int32 / int64 holding data (uint8
  widened to int16); `response_mask`: (B, S - P) of 0/1;
- the compact column: one bytes-like codec blob per sample.

Each sample's routes are checked against the model (`RouteGeometry`: experts, top-k, MoE layers) when the
caller passes it, and against the other samples of the batch always, from the blobs' headers before anything
is decoded or allocated; without a geometry, `BatchLimits` bounds what one header can make the readers allocate.

Legend: B samples, S padded positions, P prompt width, L layers, K top-k, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from routereplay.codec.blob import header_info
from routereplay.errors import BatchFieldError, BatchGeometryError, ConfigError

if TYPE_CHECKING:
    import torch

    from routereplay.integrations.verl.rollout import RouteGeometry


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchLimits:
    """What one sample's declared shape may make the readers allocate when no `RouteGeometry` is given.

    `max_route_columns` bounds L x K, the int16 entries per position (a 94-layer top-8 model has 752; the
    default 4096 leaves room): a 62-byte blob declaring K = 32767 would otherwise size (S, L, 32767).
    `max_positions` bounds one sample's padded width, prompt_length + response_length (default 2**20, 8x a
    128k context): `padded_routes(..., prompt_length=10**12)` would otherwise size a (10**12, L, K) tensor."""

    max_route_columns: int = 4096
    max_positions: int = 1 << 20

    def __post_init__(self) -> None:
        for name in ("max_route_columns", "max_positions"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"BatchLimits.{name}={value!r} must be a positive int")


DEFAULT_LIMITS = BatchLimits()


def tensors_of(batch: Any, reader: str) -> tuple[Any, Any]:
    """(tensor fields, non-tensor fields) of a `DataProto`; a `TensorDict` (or mapping) holds both."""
    non_tensor = getattr(batch, "non_tensor_batch", None)
    if non_tensor is not None:
        tensors = getattr(batch, "batch", None)
        if tensors is None or not hasattr(tensors, "get"):
            raise BatchFieldError(f"{reader}: the DataProto has no tensor batch (batch is {type(tensors).__name__})")
        return tensors, non_tensor
    if batch is None or not hasattr(batch, "get"):
        raise BatchFieldError(f"{reader} takes verl's DataProto or TensorDict, got {type(batch).__name__}")
    return batch, batch


def field(tensors: Any, key: str, reader: str, why: str) -> Any:
    """`tensors[key]`, or `BatchFieldError` naming the key and why the reader needs it."""
    try:
        value = tensors.get(key, None)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise BatchFieldError(f"{reader}: the batch's '{key}' field cannot be read ({error})") from None
    if value is None:
        raise BatchFieldError(
            f"{reader}: the batch has no '{key}' field ({why}); pass the batch verl's agent loop built, with its "
            "tensor fields intact"
        )
    return value


def checked_storage(tensor: torch.Tensor, name: str, reader: str) -> None:
    """A tensor the readers can index and compare: strided (or verl's jagged NestedTensor) and holding data, not on
    the meta device (no values) nor sparse (torch indexes neither like a dense tensor)."""
    import torch

    if tensor.device.type == "meta":
        raise BatchFieldError(
            f"{reader}: {name} is on the meta device (a shape without values); pass the batch's real tensor"
        )
    if not tensor.is_nested and tensor.layout != torch.strided:
        raise BatchFieldError(
            f"{reader}: {name} has layout {tensor.layout} (sparse); verl's is dense: pass {name}.to_dense()"
        )


def checked_input_ids(input_ids: Any, reader: str) -> torch.Tensor:
    """A torch integer tensor, (B, S) padded or a jagged NestedTensor (B, j)."""
    import torch

    if not isinstance(input_ids, torch.Tensor):
        raise BatchFieldError(
            f"{reader}: input_ids is a {type(input_ids).__name__}, not a torch tensor; pass verl's batch tensors "
            "(torch.from_numpy(...) for an array)"
        )
    checked_storage(input_ids, "input_ids", reader)
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise BatchFieldError(f"{reader}: input_ids has dtype {input_ids.dtype}; token ids are integers")
    if not input_ids.is_nested and input_ids.dim() != 2:
        raise BatchFieldError(
            f"{reader}: input_ids has shape {tuple(input_ids.shape)}; verl's is (batch, prompt_length + "
            "response_length), or jagged after left_right_2_no_padding"
        )
    return input_ids


def checked_mask(mask: Any, input_ids_BS: torch.Tensor | None, batch_size: int, reader: str) -> torch.Tensor:
    """verl's attention mask as int64 (B, S) of 0/1, of `input_ids`' shape when given."""
    import torch

    if not isinstance(mask, torch.Tensor) or mask.is_nested:
        raise BatchFieldError(
            f"{reader}: attention_mask is a {type(mask).__name__}{' (nested)' if getattr(mask, 'is_nested', 0) else ''}"
            ", not a padded torch tensor; pass the batch's (batch, prompt_length + response_length) mask"
        )
    checked_storage(mask, "attention_mask", reader)
    want = tuple(input_ids_BS.shape) if input_ids_BS is not None else None
    if mask.dim() != 2 or mask.shape[0] != batch_size or (want is not None and tuple(mask.shape) != want):
        raise BatchFieldError(
            f"{reader}: attention_mask has shape {tuple(mask.shape)} for {batch_size} samples"
            + (f" and input_ids of shape {want}" if want is not None else "")
            + "; pass one (batch, prompt_length + response_length) mask row per sample, as wide as input_ids"
        )
    if mask.dtype.is_floating_point and not bool(torch.isfinite(mask).all()):
        b = int(torch.nonzero(~torch.isfinite(mask))[0, 0])
        raise BatchFieldError(f"{reader}: sample {b}: attention_mask holds NaN or inf; a mask is 0/1 per position")
    if bool(((mask != 0) & (mask != 1)).any()):
        b, s = (int(i) for i in torch.nonzero((mask != 0) & (mask != 1))[0])
        raise BatchFieldError(
            f"{reader}: sample {b}, position {s}: attention_mask holds {mask[b, s].item()!r}; a mask is 0/1"
        )
    return mask.to(torch.int64)


def checked_route_tensor(routes: Any, reader: str) -> torch.Tensor:
    """verl's `routed_experts`: a 4-d (batch, positions, layers, top_k) tensor of int8 / int16 / int32 / int64, or
    uint8 (vLLM >= 0.26's own dtype), widened here to int16 so -1 fits. torch implements neither comparisons nor
    fills for uint16 / uint32 / uint64, so those are refused by name, like floats, bools, sparse and meta tensors."""
    import torch

    allowed = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
    if not isinstance(routes, torch.Tensor) or routes.dtype not in allowed:
        raise BatchFieldError(
            f"{reader}: routed_experts is a {type(routes).__name__} of dtype {getattr(routes, 'dtype', None)}; verl's "
            "is an integer torch tensor (batch, positions, layers, top_k) of int16 (or int8 / int32 / int64 / uint8): "
            "convert it with .to(torch.int16)"
        )
    checked_storage(routes, "routed_experts", reader)
    if routes.dim() != 4:
        raise BatchFieldError(
            f"{reader}: routed_experts has {routes.dim()} dims; verl's is (batch, positions, layers, top_k)"
        )
    return routes.to(torch.int16) if routes.dtype == torch.uint8 else routes


def checked_response_mask(response_mask: Any, batch_size: int, response_width: int, reader: str) -> torch.Tensor:
    """verl's `response_mask` (B, R) as a bool tensor: 1 on tokens the engine generated, 0 on tool tokens and padding.
    Anything else (NaN, 0.5, -1, 2) would move each sample's last generated token, so it is refused by name."""
    import torch

    if not isinstance(response_mask, torch.Tensor) or response_mask.is_nested:
        raise BatchFieldError(
            f"{reader}: response_mask is a {type(response_mask).__name__}"
            f"{' (nested)' if getattr(response_mask, 'is_nested', False) else ''}; verl's is a padded (batch, "
            f"response_length = {response_width}) tensor with 1 on generated tokens"
        )
    checked_storage(response_mask, "response_mask", reader)
    if tuple(response_mask.shape) != (batch_size, response_width):
        raise BatchFieldError(
            f"{reader}: response_mask has shape {tuple(response_mask.shape)}; verl's is (batch = {batch_size}, "
            f"response_length = {response_width}) with 1 on generated tokens"
        )
    if response_mask.dtype.is_complex:
        raise BatchFieldError(f"{reader}: response_mask has dtype {response_mask.dtype}; a mask is 0/1 per token")
    if response_mask.dtype == torch.bool:
        return response_mask
    wrong = (response_mask != 0) & (response_mask != 1)  # NaN compares unequal to both
    if bool(wrong.any()):
        b, r = (int(i) for i in torch.nonzero(wrong)[0])
        raise BatchFieldError(
            f"{reader}: sample {b}, response position {r}: response_mask holds {response_mask[b, r].item()!r}; it is "
            "1 on tokens the engine generated and 0 elsewhere (verl's agent loop writes exactly that): any other "
            "value would move the sample's last generated token, and with it which zero rows are no route"
        )
    return response_mask != 0


def checked_prompt_width(prompts: Any, width: int, batch_size: int, reader: str) -> int:
    """P, the width of verl's `prompts` (B, P), in (0, S)."""
    import torch

    if not isinstance(prompts, torch.Tensor) or prompts.is_nested or prompts.dim() != 2:
        shape = tuple(prompts.shape) if isinstance(prompts, torch.Tensor) and not prompts.is_nested else "?"
        raise BatchFieldError(
            f"{reader}: prompts is a {type(prompts).__name__} of shape {shape}; verl's is a (batch, prompt_length) "
            "tensor, its width the rollout's prompt_length"
        )
    if prompts.shape[0] != batch_size or not 0 < prompts.shape[1] < width:
        raise BatchFieldError(
            f"{reader}: prompts has shape {tuple(prompts.shape)} for {batch_size} samples of width {width}; its "
            f"width (the rollout's prompt_length) must lie in (0, {width})"
        )
    return int(prompts.shape[1])


def checked_prompt_length(prompt_length: Any, width: int, reader: str) -> int:
    if not isinstance(prompt_length, (int, np.integer)) or isinstance(prompt_length, bool):
        raise ConfigError(f"{reader}: prompt_length={prompt_length!r} must be an int (the width of batch['prompts'])")
    if not 0 < prompt_length < width:
        raise ConfigError(
            f"{reader}: prompt_length={prompt_length} must be in (0, {width}): the width of batch['prompts']"
        )
    return int(prompt_length)


def sample_lengths(mask_BS: torch.Tensor, prompt_width: int, reader: str) -> tuple[list[int], list[int]]:
    """Each sample's (prompt, response) token counts from verl's mask, its layout checked: the prompt left
    padded, the response right padded (a gap would put routes on other positions)."""
    prompt_BP, response_BR = mask_BS[:, :prompt_width], mask_BS[:, prompt_width:]
    bad_B = (prompt_BP[:, 1:] < prompt_BP[:, :-1]).any(1) | (response_BR[:, 1:] > response_BR[:, :-1]).any(1)
    if bool(bad_B.any()):
        b = int(bad_B.nonzero()[0, 0])
        raise BatchFieldError(
            f"{reader}: sample {b}: attention_mask {mask_BS[b].tolist()} is not verl's layout (the prompt left padded "
            f"over [0, {prompt_width}), the response right padded after it); pass the agent loop's own mask"
        )
    return prompt_BP.sum(1).tolist(), response_BR.sum(1).tolist()


def checked_geometry(geometry: Any, reader: str) -> RouteGeometry | None:
    """`geometry=` as given: None or a `RouteGeometry`."""
    from routereplay.integrations.verl.rollout import RouteGeometry

    if geometry is not None and not isinstance(geometry, RouteGeometry):
        raise ConfigError(
            f"{reader}: geometry={geometry!r} is a {type(geometry).__name__}, not a RouteGeometry; pass "
            "RouteGeometry.from_hf_config(model.config) or None"
        )
    return geometry


def checked_limits(limits: Any, reader: str) -> BatchLimits:
    """`limits=` as given (None: the defaults), a `BatchLimits`."""
    if limits is None:
        return DEFAULT_LIMITS
    if not isinstance(limits, BatchLimits):
        raise ConfigError(
            f"{reader}: limits={limits!r} is a {type(limits).__name__}, not a BatchLimits; pass "
            "BatchLimits(max_route_columns=..., max_positions=...) or None"
        )
    return limits


def checked_flag(value: Any, name: str, reader: str) -> bool:
    """A keyword that switches a check off must be a real bool: `unchecked="no"` is not a yes."""
    if not isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{reader}: {name}={value!r} must be True or False (a {type(value).__name__} is neither)")
    return bool(value)


def checked_num_hidden_layers(num_hidden_layers: Any, geometry: RouteGeometry | None) -> int | None:
    geometry = checked_geometry(geometry, "num_hidden_layers")
    if num_hidden_layers is None:
        return None
    if not isinstance(num_hidden_layers, (int, np.integer)) or isinstance(num_hidden_layers, bool):
        raise ConfigError(
            f"num_hidden_layers={num_hidden_layers!r} must be an int (the model config's num_hidden_layers) or None"
        )
    if num_hidden_layers < 1 or (geometry is not None and num_hidden_layers != geometry.num_layers):
        raise ConfigError(
            f"num_hidden_layers={num_hidden_layers} must be >= 1"
            + (f" and the geometry's num_layers={geometry.num_layers}" if geometry is not None else "")
        )
    return int(num_hidden_layers)


def compact_blobs(column: Any, batch_size: int, key: str) -> list[bytes | bytearray | memoryview]:
    """The compact column's blobs: an object ndarray, list or tuple, or a `NonTensorStack`, one per sample."""
    if type(column).__module__.startswith("tensordict") and hasattr(column, "tolist"):
        column = column.tolist()  # tensordict's NonTensorStack (DataProto.to_tensordict)
    if not (isinstance(column, (list, tuple)) or (isinstance(column, np.ndarray) and column.ndim == 1)):
        raise BatchFieldError(
            f"the '{key}' column is a {type(column).__name__}"
            + (f" of shape {column.shape}" if hasattr(column, "shape") else "")
            + "; it holds one codec blob per sample (compact_routes builds it)"
        )
    if len(column) != batch_size:
        raise BatchFieldError(
            f"the '{key}' column holds {len(column)} blobs for a batch of {batch_size} samples; keep the column in "
            "the batch it was built for (one blob per sample, in batch order)"
        )
    for b, blob in enumerate(column):
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise BatchFieldError(
                f"the '{key}' column: sample {b} holds a {type(blob).__name__}, not a codec blob (bytes); build the "
                "column with compact_routes / compact_blob"
            )
    return list(column)


def sample_shape(routes: Any) -> tuple[tuple[int, ...], int, int, tuple[str, ...] | None]:
    """(layers, experts, top-k, slots) of a `RouteTrace` or a codec header."""
    return tuple(routes.layers), int(routes.num_experts), int(routes.top_k), routes.slots


def check_samples(
    samples: list[Any],
    *,
    geometry: RouteGeometry | None,
    limits: BatchLimits | None,
    num_hidden_layers: int | None,
    names: list[Any] | None = None,
) -> None:
    """Every sample's routes (traces or headers) against the model, the limits and sample 0: `BatchGeometryError`."""
    geometry = checked_geometry(geometry, "geometry")
    limits = checked_limits(limits, "limits")
    for b, routes in enumerate(samples):
        name = b if names is None else names[b]
        layers, experts, top_k, slots = sample_shape(routes)
        if geometry is not None and (experts, top_k, layers) != (
            geometry.num_experts,
            geometry.top_k,
            geometry.moe_layers,
        ):
            raise BatchGeometryError(
                f"sample {name!r}: routes of E={experts}, K={top_k}, layers {list(layers)} for a model of "
                f"E={geometry.num_experts}, K={geometry.top_k}, MoE layers {list(geometry.moe_layers)}: they were "
                "captured on another model (or the header is corrupt); rebuild them with this model's RouteGeometry"
            )
        laid_out = num_hidden_layers if num_hidden_layers is not None else len(layers)
        columns = laid_out * top_k
        if geometry is None and columns > limits.max_route_columns:
            asked = f"num_hidden_layers={num_hidden_layers}" if num_hidden_layers is not None else f"{laid_out} layers"
            raise BatchGeometryError(
                f"sample {name!r}: routes of {asked} x top-{top_k} make {columns} int16 entries per "
                f"position, above BatchLimits.max_route_columns={limits.max_route_columns}; pass the model's "
                "geometry= (RouteGeometry.from_hf_config) or raise the limit if the model really is that wide"
            )
        first = sample_shape(samples[0])
        if (layers, experts, top_k, slots) != first:
            raise BatchGeometryError(
                f"sample {name!r}: routes of layers {list(layers)}, E={experts}, K={top_k}"
                f"{f', slots {list(slots)}' if slots else ''} but sample "
                f"{(0 if names is None else names[0])!r} has layers {list(first[0])}, E={first[1]}, K={first[2]}"
                f"{f', slots {list(first[3])}' if first[3] else ''}: one batch's routes share one layer axis; the "
                "samples' routes come from different models or captures"
            )


def checked_headers(
    blobs: list[bytes | bytearray | memoryview],
    *,
    geometry: RouteGeometry | None,
    limits: BatchLimits | None,
    num_hidden_layers: int | None,
) -> None:
    """Each blob's header (envelope and CRC checked, payload not decoded) against the model, limits and sample 0."""
    headers = [header_info(blob) for blob in blobs]
    check_samples(headers, geometry=geometry, limits=limits, num_hidden_layers=num_hidden_layers)


__all__ = [
    "DEFAULT_LIMITS",
    "BatchLimits",
    "check_samples",
    "checked_flag",
    "checked_geometry",
    "checked_headers",
    "checked_input_ids",
    "checked_limits",
    "checked_mask",
    "checked_num_hidden_layers",
    "checked_prompt_length",
    "checked_prompt_width",
    "checked_response_mask",
    "checked_route_tensor",
    "checked_storage",
    "compact_blobs",
    "field",
    "sample_lengths",
    "tensors_of",
]
