"""FPM producers as numbered engines: one engine per (worker_id, dp_rank), its messages
numbered as iterscope's lane numbers them.

An FPM message (telemetry/sources/fpm.py) names its producer by (worker_id, dp_rank) and
numbers its messages from 0 per publisher (Dynamo's recordings: ``counter_id``); a reader of
iterscope messages wants an engine index, a ``msg_seq`` from 1 that counts every message the
engine tried to send, and a Heartbeat before the first record. ``FpmStreams`` translates, per
(worker_id, dp_rank):

    engine index   the lowest index neither ``engines`` nor this class holds, when first met
    msg_seq        its own counter: +1 per message, + the lost ones when the FPM seq skips
                   (the message then carries ``num_dropped`` = the gap, so readers count them)
    Heartbeat      synthesized when a producer is met (or met again: a seq that goes back is
                   a restart, msg_seq starts at 1 again), with the facts: model name (given,
                   else the worker id) and source; an all-zero FPM message is a Heartbeat too,
                   with nothing waiting only from a producer whose heartbeat says it is idle
                   (fpm.IDLE_HEARTBEAT_PRODUCERS); from the others it says only that no
                   iteration came, so it carries the requests the last message left queued:
                   a scheduler that stops iterating while requests wait shows stalled, not
                   idle (one that stops with requests running and none queued cannot be told
                   from an idle one: FPM's last message counts the requests that finished too)

It hands each message to ``send`` and reads ``engines`` (the indexes whoever receives them
holds: the sidecar's Ingest live, telemetry/sidecar/fpm_engines.py; a plain set offline,
telemetry/sources/fpm_taps.py) to learn which engines were admitted.

Invariants:
- Messages the producer sent before we met it are not counted as lost: a subscriber never
  receives what was published before it connected, so the first seq seen may be above 0.
- An FPM seq more than ``max_seq_jump`` ahead is a suspect frame: ``on_message`` returns
  'seq_jump', nothing is sent, the producer's numbering is left as it was.
- State is bounded by ``engines``: a producer whose engine the receiver did not admit (or
  removed since) is forgotten here; 'engine_limit' when no index is free.
- Times are the caller's (``now_ns``, the receipt); FPM carries none. A heartbeat is placed
  where its message's iteration started (fpm.start_ns), so the one that introduces a
  producer with a busy message comes before that message's record in time too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container
from dataclasses import dataclass

from telemetry.lane.record import MAX_ENGINE_INDEX, Message, heartbeat
from telemetry.sources.fpm import (
    IDLE_HEARTBEAT_PRODUCERS,
    ForwardPassMetrics,
    is_heartbeat,
    num_running_reqs,
    num_waiting_reqs,
    source_name,
    start_ns,
    to_record,
)


@dataclass
class _Producer:
    """One (worker_id, dp_rank): its engine index and where its numbering stands."""

    engine_index: int
    last_fpm_seq: int = 0
    msg_seq: int = 0  # the last msg_seq given to one of its messages
    iteration: int = 0  # records made of its messages
    num_queued: int = 0  # requests its last iteration left queued


class FpmStreams:
    """FPM messages in, iterscope messages out. Single-threaded."""

    def __init__(
        self,
        engines: Container[int],
        send: Callable[[Message, int], None],
        max_seq_jump: int,
        model_name: str = "",
        producer: str = "unknown",
        wall_clock: Callable[[], int] = time.time_ns,
    ) -> None:
        """``engines``: the engine indexes the receiver of ``send(message, now_ns)`` holds.
        ``model_name``: every producer's model name (default: its worker id).
        ``producer``: who publishes (telemetry.sources.fpm.PRODUCERS), which says what
        ``wall_time`` means; kept in each engine's ``source``."""
        self._engines = engines
        self._send = send
        self._max_seq_jump = max_seq_jump
        self._model_name = model_name
        self._producer_name = producer
        self._source = source_name(producer)
        self._heartbeat_says_idle = producer in IDLE_HEARTBEAT_PRODUCERS
        self._wall_clock = wall_clock
        self._producers: dict[tuple[str, int], _Producer] = {}

    @property
    def num_producers(self) -> int:
        return len(self._producers)

    def on_message(self, seq: int, message: ForwardPassMetrics, now_ns: int) -> str | None:
        """One FPM message numbered ``seq``, received at ``now_ns``: numbered and sent; or
        why not ('seq_jump', 'engine_limit')."""
        key = (message.worker_id, message.dp_rank)
        producer = self._producers.get(key)
        # _is_tracked(producer), inlined: this runs once per message.
        if (
            producer is None
            or producer.engine_index not in self._engines
            or seq <= producer.last_fpm_seq
        ):
            if producer is None:
                index = self._free_index()
                if index is None:
                    return "engine_limit"
                producer = _Producer(index)
            if self._meet(key, producer, message, seq, now_ns) and not is_heartbeat(message):
                self._send_record(producer, message, now_ns, 0)
            return None
        num_lost = seq - producer.last_fpm_seq - 1
        if num_lost > self._max_seq_jump:
            return "seq_jump"
        producer.last_fpm_seq = seq
        producer.msg_seq += num_lost
        if is_heartbeat(message):
            self._send_heartbeat(producer, key, message, now_ns, num_lost)
        else:
            self._send_record(producer, message, now_ns, num_lost)
        return None

    def _is_tracked(self, producer: _Producer) -> bool:
        return producer.engine_index in self._engines

    def _meet(
        self,
        key: tuple[str, int],
        producer: _Producer,
        message: ForwardPassMetrics,
        seq: int,
        now_ns: int,
    ) -> bool:
        """A producer met for the first time, again after the receiver let its engine go, or
        restarted (its seq went back): a Heartbeat with msg_seq 1 introduces it. False when
        the receiver did not admit it (it counts that itself)."""
        producer.last_fpm_seq, producer.msg_seq, producer.num_queued = seq, 0, 0
        self._send_heartbeat(producer, key, message, now_ns, 0)
        self._producers[key] = producer
        self._forget_untracked()  # this one if refused, any the receiver evicted to admit it
        return self._is_tracked(producer)

    def _forget_untracked(self) -> None:
        """Drop the producers whose engine the receiver no longer holds (evicted or refused),
        so there are never more than the engines it holds."""
        for key in [key for key, p in self._producers.items() if not self._is_tracked(p)]:
            del self._producers[key]

    def _free_index(self) -> int | None:
        """The lowest engine index neither the receiver nor a producer here holds."""
        held = {p.engine_index for p in self._producers.values()}
        for index in range(MAX_ENGINE_INDEX + 1):
            if index not in held and index not in self._engines:
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
        """Progress from the producer's last record, queues from ``message`` (all zero for
        the producer's own heartbeat: then what its last iteration left queued, unless its
        heartbeats say it is idle), the clock anchor read now (at the iteration's start), the
        facts."""
        producer.msg_seq += 1
        ts_ns = start_ns(message, now_ns)
        num_waiting = num_waiting_reqs(message)
        if not num_waiting and not self._heartbeat_says_idle:
            num_waiting = producer.num_queued
        beat = heartbeat(
            producer.engine_index,
            producer.msg_seq,
            ts_ns,
            self._wall_clock() - (now_ns - ts_ns),
            last_iteration=producer.iteration,
            num_waiting_reqs=num_waiting,
            num_running_reqs=num_running_reqs(message),
            num_dropped=num_lost,
            model_name=self._model_name or key[0],
            source=self._source,
        )
        self._send(beat, now_ns)

    def _send_record(
        self, producer: _Producer, message: ForwardPassMetrics, now_ns: int, num_lost: int
    ) -> None:
        producer.msg_seq += 1
        producer.iteration += 1
        queued = message.queued_requests
        producer.num_queued = queued.num_prefill_requests + queued.num_decode_requests
        record = to_record(
            message,
            producer.engine_index,
            producer.msg_seq,
            producer.iteration,
            now_ns,
            self._producer_name,
            num_lost,
        )
        self._send(record, now_ns)
