"""Which engines Ingest tracks: an engine appears with its heartbeat, within a bound, a dead
one gives up its place to a new one, and what a newly met engine lost is counted.

Invariants:
- An engine appears only with a heartbeat (the message that carries its facts: model,
  device, pid), and at most ``max_engines`` are tracked: the state garbage or a forger can
  make the sidecar hold, and the size of a scrape, are bounded. When a new engine finds
  them all taken, the one dead longest gives up its place if no message came from it for
  ``evict_after_s``; a live engine is never removed. (Ingest, telemetry/sidecar/ingest.py,
  tells the sinks: ``on_engine_removed``.)
- When this sidecar meets an engine for the first time, the gap before its heartbeat is
  counted from the last ``msg_seq`` a sink remembers (``known_last_seqs``, the JSONL recording
  does) and otherwise from the engine's own ``num_dropped`` (exact for the time no sidecar
  was connected, thanks to ZMQ_IMMEDIATE), plus the records that came before its first
  heartbeat.
- What is kept of engines not tracked is bounded too: one int per engine index
  (MAX_ENGINE_INDEX + 1 at most) for the records lost before a heartbeat, and one for the
  last seq of an engine removed, so that if it comes back its gap is exact.
- ``engines`` is one dict for the roster's whole life: Ingest reads it directly on its
  per-message path.
"""

from __future__ import annotations

from telemetry.analysis.stall_rule import StallRule
from telemetry.lane.record import Heartbeat, IterationRecord
from telemetry.sidecar.engine_tracker import MAX_SEQ_JUMP, EngineTracker
from telemetry.sidecar.engine_view import SILENT_STATUSES

DEFAULT_MAX_ENGINES = 64  # data-parallel ranks behind one sidecar; /metrics grows ~30 KB each
# A dead engine silent this long may give its place to a new one (a data-parallel
# deployment restarted with new engine indexes): long enough that the engine-down alert,
# a minute of dead, has fired before the engine's series go.
EVICT_AFTER_S = 300.0


class EngineRoster:
    """The engines tracked, and what is remembered of those not (see the module docstring).

    Times are the ingest clock; the engine statuses it reads are Ingest's to write.
    """

    def __init__(
        self,
        max_engines: int = DEFAULT_MAX_ENGINES,
        evict_after_ns: int = int(EVICT_AFTER_S * 1e9),
        max_seq_jump: int = MAX_SEQ_JUMP,
        known_last_seqs: dict[int, int] | None = None,
        stall_after_ns: int = 0,
    ) -> None:
        """``stall_after_ns``: every engine's fixed stall threshold; 0 adapts it
        (telemetry/analysis/stall_rule.py)."""
        if max_engines < 1:
            raise ValueError(f"max_engines must be at least 1, got {max_engines}")
        self.engines: dict[int, EngineTracker] = {}
        self._max_engines = max_engines
        self._evict_after_ns = evict_after_ns
        self._max_seq_jump = max_seq_jump
        self._known_last_seqs = dict(known_last_seqs or {})
        self._stall_after_ns = stall_after_ns
        # engine index -> messages lost before its first heartbeat (records that came first,
        # and the drops they reported); at most MAX_ENGINE_INDEX + 1 entries.
        self._lost_before_met: dict[int, int] = {}
        # engine index -> of those, the drops the engine reported (not the records): carried
        # onto the heartbeat that introduces it (``meet``)
        self._dropped_before_met: dict[int, int] = {}

    def note_record_before_met(self, record: IterationRecord) -> None:
        """A record of an engine no heartbeat introduced yet: it, and the drops it reports,
        are lost, counted once the heartbeat comes (capped, as any one message's loss is)."""
        index = record.engine_index
        lost = self._lost_before_met.get(index, 0) + 1 + record.num_dropped
        self._lost_before_met[index] = min(lost, self._max_seq_jump)
        dropped = self._dropped_before_met.get(index, 0) + record.num_dropped
        self._dropped_before_met[index] = min(dropped, self._max_seq_jump)

    def is_full(self) -> bool:
        return len(self.engines) >= self._max_engines

    def evict_dead_engine(self, now_ns: int) -> tuple[int, int] | None:
        """Make room for a new engine: the engine silent longest is removed if it is dead
        (or closed its lane) and silent for longer than ``evict_after_s``; its (engine index,
        silent ns), None if there is none. Its last seq is kept, so if it comes back its gap
        is exact."""
        oldest = min(self.engines.values(), key=lambda state: state.last_message_ns)
        silent_ns = now_ns - oldest.last_message_ns
        if oldest.view.status not in SILENT_STATUSES or silent_ns <= self._evict_after_ns:
            return None
        del self.engines[oldest.engine_index]
        self._known_last_seqs[oldest.engine_index] = oldest.last_seq
        return oldest.engine_index, silent_ns

    def meet(self, heartbeat: Heartbeat, now_ns: int) -> tuple[EngineTracker, int]:
        """Track the heartbeat's engine (the caller made room); its new state and the
        messages it lost before this heartbeat. The drops that records rejected before it
        reported are added to the heartbeat's own ``num_dropped``, so that the sinks (a
        recording, explain on it) see what the engine itself dropped, not only a gap in
        ``msg_seq`` (a restarted sidecar meets an engine's queued records first)."""
        index = heartbeat.engine_index
        state = self.engines[index] = EngineTracker(index, stall=StallRule(self._stall_after_ns))
        state.stall.restart(now_ns)
        state.last_message_ns = now_ns  # its first message: no silence before it
        dropped_before = self._dropped_before_met.pop(index, 0)
        heartbeat.num_dropped = min(
            heartbeat.num_dropped + dropped_before, heartbeat.msg_seq - 1, self._max_seq_jump
        )
        lost_before = self._lost_before_met.pop(index, 0) - dropped_before
        known_seq = self._known_last_seqs.pop(index, None)
        if known_seq is not None and 0 <= heartbeat.msg_seq - known_seq - 1 <= self._max_seq_jump:
            return state, heartbeat.msg_seq - known_seq - 1  # exact: the recording's last seq
        # Joined mid-stream, or restarted while no sidecar listened: only the engine's own
        # count is known.
        return state, lost_before + heartbeat.num_dropped
