"""The FPM publisher sink (``--fpm-port``): iterscope records out as FPM messages, read back
by the sidecar's own FPM decoder through a real SUB socket (Dynamo's decoder reads them in
tests/test_fpm_producers_live.py)."""

from __future__ import annotations

import time

import zmq

from telemetry.lane.record import (
    UNKNOWN_ELAPSED,
    UNKNOWN_KV_TOKENS,
    UNKNOWN_PREFILL_REQS,
    iteration_record,
)
from telemetry.lane.record import heartbeat as lane_heartbeat
from telemetry.sidecar.engine_view import EngineStatus
from telemetry.sidecar.fpm_encode import from_record
from telemetry.sidecar.sinks.fpm_publisher import HEARTBEAT_AFTER_NS, FpmPublisherSink
from telemetry.sources.fpm import ForwardPassMetrics, decode_frames, is_heartbeat, to_record
from tests.helpers.lane import heartbeat
from tests.helpers.sink_feed import send, set_status
from tests.helpers.wait import wait_until

S = 1_000_000_000


class Clock:
    def __init__(self) -> None:
        self.now_ns = 5 * S

    def __call__(self) -> int:
        return self.now_ns


def mixed_record(msg_seq: int, engine_index: int = 0, **fields):
    """A chunked-prefill iteration beside decodes, every count distinct."""
    counts = dict(
        start_ns=1000,
        elapsed_ns=25_000_000,
        num_prefill_reqs=2,
        num_prefill_tokens=300,
        num_decode_reqs=7,
        num_decode_tokens=7,
        num_running_reqs=9,
        num_waiting_reqs=4,
        num_kv_tokens=2300,
    )
    return iteration_record(engine_index, msg_seq, msg_seq, **{**counts, **fields})


class Subscribed:
    """A sink bound on an ipc endpoint and a SUB connected to it, joined (PUB/SUB drops what
    is sent before the subscription arrives, so records go out until one comes back)."""

    def __init__(self, tmp_path, sndhwm: int = 1000, rcvhwm: int = 1000) -> None:
        self.context = zmq.Context()
        endpoint = f"ipc://{tmp_path / 'fpm-out.sock'}"
        self.clock = Clock()
        self.sink = FpmPublisherSink(endpoint, "w", sndhwm, self.context, self.clock)
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sub.connect(endpoint)
        send(self.sink, heartbeat(1, engine_index=0))

    def join(self) -> int:
        """Send records of engine 0 until one arrives; the next seq to expect."""
        return wait_until(lambda: self._probe(), 10, "the SUB to join")

    def _probe(self) -> int:
        send(self.sink, mixed_record(2))
        if self.sub.poll(20):
            while self.sub.poll(20):
                seq, _ = self.receive()
            return seq + 1
        return 0

    def receive(self) -> tuple[int, ForwardPassMetrics]:
        decoded = decode_frames(self.sub.recv_multipart())
        assert not isinstance(decoded, str), decoded
        return decoded

    def close(self) -> None:
        self.sink.close()
        self.sub.close(linger=0)
        self.context.term()


def test_a_record_becomes_an_fpm_message_that_maps_back_to_its_counts():
    original = mixed_record(3)
    message = from_record(original, "w", 0, 0)
    assert message.wall_time == 0.025
    assert message.scheduled_requests.sum_prefill_kv_tokens == 0
    assert message.scheduled_requests.sum_decode_kv_tokens == 2000  # 2300 - the 300 prefilled
    assert message.queued_requests.num_prefill_requests == 4
    back = to_record(message, 0, 1, 1, received_ns=10 * S)
    for field in (
        "elapsed_ns",
        "num_prefill_reqs",
        "num_prefill_tokens",
        "num_decode_reqs",
        "num_decode_tokens",
        "num_running_reqs",
        "num_waiting_reqs",
        "num_kv_tokens",
    ):
        assert getattr(back, field) == getattr(original, field), field


def test_kv_before_a_prefill_only_batch_is_the_prefills_own():
    message = from_record(mixed_record(3, num_decode_reqs=0, num_decode_tokens=0), "w", 0, 0)
    assert message.scheduled_requests.sum_prefill_kv_tokens == 2000
    assert message.scheduled_requests.sum_decode_kv_tokens == 0


def test_what_the_source_marked_unknown_is_published_as_zero_not_as_its_placeholder():
    unknown = UNKNOWN_ELAPSED | UNKNOWN_PREFILL_REQS | UNKNOWN_KV_TOKENS
    message = from_record(mixed_record(3, unknown=unknown), "w", 0, 0)
    assert message.wall_time == 0.0
    assert message.scheduled_requests.num_prefill_requests == 0
    assert message.scheduled_requests.sum_prefill_tokens == 300
    assert message.scheduled_requests.sum_decode_kv_tokens == 0


def test_each_engine_is_a_stream_numbered_from_zero_with_counter_id_the_seq(tmp_path):
    subscribed = Subscribed(tmp_path)
    try:
        next_seq = subscribed.join()
        send(subscribed.sink, heartbeat(1, engine_index=3))
        for msg_seq in range(3, 6):
            send(subscribed.sink, mixed_record(msg_seq), mixed_record(msg_seq, engine_index=3))
        received = [subscribed.receive() for _ in range(6)]
    finally:
        subscribed.close()
    by_rank: dict[int, list[int]] = {}
    for seq, message in received:
        assert message.counter_id == seq and message.worker_id == "w"
        by_rank.setdefault(message.dp_rank, []).append(seq)
    assert by_rank == {0: [next_seq, next_seq + 1, next_seq + 2], 3: [0, 1, 2]}


def test_a_silent_live_engine_heartbeats_each_second_and_a_dead_one_falls_silent(tmp_path):
    subscribed = Subscribed(tmp_path)
    sink, clock = subscribed.sink, subscribed.clock
    try:
        next_seq = subscribed.join()
        clock.now_ns += HEARTBEAT_AFTER_NS - 1
        sink.tick(0)
        assert not subscribed.sub.poll(50)  # under a second: nothing
        clock.now_ns += 1
        sink.tick(0)
        seq, message = subscribed.receive()
        assert seq == next_seq and message.wall_time == 0.0
        assert not is_heartbeat(message)  # the join's records left 9 running, 4 waiting
        assert message.queued_requests.num_prefill_requests == 4
        assert message.queued_requests.num_decode_requests == 9
        send(sink, lane_heartbeat(0, 9, 1, 1))  # the engine says it is idle now
        clock.now_ns += HEARTBEAT_AFTER_NS
        sink.tick(0)
        seq, message = subscribed.receive()
        assert seq == next_seq + 1 and is_heartbeat(message)
        set_status(sink, 0, EngineStatus.DEAD, 0)
        clock.now_ns += 5 * HEARTBEAT_AFTER_NS
        sink.tick(0)
        assert not subscribed.sub.poll(50)
    finally:
        subscribed.close()


def test_engines_that_came_in_as_fpm_are_not_published_again(tmp_path):
    subscribed = Subscribed(tmp_path)
    sink = subscribed.sink
    try:
        subscribed.join()
        send(sink, lane_heartbeat(5, 1, 1, 1, source="fpm-sglang"))
        send(sink, mixed_record(2, engine_index=5))
        subscribed.clock.now_ns += 3 * HEARTBEAT_AFTER_NS
        set_status(sink, 0, EngineStatus.DEAD, 0)
        sink.tick(0)
        assert not subscribed.sub.poll(100)
    finally:
        subscribed.close()


def test_an_evicted_engines_successor_starts_from_seq_zero(tmp_path):
    subscribed = Subscribed(tmp_path)
    sink = subscribed.sink
    try:
        assert subscribed.join() > 0
        sink.on_engine_removed(0, 60 * S)
        send(sink, heartbeat(1, engine_index=0), mixed_record(2))
        seq, _ = subscribed.receive()
    finally:
        subscribed.close()
    assert seq == 0


def test_a_subscriber_that_does_not_read_never_blocks_ingest_and_sees_gaps(tmp_path):
    subscribed = Subscribed(tmp_path, sndhwm=10, rcvhwm=10)
    sink = subscribed.sink
    try:
        first = subscribed.join()
        started = time.monotonic()
        for msg_seq in range(3, 50_003):
            send(sink, mixed_record(msg_seq))
        took_s = time.monotonic() - started
        seqs = []
        while subscribed.sub.poll(100):
            seqs.append(subscribed.receive()[0])
    finally:
        subscribed.close()
    assert took_s < 20  # no send waited for the reader
    assert sink.sidecar_counters() == {"fpm_messages_published": first + 50_000.0}
    assert seqs == sorted(seqs) and 0 < len(seqs) < 50_000
    assert seqs[-1] - seqs[0] + 1 > len(seqs)  # what the PUB dropped shows as seq gaps
