"""A vLLM stat-logger plugin that sends vLLM's per-step stats over iterscope's telemetry lane.

Installed with this package under the entry-point group ``vllm.stat_logger_plugins``; vLLM's
``vllm serve`` (AsyncLLM) builds one ``IterscopeStatLogger`` per engine index (data-parallel
rank) in its API-server process. Turned on by one environment variable:

    ITERSCOPE_TELEMETRY_ADDRESS=ipc:///tmp/iterscope-1000/telemetry.sock  (or "default":
    the address ``iterscope sidecar`` binds by default)

Without it the plugin does nothing and says so once. It imports the lane (record,
publisher) and the mapping (telemetry/sources/vllm_records.py), nothing else of iterscope.

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

import atexit
import logging
import os
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from telemetry.lane.publisher import ZmqPublisher, default_address
from telemetry.sources.vllm_records import RecordMaker, num_in_flight

ADDRESS_ENV = "ITERSCOPE_TELEMETRY_ADDRESS"
TESTED_VLLM_VERSIONS = ("0.32.0",)
# The publisher thread wakes this often. vLLM's engine core spreads its OpenMP threads over
# every core, so each wake-up of another thread can hold up a whole parallel region; vLLM
# steps take tens of ms, so 100 ms still sends each record well within a heartbeat.
SEND_INTERVAL_S = 0.1
logger = logging.getLogger("vllm.iterscope")  # vLLM's handler and format
_said_unconfigured = False


class IterscopeStatLogger(StatLoggerBase):
    """One vLLM engine's stats as iterscope IterationRecords and Heartbeats."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self.num_errors = 0
        self._vllm_config = vllm_config
        self._publisher: ZmqPublisher | None = None
        observability = getattr(vllm_config, "observability_config", None)
        self._maker = RecordMaker(
            engine_index, _num_gpu_blocks(vllm_config),
            bool(getattr(observability, "enable_logging_iteration_details", False)),
        )
        address = os.environ.get(ADDRESS_ENV, "").strip()
        if not address:
            _say_unconfigured_once()
            return
        if address == "default":
            address = default_address()
        try:
            self._publisher = ZmqPublisher(address, engine_index, facts=self._facts(),
                                           send_interval_s=SEND_INTERVAL_S)
        except Exception:  # a bad address must not stop vLLM from serving
            logger.exception("iterscope: cannot publish to %s; telemetry is off", address)
            return
        atexit.register(self._publisher.close)
        logger.info("iterscope: engine %d publishes per-step records to %s",
                    engine_index, address)
        if engine_index == 0:
            _warn_if_untested_version()

    def log_engine_initialized(self) -> None:
        """The KV pool's size is known from here on."""
        if self._publisher is None:
            return
        try:
            self._maker.set_num_gpu_blocks(_num_gpu_blocks(self._vllm_config))
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
            elif scheduler_stats is not None:
                publisher.note_queues(*num_in_flight(scheduler_stats))
        except Exception:
            self._failed()

    def _failed(self) -> None:
        self.num_errors += 1
        if self.num_errors == 1 or self.num_errors % 1000 == 0:
            logger.exception("iterscope: stats of engine %d not mapped (%d errors so far; "
                             "vLLM goes on)", self.engine_index, self.num_errors)

    def _facts(self) -> dict[str, Any]:
        """Static Heartbeat fields from vLLM's config; a missing attribute leaves its default."""
        config = self._vllm_config
        facts: dict[str, Any] = {}
        model = getattr(getattr(config, "model_config", None), "served_model_name", None)
        if isinstance(model, (list, tuple)):
            model = model[0] if model else None
        if model:
            facts["model_name"] = str(model)
        device = getattr(getattr(config, "device_config", None), "device_type", None)
        if device:
            facts["device_name"] = "GPU" if device == "cuda" else str(device).upper()
        cache = getattr(config, "cache_config", None)
        if getattr(cache, "block_size", None):
            facts["block_size"] = int(cache.block_size)
        if self._maker.num_usable_blocks:
            facts["num_kv_blocks_total"] = self._maker.num_usable_blocks
        scheduler = getattr(config, "scheduler_config", None)
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(scheduler, name, None):
                facts[name] = int(getattr(scheduler, name))
        return facts


def _num_gpu_blocks(vllm_config: Any) -> int:
    return int(getattr(getattr(vllm_config, "cache_config", None), "num_gpu_blocks", 0) or 0)


def _warn_if_untested_version() -> None:
    """vLLM's stats classes are no stable interface: say when this vLLM is not one tested."""
    from vllm import __version__

    if __version__.split("+")[0] not in TESTED_VLLM_VERSIONS:
        logger.warning("iterscope: tested with vLLM %s, this is %s; a stats field vLLM renamed "
                       "reads as 0 (docs/vllm.md)", ", ".join(TESTED_VLLM_VERSIONS), __version__)


def _say_unconfigured_once() -> None:
    global _said_unconfigured
    if not _said_unconfigured:
        _said_unconfigured = True
        logger.info("iterscope: the stat-logger plugin is installed but %s is not set, so it "
                    "sends nothing (set it to the sidecar's address, or to 'default')",
                    ADDRESS_ENV)
