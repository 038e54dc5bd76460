"""The log sink's throughput line (telemetry/sidecar/sinks/log.py): what it reports for one
engine and one window, the aggregate of several engines, and its text, vLLM's own:

    Engine 000: Avg prompt throughput: 1234.5 tokens/s, Avg generation throughput: 56.7
    tokens/s, Running: 8 reqs, Waiting: 2 reqs, GPU KV cache usage: 12.3%, Prefix cache hit
    rate: 45.6%

(one line; wrapped here). What a line reports, per engine and window:
    prompt throughput       context (prefill) tokens computed / window length
    generation throughput   generation tokens / window length
    Running, Waiting        the engine view's queues (its latest record or heartbeat)
    KV cache usage          the engine view's KV blocks: used / (used + free) of the latest
                            record, 0 of the heartbeat's total before one; "not reported"
                            for a source that does not say (FPM). The word before it is the
                            device the engine's heartbeat names (GPU, CPU), none where it
                            names none (FPM producers do not say)
    Prefix cache hit rate   hit tokens / query tokens over the window (0.0% without queries)
    Preemptions             sum over the window, shown only when non-zero
The aggregated line ("N Engines Aggregated") adds rates and queues up; its ratios are of the
summed parts, not averages of the engines' ratios. Which engines print, and the window's
length, are the sink's to decide.

An engine whose window scored speculative-decoding drafts (record.spec_decode, vLLM sources)
gets a second line, vLLM's SpecDecoding line (vllm/v1/spec_decode/metrics.py) word for word:

    Engine 000: SpecDecoding metrics: Mean acceptance length: 2.67, Accepted throughput: 8.00
    tokens/s, Drafted throughput: 14.40 tokens/s, Accepted: 80 tokens, Drafted: 144 tokens,
    Per-position acceptance rate: 0.667, 0.500, 0.500, Avg Draft acceptance rate: 55.6%

    Mean acceptance length          1 + accepted tokens / drafts (the bonus token counted)
    Accepted, Drafted throughput    accepted, draft tokens / window length
    Per-position acceptance rate    accepted tokens at each draft position / drafts
    Avg Draft acceptance rate       accepted tokens / draft tokens
all over the window's sums. No aggregated line of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from telemetry.lane.record import UNKNOWN_KV_BLOCKS, UNKNOWN_PREFIX_CACHE
from telemetry.sidecar.engine_view import EngineView, RecordTotals, kv_usage_percent


@dataclass
class LineFigures:
    """Everything one 10-second line shows."""

    label: str
    prompt_throughput: float  # tokens/s
    generation_throughput: float  # tokens/s
    num_running_reqs: int
    num_waiting_reqs: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    num_preemptions: int
    device_name: str
    kv_reported: bool = True  # False: the source does not report KV blocks (FPM)
    prefix_reported: bool = True  # False: nor prefix-cache queries and hits (FPM)
    # A window with no iteration ended: the one under way, where the heartbeats say its size
    # (EngineView.step_under_way): its tokens and how long it has run. 0: none said.
    step_tokens: int = 0
    step_s: float = 0.0


def engine_figures(engine: EngineView, counts: RecordTotals, window_time: float) -> LineFigures:
    """One engine's line: rates over ``window_time`` seconds from the window's sums
    (``counts``: the engine's record totals over the window), the rest from its view as it
    is now."""
    num_kv_blocks_used, num_kv_blocks_total = engine.kv_blocks()
    under_way = engine.step_under_way() if not counts.num_iterations else None
    step_tokens, step_s = under_way or (0, 0.0)
    return LineFigures(
        label=f"Engine {engine.engine_index:03d}",
        prompt_throughput=counts.num_prefill_tokens / window_time,
        generation_throughput=counts.num_decode_tokens / window_time,
        num_running_reqs=engine.num_running_reqs,
        num_waiting_reqs=engine.num_waiting_reqs,
        num_kv_blocks_used=num_kv_blocks_used,
        num_kv_blocks_total=num_kv_blocks_total,
        num_prefix_query_tokens=counts.num_prefix_query_tokens,
        num_prefix_hit_tokens=counts.num_prefix_hit_tokens,
        num_preemptions=counts.num_preemptions,
        device_name=engine.device_name,
        kv_reported=engine.reports(UNKNOWN_KV_BLOCKS),
        prefix_reported=engine.reports(UNKNOWN_PREFIX_CACHE),
        step_tokens=step_tokens,
        step_s=step_s,
    )


def aggregate_figures(lines: list[LineFigures]) -> LineFigures:
    """Several engines as one: rates and queues add up; ratios are of the summed parts; the
    device is named only where every engine names the same."""
    devices = {f.device_name for f in lines}
    return LineFigures(
        label=f"{len(lines)} Engines Aggregated",
        prompt_throughput=sum(f.prompt_throughput for f in lines),
        generation_throughput=sum(f.generation_throughput for f in lines),
        num_running_reqs=sum(f.num_running_reqs for f in lines),
        num_waiting_reqs=sum(f.num_waiting_reqs for f in lines),
        num_kv_blocks_used=sum(f.num_kv_blocks_used for f in lines),
        num_kv_blocks_total=sum(f.num_kv_blocks_total for f in lines),
        num_prefix_query_tokens=sum(f.num_prefix_query_tokens for f in lines),
        num_prefix_hit_tokens=sum(f.num_prefix_hit_tokens for f in lines),
        num_preemptions=sum(f.num_preemptions for f in lines),
        device_name=devices.pop() if len(devices) == 1 else "",
        kv_reported=all(f.kv_reported for f in lines),
        prefix_reported=all(f.prefix_reported for f in lines),
    )


def format_spec_decode_line(label: str, counts: RecordTotals, window_time: float) -> str | None:
    """vLLM's SpecDecoding line for the window's sums (``counts``) over ``window_time``
    seconds, after ``label`` ("Engine 000"); None when the window scored no draft."""
    num_drafts = counts.num_drafts
    if not num_drafts:
        return None
    accepted, drafted = counts.num_accepted_tokens, counts.num_draft_tokens
    acceptance = 100.0 * accepted / drafted if drafted else float("nan")  # as vLLM: nan%
    per_pos = counts.num_accepted_tokens_per_pos
    rates = ", ".join(f"{count / num_drafts:.3f}" for count in per_pos) or "not reported"
    return (
        f"{label}: SpecDecoding metrics: "
        f"Mean acceptance length: {1 + accepted / num_drafts:.2f}, "
        f"Accepted throughput: {accepted / window_time:.2f} tokens/s, "
        f"Drafted throughput: {drafted / window_time:.2f} tokens/s, "
        f"Accepted: {accepted} tokens, Drafted: {drafted} tokens, "
        f"Per-position acceptance rate: {rates}, "
        f"Avg Draft acceptance rate: {acceptance:.1f}%"
    )


def format_engine_line(figures: LineFigures) -> str:
    """The line's text, word for word vLLM's (the log sink is vLLM-compatible)."""
    kv_usage = kv_usage_percent(figures.num_kv_blocks_used, figures.num_kv_blocks_total)
    kv_text = f"{kv_usage:.1f}%" if figures.kv_reported else "not reported"
    device = f"{figures.device_name} " if figures.device_name else ""
    queries = figures.num_prefix_query_tokens
    hit_rate = 100.0 * figures.num_prefix_hit_tokens / queries if queries else 0.0
    hit_text = f"{hit_rate:.1f}%" if figures.prefix_reported else "not reported"
    line = (
        f"{figures.label}: "
        f"Avg prompt throughput: {figures.prompt_throughput:.1f} tokens/s, "
        f"Avg generation throughput: {figures.generation_throughput:.1f} tokens/s, "
        f"Running: {figures.num_running_reqs} reqs, Waiting: {figures.num_waiting_reqs} reqs, "
        f"{device}KV cache usage: {kv_text}, "
        f"Prefix cache hit rate: {hit_text}"
    )
    if figures.num_preemptions:
        line += f", Preemptions: {figures.num_preemptions}"
    if figures.step_tokens:
        line += (
            f", Iteration under way: {figures.step_tokens} tokens scheduled, "
            f"{figures.step_s:.1f} s so far"
        )
    return line
