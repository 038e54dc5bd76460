"""NVTX for Nsight Systems: one range per engine iteration, plus KV / queue counters.

Everything lives in the NVTX domain ``iterscope``; each engine gets a category
("engine 0", ...). A range's message is the per-iteration line the log sink prints
(telemetry/iteration_line.py) and its payload is the iteration number, so a range pairs with
the engine-side ``--nvtx-markers`` range of the same iteration (engine/nvtx_markers.py).

Two modes:

- live (``--nvtx``, the sidecar runs under ``nsys profile``): the record of iteration N
  reaches the sidecar just after N ended, so the range of N opens at that moment and closes
  when the engine's next record arrives (or, at a tick, once it has lasted as long as N did).
  It is therefore drawn one lane latency after N's end: over the real iteration N+1, shifted
  by that latency. bench/nvtx_offset.py measures the shift; docs/profiling.md has figures.
- exact (``--nvtx-writer-backend``): ranges and counter samples are written through an
  NVTXW backend (``nvtx.writer``) at the engine's own timestamps (CLOCK_MONOTONIC, the
  clock of ``time.monotonic_ns()``), for merging into an Nsight Systems report afterwards.

Event attributes are built once and reused; only message and payload change per iteration.
Each line becomes a registered string (nvtx._lib.lib.RegisteredString, created directly
because ``Domain.get_registered_string`` caches every string forever).
"""

from __future__ import annotations

import argparse
import sys
import time

import nvtx
from nvtx._lib.lib import DummyDomain, RegisteredString

from telemetry.iteration_line import format_iteration_line, kv_usage_ratio
from telemetry.record import IterationRecord
from telemetry.sink import Sink

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
        self.close_at_ns = 0  # monotonic time after which a tick closes the open range


class NvtxSink(Sink):
    """Live mode: ranges drawn as records arrive (see the module docstring)."""

    def __init__(self, domain_name: str = DOMAIN) -> None:
        self.domain = nvtx.get_domain(domain_name)
        self.enabled = not isinstance(self.domain, DummyDomain)  # no NVTX tool attached
        self._engines: dict[int, _EngineRanges] = {}

    def on_iteration(self, record: IterationRecord) -> None:
        if not self.enabled:
            return
        engine = self._engines.get(record.engine_index)
        if engine is None:
            engine = self._engines[record.engine_index] = _EngineRanges(
                self.domain, record.engine_index
            )
        if engine.open_range_id is not None:
            self.domain.end_range(engine.open_range_id)
        attributes = engine.attributes
        attributes.message = RegisteredString(self.domain.handle, format_iteration_line(record))
        attributes.payload = record.iteration
        engine.open_range_id = self.domain.start_range(attributes)
        engine.close_at_ns = time.monotonic_ns() + record.elapsed_ns
        engine.kv_usage.sample(100.0 * kv_usage_ratio(record))
        engine.running.sample(record.num_running_reqs)
        engine.waiting.sample(record.num_waiting_reqs)

    def tick(self, now_ns: int) -> None:
        """Close ranges that have lasted as long as their iteration and saw no successor."""
        now_ns = time.monotonic_ns()  # the clock close_at_ns was set in
        for engine in self._engines.values():
            if engine.open_range_id is not None and now_ns >= engine.close_at_ns:
                self.domain.end_range(engine.open_range_id)
                engine.open_range_id = None

    def close(self) -> None:
        for engine in self._engines.values():
            if engine.open_range_id is not None:
                self.domain.end_range(engine.open_range_id)
                engine.open_range_id = None


class NvtxWriterSink(Sink):
    """Exact mode: ranges and counters at the engine's timestamps, through an NVTXW backend.

    One NVTXW stream per engine ("engine N"), in the CLOCK_MONOTONIC time domain; the range
    of an iteration is [start_ns, start_ns + elapsed_ns] exactly, counters are sampled at its
    end. No NVTX tool needs to be attached to the sidecar in this mode.
    """

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

    def on_iteration(self, record: IterationRecord) -> None:
        stream = self._stream(record.engine_index)
        end_ns = record.start_ns + record.elapsed_ns
        stream.write_startend(
            record.start_ns, end_ns, message=format_iteration_line(record),
            color=RANGE_COLOR, category=engine_category(record.engine_index),
        )
        samples = (
            (KV_USAGE, float, 100.0 * kv_usage_ratio(record)),
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
    sink = NvtxSink()
    if not sink.enabled:
        print(
            "iterscope sidecar: --nvtx given but no NVTX tool is attached (start the sidecar "
            "under `nsys profile -t nvtx ...`); NVTX ranges are off",
            file=sys.stderr,
        )
        return None
    return sink
