"""What the sidecar calls on each sink. Every sink (log, prometheus, otel, nvtx, jsonl)
subclasses ``Sink`` and overrides the calls it cares about (the others do nothing); the
sidecar's ingest thread calls them in arrival order, one at a time.

Each message comes with its engine's view (telemetry/sidecar/engine_view.py):
``on_iteration(record, engine)``, ``on_heartbeat(heartbeat, engine)``. The view is the engine
as it was before the message (a heartbeat's clock anchor already taken in); Ingest applies
the message to it once every sink has seen it. What every sink needs of an engine is defined
there once (clock anchor, progress and queues, KV blocks and usage, facts from heartbeats,
status); sinks read it, never write it, and may keep a reference to it (one object for the
engine's whole life, read again at scrape or window time). A sink keeps only what is its own
(a log window, metric families, open spans, a file), so two sinks fed the same messages
agree (the log line and the Prometheus gauges, say).

Optional hooks, looked up with getattr by the sidecar (telemetry/sidecar/cli.py):
- ``known_last_seqs() -> dict[int, int]``: the last seq per engine this sink already holds
  from an earlier sidecar run (the JSONL recording), so gaps across a restart are exact.
- ``set_peers(sinks: list[Sink])``: called once with every built sink.
- ``sidecar_counters() -> dict[str, float]``: extra counters for the Prometheus sink.
A sink module offers ``add_arguments(parser)`` and ``build(args) -> Sink | None``.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from telemetry.lane.record import Heartbeat, IterationRecord

if TYPE_CHECKING:  # engine_view imports EngineStatus from here
    from telemetry.sidecar.engine_view import EngineView


# Why Ingest drops a decoded frame (Sink.on_rejected): a record of an engine no heartbeat
# introduced, a new engine beyond --max-engines, a seq the engine's own counts do not explain.
REJECTED_REASONS = ("unknown_engine", "engine_limit", "seq_jump")


class EngineStatus(str, enum.Enum):
    """What the sidecar believes an engine is doing.

    IDLE:    heartbeats arrive, nothing waits or runs.
    RUNNING: iterations arrive.
    STALLED: heartbeats arrive and work waits or runs, but no iteration finished for longer
             than the stall threshold (adapted to the engine's iteration times, at least
             5 s; telemetry/sidecar/engine_state.py).
    DEAD:    no message for the dead-after interval (2.5 s by default, so a killed engine is
             reported within 3 s). Heartbeats come from the publisher's thread, which runs
             while the engine loop is stuck; only a process that is gone, frozen whole
             (SIGSTOP) or cut off from the lane sends none.
    """

    IDLE = "idle"
    RUNNING = "running"
    STALLED = "stalled"
    DEAD = "dead"


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

    def on_iteration(self, record: IterationRecord, engine: EngineView) -> None:
        """One iteration record, in arrival order; ``engine`` is as it was before it."""

    def on_heartbeat(self, heartbeat: Heartbeat, engine: EngineView) -> None:
        """A heartbeat (progress, the clock anchor, static facts); ``engine`` is as it was
        before it, but with its clock anchor."""

    def on_status(self, engine_index: int, status: EngineStatus, now_ns: int) -> None:
        """An engine changed status (called once per transition, after the message that
        caused it was applied to the engine's view, which holds the new status too)."""

    def on_dropped(self, engine_index: int, num_dropped: int) -> None:
        """``num_dropped`` messages of this engine were lost (from seq gaps)."""

    def on_engine_conflict(self, engine_index: int, pids: tuple[int, int]) -> None:
        """Two live engine processes (``pids``) publish under one engine index: their
        records interleave, so this engine's numbers mix both until one of them is given
        another --engine-index. Called each time the heartbeats switch back to a pid seen
        before (about once a second while both run)."""

    def on_engine_removed(self, engine_index: int, silent_ns: int) -> None:
        """The engine, dead and silent for ``silent_ns``, is no longer tracked: its place
        went to a new engine beyond --max-engines. Drop what is kept of it (its series, its
        log state); a message of this index later is an engine met anew."""

    def on_undecodable(self, reason: str) -> None:
        """A frame could not be decoded; reason is 'malformed', 'truncated', 'version' or
        'oversized' (telemetry.lane.frame_checks.UNDECODABLE_REASONS)."""

    def on_rejected(self, reason: str) -> None:
        """A decoded frame failed a check and was dropped; reason is 'unknown_engine' (a
        record before its engine's first heartbeat), 'engine_limit' (a new engine beyond
        --max-engines, none of them dead for --evict-after) or 'seq_jump' (a seq its
        engine's counts do not explain) (REJECTED_REASONS)."""

    def on_lane_disconnect(self) -> None:
        """A connection to the lane ended: an engine exited, or the socket's size guard cut
        off a sender of a frame over 16 MiB (ZMQ says nothing else of that frame: it is
        neither passed to ``on_undecodable`` nor seen at all)."""

    def tick(self, now_ns: int) -> None:
        """Called a few times a second, also when no record arrives."""

    def close(self) -> None:
        """The sidecar stops: flush and release what the sink holds."""


def sink_name(sink: object) -> str:
    """The ``sink`` label of a sink's health series: its ``name``, else its class name."""
    return getattr(sink, "name", "") or type(sink).__name__
