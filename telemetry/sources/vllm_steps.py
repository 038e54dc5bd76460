"""What one step of vLLM's scheduler becomes: an IterationRecord, filled in vLLM's EngineCore.

``StepReporter`` is driven by the scheduler subclass in telemetry/sources/vllm_scheduler.py
(the only module here that imports vLLM): ``added`` when a request enters the scheduler,
``scheduled`` right after ``Scheduler.schedule()`` returns, ``updated`` right after
``Scheduler.update_from_output()`` returns. It reads vLLM's scheduler, SchedulerOutput and
Request objects by attribute (checked against vLLM 0.24.0 to 0.33.0; the subclass checks at
start-up that every attribute read here exists), so it can be tested with plain stand-ins.

    schedule() returns        record started: start_ns (before schedule), the batch by phase,
                              queues and why requests wait (decided now, see below),
                              preemptions, prefix-cache queries / hits, first-scheduled times
    make_spec_decoding_stats  a request's draft scored (inside update_from_output, the
    (per request)             counts vLLM's own SpecDecodingStats takes, whether or not
                              vLLM logs stats): ``drafted``
    update_from_output()      record finished: elapsed (schedule start -> update end), the
    returns                   model's part (schedule end -> update start), tokens the step
                              produced, drafts scored and accepted, running requests, KV
                              blocks and tokens, milestones (first token, finish), then
                              handed to the publisher

Steps are paired by their SchedulerOutput (with async scheduling vLLM schedules the next step
before it updates from the last one). Work per step is O(requests scheduled) plus
O(requests prefilling or finishing); nothing here encodes, formats or does I/O: the
publisher's thread does that.

Phases follow vLLM's own iteration details (vllm.v1.utils.compute_iteration_details): a
request is in prefill while it has no output token (new requests, prompt chunks), else in
decode (a request recomputed after a preemption is in decode). Tokens, to agree with vLLM's
counters: ``num_prefill_tokens`` are the prompt tokens computed (a prefill request's
scheduled tokens); ``num_decode_tokens`` are the tokens the step produced (vLLM's
generation-token count: one per decode request, plus the first token of each prefill that
completed, plus the draft tokens accepted with speculative decoding); recomputed tokens count
in neither.

Why requests wait, decided right after ``schedule()`` from the scheduler's own state, in
this order (the first that holds names every waiting request not held back):

    held back   requests vLLM skipped and has not admitted since (``deferred_waiting``; before
                0.31 ``skipped_waiting``: a structured-output grammar still compiling, a
                remote KV transfer, a streaming input, a LoRA slot): "other"
    KV          a request was preempted this step (KV blocks ran out for a running one;
                vLLM then admits nothing)
    held back   vLLM is paused, or held this step's prefills for its prefill cadence
                (``--prefill-schedule-interval``: data-parallel balancing, and from vLLM
                0.33 also a single engine; ``prefills_held`` below): "other"
    seq limit   running requests at ``max_num_active_reqs`` (``--max-num-seqs``; before
                0.31 ``max_num_running_reqs``)
    budget      the step's tokens at ``max_num_scheduled_tokens`` (``--max-num-batched-tokens``)
    KV          otherwise: the head of the queue was not admitted with room for requests and
                tokens left, which in vLLM 0.27 to 0.33 means its block allocation failed

Limits of the rule: vLLM also stops admitting for the encoder-cache budget, or without
chunked prefill when the next prompt exceeds what is left of the budget; these fall to the
last line (KV), since the scheduler keeps no trace of them. (A request over the LoRA slots is
skipped into the held-back set, so it reads as held back.)
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from telemetry.lane.record import (
    EVENT_FINISHED,
    EVENT_FIRST_TOKEN,
    IterationRecord,
    RequestMilestone,
    SpecDecodeCounts,
    iteration_record,
)
from telemetry.sources.vllm_records import num_usable_blocks

MAX_PENDING_STEPS = 8  # scheduled, not yet updated: vLLM's batch queue holds at most a few


class Publisher(Protocol):
    def publish(self, record: IterationRecord) -> None: ...

    def note_queues(self, num_waiting: int, num_running: int, step_tokens: int = 0) -> None: ...


@dataclass
class TrackedRequest:
    """One request from ``added`` to its finish: the vLLM Request and what we saw happen."""

    request: Any  # vllm.v1.request.Request
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    num_cached_tokens: int = 0
    preempted_ns: list[int] = field(default_factory=list)
    prefill_chunks: list[tuple[int, int, int]] = field(default_factory=list)


def _count_split(scheduler: Any) -> tuple[int, int]:
    """vLLM 0.31 and later: waiting requests that hold KV blocks (a remote load) in a queue of
    their own, drained first; every skipped request also in the set ``deferred_waiting``."""
    waiting = len(scheduler.waiting) + len(scheduler.kv_holding_waiting)
    return waiting, len(scheduler.deferred_waiting)


def _count_skipped(scheduler: Any) -> tuple[int, int]:
    """vLLM 0.27 to 0.30: skipped requests (and those blocked from the start) in a queue of
    their own, ``skipped_waiting``."""
    held_back = len(scheduler.skipped_waiting)
    return len(scheduler.waiting) + held_back, held_back


@dataclass(frozen=True)
class WaitingQueues:
    """Where a vLLM version keeps the requests waiting for admission. Every request vLLM
    skipped and has not admitted since (a grammar compiling, a remote KV load, a LoRA slot,
    ...) is held back."""

    # scheduler -> (requests waiting, held back included; those held back). Plain attribute
    # reads, on every step: a getattr by name per queue cost 0.27 us a step more.
    count: Callable[[Any], tuple[int, int]]
    max_active: str  # the limit --max-num-seqs sets on running requests
    names: tuple[str, ...]  # every attribute read here, for the start-up guard


SPLIT_QUEUES = WaitingQueues(
    _count_split,
    "max_num_active_reqs",
    ("waiting", "kv_holding_waiting", "deferred_waiting", "max_num_active_reqs"),
)
SKIPPED_QUEUE = WaitingQueues(
    _count_skipped, "max_num_running_reqs", ("waiting", "skipped_waiting", "max_num_running_reqs")
)


def waiting_queues(scheduler: Any) -> WaitingQueues:
    """This scheduler's layout: 0.27-0.30's where it has ``skipped_waiting``, else 0.31's."""
    return SKIPPED_QUEUE if hasattr(scheduler, "skipped_waiting") else SPLIT_QUEUES


class StepReporter:
    """One vLLM engine core's steps as IterationRecords, handed to ``publisher``."""

    def __init__(
        self,
        engine_index: int,
        num_gpu_blocks: int,
        publisher: Publisher,
        queues: WaitingQueues = SPLIT_QUEUES,
    ) -> None:
        self.engine_index = engine_index
        self.queues = queues
        self._count_waiting = queues.count
        self.num_usable_blocks = num_usable_blocks(num_gpu_blocks)
        self.publisher = publisher
        self.iteration = 0
        self.requests: dict[str, TrackedRequest] = {}
        self._awaiting_first_token: dict[str, TrackedRequest] = {}
        # (SchedulerOutput, its record, its prefill requests, when schedule() returned)
        self._pending: collections.deque[tuple[Any, IterationRecord, list, int]] = (
            collections.deque(maxlen=MAX_PENDING_STEPS)
        )
        self._finished_early: list[RequestMilestone] = []  # aborted between steps
        self._drafts: SpecDecodeCounts | None = None  # scored in the update under way

    def added(self, scheduler: Any, request: Any) -> None:
        """A request entered the scheduler's waiting queue."""
        self.requests[request.request_id] = TrackedRequest(request)
        num_waiting, _ = self._count_waiting(scheduler)
        self.publisher.note_queues(num_waiting, len(scheduler.running))

    def scheduled(
        self, scheduler: Any, output: Any, start_ns: int, prefills_held: bool = False
    ) -> None:
        """``schedule()`` (called at ``start_ns``) returned ``output``: start its record.
        ``prefills_held``: what ``prefills_held`` said just before that call."""
        self._note_finished(output.finished_req_ids, start_ns, self._finished_early)
        self.iteration += 1
        record = iteration_record(self.engine_index, 0, self.iteration, start_ns=start_ns)
        prefilling = self._fill_batch(record, scheduler, output, start_ns)
        num_waiting, num_deferred = self._count_waiting(scheduler)
        # The queues as this step runs them and its size, for the heartbeats sent while it
        # runs (a long prefill step showed the queue from before it took requests in, and
        # looked like a stall to a sidecar that did not know how big it was).
        self.publisher.note_queues(
            num_waiting, len(scheduler.running), output.total_num_scheduled_tokens
        )
        record.num_waiting_reqs = num_waiting
        record.num_waiting_other_reqs = num_deferred
        num_held = num_waiting - num_deferred
        if num_held > 0:
            max_active = getattr(scheduler, self.queues.max_active)
            reason = _wait_reason(scheduler, output, prefills_held, max_active)
            setattr(record, reason, getattr(record, reason) + num_held)
        record.num_preemptions = len(output.preempted_req_ids)
        for request_id in output.preempted_req_ids:
            tracked = self.requests.get(request_id)
            if tracked is not None:
                tracked.preempted_ns.append(start_ns)
        self._pending.append((output, record, prefilling, time.monotonic_ns()))

    def drafted(self, num_spec_tokens: int, num_draft_tokens: int, num_accepted: int) -> None:
        """A request's draft of ``num_draft_tokens`` (grammar-invalidated ones not counted)
        was scored and its first ``num_accepted`` tokens accepted, as vLLM's
        ``SpecDecodingStats.observe_draft`` counts it; ``num_spec_tokens``: vLLM's draft
        length setting (the per-position list's length)."""
        drafts = self._drafts
        if drafts is None:
            drafts = self._drafts = SpecDecodeCounts(0, 0, 0, [0] * num_spec_tokens)
        drafts.num_drafts += 1
        drafts.num_draft_tokens += num_draft_tokens
        drafts.num_accepted_tokens += num_accepted
        per_pos = drafts.num_accepted_tokens_per_pos
        for position in range(min(num_accepted, len(per_pos))):
            per_pos[position] += 1

    def updated(
        self, scheduler: Any, output: Any, engine_core_outputs: dict, update_start_ns: int
    ) -> None:
        """``update_from_output(output, ...)``, called at ``update_start_ns``, returned:
        finish that step's record and send it."""
        end_ns = time.monotonic_ns()
        drafts, self._drafts = self._drafts, None
        step = self._take_pending(output)
        if step is None:  # scheduled before this reporter existed, or beyond the bound
            return
        _, record, prefilling, scheduled_ns = step
        record.elapsed_ns = end_ns - record.start_ns
        record.model_elapsed_ns = max(0, update_start_ns - scheduled_ns)
        for tracked in prefilling:
            start_ns, _, num_tokens = tracked.prefill_chunks[-1]
            tracked.prefill_chunks[-1] = (start_ns, end_ns, num_tokens)
        record.num_decode_tokens = sum(
            len(out.new_token_ids)
            for outputs in engine_core_outputs.values()
            for out in outputs.outputs
        )
        record.spec_decode = drafts
        record.num_running_reqs = len(scheduler.running)
        num_free = scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
        record.num_kv_blocks_free = min(num_free, self.num_usable_blocks)
        record.num_kv_blocks_used = self.num_usable_blocks - record.num_kv_blocks_free
        record.num_kv_tokens = sum(request.num_computed_tokens for request in scheduler.running)
        milestones, self._finished_early = self._finished_early, []
        self._note_first_tokens(end_ns, milestones)
        self._note_finished(scheduler.finished_req_ids, end_ns, milestones)
        record.milestones = milestones
        if (
            record.num_prefill_tokens
            or record.num_decode_reqs
            or milestones
            or record.num_preemptions
        ):
            self.publisher.publish(record)
        else:  # a step that scheduled nothing (vLLM's last call after requests finish)
            self.publisher.note_queues(record.num_waiting_reqs, record.num_running_reqs)

    def _fill_batch(
        self, record: IterationRecord, scheduler: Any, output: Any, start_ns: int
    ) -> list[TrackedRequest]:
        """Requests and tokens by phase; first-scheduled times, cached tokens and prefix-cache
        lookups of new requests. Returns the requests whose prompt chunk this step computes."""
        num_scheduled = output.num_scheduled_tokens
        prefilling = []
        for new in output.scheduled_new_reqs:
            num_tokens = num_scheduled[new.req_id]
            record.num_prefill_reqs += 1
            record.num_prefill_tokens += num_tokens
            tracked = self.requests.get(new.req_id)
            if tracked is None:
                continue
            request = tracked.request
            if not tracked.first_scheduled_ns:
                tracked.first_scheduled_ns = start_ns
                # schedule() already advanced num_computed_tokens past this step's tokens
                tracked.num_cached_tokens = request.num_computed_tokens - num_tokens
                record.num_prefix_query_tokens += request.num_tokens
                record.num_prefix_hit_tokens += tracked.num_cached_tokens
                self._awaiting_first_token[new.req_id] = tracked
            tracked.prefill_chunks.append((start_ns, 0, num_tokens))
            prefilling.append(tracked)
        cached = output.scheduled_cached_reqs
        phases = zip(cached.req_ids, cached.num_output_tokens, strict=True)
        for request_id, num_output_tokens in phases:
            if num_output_tokens:
                record.num_decode_reqs += 1
                continue
            num_tokens = num_scheduled[request_id]
            record.num_prefill_reqs += 1
            record.num_prefill_tokens += num_tokens
            tracked = self.requests.get(request_id)
            if tracked is not None:
                tracked.prefill_chunks.append((start_ns, 0, num_tokens))
                prefilling.append(tracked)
        return prefilling

    def _take_pending(self, output: Any) -> tuple | None:
        pending = self._pending
        while pending:
            step = pending.popleft()
            if step[0] is output:
                return step
        return None

    def _note_first_tokens(self, end_ns: int, milestones: list[RequestMilestone]) -> None:
        done = [
            request_id
            for request_id, tracked in self._awaiting_first_token.items()
            if tracked.request.num_output_tokens > 0
        ]
        for request_id in done:
            tracked = self._awaiting_first_token.pop(request_id)
            tracked.first_token_ns = end_ns
            if not tracked.request.is_finished():  # else its finish milestone says both
                milestones.append(self._milestone(tracked, EVENT_FIRST_TOKEN, end_ns))

    def _note_finished(
        self, request_ids: Any, now_ns: int, milestones: list[RequestMilestone]
    ) -> None:
        for request_id in request_ids:
            tracked = self.requests.pop(request_id, None)
            if tracked is None:
                continue  # reported already, or added before this reporter existed
            self._awaiting_first_token.pop(request_id, None)
            event = EVENT_FINISHED
            if tracked.first_token_ns == now_ns:
                event |= EVENT_FIRST_TOKEN
            milestones.append(self._milestone(tracked, event, now_ns))

    def _milestone(self, tracked: TrackedRequest, event: int, now_ns: int) -> RequestMilestone:
        """vLLM stamps a request's arrival in wall time (the API server's ``time.time()``):
        it is moved to this process's monotonic clock, on which every other time is read."""
        request = tracked.request
        finished = bool(event & EVENT_FINISHED)
        wall_minus_monotonic_ns = time.time_ns() - time.monotonic_ns()
        arrival_ns = int(request.arrival_time * 1e9) - wall_minus_monotonic_ns
        reason = request.get_finished_reason() if finished else None
        trace_headers = request.trace_headers or {}
        return RequestMilestone(
            request_id=request.request_id,
            event=event,
            arrival_ns=max(0, min(arrival_ns, tracked.first_scheduled_ns or now_ns)),
            first_scheduled_ns=tracked.first_scheduled_ns,
            first_token_ns=tracked.first_token_ns,
            finished_ns=now_ns if finished else 0,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=tracked.num_cached_tokens,
            num_output_tokens=request.num_output_tokens,
            num_preemptions=request.num_preemptions,
            finish_reason=int(reason) if reason is not None else -1,
            traceparent=str(trace_headers.get("traceparent", "")),
            preempted_ns=tracked.preempted_ns if finished else [],
            prefill_chunks=[c for c in tracked.prefill_chunks if c[1]] if finished else [],
        )


def prefills_held(scheduler: Any, throttle_prefills: bool) -> bool:
    """Whether the ``schedule(throttle_prefills)`` about to run holds every prefill back
    for vLLM's prefill cadence: read before the call, from the state vLLM decides it on
    (vLLM 0.24-0.33 ``Scheduler.schedule``). The data-parallel engine core asks for it
    (``throttle_prefills``); vLLM 0.33 also keeps the cadence itself on an engine without
    data parallelism (``local_prefill_interval`` > 1). Either way vLLM lets prefills through
    when the last one left requests waiting (``prefill_capacity_bound``) or when every running
    request is still prefilling. Attributes a version lacks read as no hold."""
    interval = getattr(scheduler, "local_prefill_interval", 1)
    local_hold = interval > 1 and (
        getattr(scheduler, "num_executed_steps", 0) + 1 - getattr(scheduler, "last_prefill_step", 0)
        < interval
    )
    if not (throttle_prefills or local_hold) or getattr(scheduler, "prefill_capacity_bound", True):
        return False
    return any(not request.is_prefill_chunk for request in scheduler.running)


def _wait_reason(scheduler: Any, output: Any, prefills_held: bool, max_active: int) -> str:
    """The record field that counts the waiting requests vLLM did not hold back (the rule
    in the module docstring)."""
    if output.preempted_req_ids:
        return "num_waiting_kv_reqs"
    if scheduler.pause_state or prefills_held:  # pause_state: an IntEnum, UNPAUSED = 0
        return "num_waiting_other_reqs"
    num_active = len(scheduler.running) + scheduler.num_waiting_for_streaming_input
    if num_active >= max_active:
        return "num_waiting_seq_limit_reqs"
    if output.total_num_scheduled_tokens >= scheduler.max_num_scheduled_tokens:
        return "num_waiting_budget_reqs"
    return "num_waiting_kv_reqs"
