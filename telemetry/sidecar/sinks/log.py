"""Log sink: the vLLM-compatible 10-second line per engine, opt-in per-iteration lines.

Windows follow record time, not the sidecar's clock, so a replayed recording prints the
same lines as the live run did:

- An engine's monotonic times are placed on the wall clock with its view's clock anchor
  (telemetry/sidecar/engine_view.py). Records of an engine without one yet join the open
  window without moving it.
- The log clock is the latest wall time seen from any engine. Windows are
  [k * interval, (k + 1) * interval) of wall time; when the log clock enters a later window,
  the open one is closed and printed. A window's counts are the difference of the engine's
  record totals (its view's, which Prometheus' counters show too) between the window's start
  and its close, so a record that arrives after its window closed is counted in the open one,
  every record is counted exactly once, and the lines add up to the Prometheus counters.

Losses (messages lost in seq gaps, two processes under one engine index, frames undecodable
or rejected) are Ingest's counts (the engine views, PipelineHealth); this sink reports them by
difference with what it last reported, at most once per interval.

What a line reports, and its text, is telemetry/sidecar/sinks/throughput_line.py's; an
engine whose window scored speculative-decoding drafts gets vLLM's SpecDecoding line after
its own.
The window length is shortened to the time since the engine was first seen, so the first
window after a (re)start does not under-report. An engine prints nothing for a window in
which it ran no iteration and had nothing running or waiting, and nothing once dead. When
two or more engines print in a window, an aggregated line follows.

Live findings (telemetry/analysis/live_findings.py) print as they happen: a WARNING when one
opens (what, since when, the evidence, the action in the engine's own flags) and an INFO when
it closes (how long, what it cost); one that comes back soon after the last of its kind is
said with the others like it, in one line per half minute (telemetry/sidecar/sinks/
finding_log.py).
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from telemetry.analysis.live_findings import FindingEvent
from telemetry.lane.record import Heartbeat, IterationRecord
from telemetry.sidecar.engine_view import SILENT_STATUSES, EngineStatus, EngineView, RecordTotals
from telemetry.sidecar.iteration_line import format_iteration_line
from telemetry.sidecar.pipeline_health import PipelineHealth
from telemetry.sidecar.sink import Sink
from telemetry.sidecar.sinks.finding_log import FindingLog
from telemetry.sidecar.sinks.throughput_line import (
    aggregate_figures,
    engine_figures,
    format_engine_line,
    format_spec_decode_line,
)

logger = logging.getLogger("iterscope.sidecar")

DEFAULT_INTERVAL_S = 10.0
CLOCK_STEP_INTERVALS = 2  # a wall time further back than this many intervals: a clock step

Emit = Callable[[int, str], None]  # (logging level, text)


@dataclass
class EngineLog:
    """What the log sink keeps of one engine besides its view: where the open window began,
    when the engine was first seen, the status it last logged, the losses it reported."""

    engine_index: int
    engine: EngineView = field(init=False)  # Ingest's, from the engine's first message on
    first_ts_ns: int | None = None  # engine clock: start of the first record or heartbeat seen
    first_wall_ns: int | None = None  # the same on the wall clock, once an anchor is known
    last_wall_ns: int = 0  # the newest message's wall time (0: none with an anchor yet)
    status: EngineStatus | None = None  # the last one logged
    window_start: RecordTotals = field(default_factory=RecordTotals)  # totals then
    num_dropped_reported: int = 0
    num_conflicts_reported: int = 0

    def __post_init__(self) -> None:
        self.engine = EngineView(self.engine_index)  # nothing known yet

    def window_counts(self) -> RecordTotals:
        """The records of the open window (the engine's view holds all before the message
        being handled)."""
        return self.engine.totals.since(self.window_start)

    def start_window(self) -> None:
        self.window_start = self.engine.totals.copy()


def format_engine_iteration_line(record: IterationRecord) -> str:
    """The shared per-iteration line; prefixed with the engine for engines other than 000."""
    line = format_iteration_line(record)
    return f"Engine {record.engine_index:03d}: {line}" if record.engine_index else line


def _facts_text(engine: EngineView) -> str:
    """`` (source vllm-scheduler, vllm 0.32.0, pid 4242)`` once a heartbeat has said them,
    else nothing."""
    facts = [
        f"source {engine.source}" if engine.source else "",
        engine.engine_version,
        f"pid {engine.pid}" if engine.pid else "",
    ]
    said = ", ".join(fact for fact in facts if fact)
    return f" ({said})" if said else ""


def _log_to_logger(level: int, text: str) -> None:
    logger.log(level, text)


class LogSink(Sink):
    """Prints the periodic lines, per-iteration lines (opt-in), status changes and losses."""

    name = "log"

    def __init__(
        self,
        interval_s: float = DEFAULT_INTERVAL_S,
        log_iterations: bool = False,
        emit: Emit = _log_to_logger,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"log interval must be positive, got {interval_s}")
        self.interval_ns = int(interval_s * 1e9)
        self.log_iterations = log_iterations
        self.emit = emit
        self.engines: dict[int, EngineLog] = {}
        self._clock_ns: int | None = None  # latest wall time seen from any engine
        self._window_index = 0
        self._health = PipelineHealth()  # Ingest's, once attached
        self._undecodable_reported: dict[str, int] = {}
        self._rejected_reported: dict[str, int] = {}
        self._last_loss_report_ns: int | None = None
        # Engines removed (on_engine_removed) whose open window still holds iterations: they
        # get their line when the window closes, then are forgotten.
        self._removed: list[EngineLog] = []
        self._finding_log = FindingLog()

    def attach(self, health: PipelineHealth, sinks: list[Sink]) -> None:
        self._health = health

    def _log_of(self, engine_index: int) -> EngineLog:
        log = self.engines.get(engine_index)
        if log is None:
            log = self.engines[engine_index] = EngineLog(engine_index)
        return log

    def on_iteration(self, record: IterationRecord, engine: EngineView) -> None:
        log = self.engines.get(record.engine_index) or self._log_of(record.engine_index)
        log.engine = engine
        if engine.clock_offset_ns is not None:
            log.last_wall_ns = record.start_ns + record.elapsed_ns + engine.clock_offset_ns
            self._advance(log.last_wall_ns)
        if log.first_ts_ns is None:
            log.first_ts_ns = record.start_ns
        if self.log_iterations:
            self.emit(logging.INFO, format_engine_iteration_line(record))

    def on_heartbeat(self, heartbeat: Heartbeat, engine: EngineView) -> None:
        """The view is still the engine before this heartbeat (save its anchor), so a window
        the heartbeat closes shows what was true within it."""
        log = self._log_of(heartbeat.engine_index)
        log.engine = engine
        if log.first_wall_ns is None:
            first_ts_ns = heartbeat.ts_ns if log.first_ts_ns is None else log.first_ts_ns
            log.first_wall_ns = engine.to_wall_ns(min(first_ts_ns, heartbeat.ts_ns))
        log.last_wall_ns = heartbeat.wall_ns
        self._advance(heartbeat.wall_ns)

    def _advance(self, wall_ns: int) -> None:
        if self._clock_ns is None:
            self._clock_ns = wall_ns
            self._window_index = wall_ns // self.interval_ns
            return
        if wall_ns <= self._clock_ns:
            if self._clock_ns - wall_ns > CLOCK_STEP_INTERVALS * self.interval_ns:
                self._restart_clock(wall_ns)
            return
        self._clock_ns = wall_ns
        window_index = wall_ns // self.interval_ns
        if window_index > self._window_index:
            self._close_window()
            self._window_index = window_index

    def _restart_clock(self, wall_ns: int) -> None:
        """The engines' wall clock stepped back (NTP) or a bogus time was seen: print what
        the open window holds and go on from ``wall_ns``, instead of staying silent until
        the clock catches up with the highest time ever seen."""
        self._close_window(end_ns=self._clock_ns)
        self._clock_ns = wall_ns
        self._window_index = wall_ns // self.interval_ns

    def _close_window(self, end_ns: int | None = None) -> None:
        """Print the window's lines; ``end_ns`` cuts it short (at close)."""
        start_ns = self._window_index * self.interval_ns
        end_ns = start_ns + self.interval_ns if end_ns is None else end_ns
        lines = []  # per engine: its figures, and its SpecDecoding line or None
        removed, self._removed = self._removed, []
        for log in [*removed, *(self.engines[index] for index in sorted(self.engines))]:
            counts = log.window_counts()
            log.start_window()
            engine = log.engine
            quiet = counts.num_iterations == 0 and not engine.has_work
            silent = log.status in SILENT_STATUSES
            if quiet or (silent and counts.num_iterations == 0):
                continue  # a dead or closed engine's last iterations still get their line
            # The time the engine was there: from when it was first seen, and for a dead or
            # closed one up to its last message (so a replay, whatever ends its window, agrees).
            seen_ns = max(start_ns, log.first_wall_ns or start_ns)
            gone = silent and log.last_wall_ns
            until_ns = min(end_ns, log.last_wall_ns) if gone else end_ns
            window_time = (until_ns - seen_ns if seen_ns < until_ns else self.interval_ns) / 1e9
            figures = engine_figures(engine, counts, window_time)
            lines.append((figures, format_spec_decode_line(figures.label, counts, window_time)))
        for figures, spec_decode_line in lines:
            self.emit(logging.INFO, format_engine_line(figures))
            if spec_decode_line is not None:
                self.emit(logging.INFO, spec_decode_line)
        if len(lines) > 1:
            aggregate = aggregate_figures([figures for figures, _ in lines])
            self.emit(logging.INFO, format_engine_line(aggregate))
        for line in self._finding_log.due(end_ns):
            self.emit(*line)

    def on_status(self, engine_index: int, status: EngineStatus, now_ns: int) -> None:
        log = self._log_of(engine_index)
        previous, log.status = log.status, status
        self._status_line(engine_index, previous, status, log.engine)
        all_silent = all(other.status in SILENT_STATUSES for other in self.engines.values())
        if status in SILENT_STATUSES and all_silent and self._clock_ns is not None:
            # No engine moves the log clock any more: print the window with the last
            # iterations now, not at the sidecar's exit, and start the next one.
            self._close_window()
            self._window_index += 1

    def _status_line(
        self,
        engine_index: int,
        previous: EngineStatus | None,
        status: EngineStatus,
        engine: EngineView,
    ) -> None:
        queues = (
            f"{engine.num_waiting_reqs} waiting, {engine.num_running_reqs} running, "
            f"last iteration {engine.last_iteration}"
        )
        if previous is None:
            text = f"Engine {engine_index:03d}: connected, {status.value}{_facts_text(engine)}"
        else:
            text = f"Engine {engine_index:03d}: {previous.value} -> {status.value}"
        if status in (EngineStatus.STALLED, EngineStatus.DEAD):
            self.emit(logging.WARNING, f"{text} ({queues})")
        elif status is EngineStatus.CLOSED:
            self.emit(logging.INFO, f"{text} ({_closed_text(engine)})")
        elif {previous, status} == {EngineStatus.IDLE, EngineStatus.RUNNING}:
            self.emit(logging.DEBUG, text)  # every request under light load: not news
        else:
            self.emit(logging.INFO, text)  # connected, or recovered from stalled / dead

    def on_finding(self, event: FindingEvent, engine: EngineView) -> None:
        """A WARNING when a live finding opens (what, since when, evidence, the action), an
        INFO when it closes (how long, what it cost); a repeat is said with the others of
        its kind (finding_log.py)."""
        for line in self._finding_log.on_finding(event):
            self.emit(*line)

    def on_engine_removed(self, engine_index: int, silent_ns: int) -> None:
        """Said once; what the engine's open window holds still gets its line."""
        log = self.engines.pop(engine_index, None)
        if log is None:
            return
        text = (
            f"Engine {engine_index:03d}: no longer tracked (dead, no message for "
            f"{silent_ns / 1e9:.0f} s): its place went to a new engine (--max-engines)"
        )
        num_unreported = log.engine.num_dropped_total - log.num_dropped_reported
        if num_unreported:
            text += f"; {num_unreported} telemetry messages lost (sequence gaps)"
        self.emit(logging.WARNING, text)
        for line in self._finding_log.forget(engine_index):
            self.emit(*line)
        if log.window_counts().num_iterations:
            self._removed.append(log)

    def tick(self, now_ns: int) -> None:
        """Report losses at most once per interval (of the ingest clock)."""
        last = self._last_loss_report_ns
        if last is not None and now_ns - last < self.interval_ns:
            return
        if self._report_losses():
            self._last_loss_report_ns = now_ns

    def _report_losses(self) -> bool:
        reported = False
        for index in sorted(self.engines):
            log = self.engines[index]
            engine = log.engine
            num_unreported = engine.num_dropped_total - log.num_dropped_reported
            if num_unreported:
                self.emit(
                    logging.WARNING,
                    (
                        f"Engine {index:03d}: {num_unreported} telemetry messages lost (sequence "
                        f"gaps), {engine.num_dropped_total} in total"
                    ),
                )
                log.num_dropped_reported = engine.num_dropped_total
                reported = True
            if engine.num_engine_conflicts > log.num_conflicts_reported and engine.conflicting_pids:
                first, second = engine.conflicting_pids
                self.emit(
                    logging.ERROR,
                    (
                        f"Engine {index:03d}: two engine processes (pids {first} and {second}) "
                        f"publish as engine {index}; its numbers mix both. Give each its own "
                        "--engine-index"
                    ),
                )
                log.num_conflicts_reported = engine.num_engine_conflicts
                reported = True
        health = self._health
        reported |= self._report_frames(
            "undecodable frames", health.num_undecodable, self._undecodable_reported
        )
        reported |= self._report_frames(
            "frames rejected", health.num_rejected, self._rejected_reported
        )
        return reported

    def _report_frames(self, what: str, counts: dict[str, int], reported: dict[str, int]) -> bool:
        """The frames counted (by reason) since the last report of them, if any."""
        new = {
            reason: num - reported.get(reason, 0)
            for reason, num in counts.items()
            if num > reported.get(reason, 0)
        }
        if not new:
            return False
        by_reason = ", ".join(f"{reason}: {num}" for reason, num in sorted(new.items()))
        self.emit(
            logging.WARNING,
            f"Sidecar: {sum(new.values())} {what} ({by_reason}), {sum(counts.values())} in total",
        )
        reported.update(counts)
        return True

    def close(self) -> None:
        """Print the open window up to the last time seen, so every record is in a line."""
        if self._clock_ns is not None:
            self._close_window(end_ns=self._clock_ns)
        for line in self._finding_log.flush():
            self.emit(*line)
        self._report_losses()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("log lines")
    group.add_argument(
        "--log-interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        metavar="S",
        help="seconds of record time per throughput line (default: %(default)s)",
    )
    group.add_argument(
        "--log-iterations",
        action="store_true",
        help="also print one line per iteration (Iteration(N): ...)",
    )
    group.add_argument("--no-log", action="store_true", help="print no log lines at all")


def build(args: argparse.Namespace) -> LogSink | None:
    if args.no_log:
        return None
    return LogSink(interval_s=args.log_interval, log_iterations=args.log_iterations)


def _closed_text(engine: EngineView) -> str:
    """Why a closed engine is no dead one, as its closing heartbeat said (is_clean_close)."""
    last = f"last iteration {engine.last_iteration}"
    if not engine.has_work:
        return (
            f"it closed its telemetry lane with nothing in flight: a shutdown, not a death; {last}"
        )
    return (
        f"it was told to stop and closed its telemetry lane with {engine.num_running_reqs} "
        f"running and {engine.num_waiting_reqs} waiting, cut off by the shutdown: not a death; "
        f"{last}"
    )
