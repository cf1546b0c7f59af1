"""BENCHMARKS.md and the README benchmark table, written from the records of `routereplay bench all`.

Each suite's `markdown(result)` gives its tables; this module adds the command that produced them,
the targets measured in the same run, and a note on how to read them, and renders one summary
table of every target for the README (between `<!-- bench:begin -->` and `<!-- bench:end -->`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from routereplay.atomicfile import atomic_write
from routereplay.errors import ConfigError

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"

TITLES = {
    "codec": "Codec: bytes per route and decode speed against peer wire formats",
    "layout": "Layouts: pack + sequence-parallel shard against a per-sequence glue loop",
    "store": "Memory: the compact store against int16 ragged and dense padded batch tensors",
    "delivery": "Delivery: random-access decode, per-rank bundles over gloo, vLLM responses to rank tensors",
    "indexer": "DSA indexer choices: the compact IndexerTrace against dense int32",
    "replay": "Replay overhead of a training step (CPU)",
    "engine": "Engine capture overhead",
    "load": "The demo's CPU paths on a busy machine: loaded against quiet",
}

NOTES = {
    "indexer": (
        "Synthetic choices (`routereplay.bench.indexer.synthetic_choices`): *recent* picks keys with weight 1 / (1 + "
        "distance) plus the first 4 keys (attention sinks), *uniform* every visible key alike. Dense is the (T, L, I) "
        "int32 array a trainer would ship; the blob is `IndexerTrace.encode()` (checksummed), where rows of queries "
        "that see at most I keys cost nothing and the others take the smallest of packed gaps, Rice-coded gaps or a "
        "bitmap per 128-token block. Decoding checks every block and is checked equal to the input before timing."
    ),
    "codec": (
        "*bytes/row* is bytes per (token, layer) row; *x entropy* compares it with log2 C(E,K)/8, the size of a "
        "uniformly random top-K set. Peer formats are timed from wire bytes to an int16 (T, L, K) array, the signed "
        "form a trainer needs to hold the -1 sentinel. The *validated* rows time each whole decode path, wire form to "
        "a `RouteTrace` that passed every catalogue check."
    ),
    "layout": (
        "All three produce the same shard (checked before timing). The loop is what framework glue does per "
        "micro-batch: mask each sequence, concatenate, pad, slice. routereplay runs the same transforms on token "
        "numbers (1% of the bytes), then copies only this rank's rows once; even producing every rank's shard, its "
        "vectorised transforms beat the loop."
    ),
    "store": (
        "Peak and held bytes traced while each holder is built from an empty start, all from the same routes. The "
        "store keeps each sample encoded (set codec, 5.125 B per (token, layer) row against 16 B as int16) with its "
        "int64 token ids (8 bytes per token); its peak adds one sample's encode temporaries, and held bytes count "
        "what `store.nbytes` leaves out (Python objects, decode state). The ragged int16 holder is what RouteStore "
        "kept before; dense tensors pay for padding to the longest sample, and int32 doubles it."
    ),
    "delivery": (
        "*cost / share* is a range's decode time over the whole sample's, divided by its share of the rows: 1 means "
        "random access costs exactly its rows; a small window pays a fixed cost. In the DP table each rank receives "
        "its bundle (plus a (1 + W) int64 size header) or the whole dense batch; *send* is the collective alone, "
        "*to rows* adds the rank's own work (decode its bundle, or gather its rows from the dense batch); both "
        "methods give every rank the same rows (checked before timing). The 4 ranks share 2 cores, so decode "
        "times are those of a contended core. The end-to-end pipeline runs every stage in one process, all ranks' "
        "decodes in turn."
    ),
    "replay": (
        "The ratio is the median, over repeats, of each repeat's record (or replay) time divided by its off time, "
        "with the modes interleaved in every repeat. Medians vary by a few percent between runs; the machine must be "
        "quiet for the figure to mean anything."
    ),
    "engine": (
        "Capture records every router's choice across the KV-cache steps and assembles a `RouteTrace` per sequence "
        "(one gather for the batch); the ratio is the median of per-repeat ratios, interleaved."
    ),
    "load": (
        "Loaded means `--busy` processes spinning `while True: pass` while the workloads run; the bench starts them "
        "before and kills them after the loaded half of every repeat, and alternates which half goes first. The "
        "tiny model runs with 1 intra-op thread (`routereplay.threads`): with torch's default of one thread per core "
        "its spinning OpenMP workers made the same steps 12x slower under load. `--threads 2` reproduces that."
    ),
}


def grade(goal: Mapping[str, Any]) -> str:
    """`met`, `MISSED`, `MISSED (machine busy)` (a rate target missed while other processes kept the cores
    busy: `bench.conditions`), or why the target was not graded (quick runs)."""
    if goal.get("met") is None:
        return f"not graded: {goal.get('ungraded', 'no verdict')}"
    if goal["met"]:
        return "met"
    return "MISSED (machine busy)" if goal.get("machine_busy") else "MISSED"


def conditions_line(result: Mapping[str, Any]) -> str:
    """The suite's threads, load at start and end and duration (`SuiteConditions.header`), or "" for a record
    made before suites recorded them."""
    from routereplay.bench.conditions import SuiteConditions

    record = result.get("conditions")
    return SuiteConditions.from_dict(record).header() if record else ""


def ungrade(results: Mapping[str, Mapping[str, Any]], reason: str) -> None:
    """Drop the verdict of every target (`met` becomes None) and say why: figures that are not comparable
    with a target (`bench --quick`) must not be reported as meeting or missing it."""
    for result in results.values():
        for goal in result["targets"].values():
            goal["met"] = None
            goal["ungraded"] = reason
            goal.pop("machine_busy", None)


def _targets(result: Mapping[str, Any]) -> list[str]:
    lines = []
    for name, goal in result["targets"].items():
        lines.append(f"- {name}: {goal['value']:.4g} {goal['direction']} {goal['target']}  [{grade(goal)}]")
    return lines


def benchmarks_markdown(
    results: Mapping[str, Mapping[str, Any]], renderers: Mapping[str, Callable[[dict[str, Any]], str]], command: str
) -> str:
    """The whole BENCHMARKS.md for the records of one `bench all` run."""
    machine = next(iter(results.values()))["machine"]
    versions = ", ".join(f"{k} {machine[k]}" for k in ("python", "numpy", "torch", "transformers") if machine.get(k))
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `{command}` in one run on {machine['processor']} ({machine['cpu_count']} cores); {versions}.",
        "Figures are medians of repeated runs with their low and high; every ratio is measured side by side in the",
        "same run on the same data. Rerun the command to regenerate this file and the README table.",
        "Each suite's first line says how many torch intra-op threads it ran with, the load average (1, 5, 15 min)",
        "at its start and end, how many cores other processes kept busy meanwhile, and how long it took; a rate",
        "target (rows/s, seconds) missed while other processes kept half a core or more busy reads",
        "`MISSED (machine busy)`.",
        "",
        "## Summary",
        "",
        summary_table(results),
    ]
    for suite, result in results.items():
        lines += [
            "",
            f"## {TITLES.get(suite, suite)}: `routereplay bench {suite}`",
            "",
            *([conditions_line(result), ""] if conditions_line(result) else []),
            renderers[suite](dict(result)),
            "",
            "Targets in the same run:",
            "",
            *_targets(result),
            "",
            NOTES.get(suite, ""),
        ]
    return "\n".join(lines).rstrip() + "\n"


def summary_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per target of every suite: the measured ratio, the goal, met or not."""
    lines = ["| suite | measure | value | target | |", "|---|---|---:|---:|---|"]
    for suite, result in results.items():
        for name, goal in result["targets"].items():
            lines.append(
                f"| {suite} | {name} | {goal['value']:.4g} | {goal['direction']} {goal['target']} | {grade(goal)} |"
            )
    return "\n".join(lines)


def write_readme_table(readme: Path, table: str) -> None:
    """Replace the text between the bench markers of `readme` with `table` (atomically)."""
    text = readme.read_text(encoding="utf-8")
    if BEGIN not in text or END not in text or text.index(BEGIN) > text.index(END):
        raise ConfigError(f"{readme} has no {BEGIN} ... {END} markers; add them where the table belongs")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    atomic_write(readme, f"{head}{BEGIN}\n{table}\n{END}{tail}".encode())


__all__ = [
    "BEGIN",
    "END",
    "benchmarks_markdown",
    "conditions_line",
    "grade",
    "summary_table",
    "ungrade",
    "write_readme_table",
]
