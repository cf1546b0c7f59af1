"""`ReplayStats`: what the routers of a `Replayer` did, counted over its record and replay contexts.

Rows are (token, layer) pairs on attended positions. Replay counts the rows it forced (`replayed_rows`),
the -1 rows the live router served (`fallback_rows`), the rows a threshold gave back (`replaced_rows`,
`runtime/threshold.py`) and, with `count_disagreement` (the default), the forced rows whose engine set
differs from the trainer's own live choice (`disagree_rows`, `forced_disagree_rows`, tokens per expert;
`runtime/disagreement.py` defines each). `as_metrics()` gives them the one metric naming every framework
integration logs (`router_replay/...`, table in docs/metrics.md).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields

from routereplay.runtime.disagreement import HEAD

METRIC_PREFIX = "router_replay/"  # the metric names of every routereplay integration (docs/metrics.md)


@dataclass(slots=True)
class ReplayStats:
    """Counters of what the routers did; `Replayer.stats`, reset with `.reset()`."""

    forwards: int = 0
    router_calls: int = 0
    recompute_calls: int = 0  # router calls made during backward (checkpoint recompute)
    recorded_rows: int = 0  # (token, layer) rows recorded
    replayed_rows: int = 0  # (token, layer) rows forced from routes, on attended positions only
    fallback_rows: int = 0  # (token, layer) rows of -1 on attended positions, served by the live router
    fallback_rows_by_layer: dict[int, int] = field(default_factory=dict)
    checked_sequences: int = 0  # sequences whose token ids were checked against the batch (traces with ids)
    replaced_rows: int = 0  # replay(threshold=...): replayed rows given back to the live router (attended)
    replaced_rows_by_layer: dict[int, int] = field(default_factory=dict)
    # replay(count_disagreement=True), `runtime/disagreement.py`: replayed rows compared with the live choice
    compared_rows: int = 0
    compared_rows_by_layer: dict[int, int] = field(default_factory=dict)
    disagree_rows: int = 0  # compared rows whose engine set differs from the trainer's live set
    disagree_rows_by_layer: dict[int, int] = field(default_factory=dict)
    forced_disagree_rows: int = 0  # disagreeing rows still forced (threshold: not replaced)
    forced_disagree_rows_by_layer: dict[int, int] = field(default_factory=dict)
    engine_tokens_by_layer: dict[int, list[int]] = field(default_factory=dict)  # per expert, engine routes
    live_tokens_by_layer: dict[int, list[int]] = field(default_factory=dict)  # per expert, live choice

    @property
    def replace_rate(self) -> float:
        """Share of the replayed rows a threshold gave back to the live router (0.0 when none were replayed)."""
        return self.replaced_rows / self.replayed_rows if self.replayed_rows else 0.0

    @property
    def disagree_rate(self) -> float:
        """Share of the compared rows whose engine set differs from the live set (0.0 when none were compared)."""
        return self.disagree_rows / self.compared_rows if self.compared_rows else 0.0

    def disagree_rate_by_layer(self) -> dict[int, float]:
        """`disagree_rate` of each counted layer (global layer number)."""
        return {
            layer: self.disagree_rows_by_layer.get(layer, 0) / compared if compared else 0.0
            for layer, compared in sorted(self.compared_rows_by_layer.items())
        }

    def add_disagreement(self, layer: int, counts: list[int]) -> None:
        """Fold one layer's (3 + 2E) counts read from the device (`DisagreementCounter.read`)."""
        disagree, forced, compared = counts[:HEAD]
        experts = (len(counts) - HEAD) // 2
        self.disagree_rows += disagree
        self.forced_disagree_rows += forced
        self.compared_rows += compared
        for by_layer, value in (
            (self.disagree_rows_by_layer, disagree),
            (self.forced_disagree_rows_by_layer, forced),
            (self.compared_rows_by_layer, compared),
        ):
            by_layer[layer] = by_layer.get(layer, 0) + value
        for tokens_by_layer, tokens in (
            (self.engine_tokens_by_layer, counts[HEAD : HEAD + experts]),
            (self.live_tokens_by_layer, counts[HEAD + experts :]),
        ):
            before = tokens_by_layer.get(layer)
            tokens_by_layer[layer] = (
                list(tokens) if before is None else [a + b for a, b in zip(before, tokens, strict=True)]
            )

    def as_metrics(self, *, per_layer: bool = True) -> dict[str, float]:
        """The counters as `router_replay/...` metrics (docs/metrics.md); `per_layer` adds
        `router_replay/disagree_rate/layer_<n>` for every counted layer."""
        p = METRIC_PREFIX
        metrics = {
            p + "replayed_rows": float(self.replayed_rows),
            p + "fallback_rows": float(self.fallback_rows),
            p + "recompute_calls": float(self.recompute_calls),
            p + "replaced_rows": float(self.replaced_rows),
            p + "replace_rate": self.replace_rate,
            p + "compared_rows": float(self.compared_rows),
            p + "disagree_rows": float(self.disagree_rows),
            p + "forced_disagree_rows": float(self.forced_disagree_rows),
            p + "disagree_rate": self.disagree_rate,
        }
        if per_layer:
            for layer, rate in self.disagree_rate_by_layer().items():
                metrics[f"{p}disagree_rate/layer_{layer}"] = rate
        return metrics

    def copy(self) -> ReplayStats:
        """A copy whose per-layer dicts are its own (`dataclasses.replace` would share them)."""
        return ReplayStats(**{f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)})

    def since(self, before: ReplayStats) -> ReplayStats:
        """The counts added after `before` (a `.copy()` taken earlier): every counter and per-layer entry minus
        its value then. Integrations report one micro-batch or pass this way without resetting the counters."""
        out = ReplayStats()
        for f in fields(self):
            now, then = getattr(self, f.name), getattr(before, f.name)
            if isinstance(now, int):
                setattr(out, f.name, now - then)
                continue
            for layer, value in now.items():
                old = then.get(layer)
                if isinstance(value, list):
                    getattr(out, f.name)[layer] = (
                        value if old is None else [a - b for a, b in zip(value, old, strict=True)]
                    )
                else:
                    getattr(out, f.name)[layer] = value - (old or 0)
        return out

    def reset(self) -> None:
        for name in (
            "forwards",
            "router_calls",
            "recompute_calls",
            "recorded_rows",
            "replayed_rows",
            "fallback_rows",
            "checked_sequences",
            "replaced_rows",
            "compared_rows",
            "disagree_rows",
            "forced_disagree_rows",
        ):
            setattr(self, name, 0)
        for by_layer in (
            self.fallback_rows_by_layer,
            self.replaced_rows_by_layer,
            self.compared_rows_by_layer,
            self.disagree_rows_by_layer,
            self.forced_disagree_rows_by_layer,
            self.engine_tokens_by_layer,
            self.live_tokens_by_layer,
        ):
            by_layer.clear()


__all__ = ["METRIC_PREFIX", "ReplayStats"]
