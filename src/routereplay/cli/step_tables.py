"""The tables `routereplay train` prints: one row per GRPO step, synchronous or fully-async.

`step_rows` also feeds the per-step plot (`report.plot_steps`).
"""

from __future__ import annotations

from typing import Any

# the notes under each table, one line each (`console.footnotes`)
TRAIN_NOTES = (
    "≠eng: routing disagreement with the engine's routes (old: the old-log-prob pass; upd: mean over the update "
    "mini-steps)",
    "drift: max over the mini-steps of the disagreement with the old-log-prob pass's routing",
)
ASYNC_NOTES = (
    "ver: the trainer's policy version; stale: rows routed by an older version",
    "aborts: aborted calls of the batch's samples; resumed: samples resumed (rows re-fed)",
    "conflicts: stored rows a resumed prefill routed otherwise (0 under prefix-replay)",
    "dropped: groups older than --max-staleness",
)


def step_rows(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-step rows for `report.plot_steps`: k3 KL, engine-vs-trainer disagreement, drift."""
    return [
        {
            "step": r["step"],
            "mode": r["mode"],
            "k3_kl": r["k3_kl"],
            "routing_disagreement": sum(r["rollout_disagreement_per_mini_step"])
            / len(r["rollout_disagreement_per_mini_step"]),
            "drift": r["max_drift"],
            "reward_mean": r["reward_mean"],
        }
        for r in history
    ]


def render(history: list[dict[str, Any]]) -> None:
    from rich.table import Table

    from routereplay.cli.console import footnotes, show

    if not history:
        return
    table = Table(title=f"GRPO, mode {history[0]['mode']}", title_justify="left")
    columns = ("step", "reward", "≠eng old", "≠eng upd", "k3 KL", "drift", "ppo_kl", "clip", "|grad|", "fallback", "s")
    for name in columns:
        table.add_column(name, justify="right")
    for r in history:
        updates = r["rollout_disagreement_per_mini_step"]
        table.add_row(
            str(r["step"]),
            f"{r['reward_mean']:.1%}",
            f"{r['rollout_routing_disagreement']:.2%}",
            f"{sum(updates) / len(updates):.2%}",
            f"{r['k3_kl']:.2e}",
            f"{r['max_drift']:.2%}",
            f"{r['ppo_kl']:.2e}",
            f"{r['clip_frac']:.1%}",
            f"{r['grad_norm']:.3f}",
            str(r["fallback_rows"]),
            f"{sum(r['seconds'].values()):.1f}",
        )
    show(table, footnotes(*TRAIN_NOTES), min_width=124)  # 11 columns: do not squeeze into 80


def render_async(history: list[dict[str, Any]]) -> None:
    """The async run's table: reward, mismatch, and where each batch's routes came from."""
    from rich.table import Table

    from routereplay.cli.console import footnotes, show

    if not history:
        return
    first = history[0]
    table = Table(
        title=f"async GRPO, mode {first['mode']}, resume routes {first['resume_routes']}", title_justify="left"
    )
    columns = ("step", "ver", "reward", "≠eng old", "k3 KL", "ppo_kl", "stale", "aborts", "resumed", "conflicts")
    for name in (*columns, "dropped", "samples/s"):
        table.add_column(name, justify="right")
    for r in history:
        table.add_row(
            str(r["step"]),
            str(r["policy_version"]),
            f"{r['reward_mean']:.1%}",
            f"{r['rollout_routing_disagreement']:.2%}",
            f"{r['k3_kl']:.2e}",
            f"{r['ppo_kl']:.2e}",
            f"{r['stale_row_fraction']:.0%}",
            str(r["aborts"]),
            f"{r['resumed_samples']} ({r['resumed_row_fraction']:.0%})",
            str(r["prefix_conflicts"]),
            str(r["dropped_stale_groups"]),
            f"{r['samples_per_second']:.1f}",
        )
    show(table, footnotes(*ASYNC_NOTES), min_width=124)


__all__ = ["ASYNC_NOTES", "TRAIN_NOTES", "render", "render_async", "step_rows"]
