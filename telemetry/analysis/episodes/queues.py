"""Queue episodes: preemption storms, and requests waiting after scheduling."""

from __future__ import annotations

from typing import NamedTuple

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
from telemetry.lane.record import UNKNOWN_PREFILL_REQS

# Where the source does not say why requests wait, a limit is inferred to be what held them
# when the iterations that left requests waiting were at it in this share of them or more:
# nearly all, not all, as vLLM's stat-logger plugin reports one running request fewer for the
# step or two between a request's finish and the next one's admission (QA, vLLM 0.32,
# --max-num-seqs 2: 14 of 339 iterations).
INFERRED_LIMIT_SHARE = 0.9
# KV usage at or above this is "nearly full" (as _kv_room_text says it).
KV_NEARLY_FULL = 0.9


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
        setting=_waiting_setting(tl, reason, peak_usage, span),
        numbers={
            "reason": reason,
            "max_waiting_reqs": int(num_waiting.max()),
            "num_iterations": last - first + 1,
            "peak_usage": peak_usage,
        },
    )


def _waiting_setting(
    tl: EngineTimeline, reason: str, peak_usage: float | None, span: slice = slice(0, 0)
) -> str:
    """The action for requests that waited for ``reason``; where the source does not say why,
    one inferred from the episode's iterations ``span``."""
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
        return _unnamed_limit_action(tl, span, peak_usage)
    return "Check the engine's admission logic: requests waited with no limit reported."


def _kv_room_text(tl: EngineTimeline, peak_usage: float | None) -> str:
    """Whether the KV cache had room beside the sequence limit, when the source says."""
    if peak_usage is None:
        return (
            f"KV usage is {not_reported(tl.facts.get('source'))}, so whether the cache had "
            "room is not known"
        )
    room = "KV had room" if peak_usage < KV_NEARLY_FULL else "KV was nearly full too"
    return f"{room} (peak {pct(peak_usage)})"


class _LimitCheck(NamedTuple):
    """How one admission limit stood in the iterations that left requests waiting."""

    name: str  # the fact: max_num_seqs, max_num_batched_tokens
    num_at: int  # iterations at the limit
    num_rows: int  # iterations that left requests waiting
    evidence: str  # what the iterations say, in words

    @property
    def inferred(self) -> bool:
        return self.num_at >= INFERRED_LIMIT_SHARE * self.num_rows

    @property
    def never_reached(self) -> bool:
        return self.num_at == 0


def _share_text(num_at: int, num_rows: int) -> str:
    if num_at == num_rows:
        return "in every iteration while requests waited"
    return f"in {num_at} of the {num_rows} iterations while requests waited"


def _seq_check(tl: EngineTimeline, rows: np.ndarray) -> _LimitCheck | None:
    """Running requests against the engine's max_num_seqs; None where the facts lack it."""
    limit = int(tl.facts.get("max_num_seqs") or 0)
    if not limit:
        return None
    running = tl.col("num_running_reqs")[rows]
    num_at = int((running >= limit).sum())
    evidence = (
        f"{limit} running, the --max-num-seqs limit, {_share_text(num_at, len(rows))}"
        if num_at
        else f"at most {int(running.max())} running of --max-num-seqs {limit}"
    )
    return _LimitCheck("max_num_seqs", num_at, len(rows), evidence)


def _budget_check(tl: EngineTimeline, rows: np.ndarray) -> _LimitCheck | None:
    """The steps' scheduled tokens against max_num_batched_tokens; None where the facts lack
    it or the source gives no step's own token count (vLLM's plugin without
    --enable-logging-iteration-details counts a prompt in the step that finishes it)."""
    budget = int(tl.facts.get("max_num_batched_tokens") or 0)
    if not budget or not tl.known(UNKNOWN_PREFILL_REQS)[rows].all():
        return None
    tokens = tl.num_computed_tokens[rows]
    num_at = int((tokens >= budget).sum())
    evidence = (
        f"{budget} tokens scheduled, the --max-num-batched-tokens limit, "
        f"{_share_text(num_at, len(rows))}"
        if num_at
        else f"at most {int(tokens.max())} tokens a step of --max-num-batched-tokens {budget}"
    )
    return _LimitCheck("max_num_batched_tokens", num_at, len(rows), evidence)


def _why_unknown_text(tl: EngineTimeline) -> str:
    source = tl.facts.get("source")
    if source == "vllm-stat-logger":
        return "vLLM's stat-logger plugin cannot say why requests wait"
    return "the source" + (f" ({source})" if source else "") + " does not say why requests wait"


def _unnamed_limit_action(tl: EngineTimeline, span: slice, peak_usage: float | None) -> str:
    """The action for requests that waited for a limit the source does not name, inferred
    from what the episode's iterations ``span`` do say, and said to be inferred: running
    requests at max_num_seqs in nearly all those that left requests waiting -> the sequence
    limit; else their scheduled tokens at max_num_batched_tokens -> the token budget; else
    KV usage nearly full -> the cache; well below with neither limit reached -> no limit
    explains the wait. Where a figure is missing (a limit not among the facts, KV usage or
    the steps' tokens not reported), the limits it leaves open, with how to tell them apart."""
    rows = np.arange(span.start, span.stop)[tl.col("num_waiting_reqs")[span] > 0]
    why = _why_unknown_text(tl)
    checks = [c for c in (_seq_check(tl, rows), _budget_check(tl, rows)) if rows.size and c]
    for check in checks:
        if check.inferred:
            reason = "waiting_seq_limit" if check.name == "max_num_seqs" else "waiting_budget"
            limit = "sequence limit" if check.name == "max_num_seqs" else "token budget"
            return (
                f"The {limit}, inferred: {check.evidence} ({why}). "
                f"{_waiting_setting(tl, reason, peak_usage)}"
            )
    evidence = "; ".join(check.evidence for check in checks)
    bracketed = f" ({evidence})" if evidence else ""
    kv_limit = f"the cache is the limit (raise {kv_memory_text(tl)}; {kv_plan_hint(tl)})"
    if peak_usage is not None and peak_usage >= KV_NEARLY_FULL:
        return (
            f"The KV cache, inferred: KV usage peaked at {pct(peak_usage)}"
            + (f"; {evidence}" if evidence else "")
            + f" ({why}). {_waiting_setting(tl, 'waiting_kv', peak_usage)}"
        )
    open_limits = [
        flag
        for name, flag in (
            ("max_num_seqs", "--max-num-seqs"),
            ("max_num_batched_tokens", "--max-num-batched-tokens"),
        )
        if not any(c.name == name and c.never_reached for c in checks)
    ]
    if peak_usage is None:
        if not open_limits:
            return (
                f"Neither --max-num-seqs nor --max-num-batched-tokens was reached while "
                f"requests waited ({evidence}; {why}), and KV "
                f"usage is {not_reported(tl.facts.get('source'))} either: if the engine's own "
                f"metrics show its KV cache nearly full, {kv_limit}. If they do not, no "
                f"admission limit explains the wait: {_held_back_text(tl)}"
            )
        return (
            f"KV usage is {not_reported(tl.facts.get('source'))} either, so the limit is not "
            f"known{bracketed}: if the engine's own metrics show its KV cache nearly full, "
            f"{kv_limit}; if not, {_open_limits_text(open_limits)}."
        )
    if not open_limits:
        held_back = _held_back_text(tl)
        return (
            f"Not an admission limit, inferred: neither --max-num-seqs nor "
            f"--max-num-batched-tokens was reached while requests waited "
            f"({evidence}) and KV usage peaked at {pct(peak_usage)}, short of full, so they do "
            f"not explain the wait ({why}). {held_back[0].upper()}{held_back[1:]}"
        )
    return (
        f"KV usage peaked at {pct(peak_usage)}, short of full, so the cache is likely not the "
        f"limit{bracketed}: {_open_limits_text(open_limits)}."
    )


def _open_limits_text(flags: list[str]) -> str:
    if len(flags) == 2:
        return f"{flags[0]} or {flags[1]} is ({TUNE_TEXT} picks both)"
    return f"{flags[0]} is ({TUNE_TEXT} picks a value)"


def _held_back_text(tl: EngineTimeline) -> str:
    """_held_back_action after a sentence that already says no limit held the requests, in
    lower case: ``find what holds the requests back (...)``."""
    text = _held_back_action(tl).removeprefix("Not an admission limit: ")
    return text[0].lower() + text[1:]


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
