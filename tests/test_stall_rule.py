"""One stall rule (telemetry/analysis/stall_rule.py) for the live sidecar and for `explain`:
fed the same messages, the sidecar's status and explain's stall episodes agree, for a slow
but healthy engine (multi-second iterations, which a fixed 2 s threshold called stalled) and
for a real hang."""

from __future__ import annotations

from telemetry.analysis.episodes import Thresholds, build_timelines, detect_episodes
from telemetry.analysis.stall_rule import (
    STALL_FACTOR,
    STALL_FLOOR_S,
    STALL_STEP_CAP_S,
    STALL_WINDOW_S,
    StallRule,
)
from telemetry.lane.record import heartbeat, iteration_record
from telemetry.sidecar.engine_view import EngineStatus
from telemetry.sidecar.ingest import Ingest
from tests.helpers.lane import RecordingSink

SECOND = 1_000_000_000


def slow_engine(
    step_s: list[float], queued: int = 2, tokens: list[int] | None = None, say_step: bool = True
) -> list:
    """An engine whose iterations take ``step_s`` seconds each, requests always in flight,
    heartbeats every second in between (their last_iteration frozen inside an iteration).
    ``tokens``: each iteration's size (500 each by default), which its heartbeats say as
    ``step_tokens`` if ``say_step`` (an older sender does not)."""
    messages, seq, now_ns, iteration = [], 1, SECOND, 0
    messages.append(heartbeat(0, seq, now_ns, now_ns, num_waiting_reqs=queued, pid=7))
    next_heartbeat_ns = now_ns + SECOND
    for duration, num_tokens in zip(step_s, tokens or [500] * len(step_s), strict=True):
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
                    step_tokens=num_tokens if say_step else 0,
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
                num_prefill_tokens=num_tokens,
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


def test_a_step_bigger_than_any_measured_gets_the_time_its_size_can_take_in_both():
    """An 8,000-token prompt after 500-token iterations of 0.3 s took 32 s (seen on our
    engine): its heartbeats say its size, so neither the sidecar nor explain calls it a
    stall (the bound: 2 x 0.3 s x 16^2 = 154 s). A sender that does not say the size gets
    the threshold it earned, as before."""
    steps, tokens = [0.3] * 10 + [32.0] + [0.3] * 3, [500] * 10 + [8000] + [500] * 3
    messages = slow_engine(steps, tokens=tokens)
    assert EngineStatus.STALLED not in live_statuses(messages)
    assert explained_stalls(messages) == []
    unsaid = slow_engine(steps, tokens=tokens, say_step=False)
    assert EngineStatus.STALLED in live_statuses(unsaid)
    (stall,) = explained_stalls(unsaid)
    assert stall.numbers["stall_threshold_s"] == STALL_FLOOR_S


def test_a_big_step_that_outlasts_its_bound_is_a_stall_in_both():
    steps, tokens = [0.3] * 10 + [200.0] + [0.3], [500] * 10 + [8000] + [500]
    messages = slow_engine(steps, tokens=tokens)
    assert EngineStatus.STALLED in live_statuses(messages)
    (stall,) = explained_stalls(messages)
    assert abs(stall.numbers["stall_threshold_s"] - STALL_FACTOR * 0.3 * 16**2) < 0.01


def test_a_step_no_bigger_than_measured_gets_no_slack():
    steps, tokens = [0.3] * 10 + [20.0] + [0.3], [500] * 10 + [400] + [500]
    messages = slow_engine(steps, tokens=tokens)
    assert EngineStatus.STALLED in live_statuses(messages)
    (stall,) = explained_stalls(messages)
    assert stall.numbers["stall_threshold_s"] == STALL_FLOOR_S


def test_the_biggest_iteration_is_kept_and_the_slack_capped():
    """An engine's speed per token does not age: the biggest iteration measured is kept (the
    first big request after an idle quarter of an hour is no stall either); from a small
    step the square grows fast (a 21-token step of 86 ms gave a 7,000-token one 5.3 hours),
    so the slack stops at STALL_STEP_CAP_S: a hang inside the step is found then."""
    rule = StallRule()
    rule.note_progress(SECOND, had_work=True, num_tokens=1000, elapsed_ns=SECOND)
    rule.note_progress(2 * SECOND, had_work=True, num_tokens=500, elapsed_ns=SECOND // 2)
    assert (rule.biggest_tokens, rule.biggest_ns) == (1000, SECOND)
    rule.note_step(2000)
    assert rule.threshold_ns(3 * SECOND) == STALL_FACTOR * 4 * SECOND
    assert rule.threshold_ns(int(3 * STALL_WINDOW_S * SECOND)) == STALL_FACTOR * 4 * SECOND
    rule.note_step(1000)  # no bigger than measured: no slack
    assert rule.threshold_ns(3 * SECOND) == STALL_FLOOR_S * SECOND
    small = StallRule()
    small.note_progress(SECOND, had_work=True, num_tokens=21, elapsed_ns=86_000_000)
    small.note_step(7000)
    assert small.threshold_ns(2 * SECOND) == STALL_STEP_CAP_S * SECOND


def test_an_engine_s_first_step_is_given_the_cap_where_its_size_is_said():
    """A 7,000-token prompt as a fresh vLLM's first step took 23.7 s: with nothing measured
    to scale from, the step is given STALL_STEP_CAP_S, live and in explain (it was a stall
    with a restart advised). A sender that does not say the size: the floor, as before."""
    messages = slow_engine([23.7, 0.3, 0.3], tokens=[7000, 20, 20])
    assert EngineStatus.STALLED not in live_statuses(messages)
    assert explained_stalls(messages) == []
    unsaid = slow_engine([23.7, 0.3, 0.3], tokens=[7000, 20, 20], say_step=False)
    assert EngineStatus.STALLED in live_statuses(unsaid)
    assert len(explained_stalls(unsaid)) == 1


def frozen_then_hung(step_tokens: int = 0) -> list:
    """1 s iterations; the whole process frozen (SIGSTOP) for 8 s inside iteration 4, whose
    record comes 3 ms after the first heartbeat that follows the freeze; 1 s iterations again;
    then the engine loop hung for 14 s while its publisher's heartbeats go on."""
    messages, seq, last_iteration = [], 0, 0

    def beat(time_ns: int) -> None:
        nonlocal seq
        seq += 1
        messages.append(
            heartbeat(
                0,
                seq,
                time_ns,
                time_ns,
                last_iteration=last_iteration,
                num_running_reqs=2,
                pid=7,
                step_tokens=step_tokens,
            )
        )

    def step(begin_ns: int, end_ns: int) -> None:
        nonlocal seq, last_iteration
        seq += 1
        last_iteration += 1
        messages.append(
            iteration_record(
                0,
                seq,
                last_iteration,
                start_ns=begin_ns,
                elapsed_ns=end_ns - begin_ns,
                num_decode_reqs=2,
                num_decode_tokens=2,
                num_running_reqs=2,
            )
        )

    beat(SECOND)
    for n in range(1, 4):  # iterations 1-3, a heartbeat in each
        beat(n * SECOND + SECOND // 2)
        step(n * SECOND, (n + 1) * SECOND)
    thawed_ns = 4 * SECOND + SECOND // 2 + 8 * SECOND  # frozen 4.5 s -> 12.5 s
    beat(thawed_ns)
    step(4 * SECOND, thawed_ns + 3_000_000)
    now_ns = thawed_ns + 3_000_000
    for _ in range(3):
        beat(now_ns + SECOND // 2)
        step(now_ns, now_ns + SECOND)
        now_ns += SECOND
    for n in range(1, 15):  # hung: heartbeats, no progress
        beat(now_ns + n * SECOND)
    return messages


def test_a_frozen_process_teaches_no_threshold_in_either():
    """After a freeze, a heartbeat came 3 ms before the record of the iteration the freeze
    stretched: the sidecar restarts its wait at the heartbeat (heard again after a silence),
    but explain learnt the 8 s from that record and doubled it: a 14 s hang later was a
    stall live and nothing in explain (QA on vLLM's scheduler source, SIGSTOP)."""
    for step_tokens in (0, 2):
        messages = frozen_then_hung(step_tokens)
        assert EngineStatus.STALLED in live_statuses(messages)
        (stall,) = explained_stalls(messages)
        assert stall.numbers["stall_threshold_s"] == STALL_FLOOR_S
