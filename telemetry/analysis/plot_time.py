"""The plot's time axis: where a record time goes on x, and how an x tick reads.

With a clock anchor in every engine, x is wall time in seconds since the epoch, each engine's
record times converted through its own heartbeat anchors, and ticks read as local wall-clock
time in the text's format (clock.wall_clock_text): the text's timestamp for an instant and
the tick at that instant are the same string. Without an anchor x is seconds from the
earliest message of any engine, ticks ``+12.345 s`` as the text prints them (for one engine;
with several unanchored engines the text counts from each engine's own first message).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from telemetry.analysis.clock import offset_text, wall_clock_text, wall_seconds
from telemetry.analysis.timeline import NS_PER_S, EngineTimeline


class TimeAxis:
    def __init__(self, timelines: dict[int, EngineTimeline]) -> None:
        self.wall = all(tl.has_clock_anchor() for tl in timelines.values())
        self.t0_ns = min(tl.first_ns for tl in timelines.values())

    def x(self, tl: EngineTimeline, ts_ns: Iterable[int]) -> np.ndarray:
        """x positions of record times of ``tl``'s engine."""
        if self.wall:
            return np.array([wall_seconds(tl, t) for t in ts_ns], dtype=float)
        return np.array([(int(t) - self.t0_ns) / NS_PER_S for t in ts_ns], dtype=float)

    def tick_text(self, x: float, _position=None) -> str:
        return wall_clock_text(x) if self.wall else offset_text(x)

    @property
    def title(self) -> str:
        if self.wall:
            return "local wall-clock time (as in the text of explain)"
        return "seconds from the start of the recording (no clock anchor: no heartbeat)"
