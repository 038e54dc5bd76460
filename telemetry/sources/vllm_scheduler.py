"""vLLM's scheduler, reporting: one IterationRecord per step from inside vLLM's engine core.

    ITERSCOPE_TELEMETRY_ADDRESS=default vllm serve MODEL \\
        --scheduler-cls telemetry.sources.vllm_scheduler.IterscopeScheduler

(which builds an ``IterscopeAsyncScheduler`` where vLLM schedules asynchronously, its default
on a GPU: vLLM takes the class as given, and a synchronous one would serialise its steps.) vLLM
builds the scheduler in each EngineCore process (one per data-parallel rank); the subclass
schedules exactly as vLLM does and, around ``schedule()`` and ``update_from_output()``,
hands what it saw to a StepReporter (telemetry/sources/vllm_steps.py), which fills the record
and queues it to the lane publisher: an O(1) hand-off, no encoding or I/O on vLLM's step
path. The publisher's own thread sends the records and a heartbeat every second carrying
this process's pid, so a hung forward pass reads as stalled, and a stopped or killed engine
core (no heartbeats) as dead, whatever the API server does; an engine core told to stop
closes the lane first (telemetry/sources/vllm_stop.py), so a shutdown is no death.

Version guard: vLLM's scheduler internals are not a stable interface. At start-up the
subclass checks vLLM's version (TESTED_VLLM_VERSIONS) and every attribute the reporter reads;
on a mismatch it says so in vLLM's log and schedules as plain vLLM with nothing sent
(ITERSCOPE_VLLM_UNTESTED=1 tries an untested version whose attributes all exist). On an
untested version the stat-logger plugin, where vLLM loads it, reports the engine instead
(telemetry/sources/vllm_stat_logger.py), so a vLLM upgrade loses the waiting reasons, not
the engine. A failure while reporting is caught, counted and logged (the first, then every
1,000th), and the reporter turns itself off after MAX_ERRORS: serving never breaks.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import vllm
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from telemetry.lane.record import SOURCE_VLLM_SCHEDULER
from telemetry.sources.vllm_lane import (
    TESTED_VLLM_VERSIONS,
    UNTESTED_ENV,
    scheduler_source_runs_on,
    start_publisher,
)
from telemetry.sources.vllm_records import engine_facts, num_usable_blocks
from telemetry.sources.vllm_steps import StepReporter, prefills_held, waiting_queues
from telemetry.sources.vllm_stop import StopWatch

MAX_ERRORS = 1000
# What StepReporter reads of the scheduler (and of its KV manager's block pool, and of its
# waiting queues: vllm_steps.waiting_queues).
SCHEDULER_ATTRIBUTES = (
    "running",
    "finished_req_ids",
    "max_num_scheduled_tokens",
    "num_waiting_for_streaming_input",
    "pause_state",
    "kv_cache_manager",
    "vllm_config",
    "num_spec_tokens",
    "make_spec_decoding_stats",
)
logger = logging.getLogger("vllm.iterscope")  # vLLM's handler and format


class ReportingScheduler:
    """The reporting half of both scheduler classes below (a mixin: vLLM's class follows it
    in the bases, so ``super()`` is vLLM's scheduler)."""

    _iterscope: StepReporter | None = None
    _iterscope_stop: StopWatch | None = None
    _iterscope_errors = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._iterscope = make_reporter(self)
        if self._iterscope is not None:
            drains = getattr(self.vllm_config, "shutdown_timeout", 0) > 0
            self._iterscope_stop = StopWatch(
                self._iterscope_stopped, self.get_num_unfinished_requests, drains
            )

    def has_requests(self) -> bool:
        """vLLM's answer; its busy loop asks before it waits for work, which lets the stop
        watch hook vLLM's stop signals, and close the lane once a drain is done."""
        has_requests = super().has_requests()
        stop = self._iterscope_stop
        if stop is not None and stop.waiting:
            try:
                stop.on_loop(has_requests)
            except Exception:
                self._iterscope_failed()
        return has_requests

    def add_request(self, request: Any) -> None:
        super().add_request(request)
        reporter = self._iterscope
        if reporter is not None:
            try:
                reporter.added(self, request)
            except Exception:
                self._iterscope_failed()

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        reporter = self._iterscope
        if reporter is None:
            return super().schedule(*args, **kwargs)
        start_ns = time.monotonic_ns()
        try:
            held = prefills_held(self, bool(args[0] if args else kwargs.get("throttle_prefills")))
        except Exception:
            held = False
            self._iterscope_failed()
        output = super().schedule(*args, **kwargs)
        try:
            reporter.scheduled(self, output, start_ns, held)
        except Exception:
            self._iterscope_failed()
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        update_start_ns = time.monotonic_ns()
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        reporter = self._iterscope
        if reporter is not None:
            try:
                reporter.updated(self, scheduler_output, outputs, update_start_ns)
            except Exception:
                self._iterscope_failed()
        return outputs

    def make_spec_decoding_stats(
        self,
        spec_decoding_stats: Any,
        num_draft_tokens: int,
        num_accepted_tokens: int,
        num_invalid_spec_tokens: dict[str, int] | None,
        request_id: str,
    ) -> Any:
        """vLLM calls this for each request whose draft a step scored, inside
        ``update_from_output``, whether or not it logs stats; it counts the draft as vLLM's
        own does (nothing when the draft was empty; grammar-invalidated tokens not drafted)."""
        stats = super().make_spec_decoding_stats(
            spec_decoding_stats,
            num_draft_tokens=num_draft_tokens,
            num_accepted_tokens=num_accepted_tokens,
            num_invalid_spec_tokens=num_invalid_spec_tokens,
            request_id=request_id,
        )
        reporter = self._iterscope
        if reporter is not None and num_draft_tokens:
            try:
                num_invalid = (num_invalid_spec_tokens or {}).get(request_id, 0)
                reporter.drafted(
                    self.num_spec_tokens, num_draft_tokens - num_invalid, num_accepted_tokens
                )
            except Exception:
                self._iterscope_failed()
        return stats

    def shutdown(self) -> None:
        self.shutdown_reporter()
        super().shutdown()

    def _iterscope_failed(self) -> None:
        self._iterscope_errors += 1
        if self._iterscope_errors == 1 or self._iterscope_errors % 1000 == 0:
            logger.exception(
                "iterscope: a vLLM step was not reported (%d errors so far; vLLM goes on)",
                self._iterscope_errors,
            )
        if self._iterscope_errors >= MAX_ERRORS:
            logger.error("iterscope: %d errors, the scheduler source stops reporting", MAX_ERRORS)
            self.shutdown_reporter()

    def shutdown_reporter(self, stop_requested: bool = False) -> None:
        """Stop reporting: send what is queued and close the lane; vLLM schedules on.
        ``stop_requested``: the engine core was told to stop (its closing heartbeat says so)."""
        reporter, self._iterscope = self._iterscope, None
        if reporter is not None:
            reporter.publisher.close(stop_requested)

    def _iterscope_stopped(self) -> None:
        """The engine core was told to stop (the stop watch): the lane closes, saying so, so
        the requests an abort cuts off read as a shutdown's, not a death's."""
        self.shutdown_reporter(stop_requested=True)


class IterscopeScheduler(ReportingScheduler, Scheduler):
    """vLLM's scheduler, reporting every step: the one flag to give. Built with async
    scheduling on (vLLM's default on a GPU, or ``--async-scheduling``) it is an
    IterscopeAsyncScheduler, as vLLM picks AsyncScheduler over Scheduler by that setting when
    no class is given: a synchronous scheduler under vLLM's async engine loop would schedule
    nothing while a step is in flight, serialising the steps async scheduling overlaps."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        config = kwargs.get("vllm_config", args[0] if args else None)
        if cls is IterscopeScheduler and _async_scheduling(config):
            return IterscopeAsyncScheduler(*args, **kwargs)  # not an instance: no 2nd __init__
        return super().__new__(cls)


class IterscopeAsyncScheduler(ReportingScheduler, AsyncScheduler):
    """vLLM's async scheduler, reporting every step (what IterscopeScheduler becomes when
    vLLM schedules asynchronously)."""


def _async_scheduling(vllm_config: Any) -> bool:
    """Whether vLLM's config (settled before the scheduler is built) schedules asynchronously."""
    return bool(getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False))


def make_reporter(scheduler: Any) -> StepReporter | None:
    """A reporter for this scheduler, or None (plain vLLM, the reason said in vLLM's log):
    an untested vLLM version, a scheduler attribute missing, no lane address."""
    version = vllm.__version__
    if not scheduler_source_runs_on(version):
        logger.warning(
            "iterscope: the scheduler source was checked against vLLM %s, this is %s; it "
            "schedules as plain vLLM and sends nothing (set %s=1 to try it anyway); the "
            "stat-logger plugin, where vLLM loads it, reports this engine instead "
            "(docs/vllm.md)",
            ", ".join(TESTED_VLLM_VERSIONS),
            version,
            UNTESTED_ENV,
        )
        return None
    missing = missing_attributes(scheduler)
    if missing:
        logger.warning(
            "iterscope: vLLM %s's scheduler has no %s; the scheduler source "
            "schedules as plain vLLM and sends nothing",
            version,
            ", ".join(missing),
        )
        return None
    config = scheduler.vllm_config
    num_gpu_blocks = scheduler.kv_cache_manager.block_pool.num_gpu_blocks
    engine_index = _engine_index(config)
    facts = engine_facts(config, num_usable_blocks(num_gpu_blocks), SOURCE_VLLM_SCHEDULER, version)
    publisher = start_publisher(engine_index, facts, "the scheduler source")
    if publisher is None:
        return None
    return StepReporter(engine_index, num_gpu_blocks, publisher, waiting_queues(scheduler))


def missing_attributes(scheduler: Any) -> list[str]:
    """The attributes StepReporter needs that this vLLM's scheduler lacks."""
    names = (*SCHEDULER_ATTRIBUTES, *waiting_queues(scheduler).names)
    missing = [name for name in names if not hasattr(scheduler, name)]
    pool = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
    for name in ("num_gpu_blocks", "get_num_free_blocks"):
        if not hasattr(pool, name):
            missing.append(f"kv_cache_manager.block_pool.{name}")
    return missing


def _engine_index(vllm_config: Any) -> int:
    """This engine core's data-parallel rank: the engine index vLLM's stat loggers get."""
    parallel = vllm_config.parallel_config
    return int(
        getattr(parallel, "data_parallel_index", None)
        or getattr(parallel, "data_parallel_rank", 0)
        or 0
    )
