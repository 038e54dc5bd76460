"""Forward-pass metrics (FPM) frames made by hand, as SGLang and Dynamo publish them: an empty
topic, the seq as 8 bytes big-endian, a msgpack map (telemetry/sources/fpm.py)."""

from __future__ import annotations

from typing import Any

import msgspec

SCHEDULED_FIELDS = (
    "num_prefill_requests",
    "sum_prefill_tokens",
    "var_prefill_length",
    "sum_prefill_kv_tokens",
    "num_decode_requests",
    "sum_decode_kv_tokens",
    "var_decode_kv_tokens",
)
QUEUED_FIELDS = (
    "num_prefill_requests",
    "sum_prefill_tokens",
    "var_prefill_length",
    "num_decode_requests",
    "sum_decode_kv_tokens",
    "var_decode_kv_tokens",
)


def fpm_map(
    worker_id: str = "worker-a",
    dp_rank: int = 0,
    wall_time: float = 0.02,
    scheduled: dict[str, Any] | None = None,
    queued: dict[str, Any] | None = None,
    version: int = 1,
    **extra: Any,
) -> dict[str, Any]:
    """The message as a dict, every field present (zero unless given), plus ``extra`` keys."""
    return {
        "version": version,
        "worker_id": worker_id,
        "dp_rank": dp_rank,
        "counter_id": 0,
        "wall_time": wall_time,
        "scheduled_requests": {**dict.fromkeys(SCHEDULED_FIELDS, 0), **(scheduled or {})},
        "queued_requests": {**dict.fromkeys(QUEUED_FIELDS, 0), **(queued or {})},
        **extra,
    }


def fpm_frames(seq: int, **fields: Any) -> list[bytes]:
    """The three frames of one message numbered ``seq`` (fpm_map's arguments)."""
    return [b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode(fpm_map(**fields))]


def busy_frames(seq: int, **fields: Any) -> list[bytes]:
    """A mixed iteration: 1 prefill chunk of 128 tokens on 32 cached, 6 decodes holding 600
    tokens, 3 prefills and 1 decode queued."""
    scheduled = {
        "num_prefill_requests": 1,
        "sum_prefill_tokens": 128,
        "sum_prefill_kv_tokens": 32,
        "num_decode_requests": 6,
        "sum_decode_kv_tokens": 600,
        "var_decode_kv_tokens": 25.0,
    }
    queued = {"num_prefill_requests": 3, "sum_prefill_tokens": 900, "num_decode_requests": 1}
    return fpm_frames(seq, scheduled=scheduled, queued=queued, **fields)


def idle_frames(seq: int, **fields: Any) -> list[bytes]:
    """The producer's heartbeat: every count zero."""
    return fpm_frames(seq, wall_time=0.0, **fields)
