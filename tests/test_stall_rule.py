"""One stall rule (telemetry/analysis/stall_rule.py) for the live sidecar and for `explain`:
fed the same messages, the sidecar's status and explain's stall episodes agree, for a slow
but healthy engine (multi-second iterations, which a fixed 2 s threshold called stalled) and
for a real hang."""

from __future__ import annotations

from telemetry.analysis.episodes import Thresholds, build_timelines, detect_episodes
from telemetry.analysis.stall_rule import STALL_FACTOR, STALL_FLOOR_S, StallRule
from telemetry.lane.record import heartbeat, iteration_record
from telemetry.sidecar.engine_view import EngineStatus
from telemetry.sidecar.ingest import Ingest
from tests.helpers.lane import RecordingSink

SECOND = 1_000_000_000


def slow_engine(step_s: list[float], queued: int = 2) -> list:
    """An engine whose iterations take ``step_s`` seconds each, requests always in flight,
    heartbeats every second in between (their last_iteration frozen inside an iteration)."""
    messages, seq, now_ns, iteration = [], 1, SECOND, 0
    messages.append(heartbeat(0, seq, now_ns, now_ns, num_waiting_reqs=queued, pid=7))
    next_heartbeat_ns = now_ns + SECOND
    for duration in step_s:
        end_ns = now_ns + int(duration * SECOND)
        while next_heartbeat_ns < end_ns:
            seq += 1
            messages.append(
                heartbeat(
                    0,
                    seq,
                    next_heartbeat_ns,
                    next_heartbeat_ns,
                    last_iteration=iteration,
                    num_waiting_reqs=queued,
                    num_running_reqs=1,
                    pid=7,
                )
            )
            next_heartbeat_ns += SECOND
        iteration += 1
        seq += 1
        messages.append(
            iteration_record(
                0,
                seq,
                iteration,
                start_ns=now_ns,
                elapsed_ns=end_ns - now_ns,
                num_prefill_reqs=1,
                num_prefill_tokens=500,
                num_running_reqs=1,
                num_waiting_reqs=queued,
                num_waiting_seq_limit_reqs=queued,
            )
        )
        now_ns = end_ns
    return messages


def live_statuses(messages) -> list[EngineStatus]:
    """What a sidecar replaying the messages says, ticking every 0.1 s of record time."""
    sink = RecordingSink()
    ingest = Ingest([sink])
    tick_ns = 0
    for message in messages:
        now_ns = getattr(message, "ts_ns", None) or message.start_ns + message.elapsed_ns
        while tick_ns <= now_ns:
            ingest.tick(tick_ns)
            tick_ns += SECOND // 10
        ingest.on_message(message, now_ns)
    return [status for _, status, _ in sink.of("status")]


def explained_stalls(messages):
    timeline = build_timelines(messages)[0]
    return [e for e in detect_episodes(timeline, Thresholds()) if e.kind == "stall"]


def test_a_slow_healthy_engine_is_no_stall_live_or_in_explain():
    messages = slow_engine([4.5] * 12)  # prefills of 4.5 s: under the 5 s floor
    assert EngineStatus.STALLED not in live_statuses(messages)
    assert explained_stalls(messages) == []


def test_slower_iterations_teach_the_threshold_in_both():
    """A first 6 s iteration is a stall (over the floor) to both; then the threshold is twice
    that, and the 6 s iterations that follow are no stall to either."""
    messages = slow_engine([1.0, 6.0, 6.0, 6.0, 6.0])
    statuses = live_statuses(messages)
    assert statuses.count(EngineStatus.STALLED) == 1
    (stall,) = explained_stalls(messages)
    assert stall.numbers["stall_threshold_s"] == STALL_FLOOR_S


def test_a_real_hang_is_a_stall_in_both_with_the_threshold_the_engine_earned():
    messages = slow_engine([3.0] * 5 + [20.0] + [3.0] * 3)
    assert EngineStatus.STALLED in live_statuses(messages)
    (stall,) = explained_stalls(messages)
    assert stall.numbers["stall_threshold_s"] == STALL_FACTOR * 3.0
    assert stall.numbers["stall_time_s"] >= 19.9


def test_a_fixed_threshold_does_not_adapt():
    rule = StallRule(stall_after_ns=2 * SECOND)
    rule.note_progress(10 * SECOND, had_work=True)
    rule.note_progress(40 * SECOND, had_work=True)  # a 30 s interval: learnt by no one
    assert rule.threshold_ns(41 * SECOND) == 2 * SECOND
    assert rule.is_stalled(43 * SECOND)
    messages = slow_engine([4.5] * 4)
    timeline = build_timelines(messages)[0]
    assert [e for e in detect_episodes(timeline, Thresholds(stall_after=2.0)) if e.kind == "stall"]


def test_a_first_iteration_that_began_before_the_first_busy_heartbeat_is_progress_in_both():
    """vLLM's engine schedules the first requests before its next heartbeat says they wait:
    idle heartbeats, then iteration 1 (3 s) starts 0.1 s before a heartbeat saying 2
    waiting at last_iteration 0, then iteration 2 (3.5 s). Each ends within the 5 s floor;
    the heartbeats stay at last_iteration 0 only until iteration 1 ends. (explain took the
    iteration after the heartbeat, iteration 2, as the first progress, and called the 6.4 s
    to its end a stall; seen on a real vLLM 0.32 with ngram drafts.)"""
    start_ns = 10 * SECOND
    messages = [
        heartbeat(0, seq, seq * SECOND, seq * SECOND, pid=7) for seq in range(1, 10)
    ]  # idle
    iterations = [(start_ns, 3.0), (start_ns + 3 * SECOND, 3.5)]
    heartbeat_times = [start_ns + SECOND // 10 + n * SECOND for n in range(7)]
    events = [(t, "heartbeat") for t in heartbeat_times]
    events += [
        (begin + int(length * SECOND), (number, begin, length))
        for number, (begin, length) in enumerate(iterations, 1)
    ]
    seq = 9
    for time_ns, what in sorted(events, key=lambda event: event[0]):
        seq += 1
        if what == "heartbeat":
            done = sum(begin + int(length * SECOND) <= time_ns for begin, length in iterations)
            messages.append(
                heartbeat(
                    0,
                    seq,
                    time_ns,
                    time_ns,
                    last_iteration=done,
                    num_waiting_reqs=2 if done == 0 else 0,
                    num_running_reqs=0 if done == 0 else 2,
                    pid=7,
                )
            )
        else:
            number, begin, length = what
            messages.append(
                iteration_record(
                    0,
                    seq,
                    number,
                    start_ns=begin,
                    elapsed_ns=int(length * SECOND),
                    num_prefill_reqs=2,
                    num_prefill_tokens=300,
                    num_running_reqs=2,
                )
            )
    assert EngineStatus.STALLED not in live_statuses(messages)
    assert explained_stalls(messages) == []
