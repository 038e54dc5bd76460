"""Findings: episodes of the same kind merged, costed in request time, ranked by that cost.

Faults come first whatever they have cost so far: leaked KV blocks and a stalled engine are
bugs that grow until the engine is restarted (a leak costs requests nothing until the cache
runs out, then it costs every request), and no setting fixes them. Then the costliest first; a
finding whose cost is 0 or not measurable ranks below every finding that cost something.

An operator reading `explain` wants the one thing that mattered most first, not 25 copies of
the same episode in time order. A Finding gathers every problem episode of one kind (and, for
``waiting``, one reason), counts them, adds up their time and the time they cost requests,
and keeps the costliest instance as the example.

What an episode costs requests (request-seconds), from the records inside its time span:

    waiting-like kinds   requests waiting x time (each iteration's waiting count times the
                         time until the next iteration starts)
    kv_cliff             the requests it turned back to waiting x the time until they run
                         again: from the cliff, each iteration's waiting count above the count
                         before it (at most the number evicted, and at most those evicted and
                         not yet taken in again: evicted requests wait at the front of the
                         queue, so requests arriving behind them are not the cliff's) times the
                         time until the next iteration starts, until that count falls back to
                         0, plus the time of each iteration that admits them again (they
                         recompute their prompt in it); to the end of the recording if they
                         never run again
    preemption_storm     the same for the requests it preempted (at most its preemptions),
                         counted from the iteration before its first preemption: waiting that
                         was there before the storm is not the storm's, waiting it caused is
    long_prefill         decoding requests x the time their iteration took beyond the median
                         decode-only iteration before it (its baseline: episodes/latency.py;
                         request-seconds slowed), at most what its chunk accounts for
    slow_decode          decoding requests x the time their slowed iteration took beyond what
                         as much work took in the 30 s before (episodes/slow_decode.py), over
                         its slowed iterations (request-seconds slowed)
    costly_drafts        the decode tokens its iterations produced x the time each came later
                         than without drafts, by the fit that judged its step (the mean over
                         its steps: telemetry/analysis/episodes/drafts.py)
    stall                (waiting + running) x the stall's length, from the heartbeats
    silence              (waiting + running) as the last message before it said x its
                         length: a frozen or dead engine gives them no token meanwhile
                         (request-s halted; a telemetry_gap episode, its own finding; the
                         sidecar's dead finding)
    telemetry_gap        0 for lost messages: with no records, nothing is known of what
                         requests saw
    futile_speculation   0: what speculation costs each step is not in the records
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from telemetry.analysis.episodes import INFO, Episode, Thresholds
from telemetry.analysis.episodes.latency import decode_baselines, prefill_token_costs
from telemetry.analysis.episodes.silences import Silences
from telemetry.analysis.timeline import NS_PER_S, EngineTimeline

FAULT_KINDS = ("kv_leak", "stall")  # bugs: the action is a restart and a report, not a flag

# How each kind's cost is named in the text ("... request-s waiting").
COST_LABELS = {
    "long_prefill": "slowed",
    "slow_decode": "slowed",
    "costly_drafts": "slowed",
    "stall": "stalled",
    "silence": "halted",  # a telemetry_gap episode with silent_time_s (is_silence)
    "telemetry_gap": "unknown",
    "futile_speculation": "unknown",
    "kv_cliff": "delayed",
    "preemption_storm": "delayed",
}


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
        ranked = zip(
            self.costs, (e.duration_time for e in self.episodes), range(self.count), strict=True
        )
        return self.episodes[max(ranked)[2]]

    @property
    def title(self) -> str:
        return self.worst.title

    @property
    def cost_label(self) -> str:
        kind = "silence" if is_silence(self.episodes[0]) else self.kind
        return COST_LABELS.get(kind, "waiting")

    @property
    def is_fault(self) -> bool:
        return self.kind in FAULT_KINDS


def _span_rows(tl: EngineTimeline, episode: Episode) -> slice:
    """The records inside the episode: started within it, less one that starts right as its
    last one ends (back to back, it is the next iteration, not the episode's). An episode of
    one untimed record (start = end) keeps it."""
    starts = tl.col("start_ns")
    first = int(np.searchsorted(starts, episode.start_ns, side="left"))
    stop = int(np.searchsorted(starts, episode.end_ns, side="right"))
    while (
        stop - first > 1
        and starts[stop - 1] == episode.end_ns
        and tl.col("end_ns")[stop - 1] > episode.end_ns
    ):
        stop -= 1
    return slice(first, stop)


def _queued_request_seconds(
    tl: EngineTimeline, rows: slice, counts: np.ndarray, dead_after_s: float
) -> float:
    """Each row's count (aligned with ``rows``) times the time until the next iteration starts:
    a record's waiting count holds until then. The last row's holds until it ends. Time the
    engine was silent (frozen whole) is the silence's cost, not counted here again."""
    starts, ends = tl.col("start_ns"), tl.col("end_ns")
    if rows.stop <= rows.start:
        return 0.0
    next_starts = np.r_[starts[rows.start + 1 : rows.stop], ends[rows.stop - 1]]
    durations = np.maximum(next_starts - starts[rows], 0)
    if durations.max() > dead_after_s * NS_PER_S:  # else no silence fits in one: not sought
        silent = Silences(tl, dead_after_s).overlap_ns(starts[rows], next_starts)
        durations = np.maximum(durations - silent, 0)
    return float((counts * durations).sum() / NS_PER_S)


def _waiting_request_seconds(tl: EngineTimeline, rows: slice, th: Thresholds) -> float:
    return _queued_request_seconds(tl, rows, tl.col("num_waiting_reqs")[rows], th.dead_after)


def _not_readmitted(tl: EngineTimeline, first: int) -> np.ndarray:
    """From row ``first`` on: how many requests that left running other than by finishing
    (evicted, whether counted as preemptions or not) were not yet taken in again. Engines put
    evicted requests at the front of the waiting queue (ours, vLLM's), so every request taken
    into running after an eviction is one of them until none is left. Each iteration's
    evictions less its admissions is the fall in running less the requests that finished;
    the count never goes below 0 (admissions with none evicted are of other requests)."""
    running = tl.col("num_running_reqs")[first:].astype(np.int64)
    finished = tl.col("num_finished_reqs")[first:].astype(np.int64)
    net_out = -np.diff(running, prepend=running[0]) - finished
    net_out[0] = 0
    total = np.cumsum(net_out)
    return total - np.minimum.accumulate(np.minimum(total, 0))


def _evicted_request_seconds(
    tl: EngineTimeline, first: int, num_evicted: int, th: Thresholds
) -> float:
    """What a cliff starting at row ``first`` (before any eviction) cost the requests it sent
    back to waiting (see the module's docstring)."""
    waiting = tl.col("num_waiting_reqs")
    evicted = np.clip(waiting[first:] - waiting[first], 0, max(num_evicted, 0))
    evicted = np.minimum(evicted, _not_readmitted(tl, first))
    raised = np.flatnonzero(evicted > 0)
    if not raised.size:
        return 0.0
    back = np.flatnonzero(evicted[raised[0] :] == 0)
    stop = first + raised[0] + int(back[0]) if back.size else tl.num_iterations
    waited = _queued_request_seconds(tl, slice(first, stop), evicted[: stop - first], th.dead_after)
    # Up to the row that admits the last of them: a fall in the count is requests admitted
    # again, each recomputing its prompt in that row's iteration.
    span = evicted[: stop - first + 1]
    admitted = np.maximum(span[:-1] - span[1:], 0)
    recompute_ns = int((admitted * tl.col("elapsed_ns")[first + 1 : first + span.size]).sum())
    return waited + recompute_ns / NS_PER_S


def _slowed_request_seconds(tl: EngineTimeline, rows: slice, th: Thresholds) -> float:
    """Each mixed iteration's decoding requests x its time beyond its own baseline (the
    median decode-only iteration before it, as the detector judged it; none: nothing), at
    most what its chunk accounts for (its tokens x the median cost of a prefill token over
    the same 30 s): the rest of a mixed iteration slowed from outside is not the chunk's (on a
    loaded host, a 211-token chunk took 815 ms where such chunks took 200-230 ms)."""
    num_decode_reqs = tl.col("num_decode_reqs")
    mixed = (tl.col("num_prefill_tokens") > 0) & (num_decode_reqs > 0) & tl.timed
    index = np.arange(rows.start, rows.stop)[mixed[rows]]
    baselines = decode_baselines(tl, index, th)
    chunk_ns = tl.col("num_prefill_tokens")[index] * prefill_token_costs(tl, index, baselines, th)
    extra_ns = np.minimum(tl.col("elapsed_ns")[index] - baselines, chunk_ns)
    extra_ns = np.where(np.isnan(extra_ns), 0.0, np.maximum(extra_ns, 0.0))
    return float((num_decode_reqs[index] * extra_ns).sum()) / NS_PER_S


def _drafts_request_seconds(tl: EngineTimeline, rows: slice, episode: Episode) -> float:
    """The decode tokens of the iterations inside the episode, each later by what drafts add
    to the time per output token (the mean of its steps' judgments, by their decode tokens)."""
    return float(tl.col("num_decode_tokens")[rows].sum()) * episode.numbers["added_token_time_s"]


EVICTING_KINDS = ("kv_cliff", "preemption_storm")  # they send running requests back to wait


def eviction_baseline_row(tl: EngineTimeline, episode: Episode) -> int:
    """The row whose waiting count the requests an evicting episode sent back to waiting are
    counted above: a cliff's first row (its high point, before the eviction), the row before
    a storm's first preemption."""
    first = int(np.searchsorted(tl.col("start_ns"), episode.start_ns, side="left"))
    return max(first - 1, 0) if episode.kind == "preemption_storm" else first


def is_silence(episode: Episode) -> bool:
    """A silence (no message, not even a heartbeat): the sidecar's dead engine, after the fact."""
    return episode.kind == "telemetry_gap" and "silent_time_s" in episode.numbers


def episode_cost(tl: EngineTimeline, episode: Episode, thresholds: Thresholds) -> float:
    """Request-seconds the episode cost (see the module's docstring), by the thresholds its
    episodes were detected with (silences: ``dead_after``; long prefill: the baselines)."""
    if is_silence(episode):
        return episode.numbers.get("in_flight_reqs", 0) * episode.duration_time
    if episode.kind == "slow_decode":  # its slowed iterations, as its detector judged them
        return episode.numbers["slowed_request_s"]
    if COST_LABELS.get(episode.kind) == "unknown":
        return 0.0
    if episode.kind in EVICTING_KINDS:
        first = eviction_baseline_row(tl, episode)
        num_evicted = episode.numbers.get("num_evicted", episode.numbers.get("num_preemptions"))
        return _evicted_request_seconds(tl, first, num_evicted, thresholds)
    if episode.kind == "stall" and "max_running_reqs" in episode.numbers:
        busy = episode.numbers["max_waiting_reqs"] + episode.numbers["max_running_reqs"]
        return busy * episode.duration_time
    rows = _span_rows(tl, episode)
    if episode.kind == "costly_drafts":
        return _drafts_request_seconds(tl, rows, episode)
    if episode.kind == "long_prefill":
        return _slowed_request_seconds(tl, rows, thresholds)
    return _waiting_request_seconds(tl, rows, thresholds)


def _group_key(episode: Episode) -> tuple[str, str]:
    """Waiting by reason; silences apart from lost messages (their costs differ)."""
    return episode.kind, "silence" if is_silence(episode) else str(
        episode.numbers.get("reason", "")
    )


def build_findings(
    tl: EngineTimeline, episodes: list[Episode], thresholds: Thresholds
) -> list[Finding]:
    """Problem episodes (detected with ``thresholds``) merged by kind, ranked (see the
    module's docstring and _rank_key)."""
    groups: dict[tuple[str, str], Finding] = {}
    for episode in episodes:
        if episode.severity == INFO:
            continue
        key = _group_key(episode)
        finding = groups.setdefault(key, Finding(episode.kind, [], []))
        finding.episodes.append(episode)
        finding.costs.append(episode_cost(tl, episode, thresholds))
    return sorted(groups.values(), key=_rank_key, reverse=True)


def _rank_key(finding: Finding) -> tuple[bool, float, bool, float]:
    return rank_key(finding.is_fault, finding.cost, finding.cost_label, finding.total_time)


def rank_key(
    is_fault: bool, cost: float, cost_label: str, total_time: float
) -> tuple[bool, float, bool, float]:
    """How findings rank (highest first; the live sidecar ranks its own by it too): faults
    first, then the costliest; among equal costs (0 above all) one whose cost was measured
    before one whose cost is unknown, then the longest."""
    return is_fault, cost, cost_label != "unknown", total_time


def cost_text(request_seconds: float) -> str:
    """A cost as the text prints it: never a cost above 0 that reads as 0."""
    if request_seconds <= 0:
        return "0"
    if request_seconds < 0.01:
        return "< 0.01"
    return f"{request_seconds:.2f}" if request_seconds < 1 else f"{request_seconds:.1f}"


def cost_phrase(request_seconds: float, cost_label: str) -> str:
    """A finding's cost as every text says it (explain, the log lines, top): ``4.0 request-s
    waiting``, or ``cost not measurable`` for a kind whose cost the records cannot give."""
    if cost_label == "unknown":
        return "cost not measurable"
    return f"{cost_text(request_seconds)} request-s {cost_label}"
