"""Which layers' routes each pipeline stage gets: layer kinds, payload widths and PP/VPP slicing.

Layers are global decoder-layer numbers (0-based) everywhere. `LayerMap` says which are MoE, which
are dense, hash-routed (decided by token ids, identical in every engine, so left natural) or MTP
(multi-token-prediction heads, numbered after the decoder layers and kept natural). A payload is
either all-layer (one slot per decoder layer; dense slots are ignored) or MoE-only (one slot per
MoE layer); its width says which, so a dense-first model (DeepSeek-V3, Moonlight) can never shift
every layer by one. `PipelineLayout` reproduces Megatron-core's layer offsets for pipeline and
virtual-pipeline stages, including uneven first and last stages.

Legend: L = layers in a payload, K = top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from routereplay.enums import StrEnum
from routereplay.errors import ConfigError, DivisibilityError, LayerCountError, StageLayerError
from routereplay.layout.array import Array, as_tensor, check_dim, like, select


class LayerKind(StrEnum):
    DENSE = "dense"
    MOE = "moe"
    HASH = "hash"
    MTP = "mtp"


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerMap:
    """The kind of every layer of a model; `replayed` are the MoE layers routes are fed to."""

    num_layers: int
    moe_layers: tuple[int, ...]
    hash_layers: tuple[int, ...] = ()
    mtp_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_layers", tuple(sorted(self.moe_layers)))
        if self.num_layers < 1:
            raise ConfigError(f"num_layers must be >= 1, got {self.num_layers}")
        outside = [x for x in self.moe_layers if not 0 <= x < self.num_layers]
        if outside:
            raise ConfigError(f"moe_layers {outside} are outside the decoder layers 0..{self.num_layers - 1}")
        if len(set(self.moe_layers)) != len(self.moe_layers):
            raise ConfigError("moe_layers lists a layer twice")
        stray = sorted(set(self.hash_layers) - set(self.moe_layers))
        if stray:
            raise ConfigError(f"hash_layers {stray} must also be listed in moe_layers (they are MoE layers)")
        clash = sorted(x for x in self.mtp_layers if x < self.num_layers)
        if clash:
            raise ConfigError(
                f"mtp_layers {clash} collide with decoder layers 0..{self.num_layers - 1}; number MTP layers "
                f"after the decoder (from {self.num_layers}), as Megatron and DeepSeek-V3 do"
            )

    @classmethod
    def dense_first(cls, num_layers: int, first_dense: int, **kinds: tuple[int, ...]) -> LayerMap:
        """DeepSeek-V3 style: the first `first_dense` layers are dense, the rest MoE."""
        return cls(num_layers=num_layers, moe_layers=tuple(range(first_dense, num_layers)), **kinds)

    @property
    def replayed(self) -> tuple[int, ...]:
        hashed = set(self.hash_layers)
        return tuple(x for x in self.moe_layers if x not in hashed)

    def kind(self, layer: int) -> LayerKind:
        if layer in self.mtp_layers:
            return LayerKind.MTP
        if layer in self.hash_layers:
            return LayerKind.HASH
        if layer in self.moe_layers:
            return LayerKind.MOE
        if 0 <= layer < self.num_layers:
            return LayerKind.DENSE
        raise StageLayerError(f"layer {layer} is not a layer of this model (0..{self.num_layers - 1})")

    def payload_layers(self, width: int) -> tuple[int, ...]:
        """The global layer of each slot of a payload `width` slots wide (all-layer or MoE-only)."""
        if width == self.num_layers:
            return tuple(range(self.num_layers))
        if width == len(self.moe_layers):
            return self.moe_layers
        raise LayerCountError(
            f"a payload with {width} layers is neither all-layer ({self.num_layers}) nor MoE-only "
            f"({len(self.moe_layers)} MoE layers); check the model's moe_layers and whether MTP layers were included"
        )

    def select(self, routes: Array, layers: Sequence[int], *, dim: int = -2) -> Array:
        """Routes of `layers` (in that order) from an all-layer or MoE-only payload; axis `dim` is L."""
        t = as_tensor(routes)
        dim = check_dim(t, dim, "LayerMap.select")
        slot_of = {layer: i for i, layer in enumerate(self.payload_layers(t.shape[dim]))}
        slots = []
        for layer in layers:
            kind = self.kind(layer)
            if kind is not LayerKind.MOE:
                raise StageLayerError(
                    f"layer {layer} is {kind.value}: only MoE layers are replayed "
                    "(dense layers have no router; hash and MTP routers stay natural)"
                )
            slots.append(slot_of[layer])
        return like(select(t, torch.tensor(slots, dtype=torch.int64), dim=dim), routes)

    def stage_layers(self, pipeline: PipelineLayout, pp_rank: int, vpp_rank: int = 0) -> tuple[int, ...]:
        """The replayed MoE layers that model chunk (pp_rank, vpp_rank) runs."""
        if pipeline.num_layers != self.num_layers:
            raise ConfigError(f"pipeline has {pipeline.num_layers} layers but the layer map has {self.num_layers}")
        owned = set(pipeline.layers_of(pp_rank, vpp_rank))
        return tuple(x for x in self.replayed if x in owned)

    def stage_routes(self, routes: Array, pipeline: PipelineLayout, pp_rank: int, vpp_rank: int = 0) -> Array:
        """The routes model chunk (pp_rank, vpp_rank) needs, its MoE layers in order."""
        return self.select(routes, self.stage_layers(pipeline, pp_rank, vpp_rank))


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineLayout:
    """Megatron-core's assignment of decoder layers to pipeline ranks and virtual chunks."""

    num_layers: int
    pp_size: int = 1
    vpp_size: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    _starts: dict[tuple[int, int], range] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.pp_size < 1 or self.vpp_size < 1:
            raise ConfigError(f"pp_size and vpp_size must be >= 1, got {self.pp_size} and {self.vpp_size}")
        object.__setattr__(self, "_starts", self._assign())

    def _assign(self) -> dict[tuple[int, int], range]:
        pp, vpp = self.pp_size, self.vpp_size
        first = self.first_stage_layers if pp > 1 else None
        last = self.last_stage_layers if pp > 1 else None
        stage_layers = [0] * pp
        middle = [r for r in range(pp) if not (r == 0 and first is not None) and not (r == pp - 1 and last is not None)]
        rest = self.num_layers - (first or 0) - (last or 0)
        if rest < 0 or (rest and not middle) or (middle and rest % len(middle)):
            raise DivisibilityError(
                f"{self.num_layers} layers do not split over {pp} pipeline stages "
                f"(first stage {first}, last stage {last}): the middle stages need an equal share"
            )
        for r in range(pp):
            stage_layers[r] = (
                first
                if (r == 0 and first is not None)
                else last
                if (r == pp - 1 and last is not None)
                else rest // len(middle)
            )
        if any(n % vpp for n in stage_layers):
            raise DivisibilityError(f"stage layer counts {stage_layers} do not divide by {vpp} virtual pipeline chunks")
        chunk = [n // vpp for n in stage_layers]
        ranges: dict[tuple[int, int], range] = {}
        offset = 0
        for v in range(vpp):  # Megatron orders chunks (v=0: ranks 0..pp-1), then (v=1: ...), ...
            for r in range(pp):
                ranges[(r, v)] = range(offset, offset + chunk[r])
                offset += chunk[r]
        return ranges

    def layers_of(self, pp_rank: int, vpp_rank: int = 0) -> range:
        """Global decoder layers of model chunk `vpp_rank` on pipeline rank `pp_rank`."""
        try:
            return self._starts[(pp_rank, vpp_rank)]
        except KeyError:
            raise ConfigError(
                f"no model chunk (pp_rank {pp_rank}, vpp_rank {vpp_rank}) with pp_size {self.pp_size}, "
                f"vpp_size {self.vpp_size}"
            ) from None

    def stage_of(self, layer: int) -> tuple[int, int]:
        """(pp_rank, vpp_rank) that runs global decoder layer `layer`."""
        for key, layers in self._starts.items():
            if layer in layers:
                return key
        raise StageLayerError(f"layer {layer} is not a decoder layer (0..{self.num_layers - 1})")

    def check_owned(self, layers: Sequence[int], pp_rank: int, vpp_rank: int = 0) -> None:
        """Raise StageLayerError naming any of `layers` this chunk does not run, and who does."""
        owned = self.layers_of(pp_rank, vpp_rank)
        for layer in layers:
            if layer not in owned:
                raise StageLayerError(
                    f"layer {layer} is run by pipeline stage {self.stage_of(layer)} (pp_rank, vpp_rank), not by "
                    f"({pp_rank}, {vpp_rank}) which owns layers {owned.start}..{owned.stop - 1}; slice the routes with "
                    "LayerMap.stage_routes for this stage"
                )
