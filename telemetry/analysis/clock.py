"""Record time as the operator reads it: local wall-clock text, the same in text and plot.

Record times are an engine's monotonic clock; heartbeats anchor it to wall time
(EngineTimeline.to_wall_ns). Every printed or plotted time goes through ``wall_clock_text``,
so a plot's tick and the text's timestamp for the same instant read the same.
"""

from __future__ import annotations

import datetime

from telemetry.analysis.timeline import NS_PER_S, EngineTimeline


def wall_seconds(tl: EngineTimeline, ts_ns: int) -> float:
    """Wall time of a record time, in seconds since the epoch (needs a clock anchor)."""
    return tl.to_wall_ns(int(ts_ns)) / NS_PER_S


def wall_clock_text(wall_s: float, with_date: bool = False) -> str:
    """Local wall time to the millisecond, e.g. ``14:03:12.345``."""
    wall = datetime.datetime.fromtimestamp(wall_s)
    return wall.strftime("%Y-%m-%d %H:%M:%S.%f" if with_date else "%H:%M:%S.%f")[:-3]


def offset_text(seconds: float) -> str:
    """Seconds from the start of a recording without a clock anchor, e.g. ``+12.345 s``."""
    return f"+{seconds:.3f} s"


def clock_text(tl: EngineTimeline, ts_ns: int, with_date: bool = False) -> str:
    """Local wall time of a record time, or seconds from the start without a clock anchor."""
    if not tl.has_clock_anchor():
        return offset_text((ts_ns - tl.first_ns) / NS_PER_S)
    return wall_clock_text(wall_seconds(tl, ts_ns), with_date)
