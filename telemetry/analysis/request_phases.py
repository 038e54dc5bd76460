"""A request's phases on the engine's clock, rebuilt from its milestones, and lanes to draw
requests on so that no two overlap on one lane.

A request reports at most two milestones (telemetry/lane/record.py RequestMilestone): one at its
first token and one at its finish, which carries the whole lifecycle. The newest milestone of
each request is the one to draw; a request whose finish the recording does not hold (it was
still running, or the recording was cut) ends where the recording ends:

    request   arrival ............................................... finish (or recording end)
      queued    arrival .. first scheduled
      prefill              chunk [start, end]  chunk ...
      decode                                    first token ........... finish
        prefill                                        a chunk recomputed after a preemption

Children never overlap and lie inside their parent: each starts no earlier than the one
before it ends and ends no later than the request (times that disagree by a few ns, as a
chunk's end and the first token stamped by two calls, are clamped, never dropped).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

from telemetry.lane.record import EVENT_FINISHED, FINISH_REASONS, RequestMilestone


@dataclass(slots=True)
class Phase:
    """One child slice of a request: its name, times and numbers."""

    name: str
    start_ns: int
    end_ns: int
    args: dict = field(default_factory=dict)
    children: list[Phase] = field(default_factory=list)


@dataclass(slots=True)
class RequestPhases:
    """A request from arrival to finish, with its phases in time order."""

    milestone: RequestMilestone
    end_ns: int
    finished: bool
    phases: list[Phase]

    @property
    def start_ns(self) -> int:
        return self.milestone.arrival_ns

    @property
    def finish_reason(self) -> str:
        reason = self.milestone.finish_reason
        if not self.finished:
            return "unfinished (the recording ends)"
        return FINISH_REASONS[reason] if 0 <= reason < len(FINISH_REASONS) else "unknown"


def latest_milestones(milestones: Iterable[RequestMilestone]) -> list[RequestMilestone]:
    """The newest milestone of each request (the finish when there is one), by arrival."""
    latest: dict[str, RequestMilestone] = {}
    for milestone in milestones:
        held = latest.get(milestone.request_id)
        if held is None or not held.event & EVENT_FINISHED:
            latest[milestone.request_id] = milestone
    return sorted(latest.values(), key=lambda m: (m.arrival_ns, m.request_id))


def request_phases(milestone: RequestMilestone, recording_end_ns: int) -> RequestPhases:
    """The request's phases; one not finished in the recording ends at ``recording_end_ns``."""
    finished = bool(milestone.event & EVENT_FINISHED)
    end_ns = milestone.finished_ns if finished else max(recording_end_ns, milestone.arrival_ns)
    first_token_ns = milestone.first_token_ns
    phases = [Phase("queued", milestone.arrival_ns, milestone.first_scheduled_ns or end_ns)]
    after: list[Phase] = []  # chunks computed again after the first token
    for i, (start, end, num_tokens) in enumerate(milestone.prefill_chunks):
        chunk = Phase("prefill", start, end, {"chunk_index": i, "num_tokens": num_tokens})
        (after if first_token_ns and start >= first_token_ns else phases).append(chunk)
    if first_token_ns:
        phases.append(Phase("decode", first_token_ns, end_ns, children=after))
    _clamp(phases, milestone.arrival_ns, end_ns)
    return RequestPhases(milestone, end_ns, finished, phases)


def _clamp(phases: list[Phase], start_ns: int, end_ns: int) -> None:
    """Make ``phases`` follow one another inside [start_ns, end_ns] (see the module doc)."""
    previous_end_ns = start_ns
    for phase in phases:
        phase.start_ns = min(max(phase.start_ns, previous_end_ns), end_ns)
        phase.end_ns = min(max(phase.end_ns, phase.start_ns), end_ns)
        _clamp(phase.children, phase.start_ns, phase.end_ns)
        previous_end_ns = phase.end_ns


def assign_lanes(spans: list[tuple[int, int]]) -> list[int]:
    """A lane (0, 1, ...) for each (start_ns, end_ns) span, so that spans on one lane never
    overlap (one may start where another ends). Spans are taken by start; each goes to the
    lowest free lane, so the number of lanes is the most spans open at once."""
    lanes = [0] * len(spans)
    busy: list[tuple[int, int]] = []  # (end_ns, lane) of spans still open
    free: list[int] = []
    order = sorted(range(len(spans)), key=lambda i: spans[i])
    for i in order:
        start_ns, end_ns = spans[i]
        while busy and busy[0][0] <= start_ns:
            heapq.heappush(free, heapq.heappop(busy)[1])
        lane = heapq.heappop(free) if free else len(busy)
        heapq.heappush(busy, (end_ns, lane))
        lanes[i] = lane
    return lanes
