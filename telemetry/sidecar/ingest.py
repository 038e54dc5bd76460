"""The sidecar's ingest: lane frames in, checks, engine status, sinks called in order.

Two layers, so that a live socket and a replayed recording go through the same code:

    Ingest   frames/messages -> typed decode -> checks (engine admission, seq) -> status -> sinks
             (no socket and no clock of its own: every call is given ``now_ns``)
    LaneLoop a ZMQ PULL socket feeding an Ingest from one thread, and ticking it about ten
             times a second (telemetry/sidecar/lane_loop.py); replay feeds one from a
             recording instead (telemetry/sidecar/replay.py)

Which engines are tracked, and what a newly met one lost, is decided by the engine roster
(telemetry/sidecar/engine_roster.py); the checks of one engine's ``msg_seq`` and the evidence its
status is judged on are its EngineTracker's (telemetry/sidecar/engine_tracker.py).

Invariants:
- Sinks are called from one thread, in arrival order. For one engine, arrival order is send
  order (one PUSH socket per engine), so ``msg_seq`` only grows until the engine restarts.
- Every lost message is counted exactly once, on the engine's view (``num_dropped_total``),
  before the next message of that engine reaches the sinks: lost = gap in ``msg_seq``, checked
  against what the engine says it dropped (telemetry/sidecar/engine_tracker.py).
- A frame that cannot be decoded is counted by reason, a decoded one that fails a check is
  counted by reason; neither stops ingest nor reaches the sinks. Ingest is the one owner of
  these counts and of each engine's losses (PipelineHealth, the engine views): sinks read
  them, none counts them again.
- A sink that raises is counted (in total and on the sink) and logged; the other sinks and
  ingest go on.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable

import msgspec

from telemetry.analysis.live_findings import MAX_EVALUATE_SHARE, WINDOW_MESSAGES
from telemetry.analysis.stall_rule import DEAD_AFTER_S
from telemetry.lane.frame_checks import classify_undecodable
from telemetry.lane.record import (
    MAX_ENGINE_INDEX,
    Heartbeat,
    IterationRecord,
    Message,
    make_decoder,
)
from telemetry.lane.recording import message_time_ns
from telemetry.sidecar.engine_roster import DEFAULT_MAX_ENGINES, EVICT_AFTER_S, EngineRoster
from telemetry.sidecar.engine_tracker import MAX_SEQ_JUMP, EngineTracker, drops_are_plausible
from telemetry.sidecar.engine_view import EngineStatus
from telemetry.sidecar.pipeline_health import PipelineHealth
from telemetry.sidecar.sink import Sink, sink_name

MAX_FRAME_BYTES = 1 << 20  # a record with hundreds of milestones is still far below this
# How often a driver (the LaneLoop, a replay) calls ``tick``: stall and death show up only
# there, so this adds to how late they are reported.
TICK_INTERVAL_S = 0.1
_RUNNING = EngineStatus.RUNNING  # read once: an Enum member looked up on its class costs ~80 ns
_DEAD = EngineStatus.DEAD
_CLOSED = EngineStatus.CLOSED

logger = logging.getLogger("iterscope.sidecar")


class Ingest:
    """Decoded messages -> seq gaps, engine status, sinks. Single-threaded; no clock of its own."""

    def __init__(
        self,
        sinks: Iterable[Sink],
        dead_after_s: float = DEAD_AFTER_S,
        stall_after_s: float | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        known_last_seqs: dict[int, int] | None = None,
        max_engines: int = DEFAULT_MAX_ENGINES,
        max_seq_jump: int = MAX_SEQ_JUMP,
        evict_after_s: float = EVICT_AFTER_S,
        live_findings: bool = True,
        findings_window: int = WINDOW_MESSAGES,
    ) -> None:
        """``stall_after_s``: a fixed stall threshold; None adapts it to each engine's
        progress intervals (telemetry/sidecar/engine_tracker.py). ``evict_after_s``: how long
        a dead engine keeps its place among ``max_engines`` when a new one needs it.
        ``live_findings``: search each engine's newest ``findings_window`` messages for
        findings as they come (telemetry/analysis/live_findings.py)."""
        if dead_after_s <= 0 or (stall_after_s is not None and stall_after_s <= 0):
            raise ValueError("dead_after_s and stall_after_s must be positive")
        stall_after_ns = int(stall_after_s * 1e9) if stall_after_s else 0  # 0: adapt
        self._roster = EngineRoster(
            max_engines, int(evict_after_s * 1e9), max_seq_jump, known_last_seqs, stall_after_ns
        )  # raises on max_engines < 1
        if findings_window < 1:
            raise ValueError(f"findings_window ({findings_window}) must be at least 1")
        if evict_after_s < dead_after_s:
            raise ValueError(
                f"evict_after_s ({evict_after_s}) must be at least dead_after_s "
                f"({dead_after_s}): only a dead engine gives up its place"
            )
        self.sinks = list(sinks)
        # The roster's own dict, never replaced: read here once per message, without a hop.
        self.engines: dict[int, EngineTracker] = self._roster.engines
        self.health = PipelineHealth()
        self._dead_after_ns = int(dead_after_s * 1e9)
        self._max_frame_bytes = max_frame_bytes
        self._max_seq_jump = max_seq_jump
        self._live_findings = live_findings
        self._findings_window = findings_window
        self._decoder = make_decoder()
        self._decode = self._decoder.decode
        self._on_iteration = [sink.on_iteration for sink in self.sinks]
        self._on_heartbeat = [sink.on_heartbeat for sink in self.sinks]
        self._on_status = [sink.on_status for sink in self.sinks]
        self._on_engine_removed = [sink.on_engine_removed for sink in self.sinks]
        self._on_finding = [sink.on_finding for sink in self.sinks]
        self._tick = [sink.tick for sink in self.sinks]
        self._close = [sink.close for sink in self.sinks]
        for sink in self.sinks:
            sink.attach(self.health, self.sinks)

    def on_frame(self, frame: bytes, now_ns: int) -> None:
        """One lane frame: decode it, or count it as undecodable and carry on."""
        self.health.num_frames += 1
        if len(frame) > self._max_frame_bytes:
            self.count_undecodable("oversized")
            return
        try:
            message = self._decode(frame)
        except (msgspec.DecodeError, ValueError) as error:
            self.count_undecodable(classify_undecodable(frame, error))
            return
        # is_plausible(message), inlined: this runs once per frame.
        if not (0 <= message.engine_index <= MAX_ENGINE_INDEX and message.msg_seq >= 1):
            self.count_undecodable("malformed")
            return
        self.on_message(message, now_ns)

    def count_frame(self) -> None:
        """A message received by another input than the lane (an FPM subscription), which
        hands Ingest decoded messages: counted as a frame as on_frame counts the lane's."""
        self.health.num_frames += 1

    def count_undecodable(self, reason: str) -> None:
        self.health.num_undecodable[reason] += 1

    def count_rejected(self, reason: str) -> None:
        """A decoded frame failed a check (REJECTED_REASONS): counted, never passed on."""
        self.health.num_rejected[reason] += 1

    def count_lane_disconnect(self) -> None:
        """A connection to the lane ended: an engine exited, or the socket's size guard cut
        off a sender whose frame was over GUARD_FRAME_BYTES (lane_loop.py). libzmq's
        monitor reports both with the same event and no reason (tests/test_sidecar_checks.py
        checks it), so a guard's frame is counted here and not as undecodable 'oversized'; an
        engine's own frame is also the seq gap its next message reports."""
        self.health.num_lane_disconnects += 1

    def count_lane_handshake_failure(self) -> None:
        """A peer's ZMQ handshake failed (lane_loop.py says what that means, and logs it)."""
        self.health.num_lane_handshake_failures += 1

    def _call(self, methods: list, *args: object) -> None:
        """Call one sink method on every sink (``methods``: that method, bound to each);
        one that raises is counted and the rest still run."""
        for method in methods:
            try:
                method(*args)
            except Exception:
                self._sink_failed(method.__self__)

    def _sink_failed(self, sink: Sink, closing: bool = False) -> None:
        """Counted in total and on the sink itself (``num_errors``, its /metrics series); the
        first few and then every 10,000th logged: an OSError (a full disk) in one line, any
        other error with its traceback (a bug). ``closing``: a close failed, always logged,
        however many failures came before: the last word on what a sink could not write."""
        sink.num_errors += 1
        self.health.num_sink_errors += 1
        num = self.health.num_sink_errors
        if not closing and num > 10 and num % 10_000:
            return
        error = sys.exc_info()[1]
        name, traceback = sink_name(sink), not isinstance(error, OSError)
        if closing:
            logger.error("closing the %s sink failed: %s", name, error, exc_info=traceback)
        elif traceback:
            logger.exception(
                "the %s sink failed (%d sink failures so far); ingest goes on", name, num
            )
        else:
            logger.error(
                "the %s sink failed: %s (%d sink failures so far); ingest goes on", name, error, num
            )

    def on_message(self, message: Message, now_ns: int) -> None:
        """A decoded message: check it, report any gap before it, hand it to the sinks,
        update status. A sink that raises is logged and counted; the others and ingest go on.
        """
        is_heartbeat = type(message) is Heartbeat
        state = self.engines.get(message.engine_index)
        if state is not None and message.msg_seq == state.last_seq + 1 and not message.num_dropped:
            num_lost = 0  # the common case, inlined: nothing lost, nothing to doubt
        elif not drops_are_plausible(message, self._max_seq_jump):
            num_lost = None
        elif state is None:
            state, num_lost = self._meet(message, is_heartbeat, now_ns)
            if state is None:
                return
        else:
            num_lost = state.gap_before(message, is_heartbeat)
            if num_lost is not None and message.msg_seq <= state.last_seq:
                state.note_restart(now_ns)
        if num_lost is None:
            self.count_rejected("seq_jump")
            return
        view = state.view  # applied after the sinks: they see the engine before the message
        if now_ns - state.last_message_ns > self._dead_after_ns:
            if view.status is not _DEAD and self._engine_was_silent(state, message):
                # silent for longer than dead_after, though no tick came in that time: dead
                # until now, as explain calls any such silence (ticks are TICK_INTERVAL_S apart)
                self._update_status(state, now_ns)
            if view.status is _DEAD or view.status is _CLOSED:
                # Heard again after a silence, which is a finding of its own: the wait for
                # progress starts here, else the silence would read as a stall too once
                # messages resume (explain, which finds no stall across a silence, never
                # calls it one).
                state.stall.restart(now_ns)
        self.health.num_messages += 1
        state.last_seq = message.msg_seq
        state.last_message_ns = now_ns
        view.num_messages += 1
        if num_lost > 0:
            view.num_dropped_total += num_lost
        remember = state.remember  # the findings' window: before a status change reads it
        if remember is not None:
            remember(message)
        # The sinks' loops inlined (not self._call): this runs once per message.
        if is_heartbeat:
            view.take_anchor(message)
            for on_heartbeat in self._on_heartbeat:
                try:
                    on_heartbeat(message, view)
                except Exception:
                    self._sink_failed(on_heartbeat.__self__)
            self._note_heartbeat(state, message, now_ns)
        else:
            for on_iteration in self._on_iteration:
                try:
                    on_iteration(message, view)
                except Exception:
                    self._sink_failed(on_iteration.__self__)
            self._note_iteration(state, message, now_ns)

    def _engine_was_silent(self, state: EngineTracker, message: Message) -> bool:
        """Whether the engine's own clock shows the silence too, from the live window's last
        message to this one: messages that waited while the sidecar itself was held up are
        no silence of the engine's. Without the window (no live findings), ticks alone."""
        window = state.findings.messages if state.findings is not None else None
        if not window:
            return False
        return message_time_ns(message) - message_time_ns(window[-1]) > self._dead_after_ns

    def _meet(
        self, message: Message, is_heartbeat: bool, now_ns: int
    ) -> tuple[EngineTracker | None, int]:
        """A message of an engine not tracked yet: its heartbeat makes it appear, within
        ``max_engines``; a record before that is rejected and counted as lost when it does."""
        roster = self._roster
        if not is_heartbeat:
            roster.note_record_before_met(message)
            self.count_rejected("unknown_engine")
            return None, 0
        if roster.is_full():
            removed = roster.evict_dead_engine(now_ns)
            if removed is None:
                self.count_rejected("engine_limit")
                return None, 0
            self._call(self._on_engine_removed, *removed)
        state, num_lost = roster.meet(message, now_ns)
        if self._live_findings:
            state.start_findings(self._findings_window)
            share = MAX_EVALUATE_SHARE / len(self.engines)  # of the time, shared by all
            for tracker in self.engines.values():
                tracker.findings.search_share = share
        return state, num_lost

    def _note_iteration(self, state: EngineTracker, record: IterationRecord, now_ns: int) -> None:
        """The view takes the record in; progress is judged against the queues before it."""
        view = state.view
        had_work = view.num_waiting_reqs + view.num_running_reqs > 0
        if had_work and now_ns > state.stall.no_stall_before_ns:
            self._note_missed_stall(state, now_ns)
        if view.apply_iteration(record):
            state.stall.note_progress(
                now_ns,
                had_work,
                view.status is _DEAD,
                record.num_prefill_tokens + record.num_decode_tokens,
                record.elapsed_ns,
            )
        elif not had_work:  # nothing waited or ran: idle, not stuck
            state.stall.restart(now_ns)
        if view.status is not _RUNNING:
            view.closed = False  # a record: the lane is open again
            self._update_status(state, now_ns)

    def _note_heartbeat(self, state: EngineTracker, heartbeat: Heartbeat, now_ns: int) -> None:
        view = state.view
        pid_before, had_work, last_iteration = view.pid, view.has_work, view.last_iteration
        if had_work and now_ns > state.stall.no_stall_before_ns:
            self._note_missed_stall(state, now_ns)
        view.apply_heartbeat(heartbeat)
        if view.pid != pid_before:
            self._note_pid_change(state, pid_before)
            if pid_before:
                state.restarted_ns = now_ns
        # Iterations whose records were all lost still count as progress.
        if view.last_iteration > last_iteration:
            state.stall.note_progress(now_ns, had_work, view.status is _DEAD)
        elif not had_work:  # idle: the stall clock starts now
            state.stall.restart(now_ns)
        state.stall.note_step(heartbeat.step_tokens)
        self._update_status(state, now_ns)

    def _note_missed_stall(self, state: EngineTracker, now_ns: int) -> None:
        """Work in flight and no progress for longer than the shortest threshold, though no
        tick came in that time: stalled until this message if the threshold says so, as explain
        calls it (ticks are TICK_INTERVAL_S apart; a stall just over the threshold can fall
        between two). The caller compares with ``no_stall_before_ns`` first: one comparison
        a message."""
        if state.view.status is _RUNNING:
            self._update_status(state, now_ns)

    def _note_pid_change(self, state: EngineTracker, pid_before: int) -> None:
        """A restart changes the pid once; heartbeats switching back to the pid before it
        mean two live processes share this engine index."""
        pid = state.view.pid
        if pid == state.previous_pid and pid_before:
            self.health.num_engine_conflicts += 1
            pids = (min(pid, pid_before), max(pid, pid_before))
            if self.health.num_engine_conflicts <= 3 or self.health.num_engine_conflicts % 100 == 0:
                logger.error(
                    "engine %d: two engine processes (pids %d and %d) publish as engine %d; "
                    "their records mix. Give each its own --engine-index.",
                    state.engine_index,
                    *pids,
                    state.engine_index,
                )
            state.view.num_engine_conflicts += 1
            state.view.conflicting_pids = pids
        state.previous_pid = pid_before

    def status_of(self, state: EngineTracker, now_ns: int) -> EngineStatus:
        """Closed: its last message closed the lane cleanly. Dead: no message (the publisher's
        thread sends them, heartbeats included, whether or not the engine loop moves).
        Stalled: messages, work in flight, no progress."""
        if state.view.closed:
            return _CLOSED
        if now_ns - state.last_message_ns > self._dead_after_ns:
            return EngineStatus.DEAD
        if not state.view.has_work:
            return EngineStatus.IDLE
        if state.stall.is_stalled(now_ns):
            return EngineStatus.STALLED
        return EngineStatus.RUNNING

    def _update_status(self, state: EngineTracker, now_ns: int) -> None:
        status = self.status_of(state, now_ns)
        if status is not state.view.status:
            state.view.status = status
            self._call(self._on_status, state.engine_index, status, now_ns)
            if state.findings is not None:
                self._note_status_finding(state, status, now_ns)

    def _note_status_finding(self, state: EngineTracker, status: EngineStatus, now_ns: int) -> None:
        """A stall (since the last progress) or death (since the last message) opens a live
        finding; leaving it closes that finding."""
        view = state.view
        since_ns = state.last_message_ns if status is _DEAD else state.stall.last_progress_ns
        busy = (view.num_waiting_reqs, view.num_running_reqs)
        events = state.findings.note_status(
            status.value,
            now_ns,
            since_ns,
            busy,
            view.last_iteration,
            view.pid,
            _skew_ns(state),
            view.source,
            state.restarted_ns,
        )
        self._report_findings(state, events)

    def _report_findings(self, state: EngineTracker, events: list) -> None:
        for event in events:
            self._call(self._on_finding, event, state.view)

    def tick(self, now_ns: int) -> None:
        """Re-evaluate every engine's status (stall and death show up only here) and its
        live findings, tick sinks."""
        for state in self.engines.values():
            self._update_status(state, now_ns)
            self._evaluate_findings(state, now_ns)
        self._call(self._tick, now_ns)

    def _evaluate_findings(self, state: EngineTracker, now_ns: int, force: bool = False) -> None:
        findings = state.findings
        if findings is None:
            return
        if state.view.status is EngineStatus.STALLED:
            findings.note_busy(state.view.num_waiting_reqs, state.view.num_running_reqs)
        self._report_findings(state, findings.evaluate(now_ns, _skew_ns(state), force))
        notice = findings.short_window_notice()
        if notice is not None:
            logger.warning("Engine %03d: %s", state.engine_index, notice)

    def finish_findings(self, now_ns: int) -> None:
        """Search every engine's window once more, whatever the time (a replay's end)."""
        for state in self.engines.values():
            self._evaluate_findings(state, now_ns, force=True)

    def close(self) -> None:
        """Close every sink; a failure is counted and always logged (``_sink_failed``)."""
        for close in self._close:
            try:
                close()
            except Exception:
                self._sink_failed(close.__self__, closing=True)


def _skew_ns(state: EngineTracker) -> int:
    """The ingest clock minus the engine's own (they differ for an engine on another host),
    from its newest message: when it happened, when it was ingested."""
    messages = state.findings.messages
    return state.last_message_ns - message_time_ns(messages[-1]) if messages else 0
