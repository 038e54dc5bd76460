"""Ingest: typed decoding, undecodable frames by reason, seq gaps, engine status; the loop."""

import random
import threading
import time

import msgspec
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from telemetry.lane.record import TAG_HEARTBEAT, TAG_ITERATION
from telemetry.sidecar.engine_view import EngineStatus
from telemetry.sidecar.ingest import Ingest
from telemetry.sidecar.lane_loop import LaneLoop, check_address
from tests.helpers.lane import RecordingSink, encode, heartbeat, record
from tests.helpers.wait import wait_until

SECOND = 1_000_000_000


def test_seq_gaps_become_exact_dropped_counts_before_the_next_message():
    sink = RecordingSink()
    ingest = Ingest([sink])
    ingest.on_frame(encode(heartbeat(1)), now_ns=1)
    for seq in (2, 5, 6, 10):
        ingest.on_frame(encode(record(seq)), now_ns=seq)
    assert sink.of("dropped") == [(0, 2), (0, 3)]
    dropped_at = sink.calls.index(("dropped", 0, 2))
    assert sink.calls[dropped_at + 1] == ("iteration", 0, 5)
    assert ingest.engines[0].view.num_dropped_total == 5


def test_engines_are_tracked_apart_and_a_restart_counts_from_seq_1():
    sink = RecordingSink()
    ingest = Ingest([sink])
    for message in (heartbeat(1, 0), heartbeat(1, 7), record(2, 0), record(3, 7), record(3, 0)):
        ingest.on_message(message, now_ns=1)
    assert sink.of("dropped") == [(7, 1)]
    # seq went back: engine 0 restarted, and says it could not send its first message
    ingest.on_message(record(2, 0, num_dropped=1), now_ns=2)
    assert sink.of("dropped") == [(7, 1), (0, 1)]


def test_a_restart_changes_the_pid_once_and_is_no_conflict():
    sink = RecordingSink()
    ingest = Ingest([sink])
    for seq, pid in ((1, 100), (2, 100), (1, 200), (2, 200), (3, 200)):
        ingest.on_message(heartbeat(seq, pid=pid), now_ns=seq)
    assert sink.of("conflict") == [] and ingest.health.num_engine_conflicts == 0


def test_two_live_processes_on_one_engine_index_are_reported_as_a_conflict():
    sink = RecordingSink()
    ingest = Ingest([sink])
    # Each process sends its own heartbeats about once a second: the pids alternate.
    for seq, pid in ((1, 100), (1, 200), (2, 100), (2, 200), (3, 100)):
        ingest.on_message(heartbeat(seq, pid=pid), now_ns=seq)
        ingest.on_message(heartbeat(1, engine_index=3, pid=300), now_ns=seq)  # alone: fine
    view = ingest.engines[0].view
    assert (view.num_engine_conflicts, view.conflicting_pids) == (3, (100, 200))
    assert ingest.engines[3].view.num_engine_conflicts == 0
    assert ingest.health.num_engine_conflicts == 3
    # sinks learn it with the engine's next message, from its view
    assert sink.of("conflict") == [(0, (100, 200))] * 2


def test_first_contact_counts_the_engines_own_drops_or_the_recorded_last_seq():
    sink = RecordingSink()
    ingest = Ingest([sink], known_last_seqs={1: 40})
    ingest.on_message(heartbeat(100, engine_index=0, num_dropped=3), now_ns=1)
    ingest.on_message(heartbeat(50, engine_index=1, num_dropped=3), now_ns=1)
    assert sink.of("dropped") == [(0, 3), (1, 9)]


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (b"\xc1", "malformed"),  # a byte msgpack never uses
        (b"not msgpack at all", "malformed"),
        (msgspec.msgpack.encode({"tag": TAG_ITERATION}), "malformed"),
        (msgspec.msgpack.encode([TAG_ITERATION, "x", 1]), "malformed"),
        (encode(record(1))[:-3], "truncated"),
        (encode(record(1)) + b"\x00", "malformed"),
        (msgspec.msgpack.encode([TAG_ITERATION + 16, 0, 1]), "version"),
        (msgspec.msgpack.encode([TAG_HEARTBEAT + 32, 0, 1, 2]), "version"),
        (msgspec.msgpack.encode([TAG_ITERATION + 1, 0, 1]), "malformed"),  # unknown kind
        (encode(record(1, engine_index=-1)), "malformed"),
        (encode(record(0)), "malformed"),  # seq starts at 1
        (encode(record(1, num_running_reqs=-5)), "malformed"),  # a count below 0
        (b"\x00" * 9000, "oversized"),
        (b"\x92\x11" + b"\x91" * 3000 + b"\x00", "malformed"),  # nested deeper than the stack
        (b"\x92\x11" + b"\x81\x01" * 3000 + b"\x00", "malformed"),
    ],
)
def test_undecodable_frames_are_counted_by_reason(frame, reason):
    sink = RecordingSink()
    ingest = Ingest([sink], max_frame_bytes=8192)
    ingest.on_frame(frame, now_ns=1)
    health = ingest.health
    assert {r: n for r, n in health.num_undecodable.items() if n} == {reason: 1}
    assert health.num_messages == 0 and sink.calls == []  # no sink hears of it


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_are_either_a_message_or_counted(frame):
    ingest = Ingest([RecordingSink()], max_frame_bytes=150)
    ingest.on_frame(frame, now_ns=1)
    stats = ingest.health
    assert stats.num_messages + stats.num_undecodable_total + stats.num_rejected_total == 1


def test_status_idle_running_stalled_dead_each_transition_once():
    sink = RecordingSink()
    ingest = Ingest([sink], dead_after_s=2.5, stall_after_s=5)
    ingest.on_message(heartbeat(1), now_ns=0)
    ingest.tick(SECOND // 2)
    ingest.on_message(heartbeat(2, waiting=3), now_ns=SECOND)  # work arrives
    ingest.on_message(record(3, iteration=1), now_ns=SECOND + 1)
    for second in range(2, 9):  # heartbeats go on, the loop never finishes another iteration
        ingest.on_message(heartbeat(2 + second, last_iteration=1, waiting=3), second * SECOND)
        ingest.tick(second * SECOND + 1)
    for tick in range(1, 40):  # no message at all any more
        ingest.tick(8 * SECOND + tick * SECOND // 10)
    statuses = [(status, now_ns) for _, status, now_ns in sink.of("status")]
    assert [status for status, _ in statuses] == [
        EngineStatus.IDLE,
        EngineStatus.RUNNING,
        EngineStatus.STALLED,
        EngineStatus.DEAD,
    ]
    assert 6 * SECOND + 1 < statuses[2][1] <= 7 * SECOND + 1  # stalled: 5 s after progress
    assert 10.5 * SECOND < statuses[3][1] <= 10.6 * SECOND  # dead: 2.5 s after the last message


def test_a_loop_that_iterates_without_scheduling_anything_is_stalled():
    """Story 2: requests wait, the loop spins on empty iterations (e.g. leaked KV blocks)."""
    sink = RecordingSink()
    ingest = Ingest([sink], stall_after_s=2)
    ingest.on_message(heartbeat(1, waiting=2), now_ns=0)
    ingest.on_message(record(2, iteration=1), now_ns=0)  # work scheduled: progress
    seq = 2
    for step in range(1, 50):  # 100 empty iterations a second, heartbeats frozen at 1
        seq += 1
        now_ns = step * SECOND // 10
        ingest.on_message(record(seq, iteration=1 + step, num_running_reqs=0), now_ns)
        if step % 10 == 0:
            seq += 1
            ingest.on_message(heartbeat(seq, last_iteration=1, waiting=2), now_ns)
        ingest.tick(now_ns + 1)
    assert [status for _, status, _ in sink.of("status")] == [
        EngineStatus.RUNNING,
        EngineStatus.STALLED,
    ]


def test_heartbeat_progress_counts_when_the_records_were_lost():
    sink = RecordingSink()
    ingest = Ingest([sink], stall_after_s=2)
    ingest.on_message(heartbeat(1, waiting=1, running=1), now_ns=0)
    for second in range(1, 10):
        ingest.on_message(
            heartbeat(2 * second, last_iteration=100 * second, running=1), now_ns=second * SECOND
        )
        ingest.tick(second * SECOND + 1)
    assert [status for _, status, _ in sink.of("status")] == [EngineStatus.RUNNING]
    assert ingest.engines[0].view.num_dropped_total == 8  # seqs 3, 5, ..., 17: lost records


def test_a_failing_sink_is_counted_and_ingest_goes_on():
    class Failing(RecordingSink):
        def on_iteration(self, record, engine):
            raise RuntimeError("boom")

    good = RecordingSink()
    ingest = Ingest([Failing(), good])
    for message in (heartbeat(1), record(2), record(3)):
        ingest.on_message(message, now_ns=message.msg_seq)
    assert ingest.health.num_sink_errors == 2
    assert good.of("iteration") == [(0, 2), (0, 3)] and good.of("status")


@pytest.mark.parametrize(
    ("address", "bind", "allowed"),
    [
        ("ipc:///tmp/x.sock", True, True),
        ("tcp://127.0.0.1:5555", True, True),
        ("tcp://0.0.0.0:5555", True, False),
        ("tcp://10.0.0.1:5555", False, True),  # connecting goes where the user said
        ("udp://127.0.0.1:5555", True, False),
        ("/tmp/x.sock", True, False),
    ],
)
def test_addresses_are_ipc_or_loopback_unless_remote_is_allowed(address, bind, allowed):
    if allowed:
        check_address(address, bind)
    else:
        with pytest.raises(ValueError):
            check_address(address, bind)
    check_address("tcp://0.0.0.0:5555", True, allow_remote=True)


def test_100k_bad_frames_over_the_socket_are_counted_and_ingest_goes_on(tmp_path):
    """Malformed, truncated, oversized and wrong-version frames from a seeded generator."""
    rng = random.Random(4)
    good = encode(record(1))
    kinds = {
        "malformed": lambda: b"\xc1" + rng.randbytes(rng.randrange(0, 60)),  # never-used byte
        "truncated": lambda: good[: rng.randrange(1, len(good))],
        "oversized": lambda: rng.randbytes(600),
        "version": lambda: msgspec.msgpack.encode(
            [TAG_ITERATION + 16 * rng.randrange(1, 9), 0, rng.randrange(1, 99)]
        ),
    }
    frames, expected = [], dict.fromkeys(kinds, 0)
    for _ in range(100_000):
        kind = rng.choice(list(kinds))
        frames.append(kinds[kind]())
        expected[kind] += 1
    address = f"ipc://{tmp_path}/lane.sock"
    sink = RecordingSink()
    sidecar = LaneLoop(address, Ingest([sink], max_frame_bytes=512))
    thread = threading.Thread(target=sidecar.run)
    thread.start()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(address)
    try:
        for frame in frames:
            push.send(frame)  # blocking: every frame arrives
        push.send(encode(heartbeat(5)))
        wait_until(
            lambda: sidecar.ingest.health.num_messages > 0,
            60,
            "the heartbeat after the bad frames to be ingested",
        )
    finally:
        sidecar.stop()
        thread.join(timeout=10)
        push.close(linger=0)
    assert not thread.is_alive()
    stats = sidecar.ingest.health
    assert stats.num_frames == 100_001
    assert stats.num_undecodable == expected
    assert sink.of("heartbeat") == [(0, 5)] and sink.of("dropped") == []


def test_a_stopping_sidecar_ingests_what_it_already_received(tmp_path):
    """Frames in the receive queue at stop are ingested, not dropped with the socket: no later
    message could report them lost."""
    address = f"ipc://{tmp_path}/lane.sock"
    sink = RecordingSink()
    sidecar = LaneLoop(address, Ingest([sink]))
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(address)
    try:
        push.send(encode(heartbeat(1)))
        for seq in range(2, 201):
            push.send(encode(record(seq)))
        time.sleep(0.5)  # delivered into the sidecar's queue; nothing has read it yet
        sidecar.stop()  # before run(): the loop never turns, only the drain reads
        sidecar.run()
    finally:
        push.close(linger=0)
    assert sidecar.ingest.health.num_messages == 200
    assert sink.of("dropped") == []
