"""vLLM's per-step stats as iterscope records: the mapping, with no vLLM import.

vLLM (checked against 0.24.0 to 0.33.0) calls a stat logger's ``record(scheduler_stats,
iteration_stats)`` in its API-server process once per engine step, plus a trailing call when
the engine drains. ``RecordMaker.make`` turns one call into one ``IterationRecord``, or into
None when the call reports no step (then only the queue lengths changed). docs/vllm.md has
the field-by-field table; in short:

    record field                      vLLM source
    num_prefill_reqs / _tokens        iteration_details (--enable-logging-iteration-details);
                                      without it: tokens = prompt tokens computed for the
                                      prefills that finished this step, requests unknown
    num_decode_reqs                   iteration_details; without it: requests that produced
                                      a token after their first (len(inter_token_latencies))
    num_decode_tokens                 tokens produced this step (vLLM's generation counter)
    elapsed_ns                        iteration_details.elapsed_ms (forward + sample); else
                                      unknown
    num_running_reqs, num_waiting_reqs  scheduler stats (waiting = not deferred + deferred);
                                      the reasons are unknown
    num_kv_blocks_used / _free        kv_cache_usage x usable blocks (num_gpu_blocks - 1,
                                      the null block); tokens held unknown
    prefix queries / hits, preemptions  scheduler / iteration stats of the step
    spec_decode                       scheduler stats' spec_decoding_stats (drafts scored and
                                      accepted), None when the step scored none
    first_token_latencies_ns          iteration stats' time_to_first_tokens_iter: the TTFT of
                                      each request whose first token came this step, vLLM's
                                      own values (vLLM names none of those requests)
    milestones                        one per finished request, times rebuilt from vLLM's
                                      intervals (see ``milestone``), with EVENT_TTFT_SENT
                                      where vLLM sent the TTFTs as above

vLLM's stats classes are not a stable interface: every attribute is read with a default, so
a renamed one degrades that field instead of failing the call.
"""

from __future__ import annotations

import time
from typing import Any

from telemetry.lane.record import (
    EVENT_FINISHED,
    EVENT_FIRST_TOKEN,
    EVENT_TTFT_SENT,
    UNKNOWN_ELAPSED,
    UNKNOWN_KV_TOKENS,
    UNKNOWN_PREFILL_REQS,
    UNKNOWN_WAITING_REASONS,
    IterationRecord,
    RequestMilestone,
    SpecDecodeCounts,
    iteration_record,
)

NS_PER_S = 1_000_000_000
NUM_NULL_BLOCKS = 1  # vLLM's block pool keeps one block that no request ever holds
VLLM_FINISH_REASONS = {0: 0, 1: 1, 2: 2, 3: 3, 4: 4}  # vLLM FinishReason -> ours (same order)


class RecordMaker:
    """Per-engine mapping state: the iteration counter and the KV pool's size."""

    def __init__(
        self, engine_index: int, num_gpu_blocks: int = 0, iteration_details: bool = False
    ) -> None:
        """``iteration_details``: vLLM runs with --enable-logging-iteration-details, so every
        step that scheduled tokens carries its details and a call without them is no step."""
        self.engine_index = engine_index
        self.num_usable_blocks = num_usable_blocks(num_gpu_blocks)
        self.iteration_details = iteration_details
        self.iteration = 0

    def set_num_gpu_blocks(self, num_gpu_blocks: int) -> None:
        self.num_usable_blocks = num_usable_blocks(num_gpu_blocks)

    def make(self, scheduler_stats: Any, iteration_stats: Any) -> IterationRecord | None:
        """The record of one ``record()`` call, or None when it reports no engine step.

        A step is a call with iteration details (with --enable-logging-iteration-details
        vLLM sends them with every step that scheduled tokens) or with outputs. Without
        details, a call with no outputs while requests are in flight is a step whose
        outputs vLLM did not send (a prefill chunk); while nothing runs or waits it is the
        trailing call of a drained engine.
        """
        details = getattr(scheduler_stats, "iteration_details", None)
        if not self._is_step(details, scheduler_stats, iteration_stats):
            return None
        self.iteration += 1
        end_ns = time.monotonic_ns()
        record = _blank_record(self.engine_index, self.iteration, end_ns)
        record.num_decode_tokens = _int(iteration_stats, "num_generation_tokens")
        record.num_preemptions = _int(iteration_stats, "num_preempted_reqs")
        _fill_batch(record, details, iteration_stats)
        if scheduler_stats is not None:
            self._fill_scheduler_fields(record, scheduler_stats)
        ttfts = getattr(iteration_stats, "time_to_first_tokens_iter", None)
        if ttfts:
            record.first_token_latencies_ns = [max(0, _ns(seconds)) for seconds in ttfts]
        finished = getattr(iteration_stats, "finished_requests", None)
        if finished:
            wall_offset_ns = time.time_ns() - end_ns  # wall - this process's monotonic
            finished_ns = _ns(getattr(iteration_stats, "iteration_timestamp", 0.0)) - wall_offset_ns
            ttft_sent = ttfts is not None  # this vLLM sends each TTFT at its first token
            record.milestones = [milestone(stats, finished_ns, ttft_sent) for stats in finished]
        return record

    def _is_step(self, details: Any, scheduler_stats: Any, iteration_stats: Any) -> bool:
        if details is not None:
            return not getattr(details, "is_dummy", False)  # DP padding: no work of its own
        if iteration_stats:
            return True
        return not self.iteration_details and _num_in_flight(scheduler_stats) > 0

    def _fill_scheduler_fields(self, record: IterationRecord, scheduler_stats: Any) -> None:
        record.num_running_reqs = _int(scheduler_stats, "num_running_reqs")
        record.num_waiting_reqs = _num_waiting(scheduler_stats)
        usage = float(getattr(scheduler_stats, "kv_cache_usage", 0.0) or 0.0)
        num_used = min(self.num_usable_blocks, max(0, round(usage * self.num_usable_blocks)))
        record.num_kv_blocks_used = num_used
        record.num_kv_blocks_free = self.num_usable_blocks - num_used
        prefix = getattr(scheduler_stats, "prefix_cache_stats", None)
        record.num_prefix_query_tokens = _int(prefix, "queries")
        record.num_prefix_hit_tokens = _int(prefix, "hits")
        record.spec_decode = spec_decode_counts(
            getattr(scheduler_stats, "spec_decoding_stats", None)
        )


def spec_decode_counts(stats: Any) -> SpecDecodeCounts | None:
    """vLLM's SpecDecodingStats of a step as the record's counts; None without a draft."""
    num_drafts = _int(stats, "num_drafts")
    if not num_drafts:
        return None
    per_pos = getattr(stats, "num_accepted_tokens_per_pos", None) or []
    return SpecDecodeCounts(
        num_drafts,
        _int(stats, "num_draft_tokens"),
        _int(stats, "num_accepted_tokens"),
        [max(0, int(count)) for count in per_pos],
    )


def _blank_record(engine_index: int, iteration: int, end_ns: int) -> IterationRecord:
    """A record of nothing, ending at ``end_ns``; every field vLLM never gives is unknown."""
    return iteration_record(
        engine_index,
        0,
        iteration,
        start_ns=end_ns,
        unknown=UNKNOWN_WAITING_REASONS | UNKNOWN_KV_TOKENS,
    )


def _fill_batch(record: IterationRecord, details: Any, iteration_stats: Any) -> None:
    """What the step computed: vLLM's iteration details, else what its outputs tell."""
    if details is not None:
        record.num_prefill_reqs = _int(details, "num_ctx_requests")
        record.num_prefill_tokens = _int(details, "num_ctx_tokens")
        record.num_decode_reqs = _int(details, "num_generation_requests")
        record.elapsed_ns = max(0, int(getattr(details, "elapsed_ms", 0.0) * 1e6))
        record.start_ns -= record.elapsed_ns
        return
    record.unknown |= UNKNOWN_PREFILL_REQS | UNKNOWN_ELAPSED
    prompt_stats = getattr(iteration_stats, "prompt_token_stats", None)
    record.num_prefill_tokens = _int(prompt_stats, "computed")
    record.num_decode_reqs = len(getattr(iteration_stats, "inter_token_latencies_iter", None) or ())


def milestone(stats: Any, finished_ns: int, ttft_sent: bool = False) -> RequestMilestone:
    """A finished request's lifecycle from vLLM's FinishedRequestStats; ``ttft_sent``: its
    TTFT went out unnamed at its first token (EVENT_TTFT_SENT).

    vLLM gives intervals, not times: e2e_latency runs from arrival to this step's frontend
    timestamp, the others are measured on the engine core's clock (queued: queued ->
    first scheduled, prefill: first scheduled -> first token, decode: first token -> last
    token). The finish is placed at the step's timestamp (``finished_ns``, on this
    process's monotonic clock) and the rest counted back from it, so arrival -> first
    scheduled includes the frontend's own time before the request was queued, and the last
    token is taken to be the finish. vLLM reports no prefill chunks: the whole prefill phase
    is given as one chunk of the prompt tokens not served from cache.
    """
    arrival_ns = finished_ns - _ns(getattr(stats, "e2e_latency", 0.0))
    first_token_ns = finished_ns - _ns(getattr(stats, "decode_time", 0.0))
    first_scheduled_ns = first_token_ns - _ns(getattr(stats, "prefill_time", 0.0))
    num_output_tokens = _int(stats, "num_generation_tokens")
    if not num_output_tokens:  # aborted before its first token: only arrival and finish
        first_token_ns = first_scheduled_ns = 0
    reason = getattr(stats, "finish_reason", None)
    num_prompt_tokens = _int(stats, "num_prompt_tokens")
    num_cached_tokens = _int(stats, "num_cached_tokens")
    prefill = [(first_scheduled_ns, first_token_ns, max(0, num_prompt_tokens - num_cached_tokens))]
    return RequestMilestone(
        request_id=str(getattr(stats, "request_id", None) or ""),
        event=_finish_event(num_output_tokens, ttft_sent),
        arrival_ns=max(0, arrival_ns),
        first_scheduled_ns=max(0, first_scheduled_ns),
        first_token_ns=max(0, first_token_ns),
        finished_ns=max(0, finished_ns),
        num_prompt_tokens=num_prompt_tokens,
        num_cached_tokens=num_cached_tokens,
        num_output_tokens=num_output_tokens,
        num_preemptions=_int(stats, "num_preemptions"),
        finish_reason=VLLM_FINISH_REASONS.get(int(reason), -1) if reason is not None else -1,
        prefill_chunks=prefill if num_output_tokens and first_scheduled_ns > 0 else [],
    )


def _finish_event(num_output_tokens: int, ttft_sent: bool) -> int:
    if not num_output_tokens:
        return EVENT_FINISHED
    return EVENT_FIRST_TOKEN | EVENT_FINISHED | (EVENT_TTFT_SENT if ttft_sent else 0)


def num_in_flight(scheduler_stats: Any) -> tuple[int, int]:
    """(waiting, running) as vLLM's scheduler stats count them."""
    return _num_waiting(scheduler_stats), _int(scheduler_stats, "num_running_reqs")


def _num_in_flight(scheduler_stats: Any) -> int:
    return sum(num_in_flight(scheduler_stats))


def _num_waiting(scheduler_stats: Any) -> int:
    """Waiting for admission, whether vLLM deferred them or not."""
    return _int(scheduler_stats, "num_waiting_reqs") + _int(
        scheduler_stats, "num_skipped_waiting_reqs"
    )


def _int(obj: Any, name: str) -> int:
    """A non-negative int attribute; 0 when the object or the attribute is missing."""
    value = getattr(obj, name, 0) if obj is not None else 0
    return max(0, int(value or 0))


def _ns(seconds: float) -> int:
    return int((seconds or 0.0) * NS_PER_S)


def engine_facts(
    vllm_config: Any, num_usable_blocks: int, source: str, vllm_version: str
) -> dict[str, Any]:
    """Static Heartbeat fields from vLLM's config and version (``vllm.__version__``); a
    missing attribute leaves its default."""
    facts: dict[str, Any] = {"source": source, "engine_version": f"vllm {vllm_version}"}
    model = getattr(getattr(vllm_config, "model_config", None), "served_model_name", None)
    if isinstance(model, (list, tuple)):
        model = model[0] if model else None
    if model:
        facts["model_name"] = str(model)
    device = getattr(getattr(vllm_config, "device_config", None), "device_type", None)
    if device:
        facts["device_name"] = "GPU" if device == "cuda" else str(device).upper()
    cache = getattr(vllm_config, "cache_config", None)
    if getattr(cache, "block_size", None):
        facts["block_size"] = int(cache.block_size)
    if num_usable_blocks:
        facts["num_kv_blocks_total"] = num_usable_blocks
    scheduler = getattr(vllm_config, "scheduler_config", None)
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        if getattr(scheduler, name, None):
            facts[name] = int(getattr(scheduler, name))
    interval = int(getattr(scheduler, "prefill_schedule_interval", 1) or 1)
    if interval > 1:  # a cadence: prompts held between its steps (telemetry/sources/vllm_steps.py)
        facts["prefill_schedule_interval"] = interval
    model_config = getattr(vllm_config, "model_config", None)
    dtype = getattr(model_config, "dtype", None)
    if dtype is not None:  # a torch.dtype: "torch.bfloat16"
        facts["dtype"] = str(dtype).removeprefix("torch.")
    if getattr(model_config, "max_model_len", None):
        facts["max_model_len"] = int(model_config.max_model_len)
    spec = getattr(vllm_config, "speculative_config", None)
    if getattr(spec, "num_speculative_tokens", None):
        facts["num_speculative_tokens"] = int(spec.num_speculative_tokens)
    return facts


def num_gpu_blocks(vllm_config: Any) -> int:
    """The KV pool's size in blocks as vLLM's cache config says (0 before it is known)."""
    return int(getattr(getattr(vllm_config, "cache_config", None), "num_gpu_blocks", 0) or 0)


def num_usable_blocks(num_gpu_blocks: int) -> int:
    """The blocks requests can hold: vLLM's pool less its null block."""
    return max(0, num_gpu_blocks - NUM_NULL_BLOCKS)
