"""Engine monotonic time -> wall time, from the (ts_ns, wall_ns) anchor every Heartbeat carries.

The engine stamps records with ``time.monotonic_ns()``; OpenTelemetry wants Unix wall time.
Each Heartbeat reads both clocks back to back, so ``wall_ns - ts_ns`` is the offset between
them at that moment (to within the few hundred nanoseconds between the two reads). The latest
anchor wins, so a wall clock stepped by NTP is followed within a heartbeat.

Invariant: ``to_wall_ns`` is only defined once an anchor for that engine has been seen;
callers check ``has_anchor`` first and hold records back until it is true.
"""

from __future__ import annotations

from telemetry.lane.record import Heartbeat


class WallClock:
    """Per-engine monotonic -> wall offsets, learnt from heartbeats."""

    def __init__(self) -> None:
        self._offset_ns: dict[int, int] = {}

    def update(self, heartbeat: Heartbeat) -> None:
        self._offset_ns[heartbeat.engine_index] = heartbeat.wall_ns - heartbeat.ts_ns

    def has_anchor(self, engine_index: int) -> bool:
        return engine_index in self._offset_ns

    def to_wall_ns(self, engine_index: int, monotonic_ns: int) -> int:
        """Wall time of an engine monotonic timestamp; KeyError if no anchor yet."""
        try:
            return monotonic_ns + self._offset_ns[engine_index]
        except KeyError:
            raise KeyError(f"no clock anchor (heartbeat) yet from engine {engine_index}") from None
