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
chunk's end and the first token stamped by two calls, are clamped, never dropped). A trace
draws tens of thousands of requests, so the phases are plain numbers, not an object each.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

from telemetry.lane.record import EVENT_FINISHED, FINISH_REASONS, RequestMilestone

Chunk = tuple[int, int, int, int]  # a prefill chunk's start_ns, end_ns, index, num_tokens


@dataclass(slots=True)
class RequestPhases:
    """A request from arrival to finish, its phases clamped as the module doc says: queued
    from ``queued_start_ns`` to ``queued_end_ns``, then ``prefills``, then, if it had a first
    token, decode from ``decode_start_ns`` to ``end_ns`` with ``recomputed`` nested in it."""

    milestone: RequestMilestone
    end_ns: int
    finished: bool
    queued_start_ns: int
    queued_end_ns: int
    prefills: list[Chunk]
    decode_start_ns: int | None  # None: no first token
    recomputed: list[Chunk]  # chunks computed again after the first token

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
    arrival_ns = milestone.arrival_ns
    end_ns = milestone.finished_ns if finished else max(recording_end_ns, arrival_ns)
    first_token_ns = milestone.first_token_ns
    queued_start_ns = min(arrival_ns, end_ns)
    queued_end_ns = min(max(milestone.first_scheduled_ns or end_ns, queued_start_ns), end_ns)
    chunks = [(start, end, i, n) for i, (start, end, n) in enumerate(milestone.prefill_chunks)]
    if first_token_ns:  # chunks that start at or after the first token were computed again
        recomputed = [chunk for chunk in chunks if chunk[0] >= first_token_ns]
        chunks = [chunk for chunk in chunks if chunk[0] < first_token_ns]
    prefills, previous_end_ns = _clamp(chunks, queued_end_ns, end_ns)
    if not first_token_ns:
        return RequestPhases(
            milestone, end_ns, finished, queued_start_ns, queued_end_ns, prefills, None, []
        )
    decode_start_ns = min(max(first_token_ns, previous_end_ns), end_ns)
    recomputed = _clamp(recomputed, decode_start_ns, end_ns)[0]
    return RequestPhases(
        milestone,
        end_ns,
        finished,
        queued_start_ns,
        queued_end_ns,
        prefills,
        decode_start_ns,
        recomputed,
    )


def _clamp(chunks: list[Chunk], start_ns: int, end_ns: int) -> tuple[list[Chunk], int]:
    """``chunks`` made to follow one another inside [start_ns, end_ns], and where the last
    one ends (``start_ns`` if none)."""
    clamped = []
    for chunk_start_ns, chunk_end_ns, index, num_tokens in chunks:
        chunk_start_ns = min(max(chunk_start_ns, start_ns), end_ns)
        start_ns = min(max(chunk_end_ns, chunk_start_ns), end_ns)
        clamped.append((chunk_start_ns, start_ns, index, num_tokens))
    return clamped, start_ns


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
