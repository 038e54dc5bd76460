"""A one-screen summary of one engine's recording, answering "batched or queued?".

Batch composition comes straight from the records: requests per iteration (context +
generation; over the iterations that scheduled any, an engine spinning on none left out), how
many iterations mixed a prefill chunk with decoding, and how often requests
were left waiting after scheduling and why. Queue time and TTFT come from the requests'
milestones (arrival -> first scheduled -> first token); requests never scheduled (aborted
while waiting) or still waiting at the end are said beside them, as they leave them out. With
messages lost (seq holes), the counts they could hide are said as "at least".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from telemetry.analysis.episodes import Thresholds, pct, secs
from telemetry.analysis.episodes.liveness import detect_telemetry_gaps
from telemetry.analysis.spec_decode import Drafts, recorded_drafts, summary_line
from telemetry.analysis.timeline import NS_PER_S, WAIT_REASONS, EngineTimeline
from telemetry.analysis.words import plural
from telemetry.lane.record import (
    EVENT_FINISHED,
    EVENT_FIRST_TOKEN,
    FINISH_ABORT,
    UNKNOWN_KV_BLOCKS,
    UNKNOWN_PREEMPTIONS,
    UNKNOWN_PREFIX_CACHE,
)

# The keys of Summary.waiting_reason_shares, by WAIT_REASONS name: what `explain --json`
# scripts read, kept as they were when the text began naming limits by their flags.
SHARE_KEYS = {
    "waiting_kv": "KV capacity",
    "waiting_seq_limit": "max_num_seqs",
    "waiting_budget": "max_num_batched_tokens",
    "waiting_other": "other",
}
JSON_NAMES = {
    "num_prefill_tokens": "num_context_tokens",
    "num_decode_tokens": "num_generation_tokens",
}
SHARE_LABELS = {SHARE_KEYS[name]: reason.limit for name, reason in WAIT_REASONS.items()}
BATCHED_MIN_REQS = 1.5  # mean requests per iteration above which work is batched
QUEUED_MIN_SHARE = 0.05  # share of iterations with requests left waiting above which work queues


@dataclass
class Summary:
    engine_index: int
    duration_time: float
    num_iterations: int
    num_timed_iterations: int  # iterations with a measured time: the quantiles below are theirs
    busy_share: float
    iteration_time_p50: float
    iteration_time_p99: float
    iteration_time_max: float
    num_empty_iterations: int  # iterations that scheduled no request (an engine spinning)
    mean_batch_reqs: float  # over the iterations that scheduled a request
    max_batch_reqs: int
    mean_batch_tokens: float  # tokens computed (timeline.num_computed_tokens), drafts included
    decode_only_share: float
    prefill_only_share: float
    mixed_share: float
    num_prefill_tokens: int
    num_decode_tokens: int  # produced, accepted draft tokens included
    active_time: float  # from the first iteration's start to the last one's end: the rates'
    prompt_throughput: float
    generation_throughput: float
    mean_running_reqs: float
    max_running_reqs: int
    waiting_share: float
    max_waiting_reqs: int
    waiting_reason_shares: dict
    mean_kv_usage: float | None  # None: the source does not report KV blocks (FPM)
    peak_kv_usage: float | None
    num_preemptions: int | None  # None: the source does not report preemptions (FPM)
    prefix_hit_rate: float | None  # None: the source does not report prefix-cache figures
    num_finished_reqs: int  # aborted ones included
    num_aborted_reqs: int  # of those, aborted: a client that gave up, an engine that stopped
    num_timed_reqs: int  # requests whose first token is recorded: the quantiles below are theirs
    num_unscheduled_reqs: int  # finished (aborted) without ever being scheduled
    max_unscheduled_wait: float  # the longest of their waits, arrival to abort, in seconds
    num_waiting_at_end: int  # requests waiting at the recording's last message
    num_lost_msgs: int  # messages missing from the recording (seq holes): counts are lower bounds
    queue_time_p50: float
    queue_time_p90: float
    ttft_p50: float
    ttft_p90: float
    verdict: str
    spec_decode: Drafts | None = None  # speculative decoding's, where a draft was scored

    def to_dict(self) -> dict:
        """As `explain --json` prints it: the keys scripts read, two of them from before the
        vocabulary was prefill/decode (JSON_NAMES); ``spec_decode`` only with drafts."""
        data = {JSON_NAMES.get(key, key): value for key, value in asdict(self).items()}
        del data["spec_decode"]
        if self.spec_decode is not None:
            data["spec_decode"] = self.spec_decode.to_json()
        return data


def _share(mask: np.ndarray) -> float:
    return float(mask.mean()) if mask.size else 0.0


def _quantile(values: list[float] | np.ndarray, q: float) -> float:
    return float(np.quantile(values, q)) if len(values) else 0.0


def _request_times(tl: EngineTimeline) -> tuple[list[float], list[float], int, int]:
    """Queue times and TTFTs in seconds, the number of finished requests, and of those the
    aborted ones (their clients gave up, or the engine stopped them)."""
    queue_times, ttfts, num_finished, num_aborted = [], [], 0, 0
    for record in tl.records:
        for milestone in record.milestones:
            if milestone.event & EVENT_FIRST_TOKEN:
                ttfts.append((milestone.first_token_ns - milestone.arrival_ns) / NS_PER_S)
                queue_time_ns = milestone.first_scheduled_ns - milestone.arrival_ns
                queue_times.append(queue_time_ns / NS_PER_S)
            if milestone.event & EVENT_FINISHED:
                num_finished += 1
                num_aborted += milestone.finish_reason == FINISH_ABORT
    return queue_times, ttfts, num_finished, num_aborted


def _unscheduled(tl: EngineTimeline) -> tuple[int, float]:
    """Requests that finished (aborted) without ever being scheduled, and the longest time one
    of them waited (arrival to finish, s): the queue-time quantiles cannot include them."""
    waits = [
        (m.finished_ns - m.arrival_ns) / NS_PER_S
        for record in tl.records
        for m in record.milestones
        if m.event & EVENT_FINISHED and not m.first_scheduled_ns and not m.num_output_tokens
    ]
    return len(waits), max(waits, default=0.0)


def _waiting_at_end(tl: EngineTimeline) -> int:
    """Requests waiting at the recording's last message (record or heartbeat)."""
    last_record = tl.records[-1] if tl.records else None
    last_heartbeat = tl.heartbeats[-1] if tl.heartbeats else None
    if last_heartbeat is not None and (
        last_record is None or last_heartbeat.ts_ns >= int(tl.col("end_ns")[-1])
    ):
        return last_heartbeat.num_waiting_reqs
    return last_record.num_waiting_reqs if last_record is not None else 0


def _num_lost_msgs(tl: EngineTimeline) -> int:
    """Messages missing from the recording, as its telemetry-gap findings count them."""
    gaps = detect_telemetry_gaps(tl, Thresholds())
    return sum(int(gap.numbers.get("num_lost", 0)) for gap in gaps)


def summarize(tl: EngineTimeline) -> Summary:
    """Summary of a timeline; every figure is 0 when the timeline has no iteration."""
    elapsed = tl.col("elapsed_ns")[tl.timed] / NS_PER_S
    prefill_tokens, decode_tokens = tl.col("num_prefill_tokens"), tl.col("num_decode_tokens")
    decode_reqs = tl.col("num_decode_reqs")
    all_batch_reqs = tl.col("num_prefill_reqs") + decode_reqs
    # an iteration that scheduled nothing (an engine spinning) batched nothing: left out
    scheduling = (all_batch_reqs > 0) | (tl.num_computed_tokens > 0)
    batch_reqs, batch_tokens = all_batch_reqs[scheduling], tl.num_computed_tokens[scheduling]
    waiting = tl.col("num_waiting_reqs")
    span_time = (tl.last_ns - tl.first_ns) / NS_PER_S
    active_time = (
        (tl.col("end_ns")[-1] - tl.col("start_ns")[0]) / NS_PER_S if tl.num_iterations else 0.0
    )
    num_waiting_total = max(int(waiting.sum()), 1)
    queue_times, ttfts, num_finished, num_aborted = _request_times(tl)
    num_unscheduled, max_unscheduled_wait = _unscheduled(tl)
    prefix_queries = sum(r.num_prefix_query_tokens for r in tl.records)
    prefix_hits = sum(r.num_prefix_hit_tokens for r in tl.records)
    summary = Summary(
        engine_index=tl.engine_index,
        duration_time=span_time,
        num_iterations=tl.num_iterations,
        num_timed_iterations=int(elapsed.size),
        busy_share=float(elapsed.sum() / span_time) if span_time else 0.0,
        iteration_time_p50=_quantile(elapsed, 0.5),
        iteration_time_p99=_quantile(elapsed, 0.99),
        iteration_time_max=float(elapsed.max()) if elapsed.size else 0.0,
        num_empty_iterations=int((~scheduling).sum()),
        mean_batch_reqs=float(batch_reqs.mean()) if batch_reqs.size else 0.0,
        max_batch_reqs=int(batch_reqs.max()) if batch_reqs.size else 0,
        mean_batch_tokens=float(batch_tokens.mean()) if batch_tokens.size else 0.0,
        # by decoding requests, not tokens produced: a vLLM source counts a prompt's first
        # token as produced, and a lone prefill step read as mixed
        decode_only_share=_share((prefill_tokens == 0) & (decode_reqs > 0)),
        prefill_only_share=_share((prefill_tokens > 0) & (decode_reqs == 0)),
        mixed_share=_share((prefill_tokens > 0) & (decode_reqs > 0)),
        num_prefill_tokens=int(prefill_tokens.sum()),
        num_decode_tokens=int(decode_tokens.sum()),
        active_time=active_time,
        prompt_throughput=float(prefill_tokens.sum() / active_time) if active_time else 0.0,
        generation_throughput=float(decode_tokens.sum() / active_time) if active_time else 0.0,
        mean_running_reqs=float(tl.col("num_running_reqs").mean()) if tl.num_iterations else 0.0,
        max_running_reqs=int(tl.col("num_running_reqs").max()) if tl.num_iterations else 0,
        waiting_share=_share(waiting > 0),
        max_waiting_reqs=int(waiting.max()) if waiting.size else 0,
        waiting_reason_shares={  # empty: the source does not say why requests wait
            SHARE_KEYS[name]: int(tl.col(reason.field).sum()) / num_waiting_total
            for name, reason in WAIT_REASONS.items()
        }
        if tl.waiting_reasons_known
        else {},
        mean_kv_usage=_if_known(tl, UNKNOWN_KV_BLOCKS, lambda: float(tl.kv_usage.mean())),
        peak_kv_usage=_if_known(tl, UNKNOWN_KV_BLOCKS, lambda: float(tl.kv_usage.max())),
        num_preemptions=_if_known(
            tl, UNKNOWN_PREEMPTIONS, lambda: int(tl.col("num_preemptions").sum())
        ),
        prefix_hit_rate=_if_known(
            tl, UNKNOWN_PREFIX_CACHE, lambda: prefix_hits / max(prefix_queries, 1)
        ),
        num_finished_reqs=num_finished,
        num_aborted_reqs=num_aborted,
        num_timed_reqs=len(queue_times),
        num_unscheduled_reqs=num_unscheduled,
        max_unscheduled_wait=max_unscheduled_wait,
        num_waiting_at_end=_waiting_at_end(tl),
        num_lost_msgs=_num_lost_msgs(tl),
        queue_time_p50=_quantile(queue_times, 0.5),
        queue_time_p90=_quantile(queue_times, 0.9),
        ttft_p50=_quantile(ttfts, 0.5),
        ttft_p90=_quantile(ttfts, 0.9),
        verdict="",
        spec_decode=recorded_drafts(tl, per_position=True),
    )
    summary.verdict = batched_or_queued(summary)
    return summary


def _aborted_text(s: Summary) -> str:
    """How many of the finished requests were aborted (their clients gave up): none said."""
    if not s.num_aborted_reqs:
        return ""
    return f" ({s.num_aborted_reqs} of them aborted: their clients gave up, or the engine stopped)"


def _at_least(s: Summary) -> str:
    """The words "at least " where messages were lost: a count they could hide is a lower
    bound then."""
    return "at least " if s.num_lost_msgs else ""


def _unscheduled_text(s: Summary) -> str:
    """The requests the queue-time figures leave out: never scheduled, still waiting."""
    parts = []
    if s.num_unscheduled_reqs:
        parts.append(
            f"{plural(s.num_unscheduled_reqs, 'request')} never scheduled (aborted after "
            f"waiting up to {secs(s.max_unscheduled_wait * NS_PER_S)})"
        )
    if s.num_waiting_at_end:
        parts.append(
            f"{plural(s.num_waiting_at_end, 'request')} still waiting when the recording ended"
        )
    return "; ".join(parts)


def _request_times_line(s: Summary) -> str:
    """Queue time and TTFT of the requests with a first token, and those left out."""
    ms = 1000
    if not s.num_timed_reqs:
        times = "no first token recorded, so no queue time or TTFT"
    else:
        times = (
            f"queue time p50 {s.queue_time_p50 * ms:.1f} ms, p90 {s.queue_time_p90 * ms:.1f} ms; "
            f"TTFT p50 {s.ttft_p50 * ms:.1f} ms, p90 {s.ttft_p90 * ms:.1f} ms "
            f"({plural(s.num_timed_reqs, 'request')})"
        )
    left_out = _unscheduled_text(s)
    if left_out and s.num_timed_reqs:
        left_out += ", not in these figures"
    return "; ".join(part for part in (times, left_out) if part)


def _batched_text(s: Summary, queued: bool) -> str:
    """Requests per iteration, over the iterations that scheduled work; "too few arrived
    together" only where none was left waiting or never scheduled (else a limit held them)."""
    num_scheduling = s.num_iterations - s.num_empty_iterations
    if not num_scheduling:
        return f"No iteration scheduled a request ({plural(s.num_iterations, 'iteration')} ran)"
    over = (
        f" in the {plural(num_scheduling, 'iteration')} that scheduled any, "
        f"{s.num_empty_iterations} more scheduling none"
        if s.num_empty_iterations
        else ""
    )
    if s.mean_batch_reqs >= BATCHED_MIN_REQS:
        return (
            f"Batched: {s.mean_batch_reqs:.1f} requests shared each iteration on average "
            f"(max {s.max_batch_reqs}){over}"
        )
    few = (
        ""
        if queued or s.num_unscheduled_reqs or s.num_waiting_at_end
        else ", too few arrived together to batch"
    )
    return (
        f"Mostly one at a time: {s.mean_batch_reqs:.1f} requests per iteration "
        f"(max {s.max_batch_reqs}){over}{few}"
    )


def _queue_time_text(s: Summary) -> str:
    """'; median queue time X, p90 Y' and the requests those figures leave out."""
    text = ""
    if s.num_timed_reqs:
        text = (
            f"; median queue time {secs(s.queue_time_p50 * NS_PER_S)}, p90 "
            f"{secs(s.queue_time_p90 * NS_PER_S)}"
        )
        if s.num_unscheduled_reqs or s.num_waiting_at_end:
            text += f" (of the {plural(s.num_timed_reqs, 'request')} with a first token)"
    left_out = _unscheduled_text(s)
    return f"{text}; {left_out}" if left_out else text


def batched_or_queued(s: Summary) -> str:
    """One sentence: did requests share iterations, and did they wait for a limit?"""
    if not s.num_iterations:
        return "No iteration recorded."
    queued = s.waiting_share >= QUEUED_MIN_SHARE
    batched = _batched_text(s, queued)
    if not queued:
        # A request arriving while an iteration runs waits for the next one to take it in:
        # its queue time, with none left waiting after an iteration.
        median = (
            f"; they waited only for the next iteration to take them in (median queue time "
            f"{secs(s.queue_time_p50 * NS_PER_S)})"
            if s.num_timed_reqs
            else ""
        )
        left_out = _unscheduled_text(s)
        waited = (
            f"not queued: requests were left waiting in only {pct(s.waiting_share)} of "
            f"iterations{median}"
        )
        return f"{batched}; {waited}{'; ' + left_out if left_out else ''}."
    shares = s.waiting_reason_shares
    reason = (
        f"mostly for {SHARE_LABELS[max(shares, key=shares.get)]}"
        if shares
        else "for a reason the source does not report"
    )
    waited = (
        f"and queued: requests were left waiting in {pct(s.waiting_share)} of "
        f"iterations (max {s.max_waiting_reqs}), {reason}"
    )
    return f"{batched}; {waited}{_queue_time_text(s)}."


def _iterations_line(s: Summary) -> str:
    """How many iterations, how busy, how long they took: "no iteration" said where none
    was recorded or timed, not times of 0 ms."""
    ms = 1000
    if not s.num_iterations:
        return f"no iteration in {s.duration_time:.1f} s"
    lost = f"{plural(s.num_lost_msgs, 'message')} lost" if s.num_lost_msgs else ""
    head = f"{_at_least(s)}{plural(s.num_iterations, 'iteration')} in {s.duration_time:.1f} s"
    if not s.num_timed_iterations:
        return f"{head}{f' ({lost})' if lost else ''}; iteration time not reported by the source"
    return (
        f"{head} (busy {pct(s.busy_share)}{f'; {lost}' if lost else ''}); iteration time p50 "
        f"{s.iteration_time_p50 * ms:.2f} ms, p99 {s.iteration_time_p99 * ms:.2f} ms, max "
        f"{s.iteration_time_max * ms:.2f} ms"
    )


def _batch_line(s: Summary) -> str:
    """Requests and tokens per iteration that scheduled work, and the iterations' kinds."""
    over = (
        f" over the {s.num_iterations - s.num_empty_iterations} that scheduled a request "
        f"({s.num_empty_iterations} scheduled nothing)"
        if s.num_empty_iterations
        else ""
    )
    of = "of all iterations" if s.num_empty_iterations else "of iterations"
    return (
        f"batch: {s.mean_batch_reqs:.1f} requests and {s.mean_batch_tokens:.1f} tokens per "
        f"iteration on average{over}; decode-only {pct(s.decode_only_share)}, prefill-only "
        f"{pct(s.prefill_only_share)}, mixed {pct(s.mixed_share)} {of}"
    )


def format_summary(s: Summary) -> list[str]:
    """The summary's lines; with no iteration, only what there is to say."""
    requests = (
        f"requests: {_at_least(s)}{s.num_finished_reqs} finished{_aborted_text(s)}; "
        f"{_request_times_line(s)}"
    )
    verdict = f"batched or queued? {s.verdict}"
    if not s.num_iterations:
        return [f"{_iterations_line(s)}: no batch, token or queue figure", requests, verdict]
    reasons = (
        ", ".join(f"{SHARE_LABELS[k]} {pct(v)}" for k, v in s.waiting_reason_shares.items())
        or "reasons not reported by the source"
    )
    at_least = _at_least(s)
    preempted = bool(s.num_preemptions)
    recomputed = " (prompts computed again after preemptions included)" if preempted else ""
    return [
        _iterations_line(s),
        _batch_line(s),
        f"tokens: {at_least}{s.num_prefill_tokens} prefill ({s.prompt_throughput:.1f} tokens/s)"
        f"{recomputed}, {at_least}{s.num_decode_tokens} decode "
        f"({s.generation_throughput:.1f} tokens/s){_rates_span(s)}",
        *([summary_line(s.spec_decode)] if s.spec_decode else []),
        f"queues: running mean {s.mean_running_reqs:.1f} (max {s.max_running_reqs}); waiting in "
        f"{pct(s.waiting_share)} of iterations (max {s.max_waiting_reqs}; {reasons})",
        f"{_kv_text(s)}; preemptions "
        f"{'not reported' if s.num_preemptions is None else s.num_preemptions}; "
        "prefix cache hit rate "
        + ("not reported" if s.prefix_hit_rate is None else pct(s.prefix_hit_rate))
        + (
            " (a preempted request admitted again finds its own blocks: hits too)"
            if preempted and s.prefix_hit_rate
            else ""
        ),
        requests,
        verdict,
    ]


def _if_known(tl: EngineTimeline, unknown_bits: int, value: Callable[[], float]) -> float | None:
    """``value()`` when every record gives the fields of ``unknown_bits``, else None (a
    figure the source does not report is not 0); 0 for a recording without records."""
    if not tl.num_iterations:
        return 0
    return value() if bool(tl.known(unknown_bits).all()) else None


def _kv_text(s: Summary) -> str:
    if s.mean_kv_usage is None or s.peak_kv_usage is None:
        return "KV cache: not reported by the source"
    return f"KV cache: mean {pct(s.mean_kv_usage)}, peak {pct(s.peak_kv_usage)}"


def _rates_span(s: Summary) -> str:
    """The rates are over the iterations' span: said where the recording's, which the
    iterations line gives, is longer than that by more than a second or 1%."""
    if s.duration_time - s.active_time <= max(1.0, 0.01 * s.duration_time):
        return ""
    return f" over the {s.active_time:.1f} s from the first iteration to the last"
