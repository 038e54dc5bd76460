"""A Perfetto trace (protobuf TrackEvent) of one or more engines' timelines.

Each engine is a process (its name says the model, device and KV size; its labels the source
and real pid) with these tracks, at the engine's own monotonic timestamps (ns, the clock of
Nsight Systems too):

    iterations        a slice per iteration, named by its batch: prefill, decode, mixed (both)
                      or empty (it scheduled nothing); args: the record's counts that are not
                      0 (a count not listed was 0), under the record's field names
    counters          KV blocks used and %, running, waiting (total and per reason), batch
                      tokens, preemptions per second, iteration time: one sample per
                      iteration, at its end (queues and KV are counted after it)
    requests          lanes "requests 1", "requests 2", ...: a slice per request with its
                      queued / prefill / decode phases nested in it (request_phases.py); no two
                      requests overlap on one lane, so there are as many lanes as requests ever
                      ran at once
    findings          lanes "findings 1", ...: a slice per episode of each finding explain
                      reports (the same detectors, costs and actions), the action in its args
    flows             an arrow per request from the iteration that produced its first token
                      (the last to start at or before it) to the request's decode slice

Slices of one track never overlap: an iteration that a source reports as ending after the
next one starts (an asynchronous scheduler) is drawn up to that start, its true length in
``elapsed_ms``. A count the source did not give (record.UNKNOWN_*) is named in the
iteration's ``unknown`` arg and its counter track is not drawn, never shown as 0.

Encoding: two trusted packet sequences per engine, each opened by a packet that clears its
incremental state and snapshots a clock of its own, incremental (each packet carries the time
since the packet before, 3-4 bytes instead of 7-8, ticking from the snapshot's value, which
ties it to the trace's clock one to one), then a packet that interns the slice and argument
names and makes that clock the default (sequence_start).

* Iterations: the sequence's defaults are also the iterations track and the counter tracks, so
  an iteration is two small packets: a slice begin with its args and a slice end carrying every
  counter's sample. These are encoded for all iterations at once with numpy (proto_wire.py).
* Requests and findings: a packet per slice begin, end or instant, on its lane's track; the
  events are noted one by one (time, kind, track), then encoded a kind at a time, put in time
  order and framed as packets, all with numpy.

Track descriptors and the sequences' first packets are built with perfetto's protos.
Every packet after a sequence's first omits SEQ_NEEDS_INCREMENTAL_STATE: the trace processor
reads that flag only to skip packets after a data loss, which a file never has, and 2 bytes a
packet are 4 % of the trace.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Iterator
from dataclasses import dataclass, field
from operator import attrgetter
from typing import BinaryIO

import numpy as np
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import (
    BuiltinClock,
    CounterDescriptor,
    DebugAnnotation,
    Trace,
    TracePacket,
    TrackEvent,
)

from telemetry.analysis import proto_wire as wire
from telemetry.analysis.actions import finding_action
from telemetry.analysis.episodes import Thresholds, detect_episodes
from telemetry.analysis.findings import build_findings
from telemetry.analysis.request_phases import (
    Chunk,
    RequestPhases,
    assign_lanes,
    latest_milestones,
    request_phases,
)
from telemetry.analysis.timeline import NS_PER_S, WAIT_REASONS, EngineTimeline
from telemetry.analysis.track_names import (
    KV_USAGE,
    RUNNING,
    WAITING,
    counter_name,
    engine_category,
)
from telemetry.lane.record import (
    UNKNOWN_ELAPSED,
    UNKNOWN_KV_TOKENS,
    UNKNOWN_PREFILL_REQS,
    UNKNOWN_WAITING_REASONS,
)

BATCH_KINDS = ("empty", "prefill", "decode", "mixed")  # index: 1 if prefill + 2 if decode
ITERATIONS_PER_CHUNK = 16384  # encoded at once (bounds the encoder's memory)
EVENTS_PER_WRITE = 4096
SLICE_BEGIN = TrackEvent.TYPE_SLICE_BEGIN
SLICE_END = TrackEvent.TYPE_SLICE_END
INSTANT = TrackEvent.TYPE_INSTANT
CLEARED = TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
NEEDS_STATE = TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
COUNT = CounterDescriptor.UNIT_COUNT
TIME_NS = CounterDescriptor.UNIT_TIME_NS
TRACE_CLOCK = BuiltinClock.BUILTIN_CLOCK_BOOTTIME  # the clock of timestamps without a clock id
INCREMENTAL_CLOCK = 64  # the first sequence-scoped clock id
# The iteration slice's integer args: record fields, under their own names, and the UNKNOWN_*
# bit that marks each unknown (0: always known).
ITERATION_ARGS = (
    ("iteration", 0),
    ("num_prefill_reqs", UNKNOWN_PREFILL_REQS),
    ("num_prefill_tokens", 0),
    ("num_decode_reqs", 0),
    ("num_decode_tokens", 0),
    ("num_running_reqs", 0),
    ("num_waiting_reqs", 0),
    *((reason.field, UNKNOWN_WAITING_REASONS) for reason in WAIT_REASONS.values()),
    ("num_kv_blocks_used", 0),
    ("num_preemptions", 0),
    ("num_draft_tokens", 0),  # speculative decoding's, 0 (so not written) without it
    ("num_accepted_tokens", 0),
)
ELAPSED_ARG = "elapsed_ms"  # only where the slice is drawn shorter than the iteration
UNKNOWN_ARG = "unknown"  # the counts the source did not give
REQUEST_ARGS = (
    "finish_reason",
    "num_prompt_tokens",
    "num_cached_tokens",
    "num_output_tokens",
    "num_preemptions",
    "ttft_ms",
    "queue_ms",
    "chunk_index",
    "num_tokens",
)
REQUEST_COUNTS = REQUEST_ARGS[1:5]  # a request's integer args: its milestone's fields
REQUEST_NUMBERS = attrgetter(*REQUEST_COUNTS, "arrival_ns", "first_token_ns", "first_scheduled_ns")
CONTINUED_ARG = "continued"  # a finding that began before its trace file (EarlierFile)
FINDING_ARGS = (
    "title",
    "evidence",
    "action",
    "cost_request_s",
    "cost_label",
    "explanation",
    CONTINUED_ARG,
)
CONTINUED_WHOLE = "began in the file before; drawn whole, from its start there"
CONTINUED_CUT = "began before the file before; drawn from that file's start"
# Names interned once per sequence (iid = position + 1); other names are written out.
EVENT_NAMES = (*BATCH_KINDS, "queued", "preempted")  # a request's prefill, decode: BATCH_KINDS
ARG_NAMES = tuple(
    dict.fromkeys(
        [*(name for name, _ in ITERATION_ARGS), ELAPSED_ARG, UNKNOWN_ARG, *REQUEST_ARGS]
        + list(FINDING_ARGS)
    )
)
EVENT_IIDS = {name: iid for iid, name in enumerate(EVENT_NAMES, 1)}
ARG_IIDS = {name: iid for iid, name in enumerate(ARG_NAMES, 1)}
UNKNOWN_NAMES = {
    UNKNOWN_PREFILL_REQS: "num_prefill_reqs",
    UNKNOWN_ELAPSED: "elapsed_ns",
    UNKNOWN_WAITING_REASONS: "waiting reasons",
    UNKNOWN_KV_TOKENS: "num_kv_tokens",
}


def _tag(message, field: str, wire_type: int) -> bytes:
    """The tag of ``message``'s ``field``, its number as perfetto's protos have it."""
    return wire.tag(message.DESCRIPTOR.fields_by_name[field].number, wire_type)


# The tags of the fields written by hand.
PACKET = _tag(Trace, "packet", wire.LENGTH_DELIMITED)
TIMESTAMP = _tag(TracePacket, "timestamp", wire.VARINT)
SEQUENCE_ID = _tag(TracePacket, "trusted_packet_sequence_id", wire.VARINT)
TRACK_EVENT = _tag(TracePacket, "track_event", wire.LENGTH_DELIMITED)
EVENT_TYPE = _tag(TrackEvent, "type", wire.VARINT)
TRACK_UUID = _tag(TrackEvent, "track_uuid", wire.VARINT)
NAME_IID = _tag(TrackEvent, "name_iid", wire.VARINT)
NAME = _tag(TrackEvent, "name", wire.LENGTH_DELIMITED)
INTERNED_EVENT_NAMES = {name: NAME_IID + wire.varint(iid) for name, iid in EVENT_IIDS.items()}
ANNOTATION = _tag(TrackEvent, "debug_annotations", wire.LENGTH_DELIMITED)
COUNTER_VALUE = _tag(TrackEvent, "extra_counter_values", wire.VARINT)
DOUBLE_COUNTER_VALUE = _tag(TrackEvent, "extra_double_counter_values", wire.FIXED64)
FLOW_ID = _tag(TrackEvent, "flow_ids", wire.FIXED64)
TERMINATING_FLOW_ID = _tag(TrackEvent, "terminating_flow_ids", wire.FIXED64)
ARG_NAME_IID = _tag(DebugAnnotation, "name_iid", wire.VARINT)
ARG_NAME = _tag(DebugAnnotation, "name", wire.LENGTH_DELIMITED)
BOOL_VALUE = _tag(DebugAnnotation, "bool_value", wire.VARINT)
INT_VALUE = _tag(DebugAnnotation, "int_value", wire.VARINT)
DOUBLE_VALUE = _tag(DebugAnnotation, "double_value", wire.FIXED64)
STRING_VALUE = _tag(DebugAnnotation, "string_value", wire.LENGTH_DELIMITED)
INTERNED_ARG_NAMES = {name: ARG_NAME_IID + wire.varint(iid) for name, iid in ARG_IIDS.items()}
EVENT_TYPES = {kind: EVENT_TYPE + wire.varint(kind) for kind in (SLICE_BEGIN, SLICE_END, INSTANT)}


@dataclass
class TraceCounts:
    """What a trace holds, for the command's message and the checks."""

    num_engines: int = 0
    num_iterations: int = 0
    num_counter_samples: int = 0
    num_requests: int = 0
    num_findings: int = 0  # as explain counts them: each of one kind and reason
    num_finding_episodes: int = 0  # a slice each
    num_bytes: int = 0


@dataclass
class Counter:
    """A counter track: its name (track_names.counter_name), unit and one sample per iteration."""

    name: str
    unit: int
    values: np.ndarray
    unit_name: str = ""

    @property
    def is_double(self) -> bool:
        return self.values.dtype.kind == "f"


def engine_counters(tl: EngineTimeline) -> list[Counter]:
    """The engine's counter tracks, each with a sample per iteration (at the iteration's end);
    counts the source did not give have no track."""
    e, col = tl.engine_index, tl.col
    counters = [
        Counter(counter_name(e, KV_USAGE), COUNT, 100.0 * tl.kv_usage, unit_name="%"),
        Counter(counter_name(e, "KV blocks used"), COUNT, col("num_kv_blocks_used")),
        Counter(counter_name(e, RUNNING), COUNT, col("num_running_reqs")),
        Counter(counter_name(e, WAITING), COUNT, col("num_waiting_reqs")),
    ]
    if tl.waiting_reasons_known:
        counters += [
            Counter(counter_name(e, f"waiting: {reason.limit}"), COUNT, col(reason.field))
            for reason in WAIT_REASONS.values()
        ]
    counters.append(
        Counter(
            counter_name(e, "batch tokens"),
            COUNT,
            tl.num_computed_tokens,
        )
    )
    counters.append(
        Counter(counter_name(e, "preemptions per second"), COUNT, preemptions_per_second(tl))
    )
    if tl.num_iterations and tl.timed.all():
        counters.append(Counter(counter_name(e, "iteration time"), TIME_NS, col("elapsed_ns")))
    return counters


def preemptions_per_second(tl: EngineTimeline) -> np.ndarray:
    """At each iteration's end, the preemptions of the iterations that ended in the second
    up to it (its own included)."""
    ends = tl.col("end_ns")
    order = np.argsort(ends, kind="stable")
    sorted_ends = ends[order]
    cumulative = np.cumsum(tl.col("num_preemptions")[order])
    first = np.searchsorted(sorted_ends, sorted_ends - NS_PER_S, side="right")
    before = np.where(first > 0, cumulative[np.maximum(first - 1, 0)], 0)
    per_second = np.empty_like(cumulative)
    per_second[order] = cumulative - before
    return per_second


@dataclass
class EarlierFile:
    """What came before a trace file (the sidecar's previous file, at a rotation), so that a
    finding spanning both is drawn whole in the file where it ends: findings are detected over
    ``timeline`` (the engine's messages of both files) and drawn if they end after ``end_ns``
    (the earlier file's last message, where it drew them cut); one that began before is
    marked in its ``continued`` arg."""

    timeline: EngineTimeline
    end_ns: int


class TraceWriter:
    """Writes engines' timelines to a binary file as one Perfetto trace."""

    def __init__(
        self,
        out: BinaryIO,
        thresholds: Thresholds | None = None,
        earlier: dict[int, EarlierFile] | None = None,
    ) -> None:
        self.out = out
        self.thresholds = thresholds or Thresholds()
        self.earlier = earlier or {}
        self.counts = TraceCounts()
        self._next_uuid = 1
        self._next_flow_id = 1

    def write_engine(self, tl: EngineTimeline) -> None:
        """Every iteration, counter sample, request and finding of one engine."""
        process_uuid = self._process(tl)
        iterations_uuid = self._track(process_uuid, "iterations")
        counters = engine_counters(tl)
        counter_uuids = [self._counter_track(process_uuid, c) for c in counters]
        requests = engine_requests(tl)
        flow_ids, flows = first_token_flows(tl, requests, self._next_flow_id)
        self._next_flow_id += len(requests)
        iteration_sequence = 2 * tl.engine_index + 1
        self._start_iterations(tl, iteration_sequence, iterations_uuid, counters, counter_uuids)
        self._iterations(tl, iteration_sequence, counters, flows)
        events = EventWriter(self, 2 * tl.engine_index + 2)
        self._requests(requests, flow_ids, events, process_uuid)
        self._findings(tl, events, process_uuid)
        events.write()
        self.counts.num_engines += 1

    def close(self) -> TraceCounts:
        """Flush the file; the trace is complete once this returns."""
        self.out.flush()
        return self.counts

    def write(self, data: bytes) -> None:
        """Packets, each already wrapped as a Trace's ``packet`` field."""
        self.out.write(data)
        self.counts.num_bytes += len(data)

    def write_message(self, packet: TracePacket) -> None:
        """A packet built with perfetto's protos (descriptors, a sequence's first packets)."""
        self.write(wire.length_delimited(PACKET, packet.SerializeToString()))

    def _uuid(self) -> int:
        self._next_uuid += 1
        return self._next_uuid - 1

    # --- tracks ------------------------------------------------------------------------
    def _process(self, tl: EngineTimeline) -> int:
        packet = TracePacket()
        descriptor = packet.track_descriptor
        descriptor.uuid = self._uuid()
        descriptor.process.pid = tl.engine_index + 1  # engines may share a real pid (vLLM DP)
        descriptor.process.process_name = process_name(tl)
        descriptor.process.process_labels.extend(process_labels(tl))
        self.write_message(packet)
        return descriptor.uuid

    def _track(self, parent_uuid: int, name: str) -> int:
        return self._descriptor(parent_uuid, name, None)

    def _lanes(self, parent_uuid: int, name: str, lanes: list[int]) -> list[int]:
        """A track per lane in ``lanes``, named "NAME 1", "NAME 2", ..."""
        return [
            self._track(parent_uuid, f"{name} {n + 1}") for n in range(max(lanes, default=-1) + 1)
        ]

    def _counter_track(self, parent_uuid: int, counter: Counter) -> int:
        return self._descriptor(parent_uuid, counter.name, counter)

    def _descriptor(self, parent_uuid: int, name: str, counter: Counter | None) -> int:
        packet = TracePacket()
        descriptor = packet.track_descriptor
        descriptor.uuid = self._uuid()
        descriptor.parent_uuid = parent_uuid
        descriptor.name = name
        if counter is not None:
            descriptor.counter.unit = counter.unit
            if counter.unit_name:
                descriptor.counter.unit_name = counter.unit_name
        self.write_message(packet)
        return descriptor.uuid

    # --- iterations --------------------------------------------------------------------
    def _start_iterations(
        self,
        tl: EngineTimeline,
        sequence_id: int,
        iterations_uuid: int,
        counters: list[Counter],
        counter_uuids: list[int],
    ) -> None:
        """The sequence's clock (incremental from ``tl.first_ns``), interned names and
        defaults: the iterations track, the counter tracks and that clock."""
        clock, packet = sequence_start(sequence_id, tl.first_ns)
        defaults = packet.trace_packet_defaults.track_event_defaults
        defaults.track_uuid = iterations_uuid
        for counter, uuid in zip(counters, counter_uuids, strict=True):
            if counter.is_double:
                defaults.extra_double_counter_track_uuids.append(uuid)
            else:
                defaults.extra_counter_track_uuids.append(uuid)
        self.write_message(clock)
        self.write_message(packet)

    def _iterations(
        self, tl: EngineTimeline, sequence_id: int, counters: list[Counter], flows: list[bytes]
    ) -> None:
        """Two packets an iteration (see the module doc), encoded a chunk at a time."""
        columns = IterationColumns.of(tl, counters, flows)
        for start in range(0, tl.num_iterations, ITERATIONS_PER_CHUNK):
            chunk = columns.rows(slice(start, start + ITERATIONS_PER_CHUNK))
            self.write(iteration_packets(chunk, sequence_id))
        self.counts.num_iterations += tl.num_iterations
        self.counts.num_counter_samples += tl.num_iterations * len(counters)

    # --- requests ----------------------------------------------------------------------
    def _requests(
        self,
        requests: list[RequestPhases],
        flow_ids: list[int],
        events: EventWriter,
        process_uuid: int,
    ) -> None:
        lanes = assign_lanes([(r.start_ns, r.end_ns) for r in requests])
        lane_uuids = self._lanes(process_uuid, "requests", lanes)
        for request, lane, flow_id in zip(requests, lanes, flow_ids, strict=True):
            events.request(request, lane_uuids[lane], flow_id)
        self.counts.num_requests += len(requests)

    # --- findings ----------------------------------------------------------------------
    def _findings(self, tl: EngineTimeline, events: EventWriter, process_uuid: int) -> None:
        earlier = self.earlier.get(tl.engine_index)
        if earlier is None:
            found = list(finding_slices(tl, self.thresholds))
        else:
            found = continued_findings(earlier, self.thresholds)
        slices = sorted((found_slice for _, found_slice in found), key=lambda s: s.start_ns)
        lanes = assign_lanes([(s.start_ns, s.end_ns) for s in slices])
        lane_uuids = self._lanes(process_uuid, "findings", lanes)
        for finding_slice, lane in zip(slices, lanes, strict=True):
            events.slice(finding_slice, lane_uuids[lane])
        self.counts.num_findings += len({number for number, _ in found})
        self.counts.num_finding_episodes += len(slices)


def sequence_start(sequence_id: int, first_ns: int) -> tuple[TracePacket, TracePacket]:
    """A sequence's first two packets: one that clears its state and snapshots its clock,
    incremental from ``first_ns`` (the first packet after it carries the time since then,
    each other the time since the packet before), and one that interns EVENT_NAMES and
    ARG_NAMES and makes that clock the sequence's default (the caller adds its defaults)."""
    clock = TracePacket(timestamp=first_ns, trusted_packet_sequence_id=sequence_id)
    clock.sequence_flags = CLEARED | NEEDS_STATE  # as Perfetto documents a first packet
    clock.clock_snapshot.clocks.add(clock_id=TRACE_CLOCK, timestamp=first_ns)
    clock.clock_snapshot.clocks.add(
        clock_id=INCREMENTAL_CLOCK, timestamp=first_ns, is_incremental=True, unit_multiplier_ns=1
    )
    packet = TracePacket(trusted_packet_sequence_id=sequence_id, sequence_flags=NEEDS_STATE)
    for name, iid in EVENT_IIDS.items():
        packet.interned_data.event_names.add(iid=iid, name=name)
    for name, iid in ARG_IIDS.items():
        packet.interned_data.debug_annotation_names.add(iid=iid, name=name)
    packet.trace_packet_defaults.timestamp_clock_id = INCREMENTAL_CLOCK
    return clock, packet


# --- iteration packets, encoded with numpy -----------------------------------------------
@dataclass
class IterationColumns:
    """What each iteration's two packets carry, a row per iteration."""

    times: np.ndarray  # (n, 2) begin, end: ns since the packet before (incremental clock)
    kinds: np.ndarray  # the slice name's iid
    args: np.ndarray  # (n, len(ITERATION_ARGS)), 0 where not written
    cut_ms: np.ndarray  # the true length where the slice is drawn shorter, else 0
    unknown: np.ndarray  # index into unknown_table
    unknown_table: list[bytes]  # the encoded ``unknown`` args ("" first: no arg)
    int_counters: np.ndarray  # (n, int counters)
    double_counters: np.ndarray  # (n, double counters)
    flows: list[bytes]  # the flow_ids fields of the first tokens each produced

    @classmethod
    def of(
        cls, tl: EngineTimeline, counters: list[Counter], flows: list[bytes]
    ) -> IterationColumns:
        starts, ends = tl.col("start_ns"), drawn_ends(tl)
        cut_ms = np.where(ends < tl.col("end_ns"), tl.col("elapsed_ns") / 1e6, 0.0)
        codes, table = unknown_annotations(tl)
        return cls(
            incremental_times(tl.first_ns, starts, ends),
            batch_kind_iids(tl),
            iteration_args(tl),
            cut_ms,
            codes,
            table,
            counter_matrix([c for c in counters if not c.is_double], len(starts), np.int64),
            counter_matrix([c for c in counters if c.is_double], len(starts), np.float64),
            flows,
        )

    def rows(self, rows: slice) -> IterationColumns:
        return IterationColumns(
            self.times[rows],
            self.kinds[rows],
            self.args[rows],
            self.cut_ms[rows],
            self.unknown[rows],
            self.unknown_table,
            self.int_counters[rows],
            self.double_counters[rows],
            self.flows[rows],
        )


def iteration_packets(columns: IterationColumns, sequence_id: int) -> bytes:
    """Each iteration's begin and end packets, iteration after iteration."""
    n = len(columns.kinds)
    begin_event = [
        wire.constant(EVENT_TYPES[SLICE_BEGIN] + NAME_IID, n),
        wire.varint_column(columns.kinds),
        *iteration_annotations(columns),
        wire.bytes_column(columns.flows),
    ]
    end_event = [wire.constant(EVENT_TYPES[SLICE_END], n), *counter_values(columns)]
    packets = []
    for time, event in ((columns.times[:, 0], begin_event), (columns.times[:, 1], end_event)):
        body = [
            wire.constant(TIMESTAMP, n),
            wire.varint_column(time),
            wire.constant(SEQUENCE_ID + wire.varint(sequence_id), n),
            *wire.length_delimited_columns(TRACK_EVENT, event),
        ]
        packets += wire.length_delimited_columns(PACKET, body)
    return wire.join_rows(packets)


def iteration_annotations(columns: IterationColumns) -> wire.Rows:
    """The iteration slice's args: the counts not 0, elapsed_ms where cut, unknown."""
    annotations = []
    for (name, _), values in zip(ITERATION_ARGS, columns.args.T, strict=True):
        annotations += wire.optional(int_annotation(name, values), values != 0)
    elapsed = double_annotation(ELAPSED_ARG, columns.cut_ms)
    annotations += wire.optional(elapsed, columns.cut_ms != 0)
    annotations.append(wire.lookup_column(columns.unknown, columns.unknown_table))
    return annotations


def counter_values(columns: IterationColumns) -> wire.Rows:
    """Every counter's sample, in the order of the sequence's default counter tracks."""
    values = []
    for samples in columns.int_counters.T:
        values += wire.field_columns(COUNTER_VALUE, wire.varint_column(samples))
    for samples in columns.double_counters.T:
        values += wire.field_columns(DOUBLE_COUNTER_VALUE, wire.double_column(samples))
    return values


def engine_requests(tl: EngineTimeline) -> list[RequestPhases]:
    """Each request's phases, from its newest milestone, by arrival."""
    milestones = latest_milestones(m for r in tl.records for m in r.milestones)
    recording_end_ns = tl.last_ns
    return [request_phases(m, recording_end_ns) for m in milestones]


def first_token_flows(
    tl: EngineTimeline, requests: list[RequestPhases], first_id: int
) -> tuple[list[int], list[bytes]]:
    """The arrows from iterations to the first tokens they produced: each request's flow id
    (``first_id`` + its index; 0: none, no first token or none after the first iteration's
    start) and each iteration's flow_ids fields (the arrows' tails: the last iteration to start
    at or before the token); the request's decode slice terminates its flow."""
    first_tokens = np.array([r.milestone.first_token_ns for r in requests], np.int64)
    rows = np.searchsorted(tl.col("start_ns"), first_tokens, side="right") - 1
    flow_ids = [0] * len(requests)
    flows = [b""] * tl.num_iterations
    has_flow = (first_tokens > 0) & (rows >= 0)
    for index, row in zip(np.flatnonzero(has_flow).tolist(), rows[has_flow].tolist(), strict=True):
        flow_ids[index] = first_id + index
        flows[row] += FLOW_ID + wire.fixed64(first_id + index)
    return flow_ids, flows


def incremental_times(first_ns: int, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """(begin, end) of each iteration as the incremental clock has them: each the time since
    the one before (the first since ``first_ns``, the clock's snapshot)."""
    absolute = np.stack([starts, ends], axis=1).reshape(-1)
    times = np.diff(absolute, prepend=first_ns)
    if (times < 0).any():
        i = int(np.argmax(times < 0)) // 2
        raise ValueError(f"iteration {i} begins or ends before the iteration before it")
    return times.reshape(-1, 2)


# --- requests and findings: a packet per event -------------------------------------------
@dataclass(slots=True)
class Slice:
    """A finding's slice (or a request's preemption mark): its name, times and args."""

    name: str
    start_ns: int
    end_ns: int
    args: dict = field(default_factory=dict)


PREEMPTED = Slice("preempted", 0, 0)  # the instant marking a request's preemption
# The kinds of event on the request and finding lanes, and each one's TrackEvent type: each
# kind's TrackEvents are encoded together, with numpy (EventWriter.encode).
REQUEST, QUEUED, PREFILL, DECODE, END, PREEMPTION, FINDING = range(7)
KIND_TYPES = (SLICE_BEGIN, SLICE_BEGIN, SLICE_BEGIN, SLICE_BEGIN, SLICE_END, INSTANT, SLICE_BEGIN)


class EventWriter:
    """Slice begins, ends and instants on lane tracks, in one sequence with an incremental
    clock. Each event is noted as it comes (its time, kind, track and what its kind needs);
    ``write`` encodes the TrackEvents a kind at a time, puts the events in time order (those at
    one time in the order they came) and frames their packets (timestamps, lengths) with numpy,
    EVENTS_PER_WRITE at a time."""

    def __init__(self, writer: TraceWriter, sequence_id: int) -> None:
        self.writer = writer
        self.sequence_id = sequence_id
        self.times: list[int] = []
        self.kinds: list[int] = []
        self.tracks: list[int] = []
        self.requests: list[RequestPhases] = []  # a REQUEST's each
        self.chunks: list[int] = []  # a PREFILL's chunk index and number of tokens each
        self.flows: list[int] = []  # a DECODE's flow id each (0: none)
        self.findings: list[bytes] = []  # a FINDING's name and args each, encoded

    def request(self, request: RequestPhases, track_uuid: int, flow_id: int) -> None:
        """The request's slice, its phases nested in it (its decode slice ends the flow
        ``flow_id`` from the iteration of its first token; 0: none), and its preemptions."""
        times, kinds = self.times, self.kinds
        first = len(times)
        times += (request.start_ns, request.queued_start_ns, request.queued_end_ns)
        kinds += (REQUEST, QUEUED, END)
        self.requests.append(request)
        self._prefills(request.prefills)
        if request.decode_start_ns is not None:
            times.append(request.decode_start_ns)
            kinds.append(DECODE)
            self.flows.append(flow_id)
            self._prefills(request.recomputed)
            times.append(request.end_ns)
            kinds.append(END)
        times.append(request.end_ns)
        kinds.append(END)
        preempted_ns = request.milestone.preempted_ns  # after the events at the same time
        times += preempted_ns
        kinds += [PREEMPTION] * len(preempted_ns)
        self.tracks += [track_uuid] * (len(times) - first)

    def _prefills(self, chunks: list[Chunk]) -> None:
        for start_ns, end_ns, index, num_tokens in chunks:
            self.times += (start_ns, end_ns)
            self.kinds += (PREFILL, END)
            self.chunks += (index, num_tokens)

    def slice(self, finding: Slice, track_uuid: int) -> None:
        self.times += (finding.start_ns, finding.end_ns)
        self.kinds += (FINDING, END)
        self.tracks += (track_uuid, track_uuid)
        self.findings.append(slice_bytes(finding))

    def write(self) -> None:
        """The sequence: its first packets, then every event in time order."""
        if not self.times:
            return
        times = np.array(self.times, np.int64)
        order = np.argsort(times, kind="stable")
        for packet in sequence_start(self.sequence_id, int(times[order[0]])):
            self.writer.write_message(packet)
        deltas = np.diff(times[order], prepend=times[order[0]])
        sequence = SEQUENCE_ID + wire.varint(self.sequence_id)
        encoded, starts, lengths = self.encode()
        for start in range(0, len(order), EVENTS_PER_WRITE):
            rows = order[start : start + EVENTS_PER_WRITE]
            body = [
                wire.constant(TIMESTAMP, len(rows)),
                wire.varint_column(deltas[start : start + len(rows)]),
                wire.constant(sequence, len(rows)),
                *wire.length_delimited_columns(
                    TRACK_EVENT, [wire.slices_column(encoded, starts[rows], lengths[rows])]
                ),
            ]
            self.writer.write(wire.join_rows(wire.length_delimited_columns(PACKET, body)))

    def encode(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every event's TrackEvent: the bytes of all (a kind's after another's), and where
        each event begins in them and how long it is, in the order the events came."""
        kinds = np.array(self.kinds, np.int8)
        tracks = np.array(self.tracks, np.int64)
        counts = np.bincount(kinds, minlength=len(KIND_TYPES)).tolist()
        starts = np.zeros(len(kinds), np.int64)
        lengths = np.zeros(len(kinds), np.int64)
        parts, size = [], 0
        for kind, payload in enumerate(self._payloads(counts)):
            if not counts[kind]:
                continue
            rows = np.flatnonzero(kinds == kind)
            columns = [
                wire.constant(EVENT_TYPES[KIND_TYPES[kind]] + TRACK_UUID, len(rows)),
                wire.varint_column(tracks[rows]),
                *payload,
            ]
            row_lengths = wire.rows_length(columns)
            starts[rows] = size + np.cumsum(row_lengths) - row_lengths
            lengths[rows] = row_lengths
            parts.append(wire.join_rows(columns))
            size += len(parts[-1])
        return np.frombuffer(b"".join(parts) + b"\0", np.uint8), starts, lengths

    def _payloads(self, counts: list[int]) -> list[wire.Rows]:
        """What follows the type and track in each kind's TrackEvents (``counts``: how many
        there are of each kind)."""
        chunks = np.array(self.chunks, np.int64).reshape(-1, 2)
        flows = np.array(self.flows, np.uint64)
        flow = wire.field_columns(TERMINATING_FLOW_ID, wire.fixed64_column(flows))
        return [
            request_begins(self.requests),  # REQUEST
            [wire.constant(event_name("queued"), counts[QUEUED])],
            [
                wire.constant(event_name("prefill"), counts[PREFILL]),
                *int_annotation("chunk_index", chunks[:, 0]),
                *int_annotation("num_tokens", chunks[:, 1]),
            ],
            [wire.constant(event_name("decode"), counts[DECODE]), *wire.optional(flow, flows != 0)],
            [],  # END
            [wire.constant(slice_bytes(PREEMPTED), counts[PREEMPTION])],
            [wire.bytes_column(self.findings)],  # FINDING
        ]


def request_begins(requests: list[RequestPhases]) -> wire.Rows:
    """A request slice's name and args: its outcome (finish reason, tokens, preemptions, and
    TTFT and queue time where it has them)."""
    milestones = [r.milestone for r in requests]
    names = [wire.length_delimited(NAME, f"request {m.request_id}".encode()) for m in milestones]
    reasons = [r.finish_reason for r in requests]
    table = {reason: code for code, reason in enumerate(dict.fromkeys(reasons))}
    codes = np.array([table[reason] for reason in reasons], np.int64)
    begins = [
        wire.bytes_column(names),
        wire.lookup_column(codes, [annotation("finish_reason", reason) for reason in table]),
    ]
    values = np.array([REQUEST_NUMBERS(m) for m in milestones], np.int64).reshape(-1, 7)
    for name, column in zip(REQUEST_COUNTS, values[:, :4].T, strict=True):
        begins += int_annotation(name, column)
    arrival_ns, first_token_ns, first_scheduled_ns = values[:, 4:].T
    for name, ns in (("ttft_ms", first_token_ns), ("queue_ms", first_scheduled_ns)):
        ms = double_annotation(name, (ns - arrival_ns) / 1e6)
        begins += wire.optional(ms, ns != 0)
    return begins


def int_annotation(name: str, values: np.ndarray) -> wire.Rows:
    """A debug annotation per row: the interned arg ``name`` with an integer value."""
    named = wire.constant(INTERNED_ARG_NAMES[name] + INT_VALUE, len(values))
    return wire.length_delimited_columns(ANNOTATION, [named, wire.varint_column(values)])


def double_annotation(name: str, values: np.ndarray) -> wire.Rows:
    """A debug annotation per row: the interned arg ``name`` with a double value."""
    named = wire.constant(INTERNED_ARG_NAMES[name] + DOUBLE_VALUE, len(values))
    return wire.length_delimited_columns(ANNOTATION, [named, wire.double_column(values)])


def slice_bytes(drawn: Slice) -> bytes:
    """A slice's name and args, as a TrackEvent's fields."""
    encoded = event_name(drawn.name)
    for name, value in drawn.args.items():
        encoded += annotation(name, value)
    return encoded


def event_name(name: str) -> bytes:
    interned = INTERNED_EVENT_NAMES.get(name)
    return interned if interned is not None else wire.length_delimited(NAME, name.encode())


def annotation(name: str, value: object) -> bytes:
    """A debug annotation: its name (interned where it can be) and its value by type."""
    kind = type(value)
    if kind is float:  # a time in ms: nearly every one differs, not worth a cache entry
        return _encode_annotation(name, kind, value)
    return _annotation(name, kind, value)


@functools.lru_cache(maxsize=1 << 16)  # a request's counts and reasons repeat: encoded once
def _annotation(name: str, kind: type, value: object) -> bytes:
    return _encode_annotation(name, kind, value)


def _encode_annotation(name: str, kind: type, value: object) -> bytes:
    encoded = INTERNED_ARG_NAMES.get(name) or wire.length_delimited(ARG_NAME, name.encode())
    if kind is bool:
        encoded += BOOL_VALUE + wire.varint(int(value))
    elif issubclass(kind, int):
        encoded += INT_VALUE + wire.varint(int(value))
    elif issubclass(kind, float):
        encoded += DOUBLE_VALUE + wire.double(float(value))
    else:
        encoded += wire.length_delimited(STRING_VALUE, str(value).encode())
    return wire.length_delimited(ANNOTATION, encoded)


def write_trace(
    timelines: dict[int, EngineTimeline],
    out: BinaryIO,
    thresholds: Thresholds | None = None,
    earlier: dict[int, EarlierFile] | None = None,
) -> TraceCounts:
    """Every engine of ``timelines`` into ``out`` as one Perfetto trace (the findings of an
    engine in ``earlier`` over its earlier file too: see EarlierFile)."""
    writer = TraceWriter(out, thresholds, earlier)
    with cyclic_gc_paused():
        for tl in timelines.values():
            writer.write_engine(tl)
    return writer.close()


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Python's cycle collector off while the trace is written: the writer allocates about a
    million short-lived objects (phases, events), none in a cycle, while the process holds
    millions more (the records), which each collection would scan again for nothing (a
    quarter of an hour's write time). Reference counting still frees everything."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# --- what the slices and tracks say ------------------------------------------------------
def process_name(tl: EngineTimeline) -> str:
    """'engine 0: MODEL on DEVICE, N KV blocks x B tokens', what the engine reported of it."""
    facts = tl.facts
    what = facts.get("model_name", "unknown model")
    if facts.get("device_name"):
        what += f" on {facts['device_name']}"
    blocks = tl.num_kv_blocks_total or tl.facts.get("num_kv_blocks_total", 0)
    if blocks:
        what += f", {blocks} KV blocks"
        if facts.get("block_size"):
            what += f" x {facts['block_size']} tokens"
    return f"{engine_category(tl.engine_index)}: {what}"


def process_labels(tl: EngineTimeline) -> list[str]:
    return [f"{name}={value}" for name, value in sorted(tl.facts.items())]


def batch_kind_iids(tl: EngineTimeline) -> np.ndarray:
    """The interned name (1 + index into BATCH_KINDS) of each iteration's slice."""
    prefill = tl.col("num_prefill_tokens") > 0
    decode = tl.col("num_decode_reqs") > 0
    return 1 + prefill.astype(np.int64) + 2 * decode.astype(np.int64)


def drawn_ends(tl: EngineTimeline) -> np.ndarray:
    """Each iteration's end, cut at the next one's start (see the module doc)."""
    ends = tl.col("end_ns").copy()
    if len(ends) > 1:
        ends[:-1] = np.minimum(ends[:-1], tl.col("start_ns")[1:])
    return ends


def counter_matrix(counters: list[Counter], num_iterations: int, dtype) -> np.ndarray:
    """Each iteration's samples of ``counters`` (a column each, in that order)."""
    if not counters:
        return np.zeros((num_iterations, 0), dtype)
    return np.stack([c.values for c in counters], axis=1).astype(dtype)


def iteration_args(tl: EngineTimeline) -> np.ndarray:
    """Each iteration's ITERATION_ARGS values (a column each, in that order), 0 where the
    source did not give the count (unknown_annotations names those)."""
    unknown = tl.col("unknown")
    columns = [
        np.where(unknown & bit, 0, tl.col(name)) if bit else tl.col(name)
        for name, bit in ITERATION_ARGS
    ]
    return np.stack(columns, axis=1).astype(np.int64)


def unknown_annotations(tl: EngineTimeline) -> tuple[np.ndarray, list[bytes]]:
    """Each iteration's ``unknown`` arg (the counts its source did not give) as an index into
    a table of the encoded args, whose first entry is empty (all counts given)."""
    bits, codes = np.unique(tl.col("unknown"), return_inverse=True)
    table = [unknown_annotation(int(b)) for b in bits]
    if 0 not in bits:
        table, codes = [b"", *table], codes + 1
    return codes.reshape(-1), table


def unknown_annotation(bits: int) -> bytes:
    if not bits:
        return b""
    return annotation(UNKNOWN_ARG, ", ".join(n for bit, n in UNKNOWN_NAMES.items() if bits & bit))


NumberedSlice = tuple[int, Slice]  # a finding's slice, and the finding's number


def finding_slices(tl: EngineTimeline, thresholds: Thresholds) -> Iterator[NumberedSlice]:
    """A slice per episode of each finding explain reports, with the finding's action, and
    the finding's number among them."""
    episodes = detect_episodes(tl, thresholds)
    for number, finding in enumerate(build_findings(tl, episodes, thresholds)):
        action = finding_action(tl, finding, thresholds)
        for episode, cost in zip(finding.episodes, finding.costs, strict=True):
            args = {
                "title": episode.title,
                "evidence": episode.evidence,
                "action": action,
                "cost_request_s": cost,
                "cost_label": finding.cost_label,
                "explanation": episode.explanation,
            }
            yield number, Slice(f"finding {finding.kind}", episode.start_ns, episode.end_ns, args)


def continued_findings(earlier: EarlierFile, thresholds: Thresholds) -> list[NumberedSlice]:
    """The findings over both files that end after the earlier file; each that began before
    it ended is marked, as whole or as cut at the start of the messages held."""
    tl = earlier.timeline
    first_ns = int(tl.col("start_ns")[0]) if tl.num_iterations else tl.first_ns
    found = []
    for number, finding in finding_slices(tl, thresholds):
        if finding.end_ns <= earlier.end_ns:
            continue  # drawn whole in the earlier file
        if finding.start_ns <= earlier.end_ns:
            whole = finding.start_ns > first_ns  # not where the messages held begin
            finding.args[CONTINUED_ARG] = CONTINUED_WHOLE if whole else CONTINUED_CUT
        found.append((number, finding))
    return found
