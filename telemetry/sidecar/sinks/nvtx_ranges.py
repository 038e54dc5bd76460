"""NVTX for Nsight Systems: one range per engine iteration, plus KV / queue counters.

Everything lives in the NVTX domain ``iterscope``; each engine gets a category
("engine 0", ...). A range's message is the per-iteration line the log sink prints
(telemetry/sidecar/iteration_line.py) and its payload is the iteration number, so a range pairs with
the engine-side ``--nvtx-markers`` range of the same iteration (engine/nvtx_markers.py).

Two modes:

- live (``--nvtx``, the sidecar runs under ``nsys profile``): records reach the sidecar in
  batches (the engine's publisher sends every 20 or 100 ms), so drawing each range as its record
  arrives would squeeze most ranges into microseconds. A pacer thread replays them instead
  (when each range opens and closes is RangePacer's, telemetry/sidecar/sinks/nvtx_pacer.py):
  the range of iteration N opens at N's start and closes at N's end, both shifted by one
  constant lag (the smallest lane latency seen for that engine, plus ``--nvtx-delay-ms``,
  50 ms by default, which must exceed the publisher's send period). Ranges keep their true
  lengths and order and sit that lag after the real iteration; if the sidecar falls further
  behind, due ranges are drawn at once, shortened rather than dropped.
  bench/nvtx_offset.py measures the lag and the length error; docs/profiling.md has figures.
- exact (``--nvtx-writer-backend``): ranges and counter samples are written through an
  NVTXW backend (``nvtx.writer``) at the engine's own timestamps (CLOCK_MONOTONIC, the
  clock of ``time.monotonic_ns()``), for merging into an Nsight Systems report afterwards.

Event attributes are built once and reused; only message and payload change per iteration.
Each line becomes a registered string (nvtx._lib.lib.RegisteredString, created directly
because ``Domain.get_registered_string`` caches every string forever). Both modes draw the
same ranges and counters under the same names (the domain, categories, counter names and
range text are what users filter on in Nsight Systems; the names are telemetry/analysis/
track_names.py's, which the Perfetto trace uses too). The sidecar flags of both modes
(``add_arguments``, ``build``) are here too.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import nvtx
from nvtx._lib.lib import DummyDomain, RegisteredString

from telemetry.analysis.track_names import (
    DOMAIN,
    KV_USAGE,
    RUNNING,
    WAITING,
    counter_name,
    engine_category,
)
from telemetry.lane.record import IterationRecord
from telemetry.sidecar.engine_view import EngineView, record_kv_usage_ratio
from telemetry.sidecar.iteration_line import format_iteration_line
from telemetry.sidecar.sink import Sink
from telemetry.sidecar.sinks.nvtx_pacer import START, RangePacer

RANGE_COLOR = 0xFF76B900  # ARGB
DEFAULT_DELAY_MS = 50.0
KV_USAGE_SEMANTICS = nvtx.CounterSemantics(unit="%", min=0.0, max=100.0)
# Every engine's counters as (name, dtype, semantics), in the order counter_values samples them.
COUNTERS = ((KV_USAGE, float, KV_USAGE_SEMANTICS), (RUNNING, int, None), (WAITING, int, None))


def counter_values(record: IterationRecord) -> tuple[float, int, int]:
    """The record's sample of each of COUNTERS, in that order."""
    return (100.0 * record_kv_usage_ratio(record), record.num_running_reqs, record.num_waiting_reqs)


class _EngineRanges:
    """One engine's counters and its currently open range (live mode)."""

    def __init__(self, domain: nvtx.Domain, engine_index: int) -> None:
        self.attributes = domain.get_event_attributes(
            color=RANGE_COLOR, category=engine_category(engine_index)
        )
        self.counters = [
            domain.get_counter(counter_name(engine_index, what), dtype, semantics=semantics)
            for what, dtype, semantics in COUNTERS
        ]
        self.open_range_id: int | None = None
        self.open_iteration = 0  # the iteration whose range is open


class NvtxSink(Sink):
    """Live mode: ranges replayed by a pacer thread at their iterations' times plus a constant
    lag (see the module docstring). on_iteration only queues; every NVTX call is made on the
    pacer thread."""

    name = "nvtx"

    def __init__(self, domain_name: str = DOMAIN, delay_ms: float = DEFAULT_DELAY_MS) -> None:
        if delay_ms < 0:
            raise ValueError(f"the NVTX delay must be >= 0 ms, got {delay_ms}")
        self.domain = nvtx.get_domain(domain_name)
        self.enabled = not isinstance(self.domain, DummyDomain)  # no NVTX tool attached
        self._pacer = RangePacer(int(delay_ms * 1e6))
        self._engines: dict[int, _EngineRanges] = {}
        self._wakeup = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="nvtx-pacer", daemon=True)
        if self.enabled:
            self._thread.start()

    def on_iteration(self, record: IterationRecord, engine: EngineView) -> None:
        if not self.enabled:
            return
        with self._wakeup:
            self._pacer.add(record, time.monotonic_ns())
            self._wakeup.notify()

    def close(self) -> None:
        """Draw what is still queued, at its times (at most the lag from now), then stop."""
        if not self.enabled:
            return
        with self._wakeup:
            self._closing = True
            self._wakeup.notify()
        self._thread.join()
        for engine in self._engines.values():
            if engine.open_range_id is not None:
                self.domain.end_range(engine.open_range_id)
                engine.open_range_id = None

    def _run(self) -> None:
        while True:
            with self._wakeup:
                due = self._pacer.pop_due(time.monotonic_ns())
                if not due:
                    next_ns = self._pacer.next_due_ns()
                    if next_ns is None and self._closing:
                        return
                    wait_ns = None if next_ns is None else max(0, next_ns - time.monotonic_ns())
                    self._wakeup.wait(None if wait_ns is None else wait_ns / 1e9)
                    continue
            for kind, record in due:
                if kind == START:
                    self._open(record)
                else:
                    self._close_range(record)

    def _engine(self, engine_index: int) -> _EngineRanges:
        engine = self._engines.get(engine_index)
        if engine is None:
            engine = self._engines[engine_index] = _EngineRanges(self.domain, engine_index)
        return engine

    def _open(self, record: IterationRecord) -> None:
        engine = self._engine(record.engine_index)
        if engine.open_range_id is not None:  # the lag shrank: the previous range ends here
            self.domain.end_range(engine.open_range_id)
        attributes = engine.attributes
        attributes.message = RegisteredString(self.domain.handle, format_iteration_line(record))
        attributes.payload = record.iteration
        engine.open_range_id = self.domain.start_range(attributes)
        engine.open_iteration = record.iteration
        for counter, value in zip(engine.counters, counter_values(record), strict=True):
            counter.sample(value)

    def _close_range(self, record: IterationRecord) -> None:
        engine = self._engine(record.engine_index)
        if engine.open_range_id is not None and engine.open_iteration == record.iteration:
            self.domain.end_range(engine.open_range_id)
            engine.open_range_id = None


class NvtxWriterSink(Sink):
    """Exact mode: ranges and counters at the engine's timestamps, through an NVTXW backend.

    One NVTXW stream per engine ("engine N"), in the CLOCK_MONOTONIC time domain; the range
    of an iteration is [start_ns, start_ns + elapsed_ns] exactly, counters are sampled at its
    end. No NVTX tool needs to be attached to the sidecar in this mode.
    """

    name = "nvtx"

    def __init__(self, backend_path: str, config: str | None = None, name: str = DOMAIN) -> None:
        from nvtx import writer

        try:
            self._backend = writer.load_backend(backend_path)
        except (OSError, writer.WriterError) as error:
            raise ValueError(f"cannot load the NVTXW backend {backend_path!r}: {error}") from None
        try:
            self._session = writer.Session(name, backend=self._backend, config=config)
            self._session.begin()
        except writer.WriterError as error:
            self._backend.close()
            raise ValueError(
                f"the NVTXW backend {backend_path!r} refused the session: {error}"
            ) from None
        self._domain = self._session.get_domain(DOMAIN)
        self._streams: dict[int, object] = {}
        self._counters: dict[tuple[int, str], object] = {}

    def _stream(self, engine_index: int):
        stream = self._streams.get(engine_index)
        if stream is None:
            stream = self._session.create_stream(
                engine_category(engine_index),
                domain=self._domain,
                time_domain_id=nvtx.TimestampType.CPU_CLOCK_GETTIME_MONOTONIC,
            )
            stream.open()
            self._streams[engine_index] = stream
        return stream

    def _counter(
        self, engine_index: int, what: str, dtype: type, semantics: nvtx.CounterSemantics | None
    ):
        key = (engine_index, what)
        counter = self._counters.get(key)
        if counter is None:
            counter = self._domain.get_counter(
                counter_name(engine_index, what), dtype, semantics=semantics
            )
            self._counters[key] = counter
        return counter

    def on_iteration(self, record: IterationRecord, engine: EngineView) -> None:
        stream = self._stream(record.engine_index)
        end_ns = record.start_ns + record.elapsed_ns
        stream.write_startend(
            record.start_ns,
            end_ns,
            message=format_iteration_line(record),
            color=RANGE_COLOR,
            category=engine_category(record.engine_index),
        )
        for (what, dtype, semantics), value in zip(COUNTERS, counter_values(record), strict=True):
            counter = self._counter(record.engine_index, what, dtype, semantics)
            stream.write_counter_sample(counter, end_ns, value)

    def close(self) -> None:
        self._session.end()
        self._backend.close()


# --- sidecar CLI plumbing ----------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("NVTX ranges for Nsight Systems")
    group.add_argument(
        "--nvtx",
        action="store_true",
        help="one NVTX range per iteration (domain 'iterscope') and KV/queue counters; "
        "run the sidecar under `nsys profile`",
    )
    group.add_argument(
        "--nvtx-delay-ms",
        type=float,
        default=DEFAULT_DELAY_MS,
        metavar="MS",
        help="live mode: draw each range this long (plus the lane latency) after its "
        "iteration, so ranges keep their true lengths although records arrive in batches "
        f"(default {DEFAULT_DELAY_MS:g}; keep it above the publisher's send period: 20 ms, "
        "100 ms for an engine on CPU or vLLM)",
    )
    group.add_argument(
        "--nvtx-writer-backend",
        metavar="PATH",
        help="exact-timestamp mode: write ranges at the engine's own times through this "
        "NVTXW backend library (nvtx.writer) instead of live NVTX calls",
    )
    group.add_argument(
        "--nvtx-writer-config",
        metavar="TEXT",
        help="backend configuration, key=value lines (e.g. the output file)",
    )


def build(args: argparse.Namespace) -> NvtxSink | NvtxWriterSink | None:
    if args.nvtx_writer_backend:
        return NvtxWriterSink(args.nvtx_writer_backend, args.nvtx_writer_config)
    if not args.nvtx:
        return None
    sink = NvtxSink(delay_ms=args.nvtx_delay_ms)
    if not sink.enabled:
        print(
            "iterscope sidecar: --nvtx given but no NVTX tool is attached (start the sidecar "
            "under `nsys profile -t nvtx ...`); NVTX ranges are off",
            file=sys.stderr,
        )
        return None
    return sink
