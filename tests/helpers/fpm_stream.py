"""A sidecar's `--fpm-port` read as an FPM consumer reads it, and its recording to check it
against (the live vLLM modules: tests/test_vllm_scheduler_live.py, tests/test_vllm_live.py).

Connect the FpmStream before the engine starts: a SUB receives nothing published before it
is connected, and its queue is unbounded here, so nothing is lost while other tests run.
"""

from __future__ import annotations

import time
from itertools import pairwise
from pathlib import Path

import msgspec
import zmq

from telemetry.lane.record import IterationRecord
from telemetry.lane.recording import Line
from telemetry.sources.fpm import (
    ForwardPassMetrics,
    ScheduledRequests,
    decode_frames,
    is_heartbeat,
    to_record,
)
from tests.helpers.wait import wait_until

# What a consumer gets back exactly from a vLLM source's record (docs/fpm.md's mapping).
COUNTS_GIVEN_BACK = (
    "elapsed_ns",
    "num_prefill_reqs",
    "num_prefill_tokens",
    "num_decode_reqs",
    "num_waiting_reqs",
)


def given_back(message: ForwardPassMetrics, record: IterationRecord, seq: int) -> IterationRecord:
    """The record iterscope's own FPM mapping makes of ``message``, checked to hold
    ``record``'s COUNTS_GIVEN_BACK. vLLM's records count the tokens a step produced, a
    prefill's first token included; FPM has no such count: a consumer reads one token per
    decoding request."""
    back = to_record(message, 0, seq, seq, received_ns=record.start_ns + record.elapsed_ns)
    for name in COUNTS_GIVEN_BACK:
        assert getattr(back, name) == getattr(record, name), (name, seq, message, record)
    assert back.num_decode_tokens == record.num_decode_reqs
    return back


def is_iteration(message: ForwardPassMetrics) -> bool:
    """A record's message, not one of the sidecar's heartbeats, which schedule nothing and
    have wall_time 0 (telemetry/sidecar/fpm_encode.py). A record that marks its time unknown
    and scheduled nothing the source could count would read as a heartbeat."""
    return message.wall_time > 0 or message.scheduled_requests != ScheduledRequests()


def is_idle(message: ForwardPassMetrics) -> bool:
    """An all-zero heartbeat: nothing scheduled, nothing queued, no time."""
    return is_heartbeat(message) and message.wall_time == 0


class FpmStream:
    """A SUB on ``tcp://127.0.0.1:PORT``, read with iterscope's own decoder:
    ``received`` holds (seq, message, when received) in order of receipt."""

    def __init__(self, port: int) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.connect(f"tcp://127.0.0.1:{port}")
        self.received: list[tuple[int, ForwardPassMetrics, float]] = []
        self.work_from = 0

    def receive(self, timeout_ms: int) -> bool:
        """One message, if one comes within ``timeout_ms``; it must decode."""
        if not self.socket.poll(timeout_ms):
            return False
        decoded = decode_frames(self.socket.recv_multipart())
        assert not isinstance(decoded, str), decoded
        self.received.append((*decoded, time.monotonic()))
        return True

    def drain(self) -> None:
        """What was published so far (by the tests before, say): the work waited for by
        ``wait_idle_after_work`` comes after it."""
        while self.receive(0):
            pass
        self.work_from = len(self.received)

    def wait_idle_after_work(self, timeout_s: float = 10) -> None:
        """Until an iteration came after the last ``drain`` and three all-zero heartbeats
        after the last iteration."""

        def idle_after_work() -> bool:
            if self.receive(100):
                while self.receive(0):
                    pass
            busy_at = [i for i, (_, m, _) in enumerate(self.received) if is_iteration(m)]
            if not busy_at or busy_at[-1] < self.work_from:
                return False
            tail = self.received[busy_at[-1] + 1 :][-3:]
            return len(tail) == 3 and all(is_idle(m) for _, m, _ in tail)

        wait_until(idle_after_work, timeout_s, "3 heartbeats after the requests")

    def check_one_stream(self, worker_id: str, dp_rank: int = 0) -> None:
        """One stream: seq from 0, +1 a message, counter_id the seq."""
        seqs = [seq for seq, _, _ in self.received]
        assert seqs == list(range(len(self.received)))
        assert {(m.worker_id, m.dp_rank, m.counter_id - seq) for seq, m, _ in self.received} == {
            (worker_id, dp_rank, 0)
        }

    def iterations(self) -> list[ForwardPassMetrics]:
        return [message for _, message, _ in self.received if is_iteration(message)]

    def check_idle_heartbeats(self) -> None:
        """The last three: all-zero heartbeats, about a second apart."""
        idle = self.received[-3:]
        assert len(idle) == 3 and all(is_idle(message) for _, message, _ in idle)
        for (_, _, before), (_, _, after) in pairwise(idle):
            assert 0.8 < after - before < 2.0, [at for _, _, at in idle]

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def recorded_iterations(recording: Path) -> list[IterationRecord]:
    lines = recording.read_bytes().splitlines()  # a fact may hold a space
    messages = [msgspec.json.decode(line, type=Line) for line in lines]  # notes too
    return [m for m in messages if type(m) is IterationRecord]


def wait_recorded(recording: Path, num_records: int) -> list[IterationRecord]:
    """The recording's iteration records once it holds at least ``num_records``."""

    def every_record_recorded() -> list[IterationRecord] | None:
        records = recorded_iterations(recording)
        return records if len(records) >= num_records else None

    return wait_until(every_record_recorded, 10, "the recording flushed")
