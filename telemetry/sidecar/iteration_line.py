"""The per-iteration text line, shared by the log sink (opt-in per-iteration lines) and the
NVTX sink (the message of each iteration's range), so both say exactly the same thing:

    Iteration(188): 0 context requests, 0 context tokens, 50 generation requests,
    50 generation tokens, iteration elapsed time: 10.25 ms, kv cache: 5.1% (3500/68959 blocks,
    56000 tokens)

(one line; wrapped here). The KV numbers are the record's own (telemetry/sidecar/engine_view.py:
used and used + free of the same record), so the line never mixes numbers from two moments.
"""

from __future__ import annotations

from telemetry.lane.record import (
    UNKNOWN_ELAPSED,
    UNKNOWN_KV_TOKENS,
    UNKNOWN_PREFILL_REQS,
    IterationRecord,
    is_known,
)
from telemetry.sidecar.engine_view import kv_blocks_total, record_kv_usage_ratio


def format_iteration_line(record: IterationRecord) -> str:
    """The line; a field the source marked unknown reads "unknown" (e.g. "unknown context
    requests"), never a 0 it did not measure."""
    context_reqs = _known(record, UNKNOWN_PREFILL_REQS, record.num_prefill_reqs)
    elapsed = _known(record, UNKNOWN_ELAPSED, f"{record.elapsed_ns / 1e6:.2f} ms")
    kv_tokens = _known(record, UNKNOWN_KV_TOKENS, record.num_kv_tokens)
    return (
        f"Iteration({record.iteration}): "
        f"{context_reqs} context requests, "
        f"{record.num_prefill_tokens} context tokens, "
        f"{record.num_decode_reqs} generation requests, "
        f"{record.num_decode_tokens} generation tokens, "
        f"iteration elapsed time: {elapsed}, "
        f"kv cache: {100 * record_kv_usage_ratio(record):.1f}% "
        f"({record.num_kv_blocks_used}/{kv_blocks_total(record)} blocks, "
        f"{kv_tokens} tokens)"
    )


def _known(record: IterationRecord, unknown_bit: int, value: object) -> object:
    return value if is_known(record, unknown_bit) else "unknown"
