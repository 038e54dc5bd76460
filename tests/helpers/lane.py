"""Lane messages made by hand (iteration records, heartbeats, their wire encoding) and a
sink that records every call, for the sidecar's tests."""

from __future__ import annotations

from telemetry.lane.record import IterationRecord, iteration_record, make_encoder
from telemetry.lane.record import heartbeat as lane_heartbeat
from telemetry.sidecar.sink import Sink


def synthetic_record(
    engine_index: int,
    iteration: int,
    start_ns: int,
    elapsed_ns: int,
    num_running_reqs: int = 8,
    num_waiting_reqs: int = 2,
) -> IterationRecord:
    """A steady decode iteration: one generation token per running request."""
    return iteration_record(
        engine_index,
        0,
        iteration,
        start_ns=start_ns,
        elapsed_ns=elapsed_ns,
        num_decode_reqs=num_running_reqs,
        num_decode_tokens=num_running_reqs,
        num_running_reqs=num_running_reqs,
        num_waiting_reqs=num_waiting_reqs,
        num_waiting_kv_reqs=num_waiting_reqs,
        num_kv_blocks_used=100,
        num_kv_blocks_free=900,
        num_kv_tokens=1600,
    )


class RecordingSink(Sink):
    """Remembers every call, in order, and the losses each message's engine view newly holds
    (what Ingest counted before handing the message over): ("dropped", engine, num) and
    ("conflict", engine, pids) just before that message."""

    def __init__(self):
        self.calls = []
        self.closed = False
        self._seen: dict[int, tuple[int, int]] = {}  # engine -> (dropped, conflicts) seen

    def _note_losses(self, engine):
        dropped, conflicts = self._seen.get(engine.engine_index, (0, 0))
        if engine.num_dropped_total > dropped:
            self.calls.append(("dropped", engine.engine_index, engine.num_dropped_total - dropped))
        if engine.num_engine_conflicts > conflicts:
            self.calls.append(("conflict", engine.engine_index, engine.conflicting_pids))
        self._seen[engine.engine_index] = (engine.num_dropped_total, engine.num_engine_conflicts)

    def on_iteration(self, record, engine):
        self._note_losses(engine)
        self.calls.append(("iteration", record.engine_index, record.msg_seq))

    def on_heartbeat(self, heartbeat, engine):
        self._note_losses(engine)
        self.calls.append(("heartbeat", heartbeat.engine_index, heartbeat.msg_seq))

    def on_status(self, engine_index, status, now_ns):
        self.calls.append(("status", engine_index, status, now_ns))

    def tick(self, now_ns):
        pass

    def close(self):
        self.closed = True

    def of(self, kind):
        return [call[1:] for call in self.calls if call[0] == kind]


def record(msg_seq, engine_index=0, iteration=None, num_dropped=0, **overrides):
    message = synthetic_record(engine_index, iteration or msg_seq, 1000 * msg_seq, 100, **overrides)
    message.msg_seq = msg_seq
    message.num_dropped = num_dropped
    return message


def heartbeat(
    msg_seq,
    engine_index=0,
    last_iteration=0,
    waiting=0,
    running=0,
    num_dropped=0,
    pid=0,
    closing=False,
    stop_requested=False,
):
    return lane_heartbeat(
        engine_index,
        msg_seq,
        msg_seq,
        msg_seq,
        last_iteration=last_iteration,
        num_waiting_reqs=waiting,
        num_running_reqs=running,
        num_dropped=num_dropped,
        pid=pid,
        closing=closing,
        stop_requested=stop_requested,
    )


def encode(message):
    return make_encoder().encode(message)
