"""The engine core loop: schedule, execute, update, and one telemetry record per iteration.

``EngineCore.step`` is the whole loop body. The record is filled from counts the scheduler
and block pool already keep (no extra pass over the requests); only requests that got their
first token or finished in this iteration add a milestone. Nothing here logs or formats per
iteration: the record goes to a publisher that sends it without blocking.
"""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.kv_planning import KvPlan
from engine.logprobs import TokenLogprobs
from engine.nvtx_markers import make_markers
from engine.request import FinishReason, Request
from engine.scheduler import RequestRejectedError, Scheduler, SchedulerOutput, WaitReason
from telemetry.lane.publisher import NullPublisher
from telemetry.lane.record import (
    EVENT_FINISHED,
    EVENT_FIRST_TOKEN,
    SOURCE_ITERSCOPE,
    IterationRecord,
    RequestMilestone,
    step_time_bound_ns,
)


def _engine_version() -> str:
    """This engine's name and version for the heartbeats, e.g. "iterscope 0.1.0"."""
    try:
        return f"iterscope {importlib.metadata.version('iterscope')}"
    except importlib.metadata.PackageNotFoundError:  # run from a checkout not installed
        return "iterscope"


ENGINE_VERSION = _engine_version()


class RequestOutput(msgspec.Struct, array_like=True, gc=False):
    """What a client receives for one request after an iteration (or an abort / rejection)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    num_cached_tokens: int = 0
    error: str = ""  # set when the request was rejected (then finished is True)
    logprobs: list[TokenLogprobs] | None = None  # one per new token, if the request asked


class Runner(Protocol):
    def execute(self, scheduled: list[tuple[Request, int]]) -> list[int | None]: ...


class Publisher(Protocol):
    def publish(self, record: IterationRecord) -> None: ...

    def note_queues(self, num_waiting: int, num_running: int, step_tokens: int = 0) -> None: ...

    def close(self) -> None: ...


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        runner: Runner,
        kv_plan: KvPlan,
        eos_token_ids: tuple[int, ...] = (),
        publisher: Publisher | None = None,
        vocab_size: int = 0,
    ):
        """``vocab_size`` (0 = unknown) bounds the token ids a request may carry."""
        self.config = config
        self.vocab_size = vocab_size
        self.runner = runner
        self.kv_plan = kv_plan
        self.pool = BlockPool(kv_plan.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.pool,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=kv_plan.max_model_len,
            eos_token_ids=eos_token_ids,
            enable_chunked_prefill=config.enable_chunked_prefill,
        )
        self.publisher = publisher or NullPublisher()
        self.markers = make_markers(config.nvtx_markers)
        self.requests: dict[str, Request] = {}
        self.startup_notes: list[str] = []  # start-up's lines after the KV plan (CUDA graphs)
        self.iteration = 0
        self.num_scheduled_reqs = 0  # in the last iteration; 0 with work left = blocked
        # (tokens, elapsed ns) of the biggest iteration so far, the longest of that size
        self.biggest_step = (0, 0)
        # called as an iteration bigger than any before starts, with the seconds it may take
        # (record.step_time_bound_ns): engine/core_process.py tells the client, whose /health
        # waits that long before "stalled"
        self.on_big_step: Callable[[float], None] = lambda bound_s: None
        self._pending_milestones: list[RequestMilestone] = []

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._pending_milestones)

    def add_request(self, request: Request) -> None:
        """Queue a request; RequestRejectedError (a ValueError) if it could never run."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if self.vocab_size:
            check_token_ids(request, self.vocab_size)
        if not request.arrival_ns:
            request.arrival_ns = time.monotonic_ns()
        self.scheduler.add_request(request)
        self.requests[request.request_id] = request
        self.publisher.note_queues(len(self.scheduler.waiting), len(self.scheduler.running))

    def abort_request(
        self, request_id: str, reason: FinishReason = FinishReason.ABORT
    ) -> RequestOutput | None:
        """Stop a request, finished for `reason`; its finish milestone rides on the next
        iteration record."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        self.scheduler.abort_request(request, time.monotonic_ns(), reason)
        self._pending_milestones.append(_milestone(request, EVENT_FINISHED))
        return RequestOutput(request_id, [], True, reason.text)

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, execute, update, publish the record."""
        start_ns = time.monotonic_ns()
        self.iteration += 1
        self.markers.begin(self.iteration)
        scheduled = self.scheduler.schedule(start_ns)
        self.num_scheduled_reqs = len(scheduled.scheduled)
        # The queues this iteration runs with and its size, for heartbeats sent while it
        # runs (a long prefill would show the requests it took in as still waiting, and look
        # like a stall to a sidecar that does not know how big it is).
        step_tokens = scheduled.num_prefill_tokens + scheduled.num_decode_tokens
        self.publisher.note_queues(
            len(self.scheduler.waiting), len(self.scheduler.running), step_tokens
        )
        bound_ns = step_time_bound_ns(step_tokens, *self.biggest_step)
        if bound_ns:
            self.on_big_step(bound_ns / 1e9)
        model_start_ns = time.monotonic_ns()
        sampled = self.runner.execute(scheduled.scheduled) if scheduled.scheduled else []
        end_ns = time.monotonic_ns()
        if (step_tokens, end_ns - start_ns) > self.biggest_step:
            self.biggest_step = (step_tokens, end_ns - start_ns)
        updated = self.scheduler.update(scheduled.scheduled, sampled, start_ns, end_ns)
        outputs, milestones = self._outputs(updated, end_ns)
        self.publisher.publish(
            self._record(scheduled, start_ns, end_ns - model_start_ns, milestones)
        )
        self.markers.end()
        return outputs

    def _outputs(
        self, updated: list[Request], end_ns: int
    ) -> tuple[list[RequestOutput], list[RequestMilestone]]:
        outputs = []
        milestones, self._pending_milestones = self._pending_milestones, []
        for request in updated:
            reason = request.finish_reason
            finish_reason = reason.text if reason is not None else None
            logprobs = request.sampled_logprobs
            outputs.append(
                RequestOutput(
                    request.request_id,
                    [request.token_ids[-1]],
                    request.is_finished,
                    finish_reason,
                    request.num_cached_tokens,
                    logprobs=None if logprobs is None else [logprobs],
                )
            )
            event = EVENT_FIRST_TOKEN if request.first_token_ns == end_ns else 0
            if request.is_finished:
                event |= EVENT_FINISHED
                del self.requests[request.request_id]
            if event:
                milestones.append(_milestone(request, event))
        return outputs, milestones

    def _record(
        self,
        scheduled: SchedulerOutput,
        start_ns: int,
        model_elapsed_ns: int,
        milestones: list[RequestMilestone],
    ) -> IterationRecord:
        num_waiting = len(self.scheduler.waiting)
        reason = scheduled.wait_reason if num_waiting else WaitReason.NONE
        # The constructor with positional arguments, in the record's field order (its wire
        # order): this runs every iteration, and msgspec's constructor with this many keywords
        # costs several times more (0.9 us against 0.1), as does the factory's.
        return IterationRecord(
            self.config.engine_index,
            0,  # msg_seq: stamped by the publisher
            self.iteration,
            start_ns,
            time.monotonic_ns() - start_ns,  # elapsed_ns
            scheduled.num_prefill_reqs,
            scheduled.num_prefill_tokens,
            scheduled.num_decode_reqs,
            scheduled.num_decode_tokens,
            len(self.scheduler.running),  # num_running_reqs
            num_waiting,  # num_waiting_reqs, then those held by KV, sequence limit, budget:
            num_waiting if reason == WaitReason.KV_CAPACITY else 0,
            num_waiting if reason == WaitReason.SEQ_LIMIT else 0,
            num_waiting if reason == WaitReason.TOKEN_BUDGET else 0,
            self.pool.num_used_blocks,  # num_kv_blocks_used
            self.pool.num_free_blocks,  # num_kv_blocks_free
            self.scheduler.num_kv_tokens,
            scheduled.num_prefix_query_tokens,
            scheduled.num_prefix_hit_tokens,
            scheduled.num_preemptions,
            0,  # num_dropped: stamped by the publisher
            milestones,
            0,  # unknown: our engine knows every field
            0,  # num_waiting_other_reqs
            model_elapsed_ns,
        )

    def startup_lines(self) -> list[str]:
        """What start-up logged: the dtype and why, the KV plan, then any notes."""
        return [self.config.dtype_choice()[1], *self.kv_plan.startup_lines(), *self.startup_notes]

    def facts(self, model_name: str) -> dict[str, Any]:
        """Static Heartbeat fields."""
        return {
            "model_name": model_name,
            "device_name": self.config.device_name,
            "block_size": self.config.block_size,
            "num_kv_blocks_total": self.kv_plan.num_blocks,
            "max_num_seqs": self.config.max_num_seqs,
            "max_num_batched_tokens": self.config.max_num_batched_tokens,
            "source": SOURCE_ITERSCOPE,
            "engine_version": ENGINE_VERSION,
            "dtype": self.config.torch_dtype_name,
            "max_model_len": self.kv_plan.max_model_len,
        }


def check_token_ids(request: Request, vocab_size: int) -> None:
    """Raise RequestRejectedError for token ids outside the model's vocabulary (they would
    crash the embedding lookup and, with it, the engine)."""
    bad = [token for token in request.prompt_token_ids if not 0 <= token < vocab_size]
    if bad:
        raise RequestRejectedError(
            f"request {request.request_id!r}: token ids {bad[:5]} are outside the model's "
            f"vocabulary (0..{vocab_size - 1})"
        )


def _milestone(request: Request, event: int) -> RequestMilestone:
    finished = bool(event & EVENT_FINISHED)
    return RequestMilestone(
        request_id=request.request_id,
        event=event,
        arrival_ns=request.arrival_ns,
        first_scheduled_ns=request.first_scheduled_ns,
        first_token_ns=request.first_token_ns,
        finished_ns=request.finished_ns,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=request.num_cached_tokens,
        num_output_tokens=request.num_output_tokens,
        num_preemptions=request.num_preemptions,
        finish_reason=int(request.finish_reason) if request.finish_reason is not None else -1,
        traceparent=request.traceparent,
        preempted_ns=list(request.preempted_ns) if finished else [],
        prefill_chunks=list(request.prefill_chunks) if finished else [],
    )
