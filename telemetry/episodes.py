"""Episodes: stretches of a recording that answer an operator's question, found from records.

Input is one engine's timeline (its IterationRecords and Heartbeats from a recording); output
is a list of Episode, each with a start and end in the engine's record time (monotonic ns), the
numbers that prove it, a plain-language explanation and the setting to change.

What each detector looks at (all thresholds are in ``Thresholds``):

    kv_saturation     KV usage >= 95% for 10+ iterations
    kv_cliff          KV usage falls from >= 90% by 40+ points within 5 iterations while
                      running requests (not finished ones) turn into waiting ones (story 1),
                      preemptions counted or not
    preemption_storm  3+ preemptions with less than 1 s between them
    waiting           requests wait after scheduling for 1 s+, named by the dominant reason
                      (KV capacity, max_num_seqs, max_num_batched_tokens)
    stall             heartbeats say work waits or runs but last_iteration stays frozen for
                      2 s+, or iterations run that schedule nothing while work waits
    kv_leak           KV blocks held beyond what the running requests' tokens need
                      (used > ceil(kv_tokens / block_size) + 2 * running), e.g. blocks used
                      with nothing running (story 2)
    idle              heartbeats, nothing waiting or running, no iteration, for 5 s+ (info)
    telemetry_gap     holes in ``seq`` (lost messages), or no message at all for 3 s+
    long_prefill      iterations whose prefill chunk makes them 3x slower than the median
                      decode-only iteration while requests are decoding (the chunk's size times
                      the median cost of a context token must account for the slowdown)

A healthy run (load within the limits, no faults) yields no episode but ``idle``.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from telemetry.record import EVENT_FINISHED, Heartbeat, IterationRecord

NS_PER_S = 1_000_000_000
LEAK_MAX_GAP = 10  # iterations; the running requests' slack makes the excess dip a little
SEQ_RESTART_SLACK = 64  # a seq this far below the highest seen means the engine restarted

PROBLEM = "problem"
INFO = "info"


@dataclass(frozen=True)
class Thresholds:
    """Where a pattern becomes an episode. Times in seconds, ratios in 0..1."""

    kv_saturated_ratio: float = 0.95
    kv_saturated_min_iterations: int = 10
    kv_cliff_high_ratio: float = 0.90
    kv_cliff_min_drop: float = 0.40  # usage falls by at least this much (of the whole cache)
    kv_cliff_max_iterations: int = 5
    storm_min_preemptions: int = 3
    storm_window_time: float = 1.0
    waiting_min_time: float = 1.0
    waiting_min_iterations: int = 10
    stall_min_time: float = 2.0
    spin_min_iterations: int = 10
    leak_min_blocks: int = 2
    leak_min_iterations: int = 5
    idle_min_time: float = 5.0
    silence_min_time: float = 3.0
    gap_merge_time: float = 1.0
    long_prefill_ratio: float = 3.0
    long_prefill_min_extra_time: float = 0.005
    long_prefill_min_baseline_iterations: int = 10


@dataclass
class Episode:
    """One finding. ``numbers`` holds the key figures of ``evidence`` for machines and tests."""

    kind: str
    engine_index: int
    start_ns: int
    end_ns: int
    title: str
    evidence: str
    explanation: str
    setting: str
    severity: str = PROBLEM
    ongoing: bool = False
    numbers: dict = field(default_factory=dict)

    @property
    def duration_time(self) -> float:
        return (self.end_ns - self.start_ns) / NS_PER_S


# --------------------------------------------------------------------------------------------
# The timeline of one engine


class EngineTimeline:
    """One engine's records and heartbeats, ordered by record time, with numpy columns.

    Records are sorted by ``start_ns`` and heartbeats by ``ts_ns``; both clocks are the
    engine's monotonic clock, which keeps running across engine restarts on one host.
    Static facts (block size, limits, model) come from the latest heartbeat that has them.
    """

    def __init__(
        self, engine_index: int, records: list[IterationRecord], heartbeats: list[Heartbeat]
    ) -> None:
        self.engine_index = engine_index
        self.records = sorted(records, key=lambda r: r.start_ns)
        self.heartbeats = sorted(heartbeats, key=lambda h: h.ts_ns)
        self._anchor_ts_ns = [h.ts_ns for h in self.heartbeats]
        self._anchor_offset_ns = [h.wall_ns - h.ts_ns for h in self.heartbeats]
        self.columns = _record_columns(self.records)
        self.facts = _latest_facts(self.heartbeats)

    @property
    def num_iterations(self) -> int:
        return len(self.records)

    def col(self, name: str) -> np.ndarray:
        return self.columns[name]

    @property
    def kv_usage(self) -> np.ndarray:
        total = self.col("blocks_used") + self.col("blocks_free")
        return np.where(total > 0, self.col("blocks_used") / np.maximum(total, 1), 0.0)

    @property
    def num_kv_blocks_total(self) -> int:
        if self.records:
            return int((self.col("blocks_used") + self.col("blocks_free")).max())
        return int(self.facts.get("num_kv_blocks_total", 0))

    @property
    def first_ns(self) -> int:
        times = [t for t in (self._first_record_ns(), self._first_heartbeat_ns()) if t >= 0]
        return min(times) if times else 0

    @property
    def last_ns(self) -> int:
        times = []
        if self.records:
            times.append(int(self.col("end_ns").max()))
        if self.heartbeats:
            times.append(self.heartbeats[-1].ts_ns)
        return max(times) if times else 0

    def _first_record_ns(self) -> int:
        return int(self.col("start_ns")[0]) if self.records else -1

    def _first_heartbeat_ns(self) -> int:
        return self.heartbeats[0].ts_ns if self.heartbeats else -1

    def has_clock_anchor(self) -> bool:
        return bool(self.heartbeats)

    def to_wall_ns(self, ts_ns: int) -> int:
        """Wall time of a record time, from the nearest heartbeat's (ts_ns, wall_ns) anchor."""
        if not self.heartbeats:
            raise ValueError(f"engine {self.engine_index}: no heartbeat, so no clock anchor")
        i = bisect.bisect_left(self._anchor_ts_ns, ts_ns)
        candidates = [j for j in (i - 1, i) if 0 <= j < len(self._anchor_ts_ns)]
        nearest = min(candidates, key=lambda j: abs(self._anchor_ts_ns[j] - ts_ns))
        return ts_ns + self._anchor_offset_ns[nearest]


RECORD_FIELDS = {
    "iteration": "iteration",
    "start_ns": "start_ns",
    "elapsed_ns": "elapsed_ns",
    "ctx_reqs": "num_context_reqs",
    "ctx_tokens": "num_context_tokens",
    "gen_reqs": "num_generation_reqs",
    "gen_tokens": "num_generation_tokens",
    "running": "num_running_reqs",
    "waiting": "num_waiting_reqs",
    "waiting_kv": "num_waiting_kv_reqs",
    "waiting_seq_limit": "num_waiting_seq_limit_reqs",
    "waiting_budget": "num_waiting_budget_reqs",
    "blocks_used": "num_kv_blocks_used",
    "blocks_free": "num_kv_blocks_free",
    "kv_tokens": "num_kv_tokens",
    "preemptions": "num_preemptions",
}


def _record_columns(records: list[IterationRecord]) -> dict[str, np.ndarray]:
    columns = {
        name: np.fromiter((getattr(r, attr) for r in records), dtype=np.int64, count=len(records))
        for name, attr in RECORD_FIELDS.items()
    }
    columns["end_ns"] = columns["start_ns"] + columns["elapsed_ns"]
    columns["finished"] = np.fromiter(
        (sum(1 for m in r.milestones if m.event & EVENT_FINISHED) for r in records),
        dtype=np.int64, count=len(records),
    )
    return columns


FACT_FIELDS = (
    "model_name", "device_name", "block_size", "num_kv_blocks_total", "max_num_seqs",
    "max_num_batched_tokens", "pid",
)


def _latest_facts(heartbeats: list[Heartbeat]) -> dict:
    facts: dict = {}
    for heartbeat in heartbeats:
        for name in FACT_FIELDS:
            value = getattr(heartbeat, name)
            if value:
                facts[name] = value
    return facts


def build_timelines(messages: list[IterationRecord | Heartbeat]) -> dict[int, EngineTimeline]:
    """Split messages by engine; duplicates (the same file read twice) are dropped."""
    records: dict[int, dict[tuple, IterationRecord]] = {}
    heartbeats: dict[int, dict[tuple, Heartbeat]] = {}
    for message in messages:
        if isinstance(message, IterationRecord):
            key = (message.seq, message.start_ns)
            records.setdefault(message.engine_index, {})[key] = message
        else:
            key = (message.seq, message.ts_ns)
            heartbeats.setdefault(message.engine_index, {})[key] = message
    engines = sorted(set(records) | set(heartbeats))
    return {
        e: EngineTimeline(
            e, list(records.get(e, {}).values()), list(heartbeats.get(e, {}).values())
        )
        for e in engines
    }


# --------------------------------------------------------------------------------------------
# Small helpers


def true_runs(mask: np.ndarray, max_gap: int = 0) -> list[tuple[int, int]]:
    """Inclusive (first, last) index pairs of True runs; runs split by <= max_gap False merge."""
    index = np.flatnonzero(mask)
    if not index.size:
        return []
    breaks = np.flatnonzero(np.diff(index) > max_gap + 1)
    firsts = np.r_[index[0], index[breaks + 1]]
    lasts = np.r_[index[breaks], index[-1]]
    return list(zip(firsts.tolist(), lasts.tolist(), strict=True))


def group_by_time(times_ns: list[int], window_ns: int) -> list[tuple[int, int]]:
    """Inclusive index ranges of sorted times where consecutive times are <= window_ns apart."""
    groups: list[tuple[int, int]] = []
    for i, t in enumerate(times_ns):
        if groups and t - times_ns[groups[-1][1]] <= window_ns:
            groups[-1] = (groups[-1][0], i)
        else:
            groups.append((i, i))
    return groups


def pct(ratio: float) -> str:
    return f"{100 * ratio:.1f}%"


def secs(time_ns: int | float) -> str:
    seconds = time_ns / NS_PER_S
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _limit(timeline: EngineTimeline, name: str) -> str:
    value = timeline.facts.get(name)
    return f"{name}={value}" if value else name


# --------------------------------------------------------------------------------------------
# Detectors: each takes (timeline, thresholds) and returns episodes


def detect_kv_saturation(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    usage = tl.kv_usage
    episodes = []
    for first, last in true_runs(usage >= th.kv_saturated_ratio, max_gap=2):
        if last - first + 1 < th.kv_saturated_min_iterations:
            continue
        span = slice(first, last + 1)
        num_preemptions = int(tl.col("preemptions")[span].sum())
        max_waiting_kv = int(tl.col("waiting_kv")[span].max())
        peak = float(usage[span].max())
        episodes.append(Episode(
            kind="kv_saturation",
            engine_index=tl.engine_index,
            start_ns=int(tl.col("start_ns")[first]),
            end_ns=int(tl.col("end_ns")[last]),
            title="KV cache saturated",
            evidence=(
                f"KV usage >= {pct(th.kv_saturated_ratio)} for {last - first + 1} iterations "
                f"(peak {pct(peak)} of {tl.num_kv_blocks_total} blocks); "
                f"{max_waiting_kv} requests at most waited for KV capacity; "
                f"{num_preemptions} preemptions; running {int(tl.col('running')[first])} -> "
                f"{int(tl.col('running')[last])}"
            ),
            explanation=_saturation_explanation(max_waiting_kv, num_preemptions),
            setting=(
                "Give the KV cache more memory, lower max_model_len, or lower max_num_seqs / "
                "client concurrency so peak usage stays below ~90% "
                "(`iterscope kv-plan` shows how many requests fit; runbook: "
                "IterscopeKVCacheSaturated)."
            ),
            severity=PROBLEM if max_waiting_kv or num_preemptions else INFO,
            numbers={"peak_usage": peak, "num_iterations": last - first + 1,
                     "num_preemptions": num_preemptions, "max_waiting_kv_reqs": max_waiting_kv},
        ))
    return episodes


def _saturation_explanation(max_waiting_kv: int, num_preemptions: int) -> str:
    if not max_waiting_kv and not num_preemptions:
        return ("The cache was full but what was admitted still fit: no request waited for KV "
                "and none was preempted. Any more load will wait or be preempted.")
    return ("Every KV block was in use: new requests could not be admitted and running requests "
            "that needed a new block had to be preempted (recomputed later).")


def detect_kv_cliff(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    """Usage collapses from high to low in a few iterations while running turns to waiting."""
    usage = tl.kv_usage
    running, waiting = tl.col("running"), tl.col("waiting")
    window = th.kv_cliff_max_iterations
    candidates = []
    for i in range(1, tl.num_iterations):
        lookback = slice(max(0, i - window), i)
        high = max(0, i - window) + int(np.argmax(usage[lookback]))
        if usage[high] < th.kv_cliff_high_ratio or usage[high] - usage[i] < th.kv_cliff_min_drop:
            continue
        num_finished = int(tl.col("finished")[high + 1 : i + 1].sum())
        num_evicted = int(running[high] - running[i]) - num_finished  # finishes are no cliff
        num_waiting_gained = int(waiting[i] - waiting[high])
        if num_evicted >= 1 and num_waiting_gained >= max(1, num_evicted // 2):
            candidates.append((high, i))
    episodes = []
    last_end = -1
    for high, low in candidates:
        if high <= last_end:
            continue
        last_end = low
        episodes.append(_kv_cliff_episode(tl, high, low))
    return episodes


def _kv_cliff_episode(tl: EngineTimeline, high: int, low: int) -> Episode:
    usage = tl.kv_usage
    running, waiting = tl.col("running"), tl.col("waiting")
    num_preemptions = int(tl.col("preemptions")[high : low + 1].sum())
    after_end = int(np.searchsorted(tl.col("start_ns"), tl.col("end_ns")[low] + 5 * NS_PER_S))
    after = slice(low + 1, after_end)
    num_after = after_end - low - 1
    num_ctx_after = int(tl.col("ctx_tokens")[after].sum())
    num_gen_after = int(tl.col("gen_tokens")[after].sum())
    if num_preemptions:
        why = (
            f"The scheduler preempted {num_preemptions} running request(s) (by recompute) and "
            "freed their KV blocks: they went back to the waiting queue and must prefill their "
            "whole prompt again, which with long prompts costs as much as the first time."
        )
    else:
        why = (
            "The running requests released all their KV blocks and returned to the waiting "
            "queue, yet no preemption was counted: they were evicted by a path that does not "
            "count as a preemption. The engine did not stop: it kept iterating, recomputing "
            "the evicted prompts (context tokens) instead of generating."
        )
    return Episode(
        kind="kv_cliff",
        engine_index=tl.engine_index,
        start_ns=int(tl.col("start_ns")[high]),
        end_ns=int(tl.col("end_ns")[low]),
        title="KV cache cliff: running requests became waiting",
        evidence=(
            f"KV usage {pct(usage[high])} -> {pct(usage[low])} in {low - high} iteration(s) "
            f"(iterations {int(tl.col('iteration')[high])}-{int(tl.col('iteration')[low])}); "
            f"running {int(running[high])} -> {int(running[low])}, waiting "
            f"{int(waiting[high])} -> {int(waiting[low])} "
            f"({int(tl.col('waiting_kv')[low])} for KV capacity); "
            f"preemptions counted: {num_preemptions}; in the next 5 s {num_after} iterations ran "
            f"({num_ctx_after} context tokens, {num_gen_after} generation tokens)"
        ),
        explanation=why,
        setting=(
            f"Peak KV usage reached {pct(usage[high])} with {int(running[high])} requests: lower "
            "client concurrency or max_num_seqs so the peak stays below ~90%, or give the KV "
            "cache more memory (`iterscope kv-plan` shows how many requests of your length fit)."
        ),
        numbers={"usage_before": float(usage[high]), "usage_after": float(usage[low]),
                 "running_before": int(running[high]), "running_after": int(running[low]),
                 "num_preemptions": num_preemptions, "num_iterations_after": num_after},
    )


def detect_preemption_storms(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    index = np.flatnonzero(tl.col("preemptions") > 0)
    times = tl.col("start_ns")[index].tolist()
    episodes = []
    for first, last in group_by_time(times, int(th.storm_window_time * NS_PER_S)):
        rows = index[first : last + 1]
        num_preemptions = int(tl.col("preemptions")[rows].sum())
        if num_preemptions < th.storm_min_preemptions:
            continue
        span = slice(int(rows[0]), int(rows[-1]) + 1)
        num_ctx_tokens = int(tl.col("ctx_tokens")[span].sum())
        episodes.append(Episode(
            kind="preemption_storm",
            engine_index=tl.engine_index,
            start_ns=int(tl.col("start_ns")[rows[0]]),
            end_ns=int(tl.col("end_ns")[rows[-1]]),
            title="Preemption storm",
            evidence=(
                f"{num_preemptions} preemptions in {len(rows)} iterations; KV usage peak "
                f"{pct(tl.kv_usage[span].max())}; {num_ctx_tokens} context tokens computed "
                f"meanwhile (recompute included); waiting up to "
                f"{int(tl.col('waiting')[span].max())}"
            ),
            explanation=(
                "Running requests ran out of KV blocks as they grew, so the scheduler evicted "
                "some and will recompute them: work is thrown away and latency rises."
            ),
            setting=(
                f"Lower {_limit(tl, 'max_num_seqs')} or client concurrency, or give the KV cache "
                "more memory, so the requests admitted together fit until they finish "
                "(runbook: IterscopePreemptionStorm)."
            ),
            numbers={"num_preemptions": num_preemptions, "num_iterations": len(rows)},
        ))
    return episodes


WAIT_REASONS = {
    "waiting_kv": ("KV capacity", "no free KV blocks for the next request"),
    "waiting_seq_limit": ("max_num_seqs", "the sequence limit was reached"),
    "waiting_budget": ("max_num_batched_tokens", "the token budget of the iteration was used up"),
}


def detect_waiting(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    waiting = tl.col("waiting")
    episodes = []
    for first, last in true_runs(waiting > 0, max_gap=2):
        start_ns, end_ns = int(tl.col("start_ns")[first]), int(tl.col("end_ns")[last])
        if (last - first + 1 < th.waiting_min_iterations
                or end_ns - start_ns < th.waiting_min_time * NS_PER_S):
            continue
        episodes.append(_waiting_episode(tl, first, last))
    return episodes


def _waiting_episode(tl: EngineTimeline, first: int, last: int) -> Episode:
    span = slice(first, last + 1)
    totals = {name: int(tl.col(name)[span].sum()) for name in WAIT_REASONS}
    num_waiting_sum = int(tl.col("waiting")[span].sum())
    reason = max(totals, key=totals.get) if any(totals.values()) else ""
    label, cause = WAIT_REASONS.get(reason, ("unattributed", "no admission limit was reported"))
    split = ", ".join(
        f"{WAIT_REASONS[name][0]} {pct(total / max(num_waiting_sum, 1))}"
        for name, total in totals.items()
    )
    peak_usage = float(tl.kv_usage[span].max())
    return Episode(
        kind="waiting",
        engine_index=tl.engine_index,
        start_ns=int(tl.col("start_ns")[first]),
        end_ns=int(tl.col("end_ns")[last]),
        title=f"Requests waiting: {label}",
        evidence=(
            f"waiting > 0 in {last - first + 1} iterations (mean "
            f"{tl.col('waiting')[span].mean():.1f}, max {int(tl.col('waiting')[span].max())}); "
            f"reasons: {split}; running mean {tl.col('running')[span].mean():.1f}; "
            f"KV usage peak {pct(peak_usage)}"
        ),
        explanation=f"Requests queued because {cause}; their time to first token grows.",
        setting=_waiting_setting(tl, reason, peak_usage),
        numbers={"reason": reason, "max_waiting_reqs": int(tl.col("waiting")[span].max()),
                 "num_iterations": last - first + 1, "peak_usage": peak_usage},
    )


def _waiting_setting(tl: EngineTimeline, reason: str, peak_usage: float) -> str:
    if reason == "waiting_kv":
        return ("Give the KV cache more memory, lower max_model_len, or send fewer concurrent "
                "requests (`iterscope kv-plan`).")
    if reason == "waiting_seq_limit":
        room = "KV had room" if peak_usage < 0.9 else "but KV was nearly full too"
        return (f"Raise {_limit(tl, 'max_num_seqs')} ({room}, peak {pct(peak_usage)}); "
                "`iterscope tune --itl-target` picks a value that keeps your latency target.")
    if reason == "waiting_budget":
        return (f"Raise {_limit(tl, 'max_num_batched_tokens')} for more throughput at the cost "
                "of longer iterations; `iterscope tune --itl-target` picks a value.")
    return "Check the engine's admission logic: requests waited with no limit reported."


def detect_stalls(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    return _frozen_heartbeat_stalls(tl, th) + _spinning_stalls(tl, th)


def _frozen_heartbeat_stalls(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    episodes = []
    for group in _heartbeat_groups(tl, busy=True):
        if len(group) < 2:
            continue
        last_iteration = group[0].last_iteration
        since_ns = _iteration_end_ns(tl, last_iteration, before_ns=group[0].ts_ns)
        if since_ns is None:
            since_ns = group[0].ts_ns
        next_row = int(np.searchsorted(tl.col("start_ns"), since_ns, side="left"))
        ongoing = next_row >= tl.num_iterations
        until_ns = group[-1].ts_ns if ongoing else int(tl.col("end_ns")[next_row])
        if until_ns - since_ns < th.stall_min_time * NS_PER_S:
            continue
        inside = not ongoing and tl.col("start_ns")[next_row] - since_ns < (until_ns - since_ns) / 2
        episodes.append(_stall_episode(tl, group, since_ns, until_ns, ongoing, inside))
    return episodes


def _stall_episode(tl, group, since_ns, until_ns, ongoing, inside) -> Episode:
    if ongoing:
        where = "inside the next iteration or between iterations: none has finished since"
    elif inside:
        where = (f"inside iteration {group[0].last_iteration + 1}, which took "
                 f"{secs(until_ns - since_ns)} (a forward pass or a step that hung)")
    else:
        where = "between iterations (it did not start the next one)"
    max_waiting = max(h.num_waiting_reqs for h in group)
    max_running = max(h.num_running_reqs for h in group)
    return Episode(
        kind="stall",
        engine_index=tl.engine_index,
        start_ns=since_ns,
        end_ns=until_ns,
        title="Engine stalled" + (" (still stalled at the end)" if ongoing else ""),
        evidence=(
            f"last_iteration stayed at {group[0].last_iteration} for {secs(until_ns - since_ns)} "
            f"across {len(group)} heartbeats with {max_waiting} requests waiting and "
            f"{max_running} running (at most; pid {group[0].pid or '?'})"
        ),
        explanation=(
            f"Not idle (work was queued) and not dead (heartbeats kept coming): the loop was "
            f"stuck {where}. Clients see no tokens and eventually time out."
        ),
        setting=(
            "Not a tuning setting: take a stack dump of the engine process (e.g. `py-spy dump "
            f"--pid {group[0].pid or 'PID'}`), check the device, restart the engine if it does "
            "not recover (alert and runbook: IterscopeEngineStalled)."
        ),
        ongoing=ongoing,
        numbers={"frozen_iteration": group[0].last_iteration,
                 "stall_time_s": (until_ns - since_ns) / NS_PER_S,
                 "max_waiting_reqs": max_waiting, "inside_iteration": bool(inside)},
    )


def _heartbeat_groups(tl: EngineTimeline, busy: bool) -> list[list[Heartbeat]]:
    """Consecutive heartbeats of one process with the same last_iteration and busy state."""
    groups: list[list[Heartbeat]] = []
    for heartbeat in tl.heartbeats:
        is_busy = heartbeat.num_waiting_reqs + heartbeat.num_running_reqs > 0
        if is_busy != busy:
            groups.append([])
            continue
        previous = groups[-1][-1] if groups and groups[-1] else None
        if (previous is not None and previous.pid == heartbeat.pid
                and previous.last_iteration == heartbeat.last_iteration):
            groups[-1].append(heartbeat)
        else:
            groups.append([heartbeat])
    return [g for g in groups if g]


def _iteration_end_ns(tl: EngineTimeline, iteration: int, before_ns: int) -> int | None:
    rows = np.flatnonzero((tl.col("iteration") == iteration) & (tl.col("end_ns") <= before_ns))
    return int(tl.col("end_ns")[rows[-1]]) if rows.size else None


def _spinning_stalls(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    scheduled = tl.col("ctx_reqs") + tl.col("gen_reqs")
    mask = (scheduled == 0) & (tl.col("waiting") + tl.col("running") > 0)
    episodes = []
    for first, last in true_runs(mask):
        if last - first + 1 < th.spin_min_iterations:
            continue
        span = slice(first, last + 1)
        reasons = {WAIT_REASONS[n][0]: int(tl.col(n)[last]) for n in WAIT_REASONS}
        episodes.append(Episode(
            kind="stall",
            engine_index=tl.engine_index,
            start_ns=int(tl.col("start_ns")[first]),
            end_ns=int(tl.col("end_ns")[last]),
            title="Engine spinning: iterations schedule nothing",
            evidence=(
                f"{last - first + 1} iterations scheduled no request while up to "
                f"{int(tl.col('waiting')[span].max())} waited and "
                f"{int(tl.col('running')[span].max())} ran; waiting by reason at the end: "
                f"{reasons}; KV usage {pct(tl.kv_usage[last])}"
            ),
            explanation=(
                "The loop is alive but admits nothing: the first waiting request cannot be "
                "admitted (e.g. it needs more free KV blocks than exist) and nothing running will "
                "free them."
            ),
            setting="Check for leaked KV blocks (kv_leak) and requests larger than the cache.",
            numbers={"num_iterations": last - first + 1},
        ))
    return episodes


def detect_kv_leaks(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    """Blocks used beyond what the running requests' tokens need.

    A running request holds at most ceil(its tokens / block_size) blocks plus one allocated
    ahead for its next token, so used <= ceil(kv_tokens / block_size) + 2 * running unless
    blocks are held by no request. Prefix sharing only lowers the left side.
    """
    block_size = int(tl.facts.get("block_size", 0))
    used, running = tl.col("blocks_used"), tl.col("running")
    if block_size:
        needed = -(-tl.col("kv_tokens") // block_size) + 2 * running
    else:
        needed = np.where(running > 0, used, 0)  # without block_size only the idle case is seen
    excess = used - needed
    min_blocks = max(th.leak_min_blocks, math.ceil(0.01 * tl.num_kv_blocks_total))
    episodes = []
    for first, last in _growing_runs(excess, min_blocks):
        span = slice(first, last + 1)
        nothing_running = bool((running[span] == 0).any())
        if last - first + 1 < th.leak_min_iterations and not nothing_running:
            continue
        episodes.append(_leak_episode(tl, first, last, excess, nothing_running))
    return episodes


def _growing_runs(excess: np.ndarray, min_blocks: int) -> list[tuple[int, int]]:
    """Runs of excess >= min_blocks; a run whose peak is not below the previous run's peak
    continues it (the excess is a lower bound that dips while many requests run)."""
    runs: list[tuple[int, int]] = []
    for first, last in true_runs(excess >= min_blocks, max_gap=LEAK_MAX_GAP):
        if runs and excess[first : last + 1].max() >= excess[runs[-1][0] : runs[-1][1] + 1].max():
            runs[-1] = (runs[-1][0], last)
        else:
            runs.append((first, last))
    return runs


def _leak_episode(tl, first, last, excess, nothing_running) -> Episode:
    usage = tl.kv_usage
    used, running = tl.col("blocks_used"), tl.col("running")
    idle_rows = np.flatnonzero(running[first : last + 1] == 0)
    idle_note = ""
    if idle_rows.size:
        row = first + int(idle_rows[-1])
        idle_note = (f"; at iteration {int(tl.col('iteration')[row])} nothing ran yet "
                     f"{int(used[row])} blocks ({pct(usage[row])}) were in use")
    return Episode(
        kind="kv_leak",
        engine_index=tl.engine_index,
        start_ns=int(tl.col("start_ns")[first]),
        end_ns=int(tl.col("end_ns")[last]),
        title="KV blocks leaking",
        evidence=(
            f"blocks held by no running request grew {int(excess[first])} -> {int(excess[last])} "
            f"over {last - first + 1} iterations; KV usage {pct(usage[first])} -> "
            f"{pct(usage[last])} while running was {int(running[first])} -> "
            f"{int(running[last])} (mean {running[first : last + 1].mean():.1f})" + idle_note
        ),
        explanation=(
            "KV blocks are not returned to the pool when requests finish: usage climbs while "
            "few or no requests run, until new requests cannot be admitted and clients time out."
        ),
        setting=(
            "Not a tuning setting: a block-accounting bug. Restart the engine to recover and "
            "report it with this recording (alert and runbook: IterscopeKVBlocksLeaked)."
        ),
        numbers={"excess_blocks_first": int(excess[first]), "excess_blocks_last": int(excess[last]),
                 "nothing_running": nothing_running, "usage_last": float(usage[last])},
    )


def detect_idle(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    episodes = []
    for group in _heartbeat_groups(tl, busy=False):
        since_ns = _iteration_end_ns(tl, group[0].last_iteration, before_ns=group[0].ts_ns)
        since_ns = group[0].ts_ns if since_ns is None else since_ns
        until_ns = group[-1].ts_ns
        if until_ns - since_ns < th.idle_min_time * NS_PER_S:
            continue
        episodes.append(Episode(
            kind="idle",
            engine_index=tl.engine_index,
            start_ns=since_ns,
            end_ns=until_ns,
            title="Idle",
            evidence=(f"{len(group)} heartbeats with nothing waiting or running, no iteration "
                      f"for {secs(until_ns - since_ns)}"),
            explanation="Nothing to do: no request was waiting or running.",
            setting="None needed.",
            severity=INFO,
            numbers={"idle_time_s": (until_ns - since_ns) / NS_PER_S},
        ))
    return episodes


def _send_ns(message: IterationRecord | Heartbeat) -> int:
    if isinstance(message, IterationRecord):
        return message.start_ns + message.elapsed_ns
    return message.ts_ns


def detect_telemetry_gaps(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    """Holes in seq (lost messages) and silences (no message, not even a heartbeat)."""
    segments = _seq_segments(sorted([*tl.records, *tl.heartbeats], key=_send_ns))
    holes, silences = [], []
    for segment in segments:
        by_seq = sorted(segment, key=lambda m: m.seq)
        holes += [(a, b, b.seq - a.seq - 1) for a, b in pairwise(by_seq) if b.seq > a.seq + 1]
    for number, segment in enumerate(segments):
        previous = segments[number - 1][-1] if number else None
        for before, after in pairwise([previous, *segment]):
            if before is None:
                continue
            gap_ns = _send_ns(after) - _send_ns(before)
            lost = after.seq > before.seq + 1 and after is not segment[0]
            if gap_ns >= th.silence_min_time * NS_PER_S and not lost:
                silences.append((before, after, after is segment[0]))
    return _hole_episodes(tl, holes, th) + [_silence_episode(tl, *s) for s in silences]


def _seq_segments(messages: list) -> list[list]:
    """Split time-ordered messages where seq starts again (a restarted engine)."""
    segments: list[list] = []
    highest_seq = 0
    for message in messages:
        restarted = message.seq + SEQ_RESTART_SLACK < highest_seq or (
            message.seq == 1 and highest_seq > 1)
        if restarted or not segments:
            segments.append([])
            highest_seq = 0
        segments[-1].append(message)
        highest_seq = max(highest_seq, message.seq)
    return segments


def _hole_episodes(tl: EngineTimeline, holes: list, th: Thresholds) -> list[Episode]:
    times = [_send_ns(before) for before, _, _ in holes]
    episodes = []
    for first, last in group_by_time(times, int(th.gap_merge_time * NS_PER_S)):
        group = holes[first : last + 1]
        num_lost = sum(n for _, _, n in group)
        num_dropped = sum(min(after.num_dropped, n) for _, after, n in group)
        start_ns, end_ns = _send_ns(group[0][0]), _send_ns(group[-1][1])
        episodes.append(Episode(
            kind="telemetry_gap",
            engine_index=tl.engine_index,
            start_ns=start_ns,
            end_ns=end_ns,
            title="Telemetry gap: messages lost",
            evidence=(
                f"{num_lost} messages missing (seq holes: {len(group)}); {num_dropped} of them "
                f"dropped by the engine because its send queue was full or no sidecar was "
                f"connected, {num_lost - num_dropped} lost after sending"
            ),
            explanation=(
                "The recording misses part of this stretch, so counts here are lower bounds; "
                "the engine itself was not slowed (telemetry never blocks it)."
            ),
            setting=(
                "Keep the sidecar running and keeping up (bench/sidecar_ingest.py), raise the "
                "publisher's send high-water mark, and pass every rotated recording file "
                "(runbook: IterscopeTelemetryDropping)."
            ),
            numbers={"num_lost": num_lost, "num_dropped_by_engine": num_dropped},
        ))
    return episodes


def _silence_episode(tl: EngineTimeline, before, after, restarted: bool) -> Episode:
    start_ns, end_ns = _send_ns(before), _send_ns(after)
    if restarted:
        what = "then the engine started again (seq restarted)"
        why = "The engine process died or was restarted: no heartbeat came while it was gone."
    else:
        what = "with no message lost (seq continuous)"
        why = ("The whole engine process was frozen, heartbeat thread included (suspended, or "
               "a native call holding the interpreter), then resumed.")
    return Episode(
        kind="telemetry_gap",
        engine_index=tl.engine_index,
        start_ns=start_ns,
        end_ns=end_ns,
        title="Engine silent" + (": restarted" if restarted else ""),
        evidence=f"no message for {secs(end_ns - start_ns)} (heartbeats are ~1 s apart), {what}",
        explanation=why,
        setting="Check the engine's logs and exit status (alert and runbook: IterscopeEngineDown).",
        numbers={"silent_time_s": (end_ns - start_ns) / NS_PER_S, "restarted": restarted},
    )


def detect_long_prefill(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    """Decoding requests wait for a prefill chunk: their inter-token latency jumps."""
    elapsed = tl.col("elapsed_ns")
    ctx_tokens, gen_reqs = tl.col("ctx_tokens"), tl.col("gen_reqs")
    decode_only = (ctx_tokens == 0) & (gen_reqs > 0)
    if decode_only.sum() < th.long_prefill_min_baseline_iterations:
        return []
    baseline_ns = float(np.median(elapsed[decode_only]))
    with_context = ctx_tokens > 0
    # What a context token costs, robustly (a median), so that a slow iteration counts only when
    # its chunk explains the slowness, not a hiccup of the machine (or warm-up).
    extra_per_token_ns = (elapsed[with_context] - baseline_ns) / ctx_tokens[with_context]
    ctx_token_ns = float(np.median(extra_per_token_ns)) if extra_per_token_ns.size else 0.0
    extra_ns = th.long_prefill_ratio * baseline_ns - baseline_ns
    stretched = (
        with_context & (gen_reqs > 0)
        & (elapsed >= th.long_prefill_ratio * baseline_ns)
        & (elapsed - baseline_ns >= th.long_prefill_min_extra_time * NS_PER_S)
        & (ctx_tokens * ctx_token_ns >= extra_ns)
    )
    index = np.flatnonzero(stretched)
    times = tl.col("start_ns")[index].tolist()
    episodes = []
    for first, last in group_by_time(times, int(th.gap_merge_time * NS_PER_S)):
        rows = index[first : last + 1]
        worst = int(rows[np.argmax(elapsed[rows])])
        episodes.append(Episode(
            kind="long_prefill",
            engine_index=tl.engine_index,
            start_ns=int(tl.col("start_ns")[rows[0]]),
            end_ns=int(tl.col("end_ns")[rows[-1]]),
            title="Long prefill chunks stretch decode latency",
            evidence=(
                f"{len(rows)} iterations mixing up to {int(ctx_tokens[rows].max())} context "
                f"tokens with decoding requests took up to {secs(elapsed[worst])} (iteration "
                f"{int(tl.col('iteration')[worst])}, {int(gen_reqs[worst])} decoding) against a "
                f"median decode-only iteration of {secs(baseline_ns)}"
            ),
            explanation=(
                "Chunked prefill puts a prompt chunk in the same iteration as the decoding "
                "requests; each of them waits for the whole chunk, so their inter-token latency "
                "spikes to the iteration time."
            ),
            setting=(
                f"Lower {_limit(tl, 'max_num_batched_tokens')} so chunks are smaller; "
                "`iterscope tune RECORDING --itl-target 50ms` computes the largest budget that "
                "keeps your target."
            ),
            numbers={"num_iterations": len(rows), "max_elapsed_s": elapsed[worst] / NS_PER_S,
                     "baseline_s": baseline_ns / NS_PER_S},
        ))
    return episodes


DETECTORS = (
    detect_kv_saturation,
    detect_kv_cliff,
    detect_preemption_storms,
    detect_waiting,
    detect_stalls,
    detect_kv_leaks,
    detect_idle,
    detect_telemetry_gaps,
    detect_long_prefill,
)


def detect_episodes(
    timeline: EngineTimeline, thresholds: Thresholds | None = None
) -> list[Episode]:
    """Every episode of one engine, ordered by start time."""
    thresholds = thresholds or Thresholds()
    episodes = [e for detector in DETECTORS for e in detector(timeline, thresholds)]
    return sorted(episodes, key=lambda e: (e.start_ns, e.kind))
