"""The messages between the engine-core process and its client, on two lossless ZMQ channels.

    client (frontend)                              engine-core process (spawned)
    PUSH  ipc://DIR/input  --AddRequest/Abort/Shutdown/Probe-->  PULL
    PULL  ipc://DIR/output <--EngineReady/Failed/Outputs/ProbeReply--  PUSH

msgspec msgpack, tagged array-like structs. The client decodes every frame it sends with the
engine's own decoder first, so a value of a wrong type is rejected at submission.
"""

from __future__ import annotations

import msgspec

from engine.core import RequestOutput
from engine.request import FinishReason, SamplingParams

# An engine with work sends at least this often (an empty EngineOutputs when its iterations
# produce no tokens, as long prefills do), so the client can tell a working engine from a
# stuck one by the age of its last message.
PROGRESS_BEAT_S = 1.0


# Client -> engine --------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_ns: int = 0  # time.monotonic_ns() at the frontend; 0 = when the engine reads it
    traceparent: str = ""


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]
    finish_reason: int = int(FinishReason.ABORT)  # STOP when the frontend matched a stop string


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class Probe(msgspec.Struct, tag="probe", array_like=True):
    pass


EngineInput = AddRequest | AbortRequests | Shutdown | Probe


# Engine -> client --------------------------------------------------------------------------


class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    pid: int
    model_name: str
    startup_lines: list[str]
    block_size: int
    num_kv_blocks: int
    max_model_len: int


class EngineFailed(msgspec.Struct, tag="failed", array_like=True):
    error: str


class EngineOutputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[RequestOutput]
    # > 0: sent as an iteration bigger than any before starts, the seconds it may take for
    # its size (telemetry.lane.record.step_time_bound_ns): the client waits that long before
    # it calls the engine stalled, as no progress beat can come while the iteration runs
    big_step_s: float = 0.0


class ProbeReply(msgspec.Struct, tag="probe_reply", array_like=True):
    top_level_modules: list[str]
    num_log_records: int  # since ready; counted only with config.test_count_log_records
    iteration: int


EngineMessage = EngineReady | EngineFailed | EngineOutputs | ProbeReply
