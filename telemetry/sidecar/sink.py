"""What the sidecar calls on each sink. Every sink (log, prometheus, otel, nvtx, jsonl)
subclasses ``Sink`` and overrides the calls it cares about (the others do nothing); the
sidecar's ingest thread calls them in arrival order, one at a time. Ingest calls each
method by name in its code (grep finds every caller); nothing is looked up by string.

Each message comes with its engine's view (telemetry/sidecar/engine_view.py):
``on_iteration(record, engine)``, ``on_heartbeat(heartbeat, engine)``. The view is the engine
as it was before the message (a heartbeat's clock anchor already taken in); Ingest applies
the message to it once every sink has seen it. What every sink needs of an engine is defined
there once (clock anchor, progress and queues, KV blocks and usage, facts from heartbeats,
status, the sums of its records, its losses); sinks read it, never write it, and may keep a
reference to it (one object for the engine's whole life, read again at scrape or window
time). What the lane as a whole lost or refused is Ingest's PipelineHealth
(telemetry/sidecar/pipeline_health.py), handed to every sink once by ``attach``. A sink keeps
only what is its own (a log window's start, histograms, open spans, a file), so two sinks fed
the same messages agree (the log line and the Prometheus counters, say).

A sink module offers ``add_arguments(parser)`` and ``build(args) -> Sink | None``.
"""

from __future__ import annotations

from telemetry.analysis.live_findings import FindingEvent
from telemetry.lane.record import Heartbeat, IterationRecord
from telemetry.sidecar.engine_view import EngineStatus, EngineView
from telemetry.sidecar.pipeline_health import PipelineHealth


class Sink:
    """The calls a sink receives; each does nothing unless a sink overrides it.

    Health, read by the Prometheus sink at scrape time (``iterscope_sink_*{sink=name}``):
    ``num_errors`` is written by the ingest thread each time a call on this sink raises;
    ``num_lines_lost`` and ``last_write_time`` by a sink that writes an output of its own.
    """

    name = ""  # the ``sink`` label of its health series; "" = the class name
    num_errors = 0  # calls that raised (counted by the sidecar's Ingest)
    num_lines_lost = 0  # messages it accepted but gave up writing
    last_write_time = 0.0  # unix time of its last successful write; 0 = none

    def attach(self, health: PipelineHealth, sinks: list[Sink]) -> None:
        """Called once by Ingest, before the first message: the pipeline's health (what
        Ingest counts of the lane) and every sink of this sidecar, this one included (their
        own health above), for a sink that reports them."""

    def known_last_seqs(self) -> dict[int, int]:
        """The last seq per engine this sink already holds from an earlier sidecar run (the
        JSONL recording), so gaps across a restart are exact. Asked once, at start-up."""
        return {}

    def sidecar_counters(self) -> dict[str, float]:
        """Counters of this sink's own (e.g. OTel spans dropped), by series name, for the
        sinks that expose the sidecar's counters."""
        return {}

    def on_iteration(self, record: IterationRecord, engine: EngineView) -> None:
        """One iteration record, in arrival order; ``engine`` is as it was before it."""

    def on_heartbeat(self, heartbeat: Heartbeat, engine: EngineView) -> None:
        """A heartbeat (progress, the clock anchor, static facts); ``engine`` is as it was
        before it, but with its clock anchor."""

    def on_status(self, engine_index: int, status: EngineStatus, now_ns: int) -> None:
        """An engine changed status (called once per transition, after the message that
        caused it was applied to the engine's view, which holds the new status too)."""

    def on_finding(self, event: FindingEvent, engine: EngineView) -> None:
        """A live finding opened or closed (``event.what``); ``engine`` holds all of its
        findings (``engine.findings``). Called from ticks and status changes, once per
        opening and once per closing of each finding."""

    def on_engine_removed(self, engine_index: int, silent_ns: int) -> None:
        """The engine, dead and silent for ``silent_ns``, is no longer tracked: its place
        went to a new engine beyond --max-engines. Drop what is kept of it (its series, its
        log state); a message of this index later is an engine met anew."""

    def tick(self, now_ns: int) -> None:
        """Called a few times a second, also when no record arrives."""

    def close(self) -> None:
        """The sidecar stops: flush and release what the sink holds."""


def sink_name(sink: Sink) -> str:
    """The ``sink`` label of a sink's health series: its ``name``, else its class name."""
    return sink.name or type(sink).__name__
