"""Silences: stretches in which an engine sent no message at all, heartbeats included, for
longer than ``dead_after`` (the whole process frozen, or gone), as the live sidecar's dead
status and `explain`'s "Engine down" find them. What iterations and queues show across one
is the freeze's, not their own: a long prefill or a waiting cost is not charged for it (the
silence's own cost, its requests in flight x its length, is: findings.py).
"""

from __future__ import annotations

import numpy as np

from telemetry.analysis.timeline import NS_PER_S, EngineTimeline


class Silences:
    """An engine's silences, disjoint and in time order, each from the last message before
    it to the first after it."""

    def __init__(self, tl: EngineTimeline, dead_after_s: float) -> None:
        beats = np.fromiter((h.ts_ns for h in tl.heartbeats), np.int64, len(tl.heartbeats))
        times = np.sort(np.concatenate([tl.col("end_ns"), beats]))
        silent = np.flatnonzero(np.diff(times) > int(dead_after_s * NS_PER_S))
        self.begins, self.ends = times[silent], times[silent + 1]
        # silent time before each silence: _before[k] is that of silences 0..k-1
        self._before = np.r_[0, np.cumsum(self.ends - self.begins)]

    def _silent_until(self, times_ns: np.ndarray) -> np.ndarray:
        """Silent time from the first message up to each of ``times_ns``."""
        began = np.searchsorted(self.begins, times_ns, side="right")  # silences begun by then
        last = np.maximum(began - 1, 0)
        within = np.clip(times_ns - self.begins[last], 0, self.ends[last] - self.begins[last])
        return np.where(began > 0, self._before[last] + within, 0)

    def overlap_ns(self, starts_ns: np.ndarray, stops_ns: np.ndarray) -> np.ndarray:
        """For each span [start, stop), the silent time inside it."""
        if not self.begins.size:
            return np.zeros(len(starts_ns), dtype=np.int64)
        return self._silent_until(stops_ns) - self._silent_until(starts_ns)
