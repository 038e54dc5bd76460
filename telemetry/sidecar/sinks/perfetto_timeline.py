"""`--timeline PATH`: the messages the sidecar receives, drawn live as Perfetto traces.

Every file is a complete trace, the one `iterscope timeline` writes from the same messages
(telemetry/analysis/perfetto_trace.py: the same tracks, requests, and findings from explain's
detectors over the file's messages). Files rotate by size with a bounded count, named like
the JSONL recording's:

    run.pftrace      the newest, rewritten whole every ``interval_s`` while messages arrive
    run.pftrace.1    the one before, complete
    ...
    run.pftrace.N-1  the oldest kept (N = max_files); older ones are deleted

Ingest never waits for the trace: ``on_iteration`` and ``on_heartbeat`` append the message to
a list under a lock held only for that append, and a writer thread of the sink's own swaps the
list out and writes. While the writer is behind by ``max_pending`` messages, newer ones are
dropped and counted (``num_lines_lost``, with ``last_write_time`` the sink's health series in
/metrics, docs/metrics.md "Sidecar health"). Each write goes to a temporary file renamed over the
current one, so a reader never sees half a trace; while writes fail (a full disk), the
current file's messages are kept for the next try, at most ``max_pending`` of them (the oldest
beyond that are dropped and counted). A file that reached ``max_bytes`` is kept and a new one
starts, holding each engine's latest heartbeat first (its facts and clock). The full file's
messages are kept too, for the findings of the next: they are detected over both files and a
finding that spans the rotation is drawn whole in the file where it ends, marked
``continued`` (perfetto_trace.EarlierFile); the full file drew it cut at its end.

A write costs what `iterscope timeline` costs for the current file's messages (docs/
performance.md, "Timeline"; after a rotation the detectors run over two files' messages): the
default 8 MiB file (about 65,000 iterations with their requests) takes a few tenths of a second
to write, every 10 s while it fills.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

from telemetry.analysis.perfetto_trace import EarlierFile, write_trace
from telemetry.analysis.timeline import build_timelines
from telemetry.lane.record import Heartbeat, IterationRecord
from telemetry.lane.recording import rotated_path
from telemetry.sidecar.engine_view import EngineView
from telemetry.sidecar.sink import Sink

DEFAULT_MAX_BYTES = 8 << 20
DEFAULT_MAX_FILES = 4
DEFAULT_INTERVAL_S = 10.0
DEFAULT_MAX_PENDING = 500_000  # messages waiting for the writer (about 50 s at 10,000/s)

logger = logging.getLogger("iterscope.sidecar.timeline")


class PerfettoTimelineSink(Sink):
    """Size-rotated Perfetto traces of the messages, written by a thread of its own."""

    name = "timeline"

    def __init__(
        self,
        path: str | os.PathLike,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_files: int = DEFAULT_MAX_FILES,
        interval_s: float = DEFAULT_INTERVAL_S,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        if max_bytes <= 0 or max_files < 1 or interval_s <= 0 or max_pending < 1:
            raise ValueError(
                "need max_bytes > 0, max_files >= 1, interval_s > 0 and max_pending >= 1, got "
                f"{max_bytes}, {max_files}, {interval_s} and {max_pending}"
            )
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.interval_s = interval_s
        self.max_pending = max_pending
        # Health (Sink): num_lines_lost, the messages dropped (counted under _pending_lock,
        # by either thread), num_errors, the writes that failed (counted by the writer, which
        # Ingest never calls: its own calls only append), and last_write_time, in /metrics as
        # the JSONL sink's are.
        self._pending: list[IterationRecord | Heartbeat] = []
        self._pending_lock = threading.Lock()
        self._file_messages: list[IterationRecord | Heartbeat] = []  # the writer's own
        self._earlier_messages: list[IterationRecord | Heartbeat] = []  # the file before's
        self._earlier_end_ns: dict[int, int] = {}  # each engine's last message in it
        self._write_lock = threading.Lock()  # one write at a time (the thread, or close)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timeline-writer", daemon=True)
        self._thread.start()

    def _append(self, message: IterationRecord | Heartbeat, engine: EngineView) -> None:
        with self._pending_lock:
            if len(self._pending) >= self.max_pending:
                self.num_lines_lost += 1
                return
            self._pending.append(message)

    on_iteration = _append
    on_heartbeat = _append

    def write(self) -> None:
        """Take the messages that arrived and rewrite the current file with them (the
        writer thread calls it every interval_s; close calls it once more)."""
        with self._pending_lock:
            arrived, self._pending = self._pending, []
        if not arrived:
            return
        with self._write_lock:
            self._file_messages += arrived
            excess = len(self._file_messages) - self.max_pending
            if excess > 0:  # writes keep failing: hold no more than max_pending
                del self._file_messages[:excess]
                with self._pending_lock:
                    self.num_lines_lost += excess
            num_bytes = self._write_current()
            if num_bytes >= self.max_bytes:
                self._rotate()

    def _write_current(self) -> int:
        """The current file, written whole through a temporary file; its size."""
        handle = tempfile.NamedTemporaryFile(
            dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp", delete=False
        )
        try:
            with handle:
                timelines = build_timelines(self._file_messages)
                counts = write_trace(timelines, handle, earlier=self._earlier_files())
            os.replace(handle.name, self.path)
            self.last_write_time = time.time()
        finally:
            if os.path.exists(handle.name):
                os.unlink(handle.name)
        return counts.num_bytes

    def _earlier_files(self) -> dict[int, EarlierFile]:
        """Each engine's messages of the file before and this one, for the findings."""
        if not self._earlier_messages:
            return {}
        both = build_timelines(self._earlier_messages + self._file_messages)
        return {
            engine: EarlierFile(both[engine], end_ns)
            for engine, end_ns in self._earlier_end_ns.items()
            if engine in both
        }

    def _rotate(self) -> None:
        """Keep the full file as .1 (older ones move up, the oldest goes); the next file
        starts with each engine's latest heartbeat, its findings with the full file's
        messages."""
        rotated_path(self.path, self.max_files - 1).unlink(missing_ok=True)
        for generation in range(self.max_files - 2, -1, -1):
            source = rotated_path(self.path, generation)
            if source.exists():
                source.rename(rotated_path(self.path, generation + 1))
        latest: dict[int, Heartbeat] = {}
        for message in self._file_messages:
            if isinstance(message, Heartbeat):
                latest[message.engine_index] = message
        self._earlier_messages = self._file_messages
        self._earlier_end_ns = {
            engine: tl.last_ns for engine, tl in build_timelines(self._file_messages).items()
        }
        self._file_messages = list(latest.values())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._write_logging_errors()

    def _write_logging_errors(self) -> None:
        try:
            self.write()
        except OSError as error:
            self.num_errors += 1
            if self.num_errors == 1:
                logger.error(
                    "cannot write the timeline %s: %s (counted from now on)", self.path, error
                )

    def close(self) -> None:
        """Stop the writer and write what arrived since its last write."""
        self._stop.set()
        self._thread.join()
        self._write_logging_errors()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Perfetto timeline")
    group.add_argument(
        "--timeline",
        metavar="PATH",
        help="draw the messages as Perfetto traces (as `iterscope timeline`), rotated by size; "
        "open them at https://ui.perfetto.dev (read in the browser, nothing is uploaded)",
    )
    group.add_argument(
        "--timeline-max-bytes",
        type=int,
        default=DEFAULT_MAX_BYTES,
        metavar="N",
        help="start a new trace file at this size (default: %(default)s)",
    )
    group.add_argument(
        "--timeline-max-files",
        type=int,
        default=DEFAULT_MAX_FILES,
        metavar="N",
        help="trace files kept, the current one included (default: %(default)s)",
    )
    group.add_argument(
        "--timeline-interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        metavar="S",
        help="rewrite the current trace file this often, in seconds (default: %(default)s)",
    )


def build(args: argparse.Namespace) -> PerfettoTimelineSink | None:
    if not args.timeline:
        return None
    return PerfettoTimelineSink(
        args.timeline, args.timeline_max_bytes, args.timeline_max_files, args.timeline_interval
    )
