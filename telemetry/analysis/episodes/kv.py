"""KV cache episodes: saturation, a cliff (running requests turned waiting), leaked blocks."""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from telemetry.analysis.episodes.episode import (
    INFO,
    PROBLEM,
    Episode,
    Thresholds,
    flag_text,
    kv_memory_text,
    kv_plan_hint,
    pct,
    secs,
    span_episode,
    true_runs,
)
from telemetry.analysis.timeline import NS_PER_S, EngineTimeline
from telemetry.analysis.words import plural, were
from telemetry.lane.record import UNKNOWN_KV_TOKENS

AFTER_NS = 5 * NS_PER_S  # after a cliff, how long the evidence says what the engine did
LEAK_MAX_GAP = 10  # iterations; the running requests' slack makes the excess dip a little


def detect_kv_saturation(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    usage = tl.kv_usage
    episodes = []
    for first, last in true_runs(usage >= th.kv_saturated_ratio, max_gap=2):
        if last - first + 1 < th.kv_saturated_min_iterations:
            continue
        span = slice(first, last + 1)
        # The iteration that brought usage below the threshold is the saturation's too: a
        # preemption there is what ended it (freeing the blocks), as the cliff after it says.
        num_preemptions = int(tl.col("num_preemptions")[first : last + 2].sum())
        max_waiting_kv = int(tl.col("num_waiting_kv_reqs")[span].max())
        max_waiting = int(tl.col("num_waiting_reqs")[span].max())
        peak = float(usage[span].max())
        if tl.waiting_reasons_known:
            waited = f"{plural(max_waiting_kv, 'request')} at most waited for KV capacity"
            num_blocked = max_waiting_kv
        else:  # the source does not say why requests wait: say what is known
            waited = (
                f"{plural(max_waiting, 'request')} at most waited (the source reports no reason)"
            )
            num_blocked = max_waiting
        episodes.append(
            span_episode(
                tl,
                first,
                last,
                kind="kv_saturation",
                title="KV cache saturated",
                evidence=(
                    f"KV usage >= {pct(th.kv_saturated_ratio)} for "
                    f"{plural(last - first + 1, 'iteration')} "
                    f"(peak {pct(peak)} of {plural(tl.num_kv_blocks_total, 'block')}); "
                    f"{waited}; "
                    f"{plural(num_preemptions, 'preemption')}; "
                    f"running {int(tl.col('num_running_reqs')[first])} -> "
                    f"{int(tl.col('num_running_reqs')[last])}"
                ),
                explanation=_saturation_explanation(
                    peak, num_blocked, num_preemptions, tl.waiting_reasons_known
                ),
                setting=(
                    f"Raise {kv_memory_text(tl)}, lower --max-model-len, or lower "
                    f"{flag_text(tl, 'max_num_seqs')} or client concurrency so peak usage stays "
                    f"below ~90% ({kv_plan_hint(tl)}; runbook: IterscopeKVCacheSaturated)."
                ),
                severity=PROBLEM if num_blocked or num_preemptions else INFO,
                numbers={
                    "peak_usage": peak,
                    "num_iterations": last - first + 1,
                    "num_preemptions": num_preemptions,
                    "max_waiting_kv_reqs": max_waiting_kv if tl.waiting_reasons_known else None,
                },
            )
        )
    return episodes


def _waiting_kv_text(tl: EngineTimeline, row: int) -> str:
    if not tl.waiting_reasons_known:
        return "reason not reported by the source"
    return f"{int(tl.col('num_waiting_kv_reqs')[row])} for KV capacity"


def _saturation_explanation(
    peak: float, num_blocked: int, num_preemptions: int, reasons_known: bool
) -> str:
    """Each clause only when the records show it: waiting and preemption are told apart, a
    full cache is claimed only at 100%, and waiting is blamed on KV only when the source says
    why requests waited (``num_blocked`` is then those waiting for KV, else all waiting)."""
    full = (
        "Every KV block was in use"
        if peak >= 1.0
        else f"The KV cache was nearly full (peak {pct(peak)})"
    )
    if not num_blocked and not num_preemptions:
        return (
            f"{full} but what was admitted still fit: no request waited for KV "
            "and none was preempted. Any more load will wait or be preempted."
        )
    effects = []
    if num_blocked and reasons_known:
        effects.append("new requests could not be admitted and waited")
    elif num_blocked:
        effects.append("requests waited (the source does not say whether for KV capacity)")
    if num_preemptions:
        effects.append(
            f"{plural(num_preemptions, 'running request')} that needed a new block "
            f"{were(num_preemptions)} preempted (recomputed later)"
        )
    else:
        effects.append("no running request was preempted")
    return f"{full}: {'; '.join(effects)}."


def detect_kv_cliff(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    """Usage collapses from high to low in a few iterations while running turns to waiting."""
    usage = tl.kv_usage
    running, waiting = tl.col("num_running_reqs"), tl.col("num_waiting_reqs")
    window = th.kv_cliff_max_iterations
    candidates = []
    for i in _possible_cliff_ends(usage, window, th):
        lookback = slice(max(0, i - window), i)
        high = max(0, i - window) + int(np.argmax(usage[lookback]))
        if usage[high] < th.kv_cliff_high_ratio or usage[high] - usage[i] < th.kv_cliff_min_drop:
            continue
        num_finished = int(tl.col("num_finished_reqs")[high + 1 : i + 1].sum())
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


def _possible_cliff_ends(usage: np.ndarray, window: int, th: Thresholds) -> list[int]:
    """The iterations i >= 1 whose highest usage in the ``window`` before them is high enough
    and far enough above theirs (what detect_kv_cliff checks first), found with numpy."""
    if len(usage) < 2:
        return []
    padded = np.concatenate([np.full(window - 1, -np.inf), usage[:-1]])
    highest = sliding_window_view(padded, window).max(axis=1)  # over usage[i - window : i]
    possible = (highest >= th.kv_cliff_high_ratio) & (highest - usage[1:] >= th.kv_cliff_min_drop)
    return (np.flatnonzero(possible) + 1).tolist()


def _kv_cliff_episode(tl: EngineTimeline, high: int, low: int) -> Episode:
    usage = tl.kv_usage
    running, waiting = tl.col("num_running_reqs"), tl.col("num_waiting_reqs")
    num_preemptions = int(tl.col("num_preemptions")[high : low + 1].sum())
    after_end = int(np.searchsorted(tl.col("start_ns"), tl.col("end_ns")[low] + AFTER_NS))
    after = slice(low + 1, after_end)
    # Only what the timeline holds: live, a cliff is found within a second of it
    seen_after_ns = min(AFTER_NS, tl.last_ns - int(tl.col("end_ns")[low]))
    next_time = (
        "the next 5 s" if seen_after_ns >= AFTER_NS else f"the {secs(seen_after_ns)} recorded since"
    )
    num_after = after_end - low - 1
    num_prefill_after = int(tl.col("num_prefill_tokens")[after].sum())
    num_decode_after = int(tl.col("num_decode_tokens")[after].sum())
    num_evicted = int(running[high] - running[low]) - int(
        tl.col("num_finished_reqs")[high + 1 : low + 1].sum()
    )
    return span_episode(
        tl,
        high,
        low,
        kind="kv_cliff",
        title="KV cache cliff: running requests became waiting",
        evidence=(
            f"KV usage {pct(usage[high])} -> {pct(usage[low])} in "
            f"{plural(low - high, 'iteration')} "
            f"(iterations {int(tl.col('iteration')[high])}-{int(tl.col('iteration')[low])}); "
            f"running {int(running[high])} -> {int(running[low])}, waiting "
            f"{int(waiting[high])} -> {int(waiting[low])} "
            f"({_waiting_kv_text(tl, low)}); "
            f"preemptions counted: {num_preemptions}; "
            + (
                f"{plural(num_after, 'iteration')} ran in {next_time} ({num_prefill_after} "
                f"prefill tokens, {num_decode_after} decode tokens)"
                if num_after
                else f"no iteration ran in {next_time}"
            )
        ),
        explanation=_cliff_explanation(
            num_preemptions, num_evicted, num_after, num_prefill_after, next_time
        ),
        setting=(
            f"Peak KV usage reached {pct(usage[high])} with "
            f"{plural(int(running[high]), 'request')}: lower "
            f"{flag_text(tl, 'max_num_seqs')} or client concurrency so the peak stays below "
            f"~90%, or raise {kv_memory_text(tl)} ({kv_plan_hint(tl)})."
        ),
        numbers={
            "usage_before": float(usage[high]),
            "usage_after": float(usage[low]),
            "running_before": int(running[high]),
            "running_after": int(running[low]),
            "num_preemptions": num_preemptions,
            "num_evicted": num_evicted,
            "num_iterations_after": num_after,
        },
    )


def _cliff_explanation(
    num_preemptions: int, num_evicted: int, num_after: int, num_prefill_after: int, next_time: str
) -> str:
    """Preemption is claimed only when counted, iterating only when iterations followed
    (in ``next_time``: the next 5 s, or less where the timeline ends sooner)."""
    num_gone = num_preemptions or num_evicted
    their, they = ("its", "it") if num_gone == 1 else ("their", "they")
    if num_preemptions:
        why = (
            f"The scheduler preempted {plural(num_preemptions, 'running request')} (by "
            f"recompute) and freed {their} KV blocks: {they} went back to the waiting queue and "
            f"must prefill {their} whole prompt again, which with long prompts costs as much as "
            "the first time."
        )
    else:
        why = (
            f"{plural(num_evicted, 'running request')} released {their} KV blocks and returned "
            f"to the waiting queue, yet no preemption was counted: {they} {were(num_evicted)} "
            "evicted by a path that does not count as a preemption."
        )
    if not num_after:
        return why + f" No iteration followed in {next_time}."
    if num_preemptions:
        return why
    return (
        why + " The engine did not stop: it kept iterating "
        f"({plural(num_after, 'iteration')} in {next_time}, "
        f"{plural(num_prefill_after, 'prefill token')} among them: the evicted "
        f"{'prompt is' if num_evicted == 1 else 'prompts are'} computed again)."
    )


def detect_kv_leaks(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    """Blocks used beyond what the running requests' tokens need.

    A running request holds at most ceil(its tokens / block_size) blocks plus one allocated
    ahead for its next token, so used <= ceil(kv_tokens / block_size) + 2 * running unless
    blocks are held by no request. Prefix sharing only lowers the left side. Without the
    block size or the tokens held (vLLM does not report them) only the idle case is seen:
    blocks used while nothing runs.
    """
    excess = leaked_blocks(tl)
    running = tl.col("num_running_reqs")
    min_blocks = leak_min_blocks(tl, th)
    episodes = []
    for first, last in _growing_runs(excess, min_blocks):
        span = slice(first, last + 1)
        nothing_running = bool((running[span] == 0).any())
        if last - first + 1 < th.leak_min_iterations and not nothing_running:
            continue
        episodes.append(_leak_episode(tl, first, last, excess, nothing_running))
    return episodes


def leaked_blocks(tl: EngineTimeline) -> np.ndarray:
    """Per iteration, the KV blocks used beyond what the running requests' tokens need: those
    held by no request (a lower bound; detect_kv_leaks says why)."""
    block_size = int(tl.facts.get("block_size", 0))
    used, running = tl.col("num_kv_blocks_used"), tl.col("num_running_reqs")
    idle_case = np.where(running > 0, used, 0)
    if block_size:
        by_tokens = -(-tl.col("num_kv_tokens") // block_size) + 2 * running
        needed = np.where(tl.known(UNKNOWN_KV_TOKENS), by_tokens, idle_case)
    else:
        needed = idle_case
    return used - needed


def leak_min_blocks(tl: EngineTimeline, th: Thresholds) -> int:
    """The fewest blocks held by no request that make a leak."""
    return max(th.leak_min_blocks, math.ceil(0.01 * tl.num_kv_blocks_total))


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
    used, running = tl.col("num_kv_blocks_used"), tl.col("num_running_reqs")
    idle_rows = np.flatnonzero(running[first : last + 1] == 0)
    idle_note = ""
    if idle_rows.size:
        row = first + int(idle_rows[-1])
        idle_note = (
            f"; at iteration {int(tl.col('iteration')[row])} nothing ran yet "
            f"{plural(int(used[row]), 'block')} ({pct(usage[row])}) "
            f"{were(int(used[row]))} in use"
        )
    excess_first, excess_last = int(excess[first]), int(excess[last])
    if excess_last > excess_first:
        trend = f"grew {excess_first} -> {excess_last}"
    else:  # a lower bound that dips while requests run: a fall is no fall of the leak
        peak = int(excess[first : last + 1].max())
        trend = (
            f"were {excess_first} -> {excess_last}, up to {peak} (a lower bound, lower while "
            "requests run)"
        )
    return span_episode(
        tl,
        first,
        last,
        kind="kv_leak",
        title="KV blocks leaking",
        evidence=(
            f"blocks held by no running request {trend} "
            f"over {plural(last - first + 1, 'iteration')}; KV usage {pct(usage[first])} -> "
            f"{pct(usage[last])} while running was {int(running[first])} -> "
            f"{int(running[last])} (mean {running[first : last + 1].mean():.1f})" + idle_note
        ),
        explanation=_leak_explanation(excess_first, excess_last),
        setting=(
            "Not a tuning setting: a block-accounting bug. Restart the engine to recover and "
            "report it with this recording (alert and runbook: IterscopeKVBlocksLeaked)."
        ),
        numbers={
            "excess_blocks_first": excess_first,
            "excess_blocks_last": excess_last,
            "nothing_running": nothing_running,
            "usage_last": float(usage[last]),
        },
    )


def _leak_explanation(excess_first: int, excess_last: int) -> str:
    """Climbing usage is claimed only where the blocks held by no request grew."""
    if excess_last > excess_first:
        return (
            "KV blocks are not returned to the pool when requests finish: usage climbs while "
            "few or no requests run, until new requests cannot be admitted and clients time "
            "out."
        )
    return (
        f"KV blocks were not returned to the pool: {plural(excess_last, 'block')} stayed "
        "held by no running request (they did not grow here), so fewer are left for new "
        "requests."
    )
