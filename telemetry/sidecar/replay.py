"""Replay a JSONL recording through the same Ingest and sinks a live sidecar uses.

The replay clock is record time: the latest engine time seen so far (an iteration's end,
a heartbeat's ts_ns), on the engines' monotonic clock, which engines on one host share. It
drives what a live sidecar drives with its own clock: ticks (every ``tick_interval_s`` of
record time; a gap of more than MAX_TICKS_PER_GAP ticks is crossed in one step), and with
them stall and death detection. The log sink's windows already follow record time, so a
replay prints the log lines the live run printed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from telemetry.analysis.live_findings import WINDOW_MESSAGES
from telemetry.lane.record import Message
from telemetry.lane.recording import message_time_ns, read_recording  # also imported from here
from telemetry.sidecar.engine_roster import DEFAULT_MAX_ENGINES
from telemetry.sidecar.ingest import DEAD_AFTER_S, TICK_INTERVAL_S, Ingest
from telemetry.sidecar.sink import Sink

MAX_TICKS_PER_GAP = 100


class RecordClock:
    """Feeds an Ingest messages of a recording at record time: ticks every ``tick_interval_s``
    of it (a gap of more than MAX_TICKS_PER_GAP ticks crossed in one step), then each message,
    stamped with the latest engine time seen so far. Fed in batches as a file grows
    (`explain --follow`) or all at once (``replay``)."""

    def __init__(self, ingest: Ingest, tick_interval_s: float = TICK_INTERVAL_S) -> None:
        self.ingest = ingest
        self.now_ns: int | None = None  # the record time reached
        self._tick_ns = int(tick_interval_s * 1e9)
        self._next_tick_ns = 0

    def feed(self, items: Iterable[Message | str]) -> None:
        """Messages, and the reasons of lines that did not decode (counted as undecodable)."""
        ingest = self.ingest
        for item in items:
            if isinstance(item, str):
                ingest.count_undecodable(item)
                continue
            if self.now_ns is None:
                self._next_tick_ns = message_time_ns(item)
            now_ns = self.now_ns = max(self.now_ns or 0, message_time_ns(item))
            if now_ns - self._next_tick_ns > MAX_TICKS_PER_GAP * self._tick_ns:
                self._next_tick_ns = now_ns
            while self._next_tick_ns <= now_ns:
                ingest.tick(self._next_tick_ns)
                self._next_tick_ns += self._tick_ns
            ingest.on_message(item, now_ns)

    def finish(self) -> None:
        """The end of the recording: a last tick, and every engine's window searched."""
        if self.now_ns is not None:
            self.ingest.tick(self.now_ns)
            self.ingest.finish_findings(self.now_ns)


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
    clock.feed(read_recording(path))
    clock.finish()
    if close_sinks:
        ingest.close()
    return ingest
