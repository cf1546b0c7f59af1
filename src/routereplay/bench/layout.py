"""Layout benchmark: pack + Ulysses-shard a padded batch of routes, vectorised vs framework glue.

The workload is a verl-style padded int16 batch (B, S, L, K) with right padding (lengths drawn
uniformly in [S/4, S]) that one SP rank needs as its Ulysses shard of the packed THD row. Three
ways are timed, interleaved in every repeat:

- `loop`: the per-sequence glue RL frameworks write — for each sequence, boolean-mask its attended
  rows; concatenate; pad to a multiple of sp with -1; slice the rank's chunk and copy it.
- `plan`: routereplay — run unpad/pack/ulysses_shard on token numbers (`layout.plan`), then one
  gather of just this rank's rows.
- `all_ranks`: routereplay's data path for every rank at once (unpad, pack, each rank's shard), to
  show the figure does not rest on skipping other ranks' work.

Every rank's output of the three is checked equal before timing. Legend: B = sequences,
S = padded length, L = layers, K = top-k, P = rows of one rank's shard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from routereplay.bench.config import RoutedBenchConfig, require_positive, require_routing
from routereplay.bench.environment import collect, measured_on
from routereplay.bench.timing import check_device, interleave, median_ratio, spread, synchronizer, target
from routereplay.layout import pack, ulysses_shard, unpad
from routereplay.layout.plan import gather, token_index

SPEEDUP_TARGET = 10.0


@dataclass(frozen=True, slots=True, kw_only=True)
class LayoutBenchConfig(RoutedBenchConfig):
    repeats: int = 7
    sequences: int = 64
    seq: int = 4096
    sp: int = 4
    rank: int = 1
    device: str = "cpu"

    def __post_init__(self) -> None:
        check_device("layout", self.device)
        require_routing(self, "layout")
        require_positive(self, "layout", "sequences", "seq", "sp")
        if not 0 <= self.rank < self.sp:
            raise ValueError(f"layout bench: rank {self.rank} must be in 0..{self.sp - 1} for sp {self.sp}")


def glue_loop(routes_BSLK: torch.Tensor, mask_BS: torch.Tensor, sp: int, rank: int) -> torch.Tensor:
    """The per-sequence alignment loop framework glue uses (the baseline)."""
    pieces = []
    for b in range(routes_BSLK.shape[0]):
        pieces.append(routes_BSLK[b][mask_BS[b]])
    packed = torch.cat(pieces)
    remainder = -packed.shape[0] % sp
    if remainder:
        packed = torch.cat([packed, packed.new_full((remainder, *packed.shape[1:]), -1)])
    chunk = packed.shape[0] // sp
    return packed[rank * chunk : (rank + 1) * chunk].clone()


def planned(routes_BSLK: torch.Tensor, mask_BS: torch.Tensor, sp: int, rank: int) -> torch.Tensor:
    """routereplay: the layout chain on token numbers, then one gather of this rank's rows."""
    batch, seq = mask_BS.shape
    index_P = ulysses_shard(
        pack(unpad(token_index(batch, seq, device=mask_BS.device), attention_mask=mask_BS)).values, sp, rank
    )
    return gather(routes_BSLK, index_P, source_dims=2)


def all_ranks(routes_BSLK: torch.Tensor, mask_BS: torch.Tensor, sp: int) -> list[torch.Tensor]:
    """routereplay's transforms on the routes themselves, every rank's shard."""
    packed = pack(unpad(routes_BSLK, attention_mask=mask_BS))
    return [ulysses_shard(packed.values, sp, r) for r in range(sp)]


def make_batch(config: LayoutBenchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(config.seed)
    lengths_B = torch.randint(max(1, config.seq // 4), config.seq + 1, (config.sequences,), generator=generator)
    mask_BS = torch.arange(config.seq)[None] < lengths_B[:, None]
    shape = (config.sequences, config.seq, config.layers, config.top_k)
    routes_BSLK = torch.randint(0, config.experts, shape, generator=generator, dtype=torch.int16)
    routes_BSLK[~mask_BS] = -1
    return routes_BSLK.to(config.device), mask_BS.to(config.device)


def run(config: LayoutBenchConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    report = progress or (lambda _name: None)
    report("building the batch")
    routes_BSLK, mask_BS = make_batch(config)
    report("checking that all three agree")
    every = all_ranks(routes_BSLK, mask_BS, config.sp)
    for r in range(config.sp):
        expected = glue_loop(routes_BSLK, mask_BS, config.sp, r)
        if not (torch.equal(planned(routes_BSLK, mask_BS, config.sp, r), expected) and torch.equal(every[r], expected)):
            raise AssertionError(f"layout bench: rank {r}'s shard differs between the loop and routereplay")
    del every
    synchronize = synchronizer(config.device)

    def timed(function: Callable[[], Any]) -> Callable[[], None]:
        return lambda: (function(), synchronize())[1]

    seconds = interleave(
        {
            "loop": timed(lambda: glue_loop(routes_BSLK, mask_BS, config.sp, config.rank)),
            "plan": timed(lambda: planned(routes_BSLK, mask_BS, config.sp, config.rank)),
            "all_ranks": timed(lambda: all_ranks(routes_BSLK, mask_BS, config.sp)),
        },
        config.repeats,
        report,
    )
    ratios = {
        "loop_over_plan": median_ratio(seconds["loop"], seconds["plan"]),
        "loop_over_all_ranks": median_ratio(seconds["loop"], seconds["all_ranks"]),
    }
    tokens = int(mask_BS.sum())
    return {
        "suite": "layout",
        "machine": collect(),
        "config": {k: getattr(config, k) for k in LayoutBenchConfig.__dataclass_fields__},
        "tokens": tokens,
        "route_bytes": tokens * config.layers * config.top_k * routes_BSLK.element_size(),
        "seconds": spread(seconds),
        "ratios": ratios,
        "targets": {"loop_over_plan": target(ratios["loop_over_plan"], SPEEDUP_TARGET, higher_is_better=True)},
    }


def markdown(result: dict[str, Any]) -> str:
    config, machine = result["config"], result["machine"]
    lines = [
        measured_on(machine, "layout", "torch", threads=True, device=config["device"]) + ".",
        "",
        f"Pack + Ulysses SP shard (sp={config['sp']}, rank {config['rank']}) of {config['sequences']} sequences padded "
        f"to {config['seq']} tokens ({result['tokens']} real tokens), "
        f"{config['layers']} layers x top-{config['top_k']} int16 routes "
        f"({result['route_bytes'] / 2**20:.0f} MiB unpadded); {config['repeats']} interleaved repeats.",
        "",
        "| method | seconds (median) | low | high | loop / method |",
        "|---|---:|---:|---:|---:|",
    ]
    ratio = {
        "loop": 1.0,
        "plan": result["ratios"]["loop_over_plan"],
        "all_ranks": result["ratios"]["loop_over_all_ranks"],
    }
    names = {
        "loop": "per-sequence glue loop (one rank)",
        "plan": "routereplay plan + one gather (one rank)",
        "all_ranks": "routereplay transforms (all ranks' shards)",
    }
    for name, s in result["seconds"].items():
        lines.append(f"| {names[name]} | {s['median']:.4f} | {s['low']:.4f} | {s['high']:.4f} | {ratio[name]:.1f}x |")
    return "\n".join(lines)


__all__ = ["LayoutBenchConfig", "all_ranks", "glue_loop", "markdown", "planned", "run"]
