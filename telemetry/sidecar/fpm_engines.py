"""FPM producers as engines of an Ingest: one engine per (worker_id, dp_rank), numbered here.

An FPM message (telemetry/sources/fpm.py) names its producer by (worker_id, dp_rank) and
numbers its messages from 0 per publisher; Ingest wants an engine index, a ``msg_seq`` from 1
that counts every message the engine tried to send, and a Heartbeat before the first record.
``FpmEngines`` translates, per (worker_id, dp_rank):

    engine index   the lowest index neither Ingest nor this class holds, when first met
    msg_seq        its own counter: +1 per message, + the lost ones when the FPM seq skips
                   (the message then carries ``num_dropped`` = the gap, so Ingest counts them)
    Heartbeat      synthesized when a producer is met (or met again: a seq that goes back is
                   a restart, msg_seq starts at 1 again), with the facts: model name (a flag,
                   else the worker id) and source; an all-zero FPM message is a Heartbeat too

Invariants:
- Messages the producer sent before we met it are not counted as lost: a subscriber never
  receives what was published before it connected, so the first seq seen may be above 0.
- An FPM seq more than ``max_seq_jump`` ahead is a suspect frame: counted as rejected
  ('seq_jump'), nothing passed on, the producer's numbering left as it was.
- State is bounded by Ingest's ``max_engines``: a producer whose engine Ingest did not admit
  (or removed since) is forgotten here.
- Times are the caller's monotonic clock (``now_ns``, the receipt); FPM carries none.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from telemetry.lane.record import MAX_ENGINE_INDEX, Heartbeat, heartbeat
from telemetry.sidecar.engine_tracker import MAX_SEQ_JUMP
from telemetry.sidecar.ingest import Ingest
from telemetry.sources.fpm import (
    ForwardPassMetrics,
    decode_frames,
    is_heartbeat,
    source_name,
    to_record,
)


@dataclass
class _Producer:
    """One (worker_id, dp_rank): its engine index and where its numbering stands."""

    engine_index: int
    last_fpm_seq: int = 0
    msg_seq: int = 0  # the last msg_seq given to one of its messages
    iteration: int = 0  # records made of its messages


class FpmEngines:
    """FPM frames in, Ingest messages out. Single-threaded, like the Ingest it feeds."""

    def __init__(
        self,
        ingest: Ingest,
        model_name: str = "",
        producer: str = "unknown",
        max_seq_jump: int = MAX_SEQ_JUMP,
        wall_clock: Callable[[], int] = time.time_ns,
    ) -> None:
        """``model_name``: every producer's model name (default: its worker id).
        ``producer``: who publishes (telemetry.sources.fpm.PRODUCERS), which says what
        ``wall_time`` means; kept in each engine's ``source``."""
        self._ingest = ingest
        self._model_name = model_name
        self._producer_name = producer
        self._source = source_name(producer)
        self._max_seq_jump = max_seq_jump
        self._wall_clock = wall_clock
        self._producers: dict[tuple[str, int], _Producer] = {}

    @property
    def num_producers(self) -> int:
        return len(self._producers)

    def on_frames(self, frames: list[bytes], now_ns: int) -> None:
        """One FPM message's frames, received at ``now_ns``: decoded, numbered, ingested;
        or counted as undecodable or rejected by reason."""
        self._ingest.count_frame()
        decoded = decode_frames(frames)
        if isinstance(decoded, str):
            self._ingest.count_undecodable(decoded)
            return
        seq, message = decoded
        key = (message.worker_id, message.dp_rank)
        producer = self._producers.get(key)
        if producer is None or not self._is_tracked(producer) or seq <= producer.last_fpm_seq:
            producer = self._meet(key, message, seq, now_ns)
            if producer is not None and not is_heartbeat(message):
                self._send_record(producer, message, now_ns, 0)
            return
        num_lost = seq - producer.last_fpm_seq - 1
        if num_lost > self._max_seq_jump:
            self._ingest.count_rejected("seq_jump")
            return
        producer.last_fpm_seq = seq
        producer.msg_seq += num_lost
        if is_heartbeat(message):
            self._send_heartbeat(producer, key, message, now_ns, num_lost)
        else:
            self._send_record(producer, message, now_ns, num_lost)

    def _is_tracked(self, producer: _Producer) -> bool:
        return producer.engine_index in self._ingest.engines

    def _meet(
        self, key: tuple[str, int], message: ForwardPassMetrics, seq: int, now_ns: int
    ) -> _Producer | None:
        """A producer met for the first time, again after Ingest let its engine go, or
        restarted (its seq went back): a Heartbeat with msg_seq 1 introduces it to Ingest.
        None when Ingest did not admit it (--max-engines: Ingest counts that)."""
        producer = self._producers.get(key)
        if producer is None:
            index = self._free_index()
            if index is None:
                self._ingest.count_rejected("engine_limit")
                return None
            producer = _Producer(index)
        producer.last_fpm_seq, producer.msg_seq = seq, 0
        self._send_heartbeat(producer, key, message, now_ns, 0)
        self._producers[key] = producer
        self._forget_untracked()  # this one if refused, any Ingest evicted to admit it
        return producer if self._is_tracked(producer) else None

    def _forget_untracked(self) -> None:
        """Drop the producers whose engine Ingest no longer tracks (evicted or refused), so
        there are never more than the engines Ingest tracks."""
        for key in [key for key, p in self._producers.items() if not self._is_tracked(p)]:
            del self._producers[key]

    def _free_index(self) -> int | None:
        """The lowest engine index neither Ingest nor a producer here holds."""
        held = {p.engine_index for p in self._producers.values()}
        for index in range(MAX_ENGINE_INDEX + 1):
            if index not in held and index not in self._ingest.engines:
                return index
        return None

    def _send_heartbeat(
        self,
        producer: _Producer,
        key: tuple[str, int],
        message: ForwardPassMetrics,
        now_ns: int,
        num_lost: int,
    ) -> None:
        producer.msg_seq += 1
        self._ingest.on_message(self._heartbeat(producer, key, message, now_ns, num_lost), now_ns)

    def _heartbeat(
        self,
        producer: _Producer,
        key: tuple[str, int],
        message: ForwardPassMetrics,
        now_ns: int,
        num_lost: int,
    ) -> Heartbeat:
        """Progress from the producer's last record, queues from ``message`` (all zero for
        the producer's own heartbeat), the clock anchor read now, the facts."""
        queued, scheduled = message.queued_requests, message.scheduled_requests
        return heartbeat(
            producer.engine_index,
            producer.msg_seq,
            now_ns,
            self._wall_clock(),
            last_iteration=producer.iteration,
            num_waiting_reqs=queued.num_prefill_requests + queued.num_decode_requests,
            num_running_reqs=scheduled.num_prefill_requests + scheduled.num_decode_requests,
            num_dropped=num_lost,
            model_name=self._model_name or key[0],
            source=self._source,
        )

    def _send_record(
        self, producer: _Producer, message: ForwardPassMetrics, now_ns: int, num_lost: int
    ) -> None:
        producer.msg_seq += 1
        producer.iteration += 1
        record = to_record(
            message,
            producer.engine_index,
            producer.msg_seq,
            producer.iteration,
            now_ns,
            self._producer_name,
        )
        record.num_dropped = num_lost
        self._ingest.on_message(record, now_ns)
