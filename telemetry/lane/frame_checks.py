"""The checks a received frame must pass before anything keys state on it.

The live sidecar applies them to each ZMQ frame and the recording reader to each line, so a
replay and ``explain`` count bad input the same way the live sidecar does.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from telemetry.lane.record import (
    KIND_HEARTBEAT,
    KIND_ITERATION,
    MAX_ENGINE_INDEX,
    SCHEMA_VERSION,
    Message,
)

# Why a frame could not become a message; 'oversized' is the sidecar's size guard.
UNDECODABLE_REASONS = ("malformed", "truncated", "oversized", "version")


def classify_undecodable(
    data: bytes, error: Exception, loads: Callable[[bytes], object] = msgspec.msgpack.decode
) -> str:
    """Why ``data`` failed the typed decoder: 'truncated', 'version' or 'malformed'.

    A frame that is valid msgpack/JSON and whose first element is a known kind tagged with
    another schema version is 'version'; anything else that parses but has the wrong shape,
    and anything that does not parse, is 'malformed' (or 'truncated' when the input ended
    early).
    """
    if not isinstance(error, msgspec.ValidationError):  # did not parse (or bad UTF-8)
        truncated = isinstance(error, msgspec.DecodeError) and "truncated" in str(error)
        return "truncated" if truncated else "malformed"
    try:
        value = loads(data)
    except (msgspec.DecodeError, ValueError, RecursionError):  # deep nesting: a hostile frame
        return "malformed"
    if isinstance(value, list) and value and type(value[0]) is int:
        version, kind = divmod(value[0], 16)
        if kind in (KIND_ITERATION, KIND_HEARTBEAT) and version >= 1 and version != SCHEMA_VERSION:
            return "version"
    return "malformed"


def is_plausible(message: Message) -> bool:
    """Fields the sidecar keys state on must be in range, else the frame counts as malformed."""
    return 0 <= message.engine_index <= MAX_ENGINE_INDEX and message.msg_seq >= 1
