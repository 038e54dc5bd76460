"""FPM producers as engines of an Ingest: frames decoded, counted, numbered, ingested.

Each FPM message's frames are decoded by telemetry/sources/fpm.py and numbered by
telemetry/sources/fpm_streams.py (one engine per (worker_id, dp_rank), msg_seq with the FPM
seq's gaps as losses, a Heartbeat that introduces each producer: its docstring has the
invariants), which reads Ingest's engines to learn whom Ingest admitted. This module counts
what Ingest counts of any frame: every frame, the undecodable ones by reason, and the rejected
ones ('seq_jump', 'engine_limit').
"""

from __future__ import annotations

import time
from collections.abc import Callable

from telemetry.sidecar.engine_tracker import MAX_SEQ_JUMP
from telemetry.sidecar.ingest import Ingest
from telemetry.sources.fpm import decode_frames
from telemetry.sources.fpm_streams import FpmStreams


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
        self._health = ingest.health
        self._streams = FpmStreams(
            ingest.engines, ingest.on_message, max_seq_jump, model_name, producer, wall_clock
        )

    @property
    def num_producers(self) -> int:
        return self._streams.num_producers

    def on_frames(self, frames: list[bytes], now_ns: int) -> None:
        """One FPM message's frames, received at ``now_ns``: decoded, numbered, ingested;
        or counted as undecodable or rejected by reason."""
        self._health.num_frames += 1  # Ingest.count_frame(), inlined: once per message
        decoded = decode_frames(frames)
        if isinstance(decoded, str):
            self._ingest.count_undecodable(decoded)
            return
        rejected = self._streams.on_message(*decoded, now_ns)
        if rejected is not None:
            self._ingest.count_rejected(rejected)
