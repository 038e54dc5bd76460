"""Findings: episodes of the same kind merged, costed in request time, ranked by that cost.

An operator reading `explain` wants the one thing that mattered most first, not 25 copies of
the same episode in time order. A Finding gathers every problem episode of one kind (and, for
``waiting``, one reason), counts them, adds up their time and the time they cost requests,
and keeps the costliest instance as the example.

What an episode costs requests (request-seconds), from the records inside its time span:

    waiting-like kinds   requests waiting x time (each iteration's waiting count times the
                         time until the next iteration starts)
    long_prefill         decoding requests x the time their iteration took beyond the median
                         decode-only iteration (request-seconds slowed)
    stall                (waiting + running) x the stall's length, from the heartbeats
    telemetry_gap        0: with no records, nothing is known of what requests saw
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from telemetry.analysis.episodes import INFO, Episode
from telemetry.analysis.timeline import NS_PER_S, EngineTimeline

# How each kind's cost is named in the text ("... request-s waiting").
COST_LABELS = {"long_prefill": "slowed", "stall": "stalled", "telemetry_gap": "unknown"}


@dataclass
class Finding:
    """Every problem episode of one kind; ``episodes`` are in time order, costs aligned."""

    kind: str
    episodes: list[Episode]
    costs: list[float]

    @property
    def count(self) -> int:
        return len(self.episodes)

    @property
    def total_time(self) -> float:
        return sum(e.duration_time for e in self.episodes)

    @property
    def cost(self) -> float:
        """Request-seconds the episodes cost in all."""
        return sum(self.costs)

    @property
    def worst(self) -> Episode:
        """The costliest episode; the longest one among equals."""
        ranked = zip(self.costs, (e.duration_time for e in self.episodes), range(self.count),
                     strict=True)
        return self.episodes[max(ranked)[2]]

    @property
    def title(self) -> str:
        return self.worst.title

    @property
    def cost_label(self) -> str:
        return COST_LABELS.get(self.kind, "waiting")


def _span_rows(tl: EngineTimeline, episode: Episode) -> slice:
    starts = tl.col("start_ns")
    first = int(np.searchsorted(starts, episode.start_ns, side="left"))
    last = int(np.searchsorted(starts, episode.end_ns, side="right"))
    return slice(first, last)


def _waiting_request_seconds(tl: EngineTimeline, rows: slice) -> float:
    starts, ends = tl.col("start_ns"), tl.col("end_ns")
    if rows.stop <= rows.start:
        return 0.0
    # Each iteration's waiting count holds until the next iteration starts.
    next_starts = np.r_[starts[rows.start + 1 : rows.stop], ends[rows.stop - 1]]
    durations = np.maximum(next_starts - starts[rows], 0)
    return float((tl.col("waiting")[rows] * durations).sum() / NS_PER_S)


def _slowed_request_seconds(tl: EngineTimeline, rows: slice, baseline_s: float) -> float:
    elapsed_s = tl.col("elapsed_ns")[rows] / NS_PER_S
    mixed = (tl.col("ctx_tokens")[rows] > 0) & (tl.col("gen_reqs")[rows] > 0) & tl.timed[rows]
    extra = np.where(mixed, np.maximum(elapsed_s - baseline_s, 0.0), 0.0)
    return float((tl.col("gen_reqs")[rows] * extra).sum())


def episode_cost(tl: EngineTimeline, episode: Episode) -> float:
    """Request-seconds the episode cost (see the module's docstring)."""
    if episode.kind == "telemetry_gap":
        return 0.0
    if episode.kind == "stall" and "max_running_reqs" in episode.numbers:
        busy = episode.numbers["max_waiting_reqs"] + episode.numbers["max_running_reqs"]
        return busy * episode.duration_time
    rows = _span_rows(tl, episode)
    if episode.kind == "long_prefill":
        return _slowed_request_seconds(tl, rows, episode.numbers["baseline_s"])
    return _waiting_request_seconds(tl, rows)


def _group_key(episode: Episode) -> tuple[str, str]:
    return episode.kind, str(episode.numbers.get("reason", ""))


def build_findings(tl: EngineTimeline, episodes: list[Episode]) -> list[Finding]:
    """Problem episodes merged by kind, the costliest finding first (then the longest)."""
    groups: dict[tuple[str, str], Finding] = {}
    for episode in episodes:
        if episode.severity == INFO:
            continue
        key = _group_key(episode)
        finding = groups.setdefault(key, Finding(episode.kind, [], []))
        finding.episodes.append(episode)
        finding.costs.append(episode_cost(tl, episode))
    return sorted(groups.values(), key=lambda f: (f.cost, f.total_time), reverse=True)
