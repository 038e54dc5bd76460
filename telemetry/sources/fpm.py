"""Forward-pass metrics (FPM) as iterscope records: the wire and the mapping, with no zmq.

SGLang (``--enable-forward-pass-metrics``), NVIDIA Dynamo (its instrumented vLLM scheduler
and relays) and an open vLLM pull request publish one FPM message per iteration on a ZMQ PUB
socket (the producer binds; a consumer SUBs with an empty subscription). Three frames:

    [b"" (topic), seq (8 bytes, big-endian, from 0 per publisher), msgpack map]

    {version: 1, worker_id: str, dp_rank: int, counter_id: int, wall_time: float (s),
     scheduled_requests: {num_prefill_requests, sum_prefill_tokens, var_prefill_length,
                          sum_prefill_kv_tokens, num_decode_requests, sum_decode_kv_tokens,
                          var_decode_kv_tokens},
     queued_requests: {num_prefill_requests, sum_prefill_tokens, var_prefill_length,
                       num_decode_requests, sum_decode_kv_tokens, var_decode_kv_tokens}}

``decode_frames`` turns the frames into ``(seq, ForwardPassMetrics)`` or names why it cannot
(one of the lane's undecodable reasons, so the caller counts it where lane frames are
counted): ``version`` for a version other than 1, ``oversized``, ``truncated``, else
``malformed``. Fields this module does not know are ignored. A message whose counts are all
zero is a heartbeat (``is_heartbeat``): producers send one after about a second without a
message (SGLang only while idle).

``to_record`` maps a message to an IterationRecord (docs/fpm.md has the table):

    record field                     FPM field
    num_prefill_reqs / _tokens       scheduled num_prefill_requests / sum_prefill_tokens
    num_decode_reqs / _tokens        scheduled num_decode_requests (one token each)
    num_running_reqs                 scheduled prefill + decode requests (the batch)
    num_waiting_reqs                 queued prefill + queued decode requests
    num_kv_tokens                    scheduled sum_prefill_kv_tokens + sum_prefill_tokens
                                     + sum_decode_kv_tokens: what the batch holds in KV
    elapsed_ns                       wall_time (its meaning depends on the producer:
                                     PRODUCERS); model_elapsed_ns too where it is GPU time
    fpm                              the rest (FpmFigures): the batch's prefill and decode
                                     KV tokens, the variances, the queued requests' sizes
    unknown                          waiting reasons, KV blocks, preemptions, milestones

The message carries no timestamp and no engine index: the caller places the record on its
own clock (``start_ns`` = receipt - elapsed) and numbers engines and messages itself
(telemetry/sidecar/fpm_engines.py).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from telemetry.lane.record import (
    SOURCE_FPM,
    UNKNOWN_KV_BLOCKS,
    UNKNOWN_MILESTONES,
    UNKNOWN_PREEMPTIONS,
    UNKNOWN_PREFIX_CACHE,
    UNKNOWN_WAITING_REASONS,
    FpmFigures,
    IterationRecord,
    Variance,
)

FPM_VERSION = 1
NUM_FRAMES = 3
SEQ_BYTES = 8
MAX_PAYLOAD_BYTES = 1 << 16  # a message is about 400 bytes; anything far above is not FPM
NS_PER_S = 1_000_000_000
# Every field FPM does not carry, marked unknown on every record (shown as unknown, never 0).
FPM_UNKNOWN = (
    UNKNOWN_WAITING_REASONS
    | UNKNOWN_KV_BLOCKS
    | UNKNOWN_PREEMPTIONS
    | UNKNOWN_MILESTONES
    | UNKNOWN_PREFIX_CACHE  # sum_prefill_kv_tokens mixes prefix hits with earlier chunks
)

# What wall_time measures, per producer (docs/fpm.md). The producer is not on the wire: the
# operator says it (iterscope sidecar --fpm-producer).
PRODUCERS = {
    "sglang": "GPU time of the forward pass on one stream",
    "dynamo-vllm": "time between two updates of Dynamo's instrumented vLLM scheduler",
    "vllm": "GPU time of execute_model (vLLM's pull request)",
    "unknown": "what the producer measures (not said)",
}
GPU_TIME_PRODUCERS = ("sglang", "vllm")  # wall_time is the model's part of the iteration
# Producers whose heartbeat says the engine is idle: SGLang sends one only while nothing runs
# or waits. Dynamo's publisher thread sends one after any second without a message, busy or
# not (a scheduler that stopped iterating included), and vLLM's pull request is not checked:
# their heartbeats say only that no iteration came (telemetry/sources/fpm_streams.py).
IDLE_HEARTBEAT_PRODUCERS = ("sglang",)

Count = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=86400.0)]  # NaN and infinities fail too


class ScheduledRequests(msgspec.Struct, gc=False):
    """The iteration's batch: prefill chunks and decodes."""

    num_prefill_requests: Count = 0
    sum_prefill_tokens: Count = 0  # prompt tokens computed in this iteration
    var_prefill_length: Variance = 0.0
    sum_prefill_kv_tokens: Count = 0  # KV the prefill requests already held (prefix, chunks)
    num_decode_requests: Count = 0
    sum_decode_kv_tokens: Count = 0  # the decode requests' context lengths
    var_decode_kv_tokens: Variance = 0.0


class QueuedRequests(msgspec.Struct, gc=False):
    """Requests waiting after the iteration was scheduled."""

    num_prefill_requests: Count = 0
    sum_prefill_tokens: Count = 0
    var_prefill_length: Variance = 0.0
    num_decode_requests: Count = 0
    sum_decode_kv_tokens: Count = 0
    var_decode_kv_tokens: Variance = 0.0


class ForwardPassMetrics(msgspec.Struct, gc=False):
    """One FPM message (a msgpack map: unknown keys are ignored)."""

    version: int
    scheduled_requests: ScheduledRequests
    queued_requests: QueuedRequests
    worker_id: str = ""
    dp_rank: Count = 0
    counter_id: Count = 0
    wall_time: Seconds = 0.0


class _Versioned(msgspec.Struct):
    version: int


_decoder = msgspec.msgpack.Decoder(ForwardPassMetrics)
_version_decoder = msgspec.msgpack.Decoder(_Versioned)


def decode_frames(frames: list[bytes]) -> tuple[int, ForwardPassMetrics] | str:
    """``(seq, message)`` of one FPM message, or why it is not one: 'malformed' (wrong
    frames, not an FPM map), 'truncated', 'oversized' or 'version' (a version other than 1).
    The topic frame is not checked: producers send it empty and a SUB with an empty
    subscription receives every topic alike."""
    if len(frames) != NUM_FRAMES or len(frames[1]) != SEQ_BYTES:
        return "malformed"
    payload = frames[2]
    if len(payload) > MAX_PAYLOAD_BYTES:
        return "oversized"
    try:
        message = _decoder.decode(payload)
    except msgspec.DecodeError as error:
        return _why_undecodable(payload, error)
    if message.version != FPM_VERSION:
        return "version"
    return int.from_bytes(frames[1], "big"), message


def _why_undecodable(payload: bytes, error: msgspec.DecodeError) -> str:
    """A map with a version other than 1 is 'version' whatever else it holds (a later schema
    may change any field); a payload cut short is 'truncated'; the rest 'malformed'."""
    if not isinstance(error, msgspec.ValidationError):
        return "truncated" if "truncated" in str(error) else "malformed"
    try:
        version = _version_decoder.decode(payload).version
    except msgspec.DecodeError:
        return "malformed"
    return "malformed" if version == FPM_VERSION else "version"


def is_heartbeat(message: ForwardPassMetrics) -> bool:
    """Every count zero: the producer's keep-alive, no iteration."""
    scheduled, queued = message.scheduled_requests, message.queued_requests
    return not (
        scheduled.num_decode_requests  # the most common first: it decides most messages
        or scheduled.num_prefill_requests
        or scheduled.sum_prefill_tokens
        or scheduled.sum_prefill_kv_tokens
        or scheduled.sum_decode_kv_tokens
        or queued.num_prefill_requests
        or queued.sum_prefill_tokens
        or queued.num_decode_requests
        or queued.sum_decode_kv_tokens
    )


def num_waiting_reqs(message: ForwardPassMetrics) -> int:
    """Queued prefill and decode requests (preempted decodes wait too)."""
    queued = message.queued_requests
    return queued.num_prefill_requests + queued.num_decode_requests


def num_running_reqs(message: ForwardPassMetrics) -> int:
    """The requests in the iteration's batch."""
    scheduled = message.scheduled_requests
    return scheduled.num_prefill_requests + scheduled.num_decode_requests


def to_record(
    message: ForwardPassMetrics,
    engine_index: int,
    msg_seq: int,
    iteration: int,
    received_ns: int,
    producer: str = "unknown",
    num_dropped: int = 0,
) -> IterationRecord:
    """The IterationRecord of one FPM message received at ``received_ns`` (the caller's
    monotonic clock): it started ``wall_time`` before that. ``producer`` (PRODUCERS) says
    whether wall_time is the model's GPU time as well; ``num_dropped``: messages lost just
    before it.

    The constructor with positional arguments, in the record's field order: this runs per
    message of the FPM ingest, and msgspec's constructor with this many keywords cost 0.9 us
    of its 3.3 (0.1 positional)."""
    scheduled = message.scheduled_requests
    queued = message.queued_requests
    elapsed = round(message.wall_time * NS_PER_S)  # elapsed_ns(), inlined
    return IterationRecord(
        engine_index,
        msg_seq,
        iteration,
        max(0, received_ns - elapsed),  # start_ns()
        elapsed,
        scheduled.num_prefill_requests,
        scheduled.sum_prefill_tokens,
        scheduled.num_decode_requests,  # num_decode_reqs
        scheduled.num_decode_requests,  # num_decode_tokens: one each
        scheduled.num_prefill_requests + scheduled.num_decode_requests,  # num_running_reqs()
        queued.num_prefill_requests + queued.num_decode_requests,  # num_waiting_reqs()
        0,  # num_waiting_kv_reqs, _seq_limit_reqs, _budget_reqs: unknown
        0,
        0,
        0,  # num_kv_blocks_used, _free: unknown
        0,
        scheduled.sum_prefill_kv_tokens  # num_kv_tokens
        + scheduled.sum_prefill_tokens
        + scheduled.sum_decode_kv_tokens,
        0,  # num_prefix_query_tokens, _hit_tokens: not carried
        0,
        0,  # num_preemptions: unknown
        num_dropped,
        [],  # milestones: unknown
        FPM_UNKNOWN,
        0,  # num_waiting_other_reqs
        elapsed if producer in GPU_TIME_PRODUCERS else 0,  # model_elapsed_ns
        figures(message),
    )


def elapsed_ns(message: ForwardPassMetrics) -> int:
    """The message's ``wall_time`` in ns."""
    return round(message.wall_time * NS_PER_S)


def start_ns(message: ForwardPassMetrics, received_ns: int) -> int:
    """When the message's iteration started on the receiver's clock: ``wall_time`` before
    its receipt (the receipt itself for a heartbeat, whose wall_time is 0)."""
    return max(0, received_ns - elapsed_ns(message))


def figures(message: ForwardPassMetrics) -> FpmFigures:
    """What the message says beyond the record's fields."""
    scheduled, queued = message.scheduled_requests, message.queued_requests
    return FpmFigures(
        num_prefill_kv_tokens=scheduled.sum_prefill_kv_tokens,
        num_decode_kv_tokens=scheduled.sum_decode_kv_tokens,
        var_prefill_length=scheduled.var_prefill_length,
        var_decode_kv_tokens=scheduled.var_decode_kv_tokens,
        num_queued_prefill_reqs=queued.num_prefill_requests,
        num_queued_prefill_tokens=queued.sum_prefill_tokens,
        var_queued_prefill_length=queued.var_prefill_length,
        num_queued_decode_reqs=queued.num_decode_requests,
        num_queued_decode_kv_tokens=queued.sum_decode_kv_tokens,
        var_queued_decode_kv_tokens=queued.var_decode_kv_tokens,
    )


def source_name(producer: str) -> str:
    """The engine's ``source`` fact: 'fpm', with the producer where the operator said it."""
    return SOURCE_FPM if producer == "unknown" else f"{SOURCE_FPM}-{producer}"


def producer_of(source: str) -> str | None:
    """The producer an engine's ``source`` fact names (source_name's inverse): 'unknown' for
    'fpm'; None when the engine is no FPM producer."""
    if source == SOURCE_FPM:
        return "unknown"
    producer = source.removeprefix(f"{SOURCE_FPM}-")
    return producer if producer != source and producer in PRODUCERS else None
