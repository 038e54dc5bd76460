"""Episodes: stretches of a recording that answer an operator's question, found from records.

Input is one engine's timeline (its IterationRecords and Heartbeats from a recording); output
is a list of Episode, each with a start and end in the engine's record time (monotonic ns), the
numbers that prove it, a plain-language explanation and the setting to change.

What each detector looks at (all thresholds are in ``Thresholds``, episode.py):

    kv_saturation     KV usage >= 95% for 10+ iterations
    kv_cliff          KV usage falls from >= 90% by 40+ points within 5 iterations while
                      running requests (not finished ones) turn into waiting ones,
                      preemptions counted or not
    preemption_storm  3+ preemptions with less than 1 s between them
    waiting           requests wait after scheduling for 1 s+, named by the dominant reason
                      (KV capacity, max_num_seqs, max_num_batched_tokens)
    stall             heartbeats say work waits or runs but last_iteration stays frozen for
                      longer than the live sidecar's stall threshold (the same StallRule:
                      twice the longest recent progress interval, at least 5 s), or
                      iterations run that schedule nothing while work waits
    kv_leak           KV blocks held beyond what the running requests' tokens need
                      (used > ceil(kv_tokens / block_size) + 2 * running), e.g. blocks used
                      with nothing running
    idle              heartbeats, nothing waiting or running, no iteration, for 5 s+ (info)
    telemetry_gap     holes in ``msg_seq`` (lost messages), or no message at all for longer
                      than the live sidecar waits before it calls the engine dead (2.5 s)
    long_prefill      iterations whose prefill chunk makes them 3x slower than the median
                      decode-only iteration of the 30 s before each, while requests are decoding
                      (the chunk's size times the median cost of a context token over the same
                      30 s must account for the slowdown), often enough to set the p99
                      inter-token latency (1%+ of the decoding steps of those 30 s) or by a
                      pause of 1 s+
    slow_decode       decode-only iterations 3x slower than the median of those that computed
                      as many requests or more in the 30 s before each: slowed from outside the
                      batch (other jobs on the host, a throttled device), noticed as a long
                      prefill is (1%+ of the decoding steps, or a pause of 1 s+); shorter than
                      the stall rule's floor (longer: a stall)
    costly_drafts     speculative decoding's drafts add 10%+ to a decoding request's time per
                      output token, by the fit of iteration time (tune's payoff) over the 30 s
                      before each 10 s step (30+ drafting iterations), at two standard errors
                      in their favour
    futile_speculation
                      speculative decoding on, yet the 100+ decoding iterations of the 30 s
                      before an iteration accepted fewer tokens than 1% of their decoding
                      requests' steps: it spared them next to nothing (its cost is unknown)

A healthy run (load within the limits, no faults) yields no episode but ``idle``.

Modules: ``episode`` (Episode, Thresholds, shared helpers), ``kv``, ``queues``, ``liveness``,
``latency``, ``drafts`` (the detectors by concept); the timeline they read is
``telemetry.analysis.timeline``.
"""

from __future__ import annotations

from telemetry.analysis.episodes.drafts import detect_costly_drafts, detect_futile_speculation
from telemetry.analysis.episodes.episode import (
    INFO,
    PROBLEM,
    TUNE_TEXT,
    Episode,
    Thresholds,
    flag_text,
    group_by_time,
    kv_plan_hint,
    pct,
    secs,
    true_runs,
)
from telemetry.analysis.episodes.kv import detect_kv_cliff, detect_kv_leaks, detect_kv_saturation
from telemetry.analysis.episodes.liveness import detect_idle, detect_stalls, detect_telemetry_gaps
from telemetry.analysis.episodes.long_prefill import detect_long_prefill
from telemetry.analysis.episodes.queues import detect_preemption_storms, detect_waiting
from telemetry.analysis.episodes.related import note_slowed_queues
from telemetry.analysis.episodes.slow_decode import detect_slow_decode, search_slow_decode
from telemetry.analysis.timeline import (
    FACT_FIELDS,
    NS_PER_S,
    RECORD_FIELDS,
    WAIT_REASONS,
    EngineTimeline,
    build_timelines,
)

__all__ = [
    "DETECTORS",
    "FACT_FIELDS",
    "INFO",
    "kv_plan_hint",
    "NS_PER_S",
    "PROBLEM",
    "RECORD_FIELDS",
    "TUNE_TEXT",
    "WAIT_REASONS",
    "EngineTimeline",
    "Episode",
    "Thresholds",
    "build_timelines",
    "detect_episodes",
    "detect_costly_drafts",
    "detect_futile_speculation",
    "detect_idle",
    "detect_kv_cliff",
    "detect_kv_leaks",
    "detect_kv_saturation",
    "detect_long_prefill",
    "detect_preemption_storms",
    "detect_slow_decode",
    "detect_stalls",
    "detect_telemetry_gaps",
    "detect_waiting",
    "search_slow_decode",
    "flag_text",
    "group_by_time",
    "note_slowed_queues",
    "pct",
    "secs",
    "true_runs",
]


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
    detect_slow_decode,
    detect_costly_drafts,
    detect_futile_speculation,
)


def detect_episodes(
    timeline: EngineTimeline, thresholds: Thresholds | None = None
) -> list[Episode]:
    """Every episode of one engine, ordered by start time."""
    thresholds = thresholds or Thresholds()
    episodes = [e for detector in DETECTORS for e in detector(timeline, thresholds)]
    note_slowed_queues(episodes)
    return sorted(episodes, key=lambda e: (e.start_ns, e.kind))
