"""The wire schema of the telemetry lane: what the engine core sends, one frame per message.

Every frame is one msgpack array (msgspec, ``array_like=True``) whose first element is an
integer tag = SCHEMA_VERSION * 16 + kind, so a frame from another schema version is told
apart from garbage without decoding the rest:

    [17, engine_index, msg_seq, iteration, start_ns, elapsed_ns, ...]   IterationRecord (kind 1)
    [18, engine_index, msg_seq, ts_ns, wall_ns, ...]                     Heartbeat       (kind 2)

Invariants the sidecar relies on:
- ``msg_seq`` counts every message an engine *tried* to send on the lane (records and heartbeats
  share one counter), starting at 1. A gap in ``msg_seq`` is a lost message.
- ``num_dropped`` is how many messages the engine failed to send (full queue) since the last
  one it did send. Gaps the engine knows of are therefore exact; the rest were lost in transit.
- Times are the engine's ``time.monotonic_ns()``; every Heartbeat pairs ``ts_ns`` with
  ``wall_ns`` (``time.time_ns()``) read back to back, the clock anchor that converts the first
  into the second.
- A steady-state decode record (no milestones) encodes to well under 96 bytes.
- Waiting requests are split by what held them: KV capacity, the sequence limit, the token
  budget, or ``num_waiting_other_reqs``: requests a source holds back, not for a limit (a
  vLLM request blocked on a structured-output grammar, a remote KV transfer or streaming
  input; vLLM paused, or holding prompts for its prefill cadence). Our own engine has none of
  the last kind.
- ``unknown`` holds UNKNOWN_* bits for the fields a source cannot fill (a vLLM server
  reports no waiting reasons, for example). Such a field is sent as 0 and every reader shows
  it as unknown, never as a measured 0. Our own engine knows every field (``unknown`` = 0).
  Fields added since the first release (``unknown``, ``num_waiting_other_reqs``,
  ``model_elapsed_ns``, ``fpm``, ``spec_decode``, ``first_token_latencies_ns``, the
  Heartbeat's ``source``, ``prefill_schedule_interval``, ``engine_version``,
  ``num_speculative_tokens``, ``step_tokens``, ``dtype`` and ``max_model_len``) come last
  with a default, so frames of older senders still decode, and readers that predate a field
  ignore it (msgspec skips an array-like frame's extra trailing elements).
- ``fpm`` holds what a forward-pass-metrics producer says beyond the record's own fields
  (FpmFigures); None for every other source, which costs our engine's frame one byte.
- ``spec_decode`` counts speculative decoding's draft tokens scored and accepted in the
  iteration (SpecDecodeCounts, from vLLM's sources); None where no draft was scored (our
  engine has no speculative decoding). A decoding request then produces 1 + its accepted
  tokens in one iteration, so ``num_decode_tokens`` can exceed ``num_decode_reqs``, and the
  iteration computed ``num_decode_reqs + num_draft_tokens`` decode tokens.
- Each request's TTFT is counted once: at its EVENT_FIRST_TOKEN milestone, or, where the
  source could not name the request then (vLLM's stat-logger plugin), in the
  ``first_token_latencies_ns`` of the iteration of its first token, its finish milestone
  then carrying EVENT_TTFT_SENT.

Build messages with ``iteration_record`` and ``heartbeat``, which name only the fields a caller
sets and make every other count 0. The defaults live in these factories, not on the Structs:
msgspec fills the missing trailing elements of an array-like frame with the Struct's defaults,
so a default on every count would let a frame cut short after its first elements decode as a
valid message instead of being rejected as malformed. The counts stay required on the wire;
only the trailing fields that were already optional there (``num_dropped``, ``milestones``,
``unknown``, the Heartbeat's static facts) keep Struct defaults.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

SCHEMA_VERSION = 1
KIND_ITERATION = 1
KIND_HEARTBEAT = 2
TAG_ITERATION = SCHEMA_VERSION * 16 + KIND_ITERATION
TAG_HEARTBEAT = SCHEMA_VERSION * 16 + KIND_HEARTBEAT
MAX_ENGINE_INDEX = 4095  # the sidecar drops other indexes (bounds the state garbage can create)

# Counts and times are never negative: the typed decoder rejects a frame that says otherwise
# (counted as malformed), so garbage cannot make a Prometheus counter go down. Nor above a
# signed 64-bit integer, which the analysis' columns hold (a recording's line saying more is
# unreadable, not a crash).
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
# A variance of token counts: finite (NaN and infinities fail), tokens squared.
Variance = Annotated[float, msgspec.Meta(ge=0.0, le=1e18)]

# RequestMilestone.event bits
EVENT_FIRST_TOKEN = 1
EVENT_FINISHED = 2
# With EVENT_FIRST_TOKEN: the request's TTFT went out before, unnamed, in the iteration of its
# first token (IterationRecord.first_token_latencies_ns); readers count it there, once.
EVENT_TTFT_SENT = 4

# RequestMilestone.finish_reason values (engine.request.FinishReason; the same indexes as
# vLLM's FinishReason, whose error and repetition our engine never sends), -1 = not finished
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
FINISH_ABORT = FINISH_REASONS.index("abort")  # a client that gave up, an engine that stopped

# Heartbeat.source: who fills the messages (our engine, vLLM's engine core through our
# scheduler subclass, vLLM's API server through our stat-logger plugin, a forward-pass
# metrics producer through the sidecar's FPM ingest: "fpm", or "fpm-<producer>" where the
# operator said which, telemetry/sources/fpm.py)
SOURCE_ITERSCOPE = "iterscope"
SOURCE_VLLM_SCHEDULER = "vllm-scheduler"
SOURCE_VLLM_STAT_LOGGER = "vllm-stat-logger"
SOURCE_FPM = "fpm"
SOURCES = (SOURCE_ITERSCOPE, SOURCE_VLLM_SCHEDULER, SOURCE_VLLM_STAT_LOGGER, SOURCE_FPM)

# IterationRecord.unknown bits: fields the source does not give (sent as 0, shown as unknown)
UNKNOWN_PREFILL_REQS = 1  # num_prefill_reqs
UNKNOWN_ELAPSED = 2  # elapsed_ns (start_ns is then when the source saw the iteration end)
UNKNOWN_WAITING_REASONS = 4  # num_waiting_{kv,seq_limit,budget,other}_reqs
UNKNOWN_KV_TOKENS = 8  # num_kv_tokens
# Set by sources that give none of these at all (FPM); readers that predate a bit ignore it.
UNKNOWN_KV_BLOCKS = 16  # num_kv_blocks_used, num_kv_blocks_free
UNKNOWN_PREEMPTIONS = 32  # num_preemptions
UNKNOWN_MILESTONES = 64  # milestones: the source reports no request lifecycles
UNKNOWN_PREFIX_CACHE = 128  # num_prefix_query_tokens, num_prefix_hit_tokens


class RequestMilestone(msgspec.Struct, array_like=True, gc=False, omit_defaults=False):
    """A request that produced its first token and/or finished in this iteration.

    Sent twice per request at most: once at the first token (so TTFT is seen early) and once
    at the finish, which carries the whole lifecycle. ``event`` holds EVENT_* bits; both bits
    are set when a request finishes in the iteration of its first token. A source that learns
    which request had its first token only at the finish (vLLM's stat-logger plugin) sends the
    TTFT unnamed when it happens and sets EVENT_TTFT_SENT on the finish.
    """

    request_id: str
    event: Count
    arrival_ns: Count
    first_scheduled_ns: Count
    first_token_ns: Count
    finished_ns: Count  # 0 until finished
    num_prompt_tokens: Count
    num_cached_tokens: Count
    num_output_tokens: Count
    num_preemptions: Count
    finish_reason: int  # index into FINISH_REASONS, -1 until finished
    traceparent: str = ""
    # Only on the finish milestone: when the request was preempted, and its prefill chunks as
    # [start_ns, end_ns, num_tokens]; empty otherwise.
    preempted_ns: list[int] = []
    prefill_chunks: list[tuple[int, int, int]] = []


class FpmFigures(msgspec.Struct, array_like=True, gc=False):
    """What an FPM message carries beyond the record's fields (telemetry/sources/fpm.py): the
    KV split between the batch's prefills and decodes, the spread of request sizes, and the
    size of what waits. Variances are over the requests, in tokens squared."""

    num_prefill_kv_tokens: Count  # KV the scheduled prefills already held (prefix, chunks)
    num_decode_kv_tokens: Count  # the scheduled decodes' context (prompt + output so far)
    var_prefill_length: Variance
    var_decode_kv_tokens: Variance
    num_queued_prefill_reqs: Count
    num_queued_prefill_tokens: Count
    var_queued_prefill_length: Variance
    num_queued_decode_reqs: Count  # preempted decodes waiting to resume
    num_queued_decode_kv_tokens: Count
    var_queued_decode_kv_tokens: Variance


class SpecDecodeCounts(msgspec.Struct, array_like=True, gc=False):
    """Speculative decoding in one iteration, as vLLM's scheduler counts it (SpecDecodingStats
    of the step): the drafts the model scored and how many of their tokens it accepted. An
    accepted token is an output token beyond the one each decoding request gets anyway."""

    num_drafts: Count  # requests whose draft tokens were scored
    num_draft_tokens: Count  # draft tokens scored (scheduled beside the decode tokens)
    num_accepted_tokens: Count  # of those, accepted
    # Accepted tokens by their position in the draft (first draft token first); a draft is
    # accepted up to its first rejected token, so the counts never rise along the list.
    num_accepted_tokens_per_pos: list[Count] = []


class IterationRecord(msgspec.Struct, array_like=True, gc=False, tag=TAG_ITERATION):
    """One engine-core iteration (schedule + forward + update), filled from scheduler counts."""

    engine_index: Count
    msg_seq: Count
    iteration: Count
    start_ns: Count
    elapsed_ns: Count
    # What was scheduled, by phase: prefill (prompt tokens computed, chunks included) and
    # decode (requests, and the tokens they produced: one each, more with speculative
    # decoding, see spec_decode).
    num_prefill_reqs: Count
    num_prefill_tokens: Count
    num_decode_reqs: Count
    num_decode_tokens: Count
    # Queues after scheduling. Waiting is split by why admission stopped.
    num_running_reqs: Count
    num_waiting_reqs: Count
    num_waiting_kv_reqs: Count  # blocked by KV capacity
    num_waiting_seq_limit_reqs: Count  # blocked by max_num_seqs
    num_waiting_budget_reqs: Count  # blocked by max_num_batched_tokens
    # KV cache after the iteration.
    num_kv_blocks_used: Count
    num_kv_blocks_free: Count
    num_kv_tokens: Count
    # Prefix cache, counted in tokens, for requests admitted this iteration.
    num_prefix_query_tokens: Count
    num_prefix_hit_tokens: Count
    num_preemptions: Count
    num_dropped: Count = 0  # messages the engine failed to send since the last one it sent
    milestones: list[RequestMilestone] = []
    unknown: Count = 0  # UNKNOWN_* bits: fields this source does not give
    num_waiting_other_reqs: Count = 0  # held back by the source itself (see the module doc)
    # The model's part of elapsed_ns (forward pass and sampling); 0 = not measured (older
    # senders). Ours: the runner's execute; vLLM's scheduler source: schedule() returned ->
    # update_from_output() called.
    model_elapsed_ns: Count = 0
    fpm: FpmFigures | None = None  # FPM producers only (see the module doc)
    spec_decode: SpecDecodeCounts | None = None  # drafts scored this iteration, else None
    # The TTFT of each request whose first token came in this iteration, where the source
    # cannot name the request yet (vLLM's stat-logger plugin: vLLM's own values); those
    # requests' finish milestones carry EVENT_TTFT_SENT.
    first_token_latencies_ns: list[Count] = []


def is_known(record: IterationRecord, unknown_bit: int) -> bool:
    """False when the record's source marked the field(s) of ``unknown_bit`` as unknown."""
    return not record.unknown & unknown_bit


class Heartbeat(msgspec.Struct, array_like=True, gc=False, tag=TAG_HEARTBEAT):
    """About once a second, from a thread of its own: progress, clock anchor, static facts."""

    engine_index: Count
    msg_seq: Count
    ts_ns: Count  # monotonic
    wall_ns: Count  # time.time_ns(), read right after ts_ns
    last_iteration: Count  # the last iteration that scheduled work (0 = none yet)
    num_waiting_reqs: Count
    num_running_reqs: Count
    num_dropped: Count = 0
    # Static facts, repeated so a restarted sidecar learns them within a second.
    model_name: str = ""
    device_name: str = ""  # "GPU" on CUDA, else the device type in capitals, e.g. "CPU"
    block_size: Count = 0
    num_kv_blocks_total: Count = 0
    max_num_seqs: Count = 0
    max_num_batched_tokens: Count = 0
    pid: Count = 0
    schema_version: Count = SCHEMA_VERSION
    source: str = ""  # who filled the messages: SOURCES; "" = an older sender
    # vLLM's --prefill-schedule-interval (prompts admitted once every N steps); 0 = none
    prefill_schedule_interval: Count = 0
    # The engine's own name and version, e.g. "vllm 0.32.0" or "iterscope 0.1.0"; "" = not said
    engine_version: str = ""
    # Speculative decoding's draft length (vLLM's num_speculative_tokens); 0 = none, or not said.
    # Said even when no draft is proposed: a proposer that finds none still costs every step.
    num_speculative_tokens: Count = 0
    # Tokens the iteration running when the heartbeat was sent scheduled; 0 = between
    # iterations, or the source cannot say (vLLM's stat-logger plugin, FPM producers). The
    # stall rule gives a step bigger than any it measured the time its size can take.
    step_tokens: Count = 0
    # The dtype the engine computes in ("bfloat16", auto resolved) and its max model length:
    # static facts that let a KV action quote kv-plan for this engine exactly; ""/0 = not said.
    dtype: str = ""
    max_model_len: Count = 0
    # The publisher's last message: it is closing (the engine shuts down, or its source stops
    # reporting). With nothing in flight the silence after it is a shutdown, not a death.
    closing: bool = False
    # With ``closing``: the engine was told to stop (its operator's stop signal, its client's
    # shutdown), so the requests in flight, if any, are cut off by a shutdown, not a death.
    stop_requested: bool = False


Message = IterationRecord | Heartbeat


def is_clean_close(message: Message) -> bool:
    """A closing heartbeat of an engine told to stop, or with nothing waiting or running: a
    shutdown, so the silence after it is no death (the sidecar's "closed" status, and no
    silence episode in explain). One closing with work in flight, not told to stop (an engine
    loop that failed), is judged as any silence: its requests got no token after it."""
    return (
        type(message) is Heartbeat
        and message.closing
        and (message.stop_requested or not (message.num_waiting_reqs or message.num_running_reqs))
    )


def _required_zeros(struct_type: type[msgspec.Struct], named: int) -> dict[str, int]:
    """0 for each required field after the first ``named`` (which the factory takes itself)."""
    fields = [field.name for field in msgspec.structs.fields(struct_type) if field.required]
    return dict.fromkeys(fields[named:], 0)


_ITERATION_ZEROS = tuple(_required_zeros(IterationRecord, 3).values())
_ITERATION_FIELDS = frozenset(IterationRecord.__struct_fields__)
_HEARTBEAT_ZEROS = _required_zeros(Heartbeat, 4)


def iteration_record(
    engine_index: int, msg_seq: int, iteration: int, **fields: Any
) -> IterationRecord:
    """An IterationRecord with ``fields`` set and every other count 0 (no milestones).

    A misspelt field name raises TypeError, as the constructor does. Built from positional
    zeros and then set: msgspec's constructor with more than about a dozen keywords costs
    several times the positional call (0.6-0.9 us against 0.1 for this record).
    """
    record = IterationRecord(engine_index, msg_seq, iteration, *_ITERATION_ZEROS)
    for name, value in fields.items():
        if name not in _ITERATION_FIELDS:
            raise TypeError(f"IterationRecord has no field {name!r}")
        setattr(record, name, value)
    return record


def heartbeat(
    engine_index: int, msg_seq: int, ts_ns: int, wall_ns: int, **fields: Any
) -> Heartbeat:
    """A Heartbeat with ``fields`` set and every other count 0 (facts empty)."""
    return Heartbeat(engine_index, msg_seq, ts_ns, wall_ns, **{**_HEARTBEAT_ZEROS, **fields})


# The most a step bigger than any measured (or an engine's first) may take before it is stalled.
STEP_TIME_CAP_NS = 600 * 1_000_000_000


def step_time_bound_ns(step_tokens: int, biggest_tokens: int, biggest_ns: int) -> int:
    """How long an iteration of ``step_tokens`` may take, given the biggest one measured
    (``biggest_tokens`` in ``biggest_ns``; 0: none): twice that time times the square of
    their ratio (an iteration's time grows at most with the square of its tokens: a fixed
    part, the weights' work per token, attention's per pair), at most STEP_TIME_CAP_NS, all
    of it with nothing measured. One rule for the sidecar's stall rule (a heartbeat's
    ``step_tokens``) and the engine's own /health; 0 for a step no bigger than measured."""
    if step_tokens <= biggest_tokens:
        return 0
    if not biggest_tokens:
        return STEP_TIME_CAP_NS
    scaled = 2 * biggest_ns * (step_tokens / biggest_tokens) ** 2
    return min(int(scaled), STEP_TIME_CAP_NS)


def make_encoder() -> msgspec.msgpack.Encoder:
    """An encoder; each thread that sends owns its own."""
    return msgspec.msgpack.Encoder()


def make_decoder() -> msgspec.msgpack.Decoder:
    """A typed decoder for one lane frame (IterationRecord or Heartbeat)."""
    return msgspec.msgpack.Decoder(Message)
