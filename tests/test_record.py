import time

import msgspec
import pytest
import zmq

from telemetry.lane import publisher as publisher_module
from telemetry.lane.publisher import ZmqPublisher
from telemetry.lane.record import (
    TAG_ITERATION,
    Heartbeat,
    IterationRecord,
    RequestMilestone,
    SpecDecodeCounts,
    heartbeat,
    is_clean_close,
    iteration_record,
    make_decoder,
    make_encoder,
)


def decode_record(msg_seq: int = 0, iteration: int = 123_000, **overrides) -> IterationRecord:
    """A steady-state decode iteration: 50 running requests, one token each."""
    fields = dict(
        start_ns=time.monotonic_ns(),
        elapsed_ns=10_250_000,
        num_decode_reqs=50,
        num_decode_tokens=50,
        num_running_reqs=50,
        num_kv_blocks_used=3500,
        num_kv_blocks_free=65459,
        num_kv_tokens=56000,
    )
    return iteration_record(0, msg_seq, iteration, **{**fields, **overrides})


def test_steady_state_decode_record_fits_96_bytes():
    frame = make_encoder().encode(decode_record(msg_seq=2**31))
    assert len(frame) <= 96


def test_round_trip_with_milestone_and_tag_first():
    milestone = RequestMilestone(
        request_id="r1",
        event=3,
        arrival_ns=1,
        first_scheduled_ns=2,
        first_token_ns=3,
        finished_ns=4,
        num_prompt_tokens=5,
        num_cached_tokens=0,
        num_output_tokens=1,
        num_preemptions=0,
        finish_reason=1,
        prefill_chunks=[(2, 3, 5)],
    )
    record = decode_record(milestones=[milestone])
    frame = make_encoder().encode(record)
    assert msgspec.msgpack.decode(frame)[0] == TAG_ITERATION
    assert make_decoder().decode(frame) == record


def test_spec_decode_counts_ride_at_the_end_and_older_frames_read_as_none():
    """A frame from a sender that predates spec_decode (one element shorter) decodes with
    None, and a reader that predates it skips the trailing element."""
    spec = SpecDecodeCounts(2, 6, 3, [2, 1, 0])
    record = decode_record(num_decode_tokens=53, spec_decode=spec)
    frame = make_encoder().encode(record)
    assert make_decoder().decode(frame).spec_decode == spec
    cut = 1 + IterationRecord.__struct_fields__.index("spec_decode")  # the tag comes first
    older_frame = msgspec.msgpack.encode(msgspec.msgpack.decode(frame)[:cut])
    assert make_decoder().decode(older_frame) == decode_record(
        num_decode_tokens=53, start_ns=record.start_ns
    )

    class OlderRecord(msgspec.Struct, array_like=True, tag=TAG_ITERATION):
        engine_index: int
        msg_seq: int
        iteration: int

    assert msgspec.msgpack.decode(frame, type=OlderRecord).iteration == record.iteration


def test_other_schema_version_is_rejected():
    frame = msgspec.msgpack.encode([TAG_ITERATION + 16, 0, 1])
    with pytest.raises(msgspec.ValidationError):
        make_decoder().decode(frame)


def test_factories_leave_every_unnamed_count_zero():
    record = iteration_record(2, 7, 9, num_kv_tokens=16)
    assert (record.engine_index, record.msg_seq, record.iteration) == (2, 7, 9)
    assert record.num_kv_tokens == 16
    assert record.num_running_reqs == record.elapsed_ns == record.unknown == 0
    assert record.milestones == []
    beat = heartbeat(2, 7, 100, 200, num_running_reqs=4, model_name="m")
    assert (beat.ts_ns, beat.wall_ns, beat.num_running_reqs, beat.model_name) == (100, 200, 4, "m")
    assert beat.last_iteration == beat.num_waiting_reqs == beat.block_size == 0


def test_the_engine_version_rides_last_on_heartbeats_and_older_ones_say_none():
    """A heartbeat names the engine and its version; one from a sender that predates the
    field decodes with "" (not said)."""
    beat = heartbeat(0, 1, 100, 200, source="vllm-scheduler", engine_version="vllm 0.32.0")
    frame = make_encoder().encode(beat)
    assert make_decoder().decode(frame).engine_version == "vllm 0.32.0"
    cut = 1 + Heartbeat.__struct_fields__.index("engine_version")  # the tag comes first
    older_frame = msgspec.msgpack.encode(msgspec.msgpack.decode(frame)[:cut])
    older = make_decoder().decode(older_frame)
    assert (older.engine_version, older.source) == ("", "vllm-scheduler")


def test_factories_reject_a_misspelt_field():
    with pytest.raises(TypeError):
        iteration_record(0, 1, 1, num_kv_token=16)
    with pytest.raises(TypeError):
        heartbeat(0, 1, 1, 1, num_running=4)


@pytest.mark.parametrize("message", [iteration_record(0, 1, 1), heartbeat(0, 1, 1, 1)])
def test_a_frame_cut_short_is_rejected_not_filled_with_zeros(message):
    """The factories' defaults must not become Struct defaults: msgspec would fill the
    missing trailing elements of a short frame with them and accept it."""
    elements = msgspec.msgpack.decode(make_encoder().encode(message))
    frame = msgspec.msgpack.encode(elements[:5])
    with pytest.raises(msgspec.ValidationError):
        make_decoder().decode(frame)


def bound_pull(tmp_path) -> tuple[str, zmq.Socket]:
    """A lane address under ``tmp_path`` and a PULL socket bound to it: the sidecar's end."""
    address = f"ipc://{tmp_path}/lane.sock"
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(address)
    return address, pull


def test_publisher_counts_drops_and_reports_them_in_next_sent_record(tmp_path):
    address = f"ipc://{tmp_path}/lane.sock"
    publisher = ZmqPublisher(address, engine_index=3, heartbeat_interval_s=3600)
    # No sidecar yet: with ZMQ_IMMEDIATE every send is dropped and counted.
    publisher.publish(decode_record())
    publisher.publish(decode_record())
    assert publisher.flush()
    dropped_before = publisher.num_dropped_total
    assert dropped_before >= 2
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(address)
    decoder = make_decoder()
    try:
        deadline = time.monotonic() + 5
        received = None
        while received is None and time.monotonic() < deadline:
            publisher.publish(decode_record())
            if pull.poll(50):
                received = decoder.decode(pull.recv())
        # Heartbeat or record: the first message sent carries every drop before it.
        assert received is not None
        assert received.msg_seq - received.num_dropped == 1
        assert publisher.num_dropped_total == received.num_dropped
    finally:
        publisher.close()
        pull.close(linger=0)


def test_heartbeat_carries_clock_anchor(tmp_path):
    address, pull = bound_pull(tmp_path)
    publisher = ZmqPublisher(address, 1, facts={"model_name": "m"}, heartbeat_interval_s=0.05)
    try:
        assert pull.poll(5000)
        heartbeat = make_decoder().decode(pull.recv())
        assert isinstance(heartbeat, Heartbeat)
        assert heartbeat.model_name == "m" and heartbeat.engine_index == 1
        assert abs(heartbeat.wall_ns - time.time_ns()) < 5e9
    finally:
        publisher.close()
        pull.close(linger=0)


def heartbeat_where(pull: zmq.Socket, wanted, timeout_s: float = 5.0) -> Heartbeat | None:
    """The first heartbeat received for which ``wanted(heartbeat)``; None by the timeout."""
    decoder, deadline = make_decoder(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pull.poll(100):
            message = decoder.decode(pull.recv())
            if isinstance(message, Heartbeat) and wanted(message):
                return message
    return None


def test_heartbeats_say_the_size_of_the_step_under_way_until_its_record(tmp_path):
    address, pull = bound_pull(tmp_path)
    publisher = ZmqPublisher(address, 0, heartbeat_interval_s=0.05)
    try:
        publisher.note_queues(0, 2, step_tokens=8000)
        assert heartbeat_where(pull, lambda beat: beat.step_tokens == 8000) is not None
        publisher.publish(iteration_record(0, 0, 1, num_prefill_tokens=8000))
        after = heartbeat_where(pull, lambda beat: beat.last_iteration == 1)
        assert after is not None and after.step_tokens == 0
    finally:
        publisher.close()
        pull.close(linger=0)


def test_records_dropped_on_a_full_queue_leave_an_exact_seq_gap(tmp_path, monkeypatch):
    monkeypatch.setattr(publisher_module, "SEND_INTERVAL_S", 3600)  # only flush() wakes it
    address, pull = bound_pull(tmp_path)
    publisher = ZmqPublisher(address, 0, heartbeat_interval_s=3600, queue_capacity=4)
    decoder = make_decoder()
    try:
        assert publisher.flush()
        for _ in range(10):  # the sender thread sleeps: 6 find the queue full
            publisher.publish(decode_record())
        assert publisher.flush()
        publisher.publish(decode_record())
        assert publisher.flush()
        messages = []
        while pull.poll(200):
            messages.append(decoder.decode(pull.recv()))
    finally:
        publisher.close()
        pull.close(linger=0)
    records = [m for m in messages if isinstance(m, IterationRecord)]
    seqs = [m.msg_seq for m in messages]
    assert seqs == sorted(seqs)
    assert publisher.num_dropped_total == 6
    assert len(records) == 5
    # Each message's num_dropped is exactly the seq gap before it, and the gaps add up.
    previous_seq = 0
    for message in messages:
        assert message.num_dropped == message.msg_seq - previous_seq - 1
        previous_seq = message.msg_seq
    assert sum(m.num_dropped for m in messages) == 6


def close_and_receive(publisher: ZmqPublisher, pull: zmq.Socket, **close_args) -> list:
    """Close the publisher; every message the PULL socket then has, decoded."""
    publisher.close(**close_args)
    messages = []
    while pull.poll(500):
        messages.append(make_decoder().decode(pull.recv()))
    return messages


def test_drops_just_before_close_reach_the_sidecar_in_a_last_heartbeat(tmp_path, monkeypatch):
    """No later message would carry the gap of records dropped right before shutdown."""
    monkeypatch.setattr(publisher_module, "SEND_INTERVAL_S", 3600)  # only flush/close wake it
    address, pull = bound_pull(tmp_path)
    publisher = ZmqPublisher(address, 0, heartbeat_interval_s=3600, queue_capacity=4)
    try:
        assert publisher.flush()  # the first heartbeat
        for _ in range(10):  # the sender thread sleeps: 6 find the queue full
            publisher.publish(decode_record())
        messages = close_and_receive(publisher, pull)
    finally:
        pull.close(linger=0)
    assert publisher.num_dropped_total == 6
    assert isinstance(messages[-1], Heartbeat) and messages[-1].num_dropped == 6
    assert sum(m.num_dropped for m in messages) == 6


def test_a_sidecar_that_binds_late_gets_the_first_heartbeat(tmp_path):
    """A sidecar started just before the engine on a busy machine may accept the connection
    after 100 ms: the first heartbeat waited that long, then was dropped ("1 telemetry
    messages lost" on an idle engine); the sender now waits up to CONNECT_WAIT_MS for it."""
    address = f"ipc://{tmp_path}/lane.sock"
    publisher = ZmqPublisher(address, 0, heartbeat_interval_s=3600)
    pull = zmq.Context.instance().socket(zmq.PULL)
    try:
        time.sleep(0.3)
        pull.bind(address)
        assert pull.poll(5000), "no message"
        first = make_decoder().decode(pull.recv())
    finally:
        publisher.close()
        pull.close(linger=0)
    assert (type(first), first.msg_seq, first.num_dropped) == (Heartbeat, 1, 0)
    assert publisher.num_dropped_total == 0


def test_a_restarted_sidecar_gets_a_heartbeat_before_any_record(tmp_path, monkeypatch):
    """A sidecar meets an engine only by a heartbeat and rejects the records before it: a
    restarted sidecar used to reject up to a second of records (their requests got no span).
    After a failed send the first message through is a heartbeat, carrying the gap."""
    monkeypatch.setattr(publisher_module, "SEND_INTERVAL_S", 3600)  # only flush/close wake it
    address = f"ipc://{tmp_path}/lane.sock"
    context = zmq.Context.instance()
    first = context.socket(zmq.PULL)
    first.bind(address)
    publisher = ZmqPublisher(address, 0, heartbeat_interval_s=3600)
    decoder = make_decoder()
    second = None
    try:
        assert publisher.flush()  # the first heartbeat
        publisher.publish(decode_record())
        assert publisher.flush()
        assert first.poll(5000) and first.poll(5000)
        first.close(linger=0)  # the sidecar is killed
        time.sleep(0.2)
        publisher.publish(decode_record())  # dropped: nobody listens
        assert publisher.flush()
        second = context.socket(zmq.PULL)
        second.bind(address)  # the restarted sidecar
        received = []
        deadline = time.monotonic() + 5
        while len(received) < 2 and time.monotonic() < deadline:
            publisher.publish(decode_record())
            assert publisher.flush()
            while second.poll(50):
                received.append(decoder.decode(second.recv()))
    finally:
        publisher.close()
        for socket in (first, second):
            if socket is not None:
                socket.close(linger=0)
    assert len(received) >= 2, received
    assert type(received[0]) is Heartbeat
    assert all(type(message) is IterationRecord for message in received[1:])
    # the heartbeat carries every record dropped while no sidecar listened
    assert received[0].num_dropped == received[0].msg_seq - 3 >= 1
    assert publisher.num_dropped_total == received[0].num_dropped


def test_close_sends_a_closing_heartbeat_last_and_only_then(tmp_path, monkeypatch):
    """The sidecar reads the silence after a closing heartbeat as a shutdown, not a death:
    the last message says so, with the queues of the last record, and no other does."""
    monkeypatch.setattr(publisher_module, "SEND_INTERVAL_S", 3600)  # only flush/close wake it
    address, pull = bound_pull(tmp_path)
    publisher = ZmqPublisher(address, 0, heartbeat_interval_s=3600)
    try:
        assert publisher.flush()  # the first heartbeat
        publisher.publish(decode_record(num_running_reqs=0, num_waiting_reqs=0))
        messages = close_and_receive(publisher, pull)
    finally:
        pull.close(linger=0)
    assert [type(m) for m in messages] == [Heartbeat, IterationRecord, Heartbeat]
    assert [m.closing for m in messages if type(m) is Heartbeat] == [False, True]
    assert is_clean_close(messages[-1]) and not is_clean_close(messages[0])
    assert not messages[-1].stop_requested


def test_a_publisher_told_to_stop_says_so_in_its_closing_heartbeat(tmp_path):
    """Closed with requests in flight, the heartbeat is a shutdown's only if it says the
    engine was told to stop (else a failed loop's, judged as a silence)."""
    address, pull = bound_pull(tmp_path)
    publisher = ZmqPublisher(address, 0, heartbeat_interval_s=3600)
    try:
        publisher.publish(decode_record(num_running_reqs=3))
        assert publisher.flush()
        messages = close_and_receive(publisher, pull, stop_requested=True)
    finally:
        pull.close(linger=0)
    last = messages[-1]
    assert (type(last), last.closing, last.stop_requested, last.num_running_reqs) == (
        Heartbeat,
        True,
        True,
        3,
    )
    assert is_clean_close(last)
    last.stop_requested = False
    assert not is_clean_close(last)


def test_heartbeat_reports_the_last_iteration_that_scheduled_work(tmp_path):
    """A loop spinning on empty iterations must not look like progress to the sidecar."""
    address, pull = bound_pull(tmp_path)
    publisher = ZmqPublisher(address, 0, heartbeat_interval_s=0.05)
    try:
        publisher.publish(decode_record(iteration=5))
        for iteration in range(6, 9):
            publisher.publish(
                decode_record(
                    iteration=iteration,
                    num_decode_reqs=0,
                    num_decode_tokens=0,
                    num_running_reqs=0,
                    num_waiting_reqs=3,
                )
            )
        assert publisher.flush()
        heartbeat = heartbeat_where(pull, lambda beat: beat.num_waiting_reqs == 3)
    finally:
        publisher.close()
        pull.close(linger=0)
    assert heartbeat is not None and heartbeat.last_iteration == 5


def test_the_record_fields_keep_their_wire_order():
    """The frame is an array in this order, and the hot paths (engine/core.py, the FPM
    mapping, the factory) construct records positionally in it: a field moved or inserted
    anywhere but the end breaks both."""
    assert IterationRecord.__struct_fields__ == (
        "engine_index",
        "msg_seq",
        "iteration",
        "start_ns",
        "elapsed_ns",
        "num_prefill_reqs",
        "num_prefill_tokens",
        "num_decode_reqs",
        "num_decode_tokens",
        "num_running_reqs",
        "num_waiting_reqs",
        "num_waiting_kv_reqs",
        "num_waiting_seq_limit_reqs",
        "num_waiting_budget_reqs",
        "num_kv_blocks_used",
        "num_kv_blocks_free",
        "num_kv_tokens",
        "num_prefix_query_tokens",
        "num_prefix_hit_tokens",
        "num_preemptions",
        "num_dropped",
        "milestones",
        "unknown",
        "num_waiting_other_reqs",
        "model_elapsed_ns",
        "fpm",
        "spec_decode",
        "first_token_latencies_ns",
    )
