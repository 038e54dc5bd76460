"""A vLLM stat-logger plugin that sends vLLM's per-step stats over iterscope's telemetry lane.

Installed with this package under the entry-point group ``vllm.stat_logger_plugins``; vLLM's
``vllm serve`` (AsyncLLM) builds one ``IterscopeStatLogger`` per engine index (data-parallel
rank) in its API-server process. Turned on by ITERSCOPE_TELEMETRY_ADDRESS
(telemetry/sources/vllm_lane.py); without it the plugin does nothing and says so once. When
vLLM runs with iterscope's scheduler (``--scheduler-cls telemetry.sources.vllm_scheduler...``)
that source reports every step from the engine core itself, so the plugin sends nothing (one
source per engine, no double counting) and says so once; unless this vLLM is one the scheduler
source does not run on (an untested version: it then schedules plainly and sends nothing),
where the plugin reports the engine instead, and says so. It imports the lane, the mapping
(telemetry/sources/vllm_records.py) and vllm_lane.py, nothing else of iterscope.

    vLLM event loop                                publisher thread (owns socket, encoder)
    record(scheduler_stats, iteration_stats)       every 100 ms: stamp, encode, send(NOBLOCK)
      -> RecordMaker.make -> publisher.publish     every 1 s: Heartbeat (last step that
         (fills a record and queues it, no I/O)      scheduled work, requests in flight)

vLLM calls ``record`` only when an engine step finishes, so while its engine core is hung the
calls stop but the publisher thread's heartbeats go on: the sidecar sees requests in flight
and no progress (stalled), where a dead API server sends nothing at all (dead). Nothing here
raises into vLLM: an exception is caught, counted and logged (the first, then every
1,000th).
"""

from __future__ import annotations

import logging
from typing import Any

import vllm
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import SchedulerStats

from telemetry.lane.publisher import ZmqPublisher
from telemetry.lane.record import SOURCE_VLLM_STAT_LOGGER
from telemetry.sources.vllm_lane import (
    TESTED_VLLM_VERSIONS,
    is_tested_version,
    scheduler_source_runs_on,
    scheduler_source_selected,
    start_publisher,
)
from telemetry.sources.vllm_records import (
    RecordMaker,
    engine_facts,
    num_gpu_blocks,
    num_in_flight,
)
from telemetry.sources.vllm_stop import StopWatch

logger = logging.getLogger("vllm.iterscope")  # vLLM's handler and format


class IterscopeStatLogger(StatLoggerBase):
    """One vLLM engine's stats as iterscope IterationRecords and Heartbeats."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self.num_errors = 0
        self._vllm_config = vllm_config
        self._publisher: ZmqPublisher | None = None
        self._stop: StopWatch | None = None
        self._num_in_flight = 0  # waiting + running, as the latest scheduler stats said
        observability = getattr(vllm_config, "observability_config", None)
        details_asked = bool(getattr(observability, "enable_logging_iteration_details", False))
        details_lost = details_asked and not stats_carry_iteration_details()
        self._maker = RecordMaker(
            engine_index, num_gpu_blocks(vllm_config), details_asked and not details_lost
        )
        if scheduler_source_selected(vllm_config):
            if scheduler_source_runs_on(vllm.__version__):
                if engine_index == 0:
                    logger.info(
                        "iterscope: vLLM runs iterscope's scheduler, which reports every "
                        "step from the engine core; the stat-logger plugin sends nothing"
                    )
                return
            if engine_index == 0:
                logger.warning(
                    "iterscope: the scheduler source does not run on vLLM %s (untested); "
                    "the stat-logger plugin reports this engine instead: no waiting "
                    "reasons, each request's first token named only at its finish (docs/vllm.md)",
                    vllm.__version__,
                )
        self._publisher = start_publisher(engine_index, self._facts(), "the stat-logger plugin")
        if self._publisher is not None:
            drains = getattr(vllm_config, "shutdown_timeout", 0) > 0
            self._stop = StopWatch(self._stopped, lambda: self._num_in_flight, drains)
        if self._publisher is not None and engine_index == 0:
            _warn_if_untested_version()
            if details_lost:
                logger.warning(
                    "iterscope: vLLM %s logs each step's iteration details in its engine core "
                    "but hands them to no stat logger (vLLM 0.26 and later do): the plugin's "
                    "records have no iteration time and no count of prefill requests, shown "
                    "as unknown; iterscope's scheduler source measures both (docs/vllm.md)",
                    vllm.__version__,
                )

    def log_engine_initialized(self) -> None:
        """The KV pool's size is known from here on."""
        if self._publisher is None:
            return
        try:
            self._maker.set_num_gpu_blocks(num_gpu_blocks(self._vllm_config))
            self._publisher.update_facts(**self._facts())
        except Exception:
            self._failed()

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        publisher = self._publisher
        if publisher is None:
            return
        try:
            record = self._maker.make(scheduler_stats, iteration_stats)
            if record is not None:
                publisher.publish(record)
                self._num_in_flight = record.num_waiting_reqs + record.num_running_reqs
            elif scheduler_stats is not None:
                waiting, running = num_in_flight(scheduler_stats)
                publisher.note_queues(waiting, running)
                self._num_in_flight = waiting + running
            stop = self._stop
            if stop is not None and stop.waiting:
                stop.on_loop(self._num_in_flight > 0)
        except Exception:
            self._failed()

    def _stopped(self) -> None:
        """The API server was told to stop (the stop watch, from vLLM's signal handler): the
        lane closes saying so, so the requests an abort cuts off read as a shutdown's, not as
        a stall while the API server waits for its clients (the engine core is gone)."""
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            publisher.close(stop_requested=True)

    def _failed(self) -> None:
        self.num_errors += 1
        if self.num_errors == 1 or self.num_errors % 1000 == 0:
            logger.exception(
                "iterscope: stats of engine %d not mapped (%d errors so far; vLLM goes on)",
                self.engine_index,
                self.num_errors,
            )

    def _facts(self) -> dict[str, Any]:
        return engine_facts(
            self._vllm_config,
            self._maker.num_usable_blocks,
            SOURCE_VLLM_STAT_LOGGER,
            vllm.__version__,
        )


def stats_carry_iteration_details() -> bool:
    """Whether this vLLM hands stat loggers each step's iteration details
    (``SchedulerStats.iteration_details``, from vLLM 0.26; before, only its engine core logs
    them)."""
    return hasattr(SchedulerStats, "iteration_details")


def _warn_if_untested_version() -> None:
    """vLLM's stats classes are no stable interface: say when this vLLM is not one tested."""
    if not is_tested_version(vllm.__version__):
        logger.warning(
            "iterscope: tested with vLLM %s, this is %s; a stats field vLLM renamed "
            "reads as 0 (docs/vllm.md)",
            ", ".join(TESTED_VLLM_VERSIONS),
            vllm.__version__,
        )
