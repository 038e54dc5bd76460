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

Slices of one track never overlap: an iteration that a source reports as ending after the
next one starts (an asynchronous scheduler) is drawn up to that start, its true length in
``elapsed_ms``. A count the source did not give (record.UNKNOWN_*) is named in the
iteration's ``unknown`` arg and its counter track is not drawn, never shown as 0.

Encoding: one trusted packet sequence per engine. Its first packet clears the incremental
state, interns the iteration slice names and argument names, and sets the defaults
(the iterations track, the counter tracks) so that an iteration costs two small packets: a
slice begin with its args and a slice end carrying every counter's sample. Packets are built
with the perfetto package's TraceProtoBuilder and written in batches (a trace file is a
sequence of packets, so batches concatenate into one valid trace).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import (
    CounterDescriptor,
    TracePacket,
    TrackEvent,
)
from perfetto.trace_builder.proto_builder import TraceProtoBuilder

from telemetry.analysis.actions import finding_action
from telemetry.analysis.episodes import Thresholds, detect_episodes
from telemetry.analysis.findings import build_findings
from telemetry.analysis.request_phases import (
    Phase,
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
PACKETS_PER_WRITE = 4096
SLICE_BEGIN = TrackEvent.TYPE_SLICE_BEGIN
SLICE_END = TrackEvent.TYPE_SLICE_END
INSTANT = TrackEvent.TYPE_INSTANT
CLEARED = TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
NEEDS_STATE = TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
COUNT = CounterDescriptor.UNIT_COUNT
TIME_NS = CounterDescriptor.UNIT_TIME_NS
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
)
PREEMPTED = Phase("preempted", 0, 0)  # the instant marking a request's preemption
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
FINDING_ARGS = ("title", "evidence", "action", "cost_request_s", "cost_label", "explanation")
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
ITERATION_ARG_IIDS = tuple(ARG_IIDS[name] for name, _ in ITERATION_ARGS)
ELAPSED_IID = ARG_IIDS[ELAPSED_ARG]
UNKNOWN_IID = ARG_IIDS[UNKNOWN_ARG]
UNKNOWN_NAMES = {
    UNKNOWN_PREFILL_REQS: "num_prefill_reqs",
    UNKNOWN_ELAPSED: "elapsed_ns",
    UNKNOWN_WAITING_REASONS: "waiting reasons",
    UNKNOWN_KV_TOKENS: "num_kv_tokens",
}


@dataclass
class TraceCounts:
    """What a trace holds, for the command's message and the checks."""

    num_engines: int = 0
    num_iterations: int = 0
    num_counter_samples: int = 0
    num_requests: int = 0
    num_findings: int = 0
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
            col("num_prefill_tokens") + col("num_decode_tokens"),
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


class TraceWriter:
    """Writes engines' timelines to a binary file as one Perfetto trace."""

    def __init__(self, out: BinaryIO, thresholds: Thresholds | None = None) -> None:
        self.out = out
        self.thresholds = thresholds or Thresholds()
        self.counts = TraceCounts()
        self._builder = TraceProtoBuilder()
        self._num_pending = 0
        self._next_uuid = 1

    def write_engine(self, tl: EngineTimeline) -> None:
        """Every iteration, counter sample, request and finding of one engine."""
        process_uuid = self._process(tl)
        iterations_uuid = self._track(process_uuid, "iterations")
        counters = engine_counters(tl)
        counter_uuids = [self._counter_track(process_uuid, c) for c in counters]
        sequence_id = tl.engine_index + 1
        self._start_sequence(tl, sequence_id, iterations_uuid, counters, counter_uuids)
        self._iterations(tl, sequence_id, counters)
        self._requests(tl, sequence_id, process_uuid)
        self._findings(tl, sequence_id, process_uuid)
        self.counts.num_engines += 1

    def close(self) -> TraceCounts:
        """Write what is pending; the trace is complete once this returns."""
        self._flush()
        self.out.flush()
        return self.counts

    # --- packets -----------------------------------------------------------------------
    def _packet(self) -> TracePacket:
        self._num_pending += 1
        if self._num_pending > PACKETS_PER_WRITE:
            self._flush()
            self._num_pending = 1
        return self._builder.add_packet()

    def _flush(self) -> None:
        data = self._builder.serialize()
        self.out.write(data)
        self.counts.num_bytes += len(data)
        self._builder = TraceProtoBuilder()
        self._num_pending = 0

    def _uuid(self) -> int:
        self._next_uuid += 1
        return self._next_uuid - 1

    # --- tracks ------------------------------------------------------------------------
    def _process(self, tl: EngineTimeline) -> int:
        uuid = self._uuid()
        descriptor = self._packet().track_descriptor
        descriptor.uuid = uuid
        descriptor.process.pid = tl.engine_index + 1  # engines may share a real pid (vLLM DP)
        descriptor.process.process_name = process_name(tl)
        descriptor.process.process_labels.extend(process_labels(tl))
        return uuid

    def _track(self, parent_uuid: int, name: str) -> int:
        return self._descriptor(parent_uuid, name).uuid

    def _lanes(self, parent_uuid: int, name: str, lanes: list[int]) -> list[int]:
        """A track per lane in ``lanes``, named "NAME 1", "NAME 2", ..."""
        return [
            self._track(parent_uuid, f"{name} {n + 1}") for n in range(max(lanes, default=-1) + 1)
        ]

    def _descriptor(self, parent_uuid: int, name: str):
        descriptor = self._packet().track_descriptor
        descriptor.uuid = self._uuid()
        descriptor.parent_uuid = parent_uuid
        descriptor.name = name
        return descriptor

    def _counter_track(self, parent_uuid: int, counter: Counter) -> int:
        descriptor = self._descriptor(parent_uuid, counter.name)
        descriptor.counter.unit = counter.unit
        if counter.unit_name:
            descriptor.counter.unit_name = counter.unit_name
        return descriptor.uuid

    def _start_sequence(self, tl, sequence_id, iterations_uuid, counters, counter_uuids) -> None:
        packet = self._packet()
        packet.timestamp = tl.first_ns
        packet.trusted_packet_sequence_id = sequence_id
        packet.sequence_flags = CLEARED | NEEDS_STATE  # as Perfetto documents a first packet
        defaults = packet.trace_packet_defaults.track_event_defaults
        defaults.track_uuid = iterations_uuid
        for counter, uuid in zip(counters, counter_uuids, strict=True):
            if counter.is_double:
                defaults.extra_double_counter_track_uuids.append(uuid)
            else:
                defaults.extra_counter_track_uuids.append(uuid)
        interned = packet.interned_data
        for name, iid in EVENT_IIDS.items():
            interned.event_names.add(iid=iid, name=name)
        for name, iid in ARG_IIDS.items():
            interned.debug_annotation_names.add(iid=iid, name=name)

    # --- iterations --------------------------------------------------------------------
    def _iterations(self, tl: EngineTimeline, sequence_id: int, counters: list[Counter]) -> None:
        starts = tl.col("start_ns").tolist()
        ends = drawn_ends(tl)
        cut_ms = np.where(ends < tl.col("end_ns"), tl.col("elapsed_ns") / 1e6, 0.0).tolist()
        ends = ends.tolist()
        kinds = batch_kind_iids(tl).tolist()
        args = iteration_arg_rows(tl)
        unknown = unknown_texts(tl)
        ints = counter_rows([c for c in counters if not c.is_double], len(starts))
        doubles = counter_rows([c for c in counters if c.is_double], len(starts))
        for i, (start_ns, end_ns) in enumerate(zip(starts, ends, strict=True)):
            event = self._event_packet(start_ns, sequence_id, SLICE_BEGIN).track_event
            event.name_iid = kinds[i]
            add = event.debug_annotations.add
            for iid, value in zip(ITERATION_ARG_IIDS, args[i], strict=True):
                if value:
                    add(name_iid=iid, int_value=value)
            if cut_ms[i]:
                add(name_iid=ELAPSED_IID, double_value=cut_ms[i])
            if unknown[i]:
                add(name_iid=UNKNOWN_IID, string_value=unknown[i])
            event = self._event_packet(end_ns, sequence_id, SLICE_END).track_event
            event.extra_counter_values.extend(ints[i])
            event.extra_double_counter_values.extend(doubles[i])
        self.counts.num_iterations += len(starts)
        self.counts.num_counter_samples += len(starts) * len(counters)

    # --- requests ----------------------------------------------------------------------
    def _requests(self, tl: EngineTimeline, sequence_id: int, process_uuid: int) -> None:
        milestones = latest_milestones(m for r in tl.records for m in r.milestones)
        requests = [request_phases(m, tl.last_ns) for m in milestones]
        lanes = assign_lanes([(r.start_ns, r.end_ns) for r in requests])
        lane_uuids = self._lanes(process_uuid, "requests", lanes)
        for request, lane in zip(requests, lanes, strict=True):
            self._request(request, sequence_id, lane_uuids[lane])
        self.counts.num_requests += len(requests)

    def _request(self, request: RequestPhases, sequence_id: int, track_uuid: int) -> None:
        whole = Phase(
            f"request {request.milestone.request_id}",
            request.start_ns,
            request.end_ns,
            request_args(request),
            request.phases,
        )
        events = slice_events(whole)
        events += [(ts_ns, INSTANT, PREEMPTED) for ts_ns in request.milestone.preempted_ns]
        events.sort(key=lambda event: event[0])  # stable: nesting kept at equal times
        for ts_ns, kind, phase in events:
            self._event(ts_ns, kind, phase, sequence_id, track_uuid)

    def _slice(self, phase: Phase, sequence_id: int, track_uuid: int) -> None:
        for ts_ns, kind, event_phase in slice_events(phase):
            self._event(ts_ns, kind, event_phase, sequence_id, track_uuid)

    def _event(self, ts_ns: int, kind: int, phase: Phase, sequence_id: int, track_uuid: int):
        event = self._event_packet(ts_ns, sequence_id, kind, track_uuid).track_event
        if kind == SLICE_END:
            return
        _set_name(event, phase.name)
        for name, value in phase.args.items():
            annotation = event.debug_annotations.add()
            if name in ARG_IIDS:
                annotation.name_iid = ARG_IIDS[name]
            else:
                annotation.name = name
            _set_arg(annotation, value)

    def _event_packet(
        self, ts_ns: int, sequence_id: int, kind: int, track_uuid: int | None = None
    ) -> TracePacket:
        """A track event of ``kind`` at ``ts_ns`` in the sequence; on ``track_uuid``, or on
        the sequence's default track (the iterations') when None, which saves its bytes."""
        packet = self._packet()
        packet.timestamp = ts_ns
        packet.trusted_packet_sequence_id = sequence_id
        packet.sequence_flags = NEEDS_STATE
        packet.track_event.type = kind
        if track_uuid is not None:
            packet.track_event.track_uuid = track_uuid
        return packet

    # --- findings ----------------------------------------------------------------------
    def _findings(self, tl: EngineTimeline, sequence_id: int, process_uuid: int) -> None:
        slices = sorted(finding_slices(tl, self.thresholds), key=lambda s: s.start_ns)
        lanes = assign_lanes([(s.start_ns, s.end_ns) for s in slices])
        lane_uuids = self._lanes(process_uuid, "findings", lanes)
        for finding_slice, lane in zip(slices, lanes, strict=True):
            self._slice(finding_slice, sequence_id, lane_uuids[lane])
        self.counts.num_findings += len(slices)


def write_trace(
    timelines: dict[int, EngineTimeline], out: BinaryIO, thresholds: Thresholds | None = None
) -> TraceCounts:
    """Every engine of ``timelines`` into ``out`` as one Perfetto trace."""
    writer = TraceWriter(out, thresholds)
    for tl in timelines.values():
        writer.write_engine(tl)
    return writer.close()


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


def counter_rows(counters: list[Counter], num_iterations: int) -> list[list]:
    """Each iteration's samples of ``counters``, in that order."""
    if not counters:
        return [[] for _ in range(num_iterations)]
    return np.stack([c.values for c in counters], axis=1).tolist()


def iteration_arg_rows(tl: EngineTimeline) -> list[list[int]]:
    """Each iteration's ITERATION_ARGS values in that order, 0 where the source did not give
    the count (unknown_texts names those)."""
    unknown = tl.col("unknown")
    columns = [
        np.where(unknown & bit, 0, tl.col(name)) if bit else tl.col(name)
        for name, bit in ITERATION_ARGS
    ]
    return np.stack(columns, axis=1).tolist() if columns[0].size else []


def unknown_texts(tl: EngineTimeline) -> list[str]:
    """Each iteration's ``unknown`` arg: the counts its source did not give, or ""."""
    texts = {0: ""}
    for bits in set(tl.col("unknown").tolist()) - {0}:
        texts[bits] = ", ".join(name for bit, name in UNKNOWN_NAMES.items() if bits & bit)
    return [texts[bits] for bits in tl.col("unknown").tolist()]


def request_args(request: RequestPhases) -> dict:
    """The request's outcome: finish reason, TTFT, queue time, tokens, preemptions."""
    m = request.milestone
    args = {
        "finish_reason": request.finish_reason,
        "num_prompt_tokens": m.num_prompt_tokens,
        "num_cached_tokens": m.num_cached_tokens,
        "num_output_tokens": m.num_output_tokens,
        "num_preemptions": m.num_preemptions,
    }
    if m.first_token_ns:
        args["ttft_ms"] = (m.first_token_ns - m.arrival_ns) / 1e6
    if m.first_scheduled_ns:
        args["queue_ms"] = (m.first_scheduled_ns - m.arrival_ns) / 1e6
    return args


def finding_slices(tl: EngineTimeline, thresholds: Thresholds) -> Iterator[Phase]:
    """A slice per episode of each finding explain reports, with the finding's action."""
    episodes = detect_episodes(tl, thresholds)
    for finding in build_findings(tl, episodes):
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
            yield Phase(f"finding {finding.kind}", episode.start_ns, episode.end_ns, args)


def slice_events(phase: Phase) -> list[tuple[int, int, Phase]]:
    """(time, SLICE_BEGIN or SLICE_END, phase) of a phase and its children, nested, in time
    order (request_phases keeps children inside their parent and after one another)."""
    events = [(phase.start_ns, SLICE_BEGIN, phase)]
    for child in phase.children:
        events += slice_events(child)
    events.append((phase.end_ns, SLICE_END, phase))
    return events


def _set_name(event: TrackEvent, name: str) -> None:
    if name in EVENT_IIDS:
        event.name_iid = EVENT_IIDS[name]
    else:
        event.name = name


def _set_arg(annotation, value: object) -> None:
    if isinstance(value, bool):
        annotation.bool_value = value
    elif isinstance(value, int):
        annotation.int_value = value
    elif isinstance(value, float):
        annotation.double_value = value
    else:
        annotation.string_value = str(value)
