"""NVTX for Nsight Systems: one range per engine iteration, plus KV / queue counters.

Everything lives in the NVTX domain ``iterscope``; each engine gets a category
("engine 0", ...). A range's message is the per-iteration line the log sink prints
(telemetry/sidecar/iteration_line.py) and its payload is the iteration number, so a range pairs with
the engine-side ``--nvtx-markers`` range of the same iteration (engine/nvtx_markers.py).

Two modes:

- live (``--nvtx``, the sidecar runs under ``nsys profile``): records reach the sidecar in
  batches (the engine's publisher sends every 20 ms), so drawing each range as its record
  arrives would squeeze most ranges into microseconds. A pacer thread replays them instead:
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
because ``Domain.get_registered_string`` caches every string forever).
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time

import nvtx
from nvtx._lib.lib import DummyDomain, RegisteredString

from telemetry.lane.record import IterationRecord
from telemetry.sidecar.engine_view import EngineView, record_kv_usage_ratio
from telemetry.sidecar.iteration_line import format_iteration_line
from telemetry.sidecar.sink import Sink

DOMAIN = "iterscope"
RANGE_COLOR = 0xFF76B900  # ARGB
KV_USAGE = "KV cache usage (%)"
RUNNING = "running requests"
WAITING = "waiting requests"
KV_USAGE_SEMANTICS = nvtx.CounterSemantics(unit="%", min=0.0, max=100.0)


def engine_category(engine_index: int) -> str:
    return f"engine {engine_index}"


def counter_name(engine_index: int, what: str) -> str:
    return f"{engine_category(engine_index)}: {what}"


DEFAULT_DELAY_MS = 50.0
START, END = 0, 1  # event kinds


class RangePacer:
    """When to open and close each live range, in the sidecar's clock (no NVTX calls here).

    Each engine's events wait in a queue in its own clock, in record order. Engine time maps
    to sidecar time by the smallest lane latency seen so far (arrival - record end; not the
    heartbeat's wall-clock anchor, which says nothing of the sidecar's clock), applied
    when an event falls due, so a batch whose last record lowers the estimate moves its
    earlier records with it; the mapping also holds for an engine on another host. ``delay``
    is added on top so that a whole batch of records has arrived before its first range opens.
    """

    def __init__(self, delay_ns: int) -> None:
        self.delay_ns = delay_ns
        self._queues: dict[int, collections.deque] = {}  # engine -> (engine ns, kind, record)
        self._offsets: dict[int, int] = {}  # engine index -> sidecar time - engine time

    def add(self, record: IterationRecord, arrival_ns: int) -> None:
        engine_index = record.engine_index
        end_ns = record.start_ns + record.elapsed_ns
        offset = self._offsets.get(engine_index)
        if offset is None or arrival_ns - end_ns < offset:
            self._offsets[engine_index] = arrival_ns - end_ns
        queue = self._queues.setdefault(engine_index, collections.deque())
        queue.append((record.start_ns, START, record))
        queue.append((end_ns, END, record))

    def next_due_ns(self) -> int | None:
        """Sidecar time of the earliest queued event; None when nothing is queued."""
        earliest = self._earliest()
        return None if earliest is None else earliest[0]

    def pop_due(self, now_ns: int) -> list[tuple[int, IterationRecord]]:
        """(kind, record) of every event due by ``now_ns``, in time order."""
        due = []
        while (earliest := self._earliest()) is not None and earliest[0] <= now_ns:
            _, kind, record = earliest[1].popleft()
            due.append((kind, record))
        return due

    def _earliest(self) -> tuple[int, collections.deque] | None:
        """(sidecar time, queue) of the earliest queued event over all engines."""
        earliest = None
        for engine_index, queue in self._queues.items():
            if queue:
                due_ns = queue[0][0] + self._offsets[engine_index] + self.delay_ns
                if earliest is None or due_ns < earliest[0]:
                    earliest = (due_ns, queue)
        return earliest


class _EngineRanges:
    """One engine's counters and its currently open range (live mode)."""

    def __init__(self, domain: nvtx.Domain, engine_index: int) -> None:
        self.attributes = domain.get_event_attributes(
            color=RANGE_COLOR, category=engine_category(engine_index)
        )
        self.kv_usage = domain.get_counter(
            counter_name(engine_index, KV_USAGE), float, semantics=KV_USAGE_SEMANTICS
        )
        self.running = domain.get_counter(counter_name(engine_index, RUNNING), int)
        self.waiting = domain.get_counter(counter_name(engine_index, WAITING), int)
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
        engine.kv_usage.sample(100.0 * record_kv_usage_ratio(record))
        engine.running.sample(record.num_running_reqs)
        engine.waiting.sample(record.num_waiting_reqs)

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

    def __init__(self, backend_path: str, config: str | None = None,
                 name: str = DOMAIN) -> None:
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

    def _counter(self, engine_index: int, what: str, dtype: type):
        key = (engine_index, what)
        counter = self._counters.get(key)
        if counter is None:
            semantics = KV_USAGE_SEMANTICS if what == KV_USAGE else None
            counter = self._domain.get_counter(
                counter_name(engine_index, what), dtype, semantics=semantics
            )
            self._counters[key] = counter
        return counter

    def on_iteration(self, record: IterationRecord, engine: EngineView) -> None:
        stream = self._stream(record.engine_index)
        end_ns = record.start_ns + record.elapsed_ns
        stream.write_startend(
            record.start_ns, end_ns, message=format_iteration_line(record),
            color=RANGE_COLOR, category=engine_category(record.engine_index),
        )
        samples = (
            (KV_USAGE, float, 100.0 * record_kv_usage_ratio(record)),
            (RUNNING, int, record.num_running_reqs),
            (WAITING, int, record.num_waiting_reqs),
        )
        for what, dtype, value in samples:
            stream.write_counter_sample(self._counter(record.engine_index, what, dtype),
                                        end_ns, value)

    def close(self) -> None:
        self._session.end()
        self._backend.close()


# --- sidecar CLI plumbing ----------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("NVTX ranges for Nsight Systems")
    group.add_argument(
        "--nvtx", action="store_true",
        help="one NVTX range per iteration (domain 'iterscope') and KV/queue counters; "
        "run the sidecar under `nsys profile`",
    )
    group.add_argument(
        "--nvtx-delay-ms", type=float, default=DEFAULT_DELAY_MS, metavar="MS",
        help="live mode: draw each range this long (plus the lane latency) after its "
        "iteration, so ranges keep their true lengths although records arrive in batches "
        f"(default {DEFAULT_DELAY_MS:g}; keep it above the publisher's 20 ms send period)",
    )
    group.add_argument(
        "--nvtx-writer-backend", metavar="PATH",
        help="exact-timestamp mode: write ranges at the engine's own times through this "
        "NVTXW backend library (nvtx.writer) instead of live NVTX calls",
    )
    group.add_argument(
        "--nvtx-writer-config", metavar="TEXT",
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
