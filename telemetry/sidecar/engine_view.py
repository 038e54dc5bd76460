"""What every sink may read of one engine: the view Ingest folds from that engine's messages.

Ingest (telemetry/sidecar/ingest.py) keeps one EngineView per engine and hands it to the sinks
with each message (``on_iteration(record, engine)``, ``on_heartbeat(heartbeat, engine)``).
It applies the message to the view right after the sinks have seen it: a sink sees the engine
as it was before the message (the message is the news; a log window that the message closes
shows what was true within it), except for a heartbeat's clock anchor, taken in first so that
the heartbeat's own times read with it. Sinks read the view and never write it. Each concept
below is defined here once, so that every sink says the same:

    clock anchor  engine monotonic -> wall time: ``wall_ns - ts_ns`` of the latest heartbeat,
                  which reads both clocks back to back (to within a few hundred ns). The
                  latest wins, so a wall clock stepped by NTP is followed within a heartbeat.
                  None until the first heartbeat (Ingest meets an engine only with one).
    progress      ``last_iteration``: the last iteration that scheduled work, from records (a
                  loop spinning on empty iterations makes none) and from heartbeats (its
                  records may all be lost); 0 again when the engine restarts (Ingest).
                  Queues: the latest record's or heartbeat's.
    KV blocks     used and used + free of the latest record, so the two never mix moments;
                  before a record of this process, 0 used of the heartbeat's total.
    facts         from heartbeats: the latest device and source ("" = not said); the latest
                  non-empty model and KV total (a metric label must not flap). A new pid (0 = not
                  said) is a new process: no record of it yet.
    status        written by Ingest only, right before it calls the sinks' ``on_status``.
    totals        RecordTotals: the sums of record fields over every record of the engine
                  since it was met, that more than one sink reports (the log line's window
                  is the difference of two totals, Prometheus shows them as counters), so
                  those sinks cannot disagree; speculative decoding's drafts and accepted
                  tokens among them (record.spec_decode).
    findings      what the engine's live findings are (telemetry/analysis/live_findings.py),
                  kept by Ingest's tracker of the engine; None when they are turned off.
    losses        messages received and lost (seq gaps), and the times two processes were
                  seen publishing as this engine (the latest pair of pids): Ingest counts
                  them (telemetry/sidecar/pipeline_health.py has the lane-wide ones).

Invariant: only Ingest's thread writes a view; another thread (a /metrics scrape) may read
one, a single attribute at a time.
"""

from __future__ import annotations

import enum
from itertools import zip_longest

from telemetry.analysis.live_findings import EngineFindings
from telemetry.lane.record import Heartbeat, IterationRecord, SpecDecodeCounts, is_clean_close


class EngineStatus(str, enum.Enum):
    """What the sidecar believes an engine is doing.

    IDLE:    heartbeats arrive, nothing waits or runs.
    RUNNING: iterations arrive.
    STALLED: heartbeats arrive and work waits or runs, but no iteration finished for longer
             than the stall threshold (adapted to the engine's iteration times, at least
             5 s; telemetry/sidecar/engine_tracker.py).
    DEAD:    no message for the dead-after interval (2.5 s by default, so a killed engine is
             reported within 3 s). Heartbeats come from the publisher's thread, which runs
             while the engine loop is stuck; only a process that is gone, frozen whole
             (SIGSTOP) or cut off from the lane sends none.
    CLOSED:  its last message said the lane closes with nothing in flight (record.py's
             is_clean_close: a shutdown, or a source that stops reporting): its silence is
             no death, and no finding or alert. A message after it opens the lane again.
    """

    IDLE = "idle"
    RUNNING = "running"
    STALLED = "stalled"
    DEAD = "dead"
    CLOSED = "closed"


# No message is expected from an engine in these (the roster may evict it; a message after
# one comes after a silence).
SILENT_STATUSES = (EngineStatus.DEAD, EngineStatus.CLOSED)


def kv_blocks_total(record: IterationRecord) -> int:
    """The KV pool of one record: its used + free blocks."""
    return record.num_kv_blocks_used + record.num_kv_blocks_free


def kv_usage_ratio(num_blocks_used: int, num_blocks_total: int) -> float:
    """Fraction of KV blocks in use, 0.0 for an empty pool."""
    return num_blocks_used / num_blocks_total if num_blocks_total else 0.0


def kv_usage_percent(num_blocks_used: int, num_blocks_total: int) -> float:
    """The log line's percent, from the counts: ``100 * ratio`` differs in the last bit and so
    rounds some x.x5 values the other way."""
    return 100.0 * num_blocks_used / num_blocks_total if num_blocks_total else 0.0


def record_kv_usage_ratio(record: IterationRecord) -> float:
    """Fraction of KV blocks in use after the iteration, 0.0 when the pool is empty."""
    return kv_usage_ratio(record.num_kv_blocks_used, kv_blocks_total(record))


# The int fields of RecordTotals: record fields summed (num_iterations counts records,
# num_kv_blocked_iterations those that left requests waiting for KV), then speculative
# decoding's (record.spec_decode, summed where it is not None).
_SUMS = (
    "num_iterations",
    "num_prefill_tokens",
    "num_decode_tokens",
    "num_preemptions",
    "num_prefix_query_tokens",
    "num_prefix_hit_tokens",
    "num_kv_blocked_iterations",
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
)


class RecordTotals:
    """Sums of record fields over an engine's records. ``add`` runs once per record, on the
    ingest thread; a reader on another thread (a scrape) reads one attribute at a time.

    ``num_accepted_tokens_per_pos`` sums speculative decoding's accepted tokens by draft
    position, as long as the longest list seen (a position a record does not list adds 0).
    It is a tuple that ``add`` replaces, never changes, so a reader that takes it once holds
    the sums of one moment."""

    __slots__ = (*_SUMS, "num_accepted_tokens_per_pos")

    def __init__(self) -> None:
        for name in _SUMS:
            setattr(self, name, 0)
        self.num_accepted_tokens_per_pos: tuple[int, ...] = ()

    def add(self, record: IterationRecord) -> None:
        self.num_iterations += 1
        self.num_prefill_tokens += record.num_prefill_tokens
        self.num_decode_tokens += record.num_decode_tokens
        self.num_preemptions += record.num_preemptions
        self.num_prefix_query_tokens += record.num_prefix_query_tokens
        self.num_prefix_hit_tokens += record.num_prefix_hit_tokens
        if record.num_waiting_kv_reqs:
            self.num_kv_blocked_iterations += 1
        if record.spec_decode is not None:  # the common case pays this check only
            self.add_spec_decode(record.spec_decode)

    def add_spec_decode(self, counts: SpecDecodeCounts) -> None:
        self.num_drafts += counts.num_drafts
        self.num_draft_tokens += counts.num_draft_tokens
        self.num_accepted_tokens += counts.num_accepted_tokens
        pairs = zip_longest(
            self.num_accepted_tokens_per_pos, counts.num_accepted_tokens_per_pos, fillvalue=0
        )
        self.num_accepted_tokens_per_pos = tuple(total + count for total, count in pairs)

    def copy(self) -> RecordTotals:
        totals = RecordTotals()
        for name in self.__slots__:
            setattr(totals, name, getattr(self, name))
        return totals

    def since(self, earlier: RecordTotals) -> RecordTotals:
        """What was added after ``earlier`` (a copy of these totals taken then)."""
        totals = RecordTotals()
        for name in _SUMS:
            setattr(totals, name, getattr(self, name) - getattr(earlier, name))
        pairs = zip_longest(
            self.num_accepted_tokens_per_pos, earlier.num_accepted_tokens_per_pos, fillvalue=0
        )
        totals.num_accepted_tokens_per_pos = tuple(later - before for later, before in pairs)
        return totals


class EngineView:
    """One engine as every sink sees it (see the module docstring)."""

    def __init__(self, engine_index: int) -> None:
        self.engine_index = engine_index
        self.pid = 0  # 0 = no heartbeat named one yet
        self.model_name = ""
        self.device_name = ""
        self.source = ""  # who fills the messages (telemetry.lane.record.SOURCES); "" = not said
        self.engine_version = ""  # e.g. "vllm 0.32.0"; "" = not said
        self.clock_offset_ns: int | None = None  # wall - monotonic, of the latest heartbeat
        self.last_iteration = 0
        self.num_waiting_reqs = 0
        self.num_running_reqs = 0
        self.last_record: IterationRecord | None = None  # of this process
        self.last_heartbeat: Heartbeat | None = None
        self.heartbeat_kv_blocks_total = 0
        self.status: EngineStatus | None = None  # None: not judged yet
        self.closed = False  # its latest message closed the lane cleanly (is_clean_close)
        self.totals = RecordTotals()
        self.num_messages = 0  # received, checked and passed to the sinks
        self.num_dropped_total = 0  # lost in seq gaps
        self.num_engine_conflicts = 0  # times two live processes were seen as this engine
        self.conflicting_pids: tuple[int, int] | None = None  # the latest such pair
        self.findings: EngineFindings | None = None  # live findings; None when turned off

    @property
    def has_work(self) -> bool:
        return self.num_waiting_reqs + self.num_running_reqs > 0

    def to_wall_ns(self, monotonic_ns: int) -> int:
        """Wall time of an engine monotonic timestamp; KeyError before the first anchor."""
        if self.clock_offset_ns is None:
            raise KeyError(f"no clock anchor (heartbeat) yet from engine {self.engine_index}")
        return monotonic_ns + self.clock_offset_ns

    def kv_blocks(self) -> tuple[int, int]:
        """(used, total) KV blocks, from one read of the latest record."""
        record = self.last_record
        if record is None:
            return 0, self.heartbeat_kv_blocks_total
        return record.num_kv_blocks_used, record.num_kv_blocks_used + record.num_kv_blocks_free

    def reports(self, unknown_bits: int) -> bool:
        """Whether the engine's source gives the fields of ``unknown_bits`` (record.UNKNOWN_*),
        as its latest record says; True before any record."""
        record = self.last_record
        return record is None or not record.unknown & unknown_bits

    @property
    def kv_usage_ratio(self) -> float:
        return kv_usage_ratio(*self.kv_blocks())

    def apply_iteration(self, record: IterationRecord) -> bool:
        """Take in a record; True if it scheduled work (progress)."""
        self.num_waiting_reqs = record.num_waiting_reqs
        self.num_running_reqs = record.num_running_reqs
        self.last_record = record
        self.totals.add(record)
        if record.num_prefill_tokens + record.num_decode_tokens > 0:
            self.last_iteration = record.iteration
            return True
        return False

    def step_under_way(self) -> tuple[int, float] | None:
        """(tokens it scheduled, seconds so far) of the iteration under way, where the latest
        heartbeat says its size (``step_tokens``; 0: the source does not say) and came after
        the last record's iteration ended; None else (or before a record of this process)."""
        beat, record = self.last_heartbeat, self.last_record
        if beat is None or record is None or not beat.step_tokens:
            return None
        ended_ns = record.start_ns + record.elapsed_ns
        if beat.ts_ns <= ended_ns:
            return None
        return beat.step_tokens, (beat.ts_ns - ended_ns) / 1e9

    def take_anchor(self, heartbeat: Heartbeat) -> None:
        """The heartbeat's clock anchor (before the sinks see it: see the module docstring)."""
        self.clock_offset_ns = heartbeat.wall_ns - heartbeat.ts_ns

    def apply_heartbeat(self, heartbeat: Heartbeat) -> None:
        """Take in a heartbeat: anchor, facts, queues, and its last iteration if later."""
        if heartbeat.pid and heartbeat.pid != self.pid:  # a new process: no record of it yet
            self.pid = heartbeat.pid
            self.last_record = None
        self.take_anchor(heartbeat)
        self.last_heartbeat = heartbeat
        if heartbeat.model_name:
            self.model_name = heartbeat.model_name
        self.device_name = heartbeat.device_name
        self.source = heartbeat.source
        self.engine_version = heartbeat.engine_version
        if heartbeat.num_kv_blocks_total:
            self.heartbeat_kv_blocks_total = heartbeat.num_kv_blocks_total
        if heartbeat.last_iteration > self.last_iteration:
            self.last_iteration = heartbeat.last_iteration
        self.num_waiting_reqs = heartbeat.num_waiting_reqs
        self.num_running_reqs = heartbeat.num_running_reqs
        self.closed = is_clean_close(heartbeat)
