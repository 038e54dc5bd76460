"""Queue episodes: preemption storms, and requests waiting after scheduling."""

from __future__ import annotations

import numpy as np

from telemetry.analysis.episodes.episode import (
    TUNE_TEXT,
    Episode,
    Thresholds,
    flag_text,
    group_by_time,
    kv_memory_text,
    kv_plan_hint,
    kv_usage_at,
    kv_usage_text,
    pct,
    span_episode,
    true_runs,
)
from telemetry.analysis.timeline import NS_PER_S, WAIT_REASONS, EngineTimeline
from telemetry.analysis.words import not_reported, plural


def detect_preemption_storms(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    index = np.flatnonzero(tl.col("num_preemptions") > 0)
    times = tl.col("start_ns")[index].tolist()
    episodes = []
    for first, last in group_by_time(times, int(th.storm_window_time * NS_PER_S)):
        rows = index[first : last + 1]
        num_preemptions = int(tl.col("num_preemptions")[rows].sum())
        if num_preemptions < th.storm_min_preemptions:
            continue
        span = slice(int(rows[0]), int(rows[-1]) + 1)
        num_prefill_tokens = int(tl.col("num_prefill_tokens")[span].sum())
        episodes.append(
            span_episode(
                tl,
                rows[0],
                rows[-1],
                kind="preemption_storm",
                title="Preemption storm",
                evidence=(
                    f"{plural(num_preemptions, 'preemption')} in {plural(len(rows), 'iteration')}; "
                    f"{kv_usage_text(kv_usage_at(tl, span), 'KV usage peak')}; "
                    f"{plural(num_prefill_tokens, 'prefill token')} computed "
                    f"meanwhile (recompute included); waiting up to "
                    f"{int(tl.col('num_waiting_reqs')[span].max())}"
                ),
                explanation=(
                    "Running requests ran out of KV blocks as they grew, so the scheduler evicted "
                    "some and will recompute them: work is thrown away and latency rises."
                ),
                setting=(
                    f"Lower {flag_text(tl, 'max_num_seqs')} or client concurrency, or raise "
                    f"{kv_memory_text(tl)}, so the requests admitted together fit until they "
                    f"finish ({kv_plan_hint(tl)}; runbook: IterscopePreemptionStorm)."
                ),
                numbers={"num_preemptions": num_preemptions, "num_iterations": len(rows)},
            )
        )
    return episodes


def detect_waiting(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    waiting = tl.col("num_waiting_reqs")
    episodes = []
    for first, last in true_runs(waiting > 0, max_gap=2):
        start_ns, end_ns = int(tl.col("start_ns")[first]), int(tl.col("end_ns")[last])
        if (
            last - first + 1 < th.waiting_min_iterations
            or end_ns - start_ns < th.waiting_min_time * NS_PER_S
        ):
            continue
        episodes.append(_waiting_episode(tl, first, last))
    return episodes


def _waiting_episode(tl: EngineTimeline, first: int, last: int) -> Episode:
    span = slice(first, last + 1)
    totals = {name: int(tl.col(r.field)[span].sum()) for name, r in WAIT_REASONS.items()}
    num_waiting = tl.col("num_waiting_reqs")[span]
    num_waiting_sum = int(num_waiting.sum())
    reason = max(totals, key=totals.get) if any(totals.values()) else ""
    label, cause = (
        (WAIT_REASONS[reason].limit, WAIT_REASONS[reason].cause)
        if reason
        else ("unattributed", "no admission limit was reported")
    )
    split = ", ".join(
        f"{WAIT_REASONS[name].limit} {pct(total / max(num_waiting_sum, 1))}"
        for name, total in totals.items()
    )
    if not tl.waiting_reasons_known:
        label, cause = "reason not reported", "of a limit the source does not name"
        split = not_reported(tl.facts.get("source"))
    peak_usage = kv_usage_at(tl, span)
    return span_episode(
        tl,
        first,
        last,
        kind="waiting",
        title=f"Requests waiting: {label}",
        evidence=(
            f"waiting > 0 in {plural(last - first + 1, 'iteration')} (mean "
            f"{num_waiting.mean():.1f}, max {int(num_waiting.max())}); "
            f"reasons: {split}; running mean {tl.col('num_running_reqs')[span].mean():.1f}; "
            f"{kv_usage_text(peak_usage, 'KV usage peak')}"
        ),
        explanation=f"Requests queued because {cause}; their time to first token grows.",
        setting=_waiting_setting(tl, reason, peak_usage),
        numbers={
            "reason": reason,
            "max_waiting_reqs": int(num_waiting.max()),
            "num_iterations": last - first + 1,
            "peak_usage": peak_usage,
        },
    )


def _waiting_setting(tl: EngineTimeline, reason: str, peak_usage: float | None) -> str:
    if reason == "waiting_kv":
        return (
            f"Raise {kv_memory_text(tl)}, lower --max-model-len, or send fewer concurrent "
            f"requests ({kv_plan_hint(tl)})."
        )
    if reason == "waiting_seq_limit":
        return (
            f"Raise {flag_text(tl, 'max_num_seqs')}: {_kv_room_text(tl, peak_usage)}; "
            f"{TUNE_TEXT} picks a value that keeps it."
        )
    if reason == "waiting_budget":
        return (
            f"Raise {flag_text(tl, 'max_num_batched_tokens')} for more throughput at the "
            f"cost of longer iterations; {TUNE_TEXT} picks a value that keeps it."
        )
    if reason == "waiting_other":
        return _held_back_action(tl)
    if not tl.waiting_reasons_known:
        return _unnamed_limit_action(tl, peak_usage)
    return "Check the engine's admission logic: requests waited with no limit reported."


def _kv_room_text(tl: EngineTimeline, peak_usage: float | None) -> str:
    """Whether the KV cache had room beside the sequence limit, when the source says."""
    if peak_usage is None:
        return (
            f"KV usage is {not_reported(tl.facts.get('source'))}, so whether the cache had "
            "room is not known"
        )
    room = "KV had room" if peak_usage < 0.9 else "KV was nearly full too"
    return f"{room} (peak {pct(peak_usage)})"


def _unnamed_limit_action(tl: EngineTimeline, peak_usage: float | None) -> str:
    """The action for requests that waited for a limit the source does not name: read from
    the KV usage peak where the source reports it, else both limits and how to tell them
    apart."""
    kv_limit = f"the cache is the limit (raise {kv_memory_text(tl)}; {kv_plan_hint(tl)})"
    other_limits = f"--max-num-seqs or --max-num-batched-tokens is ({TUNE_TEXT} picks both)"
    if peak_usage is None:
        return (
            f"KV usage is {not_reported(tl.facts.get('source'))} either, so the limit is not "
            f"known: if the engine's own metrics show its KV cache nearly full, {kv_limit}; "
            f"if not, {other_limits}."
        )
    return (
        f"KV usage peaked at {pct(peak_usage)}: near 100% {kv_limit}; well below, {other_limits}."
    )


def _held_back_action(tl: EngineTimeline) -> str:
    """Requests the engine held back, not for a limit: vLLM's prefill cadence when it runs
    with one (the likeliest cause, and one flag), else the holds it may have."""
    holds = (
        "a paused engine; structured-output grammars still compiling; KV transfers from a "
        "remote instance; streaming inputs waiting for their next part"
    )
    interval = tl.facts.get("prefill_schedule_interval", 0)
    if interval > 1:
        return (
            f"Lower {flag_text(tl, 'prefill_schedule_interval')}, down to 1 to turn the "
            f"cadence off: vLLM admits prompts once every {interval} steps while others "
            "decode, so a prompt waits up to that many steps; the price is decode steps "
            "stretched by prefills more often. If lowering it does not help, the hold is "
            f"another ({holds})."
        )
    return (
        "Not an admission limit: find what holds the requests back (vLLM: its prefill "
        "cadence, --prefill-schedule-interval, which admits prompts once every N steps "
        f"while others decode; {holds})."
    )
