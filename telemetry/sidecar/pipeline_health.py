"""What the sidecar's pipeline lost or refused: counted once, by Ingest, read by every sink.

Ingest (telemetry/sidecar/ingest.py) is the only writer. Sinks get the PipelineHealth once,
through ``Sink.attach``, and read it when they render: the Prometheus sink at scrape time
(``iterscope_frames_undecodable_total{reason}`` and the like), the log sink by difference
with what it last reported. Per-engine losses (messages lost in seq gaps, processes sharing
an index) are kept on that engine's view (telemetry/sidecar/engine_view.py), also by Ingest
alone. Nothing here is counted a second time anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from telemetry.lane.frame_checks import UNDECODABLE_REASONS

# Why Ingest drops a decoded frame: a record of an engine no heartbeat introduced, a new
# engine beyond --max-engines, a seq the engine's own counts do not explain.
REJECTED_REASONS = ("unknown_engine", "engine_limit", "seq_jump")


@dataclass
class PipelineHealth:
    """Counts of the whole lane (per-engine ones are on the engine views)."""

    num_frames: int = 0  # every frame read from the lane (or a recording)
    num_messages: int = 0  # decoded, checked and passed to the sinks
    num_engine_conflicts: int = 0  # heartbeats switching back to a pid seen before
    num_sink_errors: int = 0  # calls on a sink that raised
    # 'malformed', 'truncated', 'version', 'oversized' (telemetry/lane/frame_checks.py)
    num_undecodable: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(UNDECODABLE_REASONS, 0)
    )
    num_rejected: dict[str, int] = field(  # REJECTED_REASONS
        default_factory=lambda: dict.fromkeys(REJECTED_REASONS, 0)
    )
    num_lane_disconnects: int = 0  # connections that ended (an engine exited, a guard cut)
    # peers whose ZMQ handshake failed: on a CURVE lane, an engine without keys or with
    # keys the sidecar does not trust (its messages never arrive, so nothing else counts it)
    num_lane_handshake_failures: int = 0

    @property
    def num_undecodable_total(self) -> int:
        return sum(self.num_undecodable.values())

    @property
    def num_rejected_total(self) -> int:
        return sum(self.num_rejected.values())
