"""iterscope records as forward-pass metrics (FPM) messages: the reverse of the mapping in
telemetry/sources/fpm.py.

The sidecar publishes one FPM message per record of an engine on its lane
(telemetry/sidecar/sinks/fpm_publisher.py), so any FPM consumer (Dynamo's planner, another
iterscope sidecar's ``--fpm``) reads iterscope's engine and the vLLM sources. This module
builds the message and its frames; it holds no socket. What is exact and what approximated
(docs/fpm.md has the table):

    FPM field                          from the record
    wall_time                          elapsed_ns (exact; 0 where the source marks it unknown)
    scheduled num_prefill_requests     num_prefill_reqs (exact; 0 where unknown)
      sum_prefill_tokens               num_prefill_tokens (exact)
      num_decode_requests              num_decode_reqs (exact)
      sum_prefill_kv_tokens,           num_kv_tokens - num_prefill_tokens: the KV the batch
      sum_decode_kv_tokens             held before the iteration's prefill, all of it on the
                                       decodes when there are any, else on the prefills
                                       (approximated: running requests not scheduled in the
                                       iteration are in it; 0 where unknown)
      var_prefill_length,              0 (not measured: records carry no per-request lengths)
      var_decode_kv_tokens
    queued num_prefill_requests        num_waiting_reqs (preempted requests included)
      num_decode_requests, the sums    0 (not measured)

so fpm.to_record gives back the record's counts, KV tokens included.

A heartbeat (``idle_message``) schedules nothing and carries the engine's queues: waiting
requests as queued prefills, running ones (an engine stalled, no iteration for a second) as
queued decodes. It is all-zero, a heartbeat in FPM's sense, exactly when the engine is idle.
"""

from __future__ import annotations

import msgspec

from telemetry.lane.record import (
    UNKNOWN_ELAPSED,
    UNKNOWN_KV_TOKENS,
    UNKNOWN_PREFILL_REQS,
    IterationRecord,
)
from telemetry.sources.fpm import (
    NS_PER_S,
    SEQ_BYTES,
    ForwardPassMetrics,
    QueuedRequests,
    ScheduledRequests,
)

TOPIC = b""  # FPM producers publish on the empty topic

_encoder = msgspec.msgpack.Encoder()


def kv_split(record: IterationRecord) -> tuple[int, int]:
    """(sum_prefill_kv_tokens, sum_decode_kv_tokens): the KV held before this iteration's
    prefill tokens, on the decodes when the batch has any, else on the prefills."""
    if record.unknown & UNKNOWN_KV_TOKENS:
        return 0, 0
    held = max(0, record.num_kv_tokens - record.num_prefill_tokens)
    return (0, held) if record.num_decode_reqs else (held, 0)


def from_record(
    record: IterationRecord, worker_id: str, dp_rank: int, counter_id: int
) -> ForwardPassMetrics:
    """The FPM message of one iteration record (the module docstring says what is exact)."""
    prefill_kv, decode_kv = kv_split(record)
    unknown = record.unknown
    scheduled = ScheduledRequests(
        num_prefill_requests=0 if unknown & UNKNOWN_PREFILL_REQS else record.num_prefill_reqs,
        sum_prefill_tokens=record.num_prefill_tokens,
        sum_prefill_kv_tokens=prefill_kv,
        num_decode_requests=record.num_decode_reqs,
        sum_decode_kv_tokens=decode_kv,
    )
    elapsed_ns = 0 if unknown & UNKNOWN_ELAPSED else record.elapsed_ns
    return ForwardPassMetrics(
        version=1,
        scheduled_requests=scheduled,
        queued_requests=QueuedRequests(num_prefill_requests=record.num_waiting_reqs),
        worker_id=worker_id,
        dp_rank=dp_rank,
        counter_id=counter_id,
        wall_time=elapsed_ns / NS_PER_S,
    )


def idle_message(
    worker_id: str,
    dp_rank: int,
    counter_id: int,
    num_waiting_reqs: int = 0,
    num_running_reqs: int = 0,
) -> ForwardPassMetrics:
    """A heartbeat: nothing scheduled, the engine's queues as queued requests (all zero when
    it is idle)."""
    queued = QueuedRequests(
        num_prefill_requests=num_waiting_reqs, num_decode_requests=num_running_reqs
    )
    return ForwardPassMetrics(
        version=1,
        scheduled_requests=ScheduledRequests(),
        queued_requests=queued,
        worker_id=worker_id,
        dp_rank=dp_rank,
        counter_id=counter_id,
    )


def frames(seq: int, message: ForwardPassMetrics) -> tuple[bytes, bytes, bytes]:
    """The three frames: the empty topic, ``seq`` as 8 bytes big-endian, the msgpack map."""
    return TOPIC, seq.to_bytes(SEQ_BYTES, "big"), _encoder.encode(message)
