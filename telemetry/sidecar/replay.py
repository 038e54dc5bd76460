"""Replay a JSONL recording through the same Ingest and sinks a live sidecar uses.

The replay clock is record time: the latest engine time seen so far (an iteration's end,
a heartbeat's ts_ns), on the engines' monotonic clock, which engines on one host share. It
drives what a live sidecar drives with its own clock: ticks (every ``tick_interval_s`` of
record time; of a long gap, the first MAX_TICKS_PER_GAP ticks, the rest in one step), and with
them stall and death detection. The log sink's windows already follow record time, so a
replay prints the log lines the live run printed, stamped with the wall time of the record
time they were printed at (the newest heartbeat's clock anchor; RecordTimeStamps), not with
the time of the replay.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from telemetry.analysis.live_findings import WINDOW_MESSAGES
from telemetry.lane.record import Heartbeat
from telemetry.lane.recording import (  # also imported from here
    Line,
    SidecarNote,
    message_time_ns,
    read_recording,
)
from telemetry.sidecar.engine_roster import DEFAULT_MAX_ENGINES
from telemetry.sidecar.ingest import DEAD_AFTER_S, TICK_INTERVAL_S, Ingest
from telemetry.sidecar.sink import Sink

# Ticks through a gap between messages, at most: a minute (death and a finding during a
# freeze are stamped at their own times, as live), then the rest of a long gap in one step.
MAX_TICKS_PER_GAP = 600


class RecordClock:
    """Feeds an Ingest messages of a recording at record time: ticks every ``tick_interval_s``
    of it (a gap's first MAX_TICKS_PER_GAP ticks, the rest in one step), then each message,
    stamped with the latest engine time seen so far. Fed in batches as a file grows
    (`explain --follow`) or all at once (``replay``)."""

    def __init__(self, ingest: Ingest, tick_interval_s: float = TICK_INTERVAL_S) -> None:
        self.ingest = ingest
        self.now_ns: int | None = None  # the record time reached
        self._tick_ns = int(tick_interval_s * 1e9)
        self._next_tick_ns = 0
        self._wall_offset_ns: int | None = None  # wall minus engine time, newest heartbeat's
        self._driven_ns = 0  # the record time of the tick or message being fed
        # the record time of the sidecar's latest note after the latest message, if any
        self._note_ns: int | None = None

    def wall_ns(self) -> int | None:
        """The record time of the tick or message being fed, as wall time; None before a
        heartbeat anchored it."""
        if self._wall_offset_ns is None:
            return None
        return self._driven_ns + self._wall_offset_ns

    def feed(self, items: Iterable[Line | str]) -> None:
        """Messages, and the reasons of lines that did not decode (counted as undecodable).
        The sidecar's notes are no message (this Ingest judges the engines' status anew), but
        those after the last message say how long the recording went on after it, on the
        engines' clock: ``finish`` ticks until then, so a death after the last message is
        found, as the sidecar that wrote them found it. One before a later message says
        nothing a message does not: records an engine sent late (a process stopped with
        records queued) have earlier times than the note, so a clock moved to it would judge
        them late."""
        ingest = self.ingest
        for item in items:
            if isinstance(item, str):
                ingest.count_undecodable(item)
                continue
            if type(item) is SidecarNote:
                if self._wall_offset_ns is not None:
                    self._note_ns = item.wall_ns - self._wall_offset_ns
                continue
            self._note_ns = None
            if type(item) is Heartbeat:
                self._wall_offset_ns = item.wall_ns - item.ts_ns
            if self.now_ns is None:
                self._next_tick_ns = message_time_ns(item)
            now_ns = self._tick_until(max(self.now_ns or 0, message_time_ns(item)))
            ingest.on_message(item, now_ns)

    def _tick_until(self, now_ns: int) -> int:
        """Ticks up to ``now_ns`` (record time), the clock then at it."""
        self.now_ns = now_ns
        num_ticks = 0
        while self._next_tick_ns <= now_ns:
            if num_ticks == MAX_TICKS_PER_GAP:  # the rest of a long gap in one step
                self._next_tick_ns = now_ns
            self._driven_ns = self._next_tick_ns
            self.ingest.tick(self._next_tick_ns)
            self._next_tick_ns += self._tick_ns
            num_ticks += 1
        self._driven_ns = now_ns
        return now_ns

    def finish(self) -> None:
        """The end of the recording (as far as the sidecar's notes after the last message
        say it went on): a last tick, and every engine's window searched."""
        if self.now_ns is not None:
            if self._note_ns is not None and self._note_ns > self.now_ns:
                self._tick_until(self._note_ns)
            self.ingest.tick(self.now_ns)
            self.ingest.finish_findings(self.now_ns)


class RecordTimeStamps(logging.Filter):
    """Stamps each log record with the replay clock's wall time, where it has one."""

    def __init__(self, clock: RecordClock) -> None:
        super().__init__()
        self.clock = clock

    def filter(self, record: logging.LogRecord) -> bool:
        wall_ns = self.clock.wall_ns()
        if wall_ns is not None:
            record.created = wall_ns / 1e9
            record.msecs = wall_ns // 1_000_000 % 1000
        return True


@contextmanager
def record_time_stamps(clock: RecordClock) -> Iterator[None]:
    """While it lasts, the root logger's handlers stamp records with ``clock``'s time."""
    stamps = RecordTimeStamps(clock)
    handlers = list(logging.getLogger().handlers)
    for handler in handlers:
        handler.addFilter(stamps)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(stamps)


def replay(
    path: str | os.PathLike,
    sinks: Iterable[Sink],
    dead_after_s: float = DEAD_AFTER_S,
    stall_after_s: float | None = None,
    tick_interval_s: float = TICK_INTERVAL_S,
    max_engines: int = DEFAULT_MAX_ENGINES,
    live_findings: bool = True,
    close_sinks: bool = True,
    findings_window: int = WINDOW_MESSAGES,
) -> Ingest:
    """Feed a recording through ``sinks`` in order; returns the Ingest (stats, engines).

    The sinks are closed at the end, unless ``close_sinks`` is False: then the caller closes
    them with ``Ingest.close()`` (`--serve-after-replay` keeps /metrics serving meanwhile).
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"no recording at {path}")
    ingest = Ingest(
        sinks,
        dead_after_s=dead_after_s,
        stall_after_s=stall_after_s,
        max_engines=max_engines,
        live_findings=live_findings,
        findings_window=findings_window,
    )
    clock = RecordClock(ingest, tick_interval_s)
    with record_time_stamps(clock):
        clock.feed(read_recording(path, notes=True))
        clock.finish()
        if close_sinks:
            ingest.close()
    return ingest
