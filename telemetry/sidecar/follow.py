"""`iterscope explain --follow`: a recording read as the sidecar writes it, and said as the
live sidecar says it.

The messages go through the sidecar's own Ingest, live findings and log sink, at record time
(replay.py's RecordClock), so what is printed is what the live sidecar printed: a finding when
it opens (what, since when, the evidence, the action) and when it closes (how long, what it
cost), a condition that comes and goes folded into one line, the 10-second throughput lines,
engine status changes; decided by the same code, not by explain's search re-run over what has
arrived. The files are read again every interval (rotated files created meanwhile included:
telemetry/lane/recording.py RecordingReader). When it stops (Ctrl-C or ``max_time_s``), explain's
summary of the newest ``window_messages`` messages follows.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from pathlib import Path
from typing import TextIO

from telemetry.analysis.episodes import Thresholds, detect_episodes
from telemetry.analysis.explain_report import format_engine
from telemetry.analysis.timeline import build_timelines
from telemetry.lane.record import Message
from telemetry.lane.recording import RecordingReader
from telemetry.sidecar.ingest import Ingest
from telemetry.sidecar.replay import RecordClock
from telemetry.sidecar.sinks.log import LogSink

# The newest messages kept for the closing summary: at 100 iterations per second about 8
# minutes of one engine, about 35 MB (measured ~0.7 KB each with milestones).
FOLLOW_WINDOW_MESSAGES = 50_000


def follow(
    paths: list[Path],
    thresholds: Thresholds,
    interval_s: float,
    max_time_s: float | None,
    out: TextIO = sys.stdout,
    engine_index: int | None = None,
    window_messages: int = FOLLOW_WINDOW_MESSAGES,
) -> int:
    """Print the sidecar's log of ``paths`` as they grow, until interrupted or ``max_time_s``;
    then explain's summary of the newest ``window_messages`` messages."""
    if window_messages < 1:
        raise ValueError(f"window_messages must be >= 1, got {window_messages}")
    reader = RecordingReader(paths, notes=True)  # how it ends, in the summary
    ingest = Ingest(
        [LogSink(emit=printer(out))],
        dead_after_s=thresholds.dead_after,
        stall_after_s=thresholds.stall_after,
    )
    clock = RecordClock(ingest)
    newest: deque[Message] = deque(maxlen=window_messages)
    deadline = None if max_time_s is None else time.monotonic() + max_time_s
    print(f"following {', '.join(map(str, paths))} (Ctrl-C to stop)", file=out, flush=True)
    try:
        while deadline is None or time.monotonic() < deadline:
            feed(reader, clock, newest, engine_index)
            time.sleep(interval_s)
    except KeyboardInterrupt:
        pass
    feed(reader, clock, newest, engine_index)  # what the last interval added
    clock.finish()
    ingest.close()
    for tl in build_timelines(newest).values():
        lines = format_engine(tl, detect_episodes(tl, thresholds), thresholds)
        print("\n" + "\n".join(lines), file=out)
    return 0


def feed(
    reader: RecordingReader, clock: RecordClock, newest: deque, engine_index: int | None
) -> None:
    """The messages added since the last read (of ``engine_index`` only, unless None) to the
    sidecar's clock and the newest ones kept for the summary."""
    messages = of_engine(reader.read_new(), engine_index)
    newest.extend(messages)
    clock.feed(messages)


def of_engine(messages: list[Message], engine_index: int | None) -> list[Message]:
    if engine_index is None:
        return messages
    return [message for message in messages if message.engine_index == engine_index]


def printer(out: TextIO):
    """The log sink's lines to ``out``, each with its level, as the sidecar's log has them
    (DEBUG ones, every request's news under light load, left out)."""

    def emit(level: int, text: str) -> None:
        if level >= logging.INFO:
            print(f"{logging.getLevelName(level)} {text}", file=out, flush=True)

    return emit
