"""The route path's cost per RL step at cluster scale, predicted from the per-core rates `bench delivery` measures.

`bench delivery` times one process taking vLLM HTTP bodies to every rank's replay-ready tensor, stage by
stage (`ResponsePipeline`), and a real 4-rank gloo job delivering per-rank bundles (`DeliveryJob`). This
module turns those measured per-core rates into what one RL step costs, and where:

- rollout workers (one per GPU, colocated): `decode` (body -> validated trace) and `store` (encode into
  the `RouteStore`) of the responses that worker sampled: rows / GPUs each;
- the driver: `bundles` (cut every rank's spans out of the encoded samples, no decode) for all rows;
- each trainer rank: receive its bundle and `ranks` (decode it to the replay-ready tensor): rows / ranks,
  every GPU a data- or sequence-parallel rank of its own tokens (TP ranks of one group share a bundle).

Per-stage rates are (token, layer) rows per second on one core; a rate measured on routes of another
expert count is scaled by bits per row for the stages whose work is bit-bound (store, bundles, ranks).
Runs: Qwen3-30B-A3B (48 MoE layers, top-8 of 128) and DeepSeek-V3 (58 MoE layers, top-8 of 256) on 64,
512 and 4096 GPUs, with `SAMPLES_PER_GPU` samples of `TOKENS_PER_SAMPLE` tokens per GPU per step (the
seeds' 512 x 8k on 64 GPUs). The model is checked against the gloo job it was measured beside: its
predicted per-rank decode time and bytes against the job's own (`check`).
Legend: R = (token, layer) rows of a step, G = GPUs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

SAMPLES_PER_GPU = 8
TOKENS_PER_SAMPLE = 8192
GPU_COUNTS = (64, 512, 4096)
BIT_BOUND_STAGES = ("store", "bundles", "ranks")


@dataclass(frozen=True, slots=True)
class Shape:
    """A model's routing shape."""

    name: str
    layers: int
    top_k: int
    experts: int

    @property
    def bits_per_row(self) -> int:
        """Bits of one (token, layer) row in the set codec: ceil(log2 C(E, K))."""
        return (math.comb(self.experts, self.top_k) - 1).bit_length()


SHAPES = (Shape("Qwen3-30B-A3B", 48, 8, 128), Shape("DeepSeek-V3", 58, 8, 256))


@dataclass(frozen=True, slots=True)
class Rates:
    """Measured one-core rates, (token, layer) rows per second, of the stages and the shape they were measured on."""

    decode: float
    store: float
    bundles: float
    ranks: float
    bits_per_row: int

    @classmethod
    def from_delivery(cls, record: dict[str, Any]) -> Rates:
        """From a `bench delivery` record: the pipeline's median stage seconds over its rows."""
        pipeline, config = record["pipeline"], record["config"]
        rows = pipeline["rows"]
        median = {stage: pipeline["seconds"][stage]["median"] for stage in ("decode", "store", "bundles", "ranks")}
        bits = Shape("measured", config["layers"], config["top_k"], config["experts"]).bits_per_row
        speed = {stage: rows / seconds for stage, seconds in median.items()}
        return cls(speed["decode"], speed["store"], speed["bundles"], speed["ranks"], bits)

    def for_shape(self, shape: Shape) -> dict[str, float]:
        """Rates for `shape`: the bit-bound stages slow down in proportion to its bits per row."""
        factor = self.bits_per_row / shape.bits_per_row
        return {
            "decode": self.decode,
            "store": self.store * factor,
            "bundles": self.bundles * factor,
            "ranks": self.ranks * factor,
        }


def step_cost(rates: Rates, shape: Shape, gpus: int) -> dict[str, Any]:
    """One RL step's route path for `shape` on `gpus` GPUs: core-seconds where each stage runs, bytes per rank."""
    rows = gpus * SAMPLES_PER_GPU * TOKENS_PER_SAMPLE * shape.layers
    rate = rates.for_shape(shape)
    worker_s = rows / gpus * (1 / rate["decode"] + 1 / rate["store"])
    driver_s = rows / rate["bundles"]
    rank_s = rows / gpus / rate["ranks"]
    return {
        "model": shape.name,
        "gpus": gpus,
        "rows": rows,
        "rollout_worker_seconds": worker_s,
        "driver_seconds": driver_s,
        "trainer_rank_seconds": rank_s,
        "core_seconds": worker_s * gpus + driver_s + rank_s * gpus,
        "bytes_per_rank": rows / gpus * shape.bits_per_row / 8,
        "dense_int16_bytes_per_rank": rows / gpus * shape.top_k * 2,
    }


def predict(record: dict[str, Any]) -> dict[str, Any]:
    """The scale table from a `bench delivery` record, and the check against its own gloo job."""
    rates = Rates.from_delivery(record)
    return {
        "assumptions": {"samples_per_gpu": SAMPLES_PER_GPU, "tokens_per_sample": TOKENS_PER_SAMPLE},
        "rates_rows_per_s": asdict(rates),
        "runs": [step_cost(rates, shape, gpus) for shape in SHAPES for gpus in GPU_COUNTS],
        "check": check(rates, record),
    }


def check(rates: Rates, record: dict[str, Any]) -> dict[str, Any]:
    """The model against the measured gloo job: each rank's decode time (to_rows minus the collective, slowest
    rank, median) and bytes received, predicted from the pipeline's rates and the codec's bits per row."""
    dp = record["dp"]
    rows = max(dp["rows_per_rank"]) * record["config"]["layers"]  # the job counts token rows of (L, K)
    seconds = dp["seconds"]
    measured_s = seconds["compact_to_rows"]["median"] - seconds["compact_collective"]["median"]
    # the job's ranks share this machine's cores: each decodes on 1 / (ranks / cores) of a core at most
    sharing = max(1.0, dp["ranks"] / max(1, int(record["machine"].get("cpu_count") or 1)))
    predicted_s = rows / rates.ranks * sharing
    measured_bytes = max(dp["bytes_per_rank"]["compact"])
    predicted_bytes = rows * rates.bits_per_row / 8
    return {
        "ranks": dp["ranks"],
        "rows_per_rank": rows,
        "core_sharing": sharing,
        "decode_seconds": {
            "predicted": predicted_s,
            "measured": measured_s,
            "measured_over_predicted": measured_s / predicted_s,
        },
        "bytes_per_rank": {
            "predicted": predicted_bytes,
            "measured": measured_bytes,
            "measured_over_predicted": measured_bytes / predicted_bytes,
        },
    }


def markdown(model: dict[str, Any]) -> str:
    a, r = model["assumptions"], model["rates_rows_per_s"]
    lines = [
        f"Route path per RL step, predicted from this run's one-core rates (decode {r['decode'] / 1e6:.1f}M, store "
        f"{r['store'] / 1e6:.1f}M, bundles {r['bundles'] / 1e6:.0f}M, rank decode {r['ranks'] / 1e6:.1f}M rows/s at "
        f"{r['bits_per_row']} bits per row); {a['samples_per_gpu']} samples x {a['tokens_per_sample']} tokens per GPU "
        "per step; rollout workers and trainer ranks one per GPU, the driver one process.",
        "",
        "| model | GPUs | rows per step | each rollout worker, s | driver, s | each trainer rank, s | core-seconds "
        "| bytes per rank (compact) | bytes per rank (int16) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in model["runs"]:
        lines.append(
            f"| {run['model']} | {run['gpus']:,} | {run['rows'] / 1e6:,.0f}M | {run['rollout_worker_seconds']:.2f} | "
            f"{run['driver_seconds']:.2f} | {run['trainer_rank_seconds']:.3f} | {run['core_seconds']:,.0f} | "
            f"{run['bytes_per_rank'] / 2**20:.0f} MiB | {run['dense_int16_bytes_per_rank'] / 2**20:.0f} MiB |"
        )
    c = model["check"]
    lines.append(
        f"\nChecked against the {c['ranks']}-rank gloo job of the same run ({c['rows_per_rank']:,} rows per rank, "
        f"{c['core_sharing']:g} ranks per core): rank decode "
        f"predicted {c['decode_seconds']['predicted']:.3f} s, measured {c['decode_seconds']['measured']:.3f} s "
        f"({c['decode_seconds']['measured_over_predicted']:.2f} x); bytes per rank predicted "
        f"{c['bytes_per_rank']['predicted'] / 2**20:.1f} MiB, measured "
        f"{c['bytes_per_rank']['measured'] / 2**20:.1f} MiB "
        f"({c['bytes_per_rank']['measured_over_predicted']:.3f} x)."
    )
    return "\n".join(lines)


__all__ = ["GPU_COUNTS", "SHAPES", "Rates", "Shape", "check", "markdown", "predict", "step_cost"]
