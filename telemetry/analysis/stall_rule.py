"""When an engine that has work and makes no progress is stalled: one rule, for the live
sidecar (telemetry/sidecar/engine_tracker.py) and for `explain` on a recording
(telemetry/analysis/episodes/liveness.py), so the two cannot disagree.

Progress is an iteration that scheduled work (seen in a record, or in a heartbeat's
``last_iteration``). While work is in flight, the engine is stalled once no progress came for
longer than the threshold: STALL_FACTOR times the longest progress interval of the last
STALL_WINDOW_S, at least STALL_FLOOR_S. So an engine whose prefill chunks take 10 s is not
called stalled at every chunk, and a hang that recovers raises the threshold too, for
STALL_WINDOW_S at most. A fixed threshold (``--stall-after``) turns the adaptation off.
An interval counts only when work was in flight during it and the engine was not silent
(a frozen process's pause is no iteration).

A step bigger than any measured gets the time its size can take: where heartbeats say how
many tokens N the iteration under way scheduled (``step_tokens``) and that is more than the
biggest iteration the rule has measured (M tokens in D s, its own elapsed time; an engine's
speed per token does not age, so it is kept for good), the threshold is at least
STALL_FACTOR x D x (N / M)^2, at most STALL_STEP_CAP_S; with nothing measured yet (the
engine's first step), STALL_STEP_CAP_S (record.step_time_bound_ns, which our engine's own
/health applies too). An iteration's time grows at most with the square of its tokens (a
fixed part, the weights' work per token, attention's per pair of tokens), so an engine
computing an 8,000-token prompt after 500-token ones, or as its first step, is not called
stalled before it could have finished; the cap bounds how late a hang inside such a step is
found (from a 21-token step of 86 ms, the square gave a 7,000-token one 5.3 hours).
Steps no bigger than what was measured keep the threshold above: an engine that has run a
full token budget once gets no slack.
"""

from __future__ import annotations

import collections

from telemetry.lane.record import STEP_TIME_CAP_NS, step_time_bound_ns

# No message for this long is dead (heartbeats come every second: dead is reported within 3 s
# of a kill); a pause that long is the process's, not an interval between iterations.
DEAD_AFTER_S = 2.5
STALL_FLOOR_S = 5.0
STALL_FACTOR = 2
STALL_WINDOW_S = 600.0
# The most a step bigger than any measured (or the first) is given before it is a stall.
STALL_STEP_CAP_S = STEP_TIME_CAP_NS / 1e9
_STALL_FLOOR_NS = int(STALL_FLOOR_S * 1e9)
# Shorter progress intervals cannot raise the threshold above the floor: not worth keeping.
_SHORTEST_LEARNT_NS = _STALL_FLOOR_NS // STALL_FACTOR


class RecentMax:
    """The largest value added within the last ``window_ns`` of a clock.

    A deque of (time, value) whose values decrease from front to back: a new value removes
    the smaller ones before it (they can never be the maximum again), and the front expires
    with time, so each call is O(1) amortized.
    """

    def __init__(self, window_ns: int) -> None:
        self.window_ns = window_ns
        self._entries: collections.deque[tuple[int, int]] = collections.deque()

    def add(self, now_ns: int, value: int) -> None:
        entries = self._entries
        while entries and entries[-1][1] <= value:
            entries.pop()
        entries.append((now_ns, value))

    def max(self, now_ns: int) -> int:
        """The largest value added since ``now_ns - window_ns``; 0 if none."""
        entries = self._entries
        while entries and entries[0][0] < now_ns - self.window_ns:
            entries.popleft()
        return entries[0][1] if entries else 0


class StallRule:
    """One engine's progress and the stall threshold it has earned (times on one clock: the
    sidecar's ingest clock, or record time in a replay and in `explain`)."""

    def __init__(self, stall_after_ns: int = 0) -> None:
        """``stall_after_ns``: a fixed threshold; 0 adapts it (the module docstring)."""
        self.stall_after_ns = stall_after_ns
        self.last_progress_ns = 0
        # No threshold is shorter than this: before it, no stall (a bound cheap to compare).
        self._shortest_threshold_ns = stall_after_ns or _STALL_FLOOR_NS
        self.no_stall_before_ns = self._shortest_threshold_ns
        self._intervals = RecentMax(int(STALL_WINDOW_S * 1e9))
        self.step_tokens = 0  # tokens of the iteration under way, heartbeats say; 0: unknown
        # The biggest iteration measured: its tokens, then its elapsed time (the longest of
        # those that size). Plain integers: every record passes here.
        self.biggest_tokens = self.biggest_ns = 0

    def note_progress(
        self,
        now_ns: int,
        had_work: bool,
        was_silent: bool = False,
        num_tokens: int = 0,
        elapsed_ns: int = 0,
    ) -> None:
        """An iteration scheduled work at ``now_ns``; ``had_work``: work was in flight before
        it, ``was_silent``: the engine sent nothing for a while before (dead meanwhile).
        From a record: it computed ``num_tokens`` in ``elapsed_ns``, its own time (the
        interval between messages says nothing of one iteration: senders batch them); a
        heartbeat's progress passes 0."""
        interval_ns = now_ns - self.last_progress_ns
        if interval_ns > _SHORTEST_LEARNT_NS and had_work and not was_silent:
            self._intervals.add(now_ns, interval_ns)
        self.last_progress_ns = now_ns
        self.no_stall_before_ns = now_ns + self._shortest_threshold_ns
        self.step_tokens = 0
        if num_tokens >= self.biggest_tokens and (
            num_tokens > self.biggest_tokens or elapsed_ns > self.biggest_ns
        ):
            self.biggest_tokens, self.biggest_ns = num_tokens, elapsed_ns

    def note_step(self, step_tokens: int) -> None:
        """A heartbeat: the iteration under way scheduled ``step_tokens`` (0: unknown)."""
        self.step_tokens = step_tokens

    def restart(self, now_ns: int) -> None:
        """No work in flight, or a new process: the wait for progress starts now."""
        self.last_progress_ns = now_ns
        self.no_stall_before_ns = now_ns + self._shortest_threshold_ns
        self.step_tokens = 0

    def threshold_ns(self, now_ns: int) -> int:
        if self.stall_after_ns:
            return self.stall_after_ns
        threshold_ns = max(_STALL_FLOOR_NS, STALL_FACTOR * self._intervals.max(now_ns))
        if self.step_tokens:
            return max(threshold_ns, self.step_bound_ns())
        return threshold_ns

    def step_bound_ns(self) -> int:
        """The time the iteration under way may take for its size (record.step_time_bound_ns),
        if it is bigger than every iteration measured; else 0 (no slack)."""
        return step_time_bound_ns(self.step_tokens, self.biggest_tokens, self.biggest_ns)

    def is_stalled(self, now_ns: int) -> bool:
        """No progress for longer than the threshold (the caller knows work is in flight)."""
        return now_ns - self.last_progress_ns > self.threshold_ns(now_ns)
