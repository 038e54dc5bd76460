"""When the live NVTX sink opens and closes each range, in the sidecar's clock (no NVTX calls).

Records reach the sidecar in batches (the engine's publisher sends every 20 or 100 ms), so drawing a
range as its record arrives would squeeze most ranges into microseconds. RangePacer instead
schedules iteration N's range to open at N's start and close at N's end, both shifted by one
constant lag per engine: the smallest lane latency seen so far plus ``delay_ns``.

Invariants: each engine's events come out in record order, START before END of the same
record; an event is never dropped, only drawn late (at once) when the sidecar falls behind.
"""

from __future__ import annotations

import collections

from telemetry.lane.record import IterationRecord

START, END = 0, 1  # event kinds


class RangePacer:
    """When to open and close each live range, in the sidecar's clock (no NVTX calls here).

    Each engine's events wait in a queue in its own clock, in record order. Engine time maps
    to sidecar time by the smallest lane latency seen so far (arrival - record end; not the
    heartbeat's wall-clock anchor, which says nothing of the sidecar's clock), applied
    when an event falls due, so a batch whose last record lowers the estimate moves its
    earlier records with it; the mapping also holds for an engine on another host. ``delay``
    is added on top so that a whole batch of records has arrived before its first range opens.
    """

    def __init__(self, delay_ns: int) -> None:
        self.delay_ns = delay_ns
        self._queues: dict[int, collections.deque] = {}  # engine -> (engine ns, kind, record)
        self._offsets: dict[int, int] = {}  # engine index -> sidecar time - engine time

    def add(self, record: IterationRecord, arrival_ns: int) -> None:
        """Queue the record's START and END; ``arrival_ns`` is the sidecar's clock now."""
        engine_index = record.engine_index
        end_ns = record.start_ns + record.elapsed_ns
        offset = self._offsets.get(engine_index)
        if offset is None or arrival_ns - end_ns < offset:
            self._offsets[engine_index] = arrival_ns - end_ns
        queue = self._queues.setdefault(engine_index, collections.deque())
        queue.append((record.start_ns, START, record))
        queue.append((end_ns, END, record))

    def next_due_ns(self) -> int | None:
        """Sidecar time of the earliest queued event; None when nothing is queued."""
        earliest = self._earliest()
        return None if earliest is None else earliest[0]

    def pop_due(self, now_ns: int) -> list[tuple[int, IterationRecord]]:
        """(kind, record) of every event due by ``now_ns``, in time order."""
        due = []
        while (earliest := self._earliest()) is not None and earliest[0] <= now_ns:
            _, kind, record = earliest[1].popleft()
            due.append((kind, record))
        return due

    def _earliest(self) -> tuple[int, collections.deque] | None:
        """(sidecar time, queue) of the earliest queued event over all engines."""
        earliest = None
        for engine_index, queue in self._queues.items():
            if queue:
                due_ns = queue[0][0] + self._offsets[engine_index] + self.delay_ns
                if earliest is None or due_ns < earliest[0]:
                    earliest = (due_ns, queue)
        return earliest
