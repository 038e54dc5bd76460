"""A Perfetto trace read back with perfetto's own protos, the way its trace processor reads
TrackEvents: interned names and track defaults per packet sequence, slices from BEGIN/END
pairs per track (nested ones with their depth), counter samples from counter_value and the
extra counter values of any event, flows as the slices that name each flow id (flow_ids,
terminating_flow_ids) in packet order, timestamps of a sequence-scoped incremental clock (a clock
snapshot's is_incremental, the packet's or the defaults' timestamp_clock_id) each added to the
one before, from the snapshot's value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent


@dataclass
class Slice:
    name: str
    start_ns: int
    end_ns: int = -1
    depth: int = 0
    args: dict = field(default_factory=dict)


@dataclass
class ReadTrace:
    tracks: dict  # uuid -> TrackDescriptor
    slices: dict = field(default_factory=dict)  # track uuid -> [Slice] in begin order
    instants: dict = field(default_factory=dict)  # track uuid -> [Slice]
    counters: dict = field(default_factory=dict)  # track uuid -> [(ts_ns, value)]
    timestamps: dict = field(default_factory=dict)  # track uuid -> [ts_ns] in packet order
    flows: dict = field(default_factory=dict)  # flow id -> [(track uuid, Slice)]: its slices

    def track_named(self, name: str, parent_uuid: int | None = None) -> int:
        uuids = [
            u
            for u, d in self.tracks.items()
            if d.name == name and (parent_uuid is None or d.parent_uuid == parent_uuid)
        ]
        assert len(uuids) == 1, f"{len(uuids)} tracks named {name!r}"
        return uuids[0]

    def processes(self) -> dict[int, object]:
        return {u: d for u, d in self.tracks.items() if d.HasField("process")}

    def children(self, parent_uuid: int, prefix: str = "") -> list[int]:
        return [
            u
            for u, d in self.tracks.items()
            if d.parent_uuid == parent_uuid and d.name.startswith(prefix)
        ]


class _Sequence:
    def __init__(self) -> None:
        self.event_names: dict[int, str] = {}
        self.arg_names: dict[int, str] = {}
        self.track_uuid = 0
        self.extra_uuids: list[int] = []
        self.extra_double_uuids: list[int] = []
        self.clock_id = 0  # the defaults' timestamp_clock_id
        self.incremental_clocks: dict[int, int] = {}  # clock id -> its latest timestamp


def read_trace(path: Path) -> ReadTrace:
    trace = Trace.FromString(Path(path).read_bytes())
    read = ReadTrace(
        {
            p.track_descriptor.uuid: p.track_descriptor
            for p in trace.packet
            if p.HasField("track_descriptor")
        }
    )
    sequences: dict[int, _Sequence] = {}
    open_slices: dict[int, list[Slice]] = {}
    for packet in trace.packet:
        if packet.HasField("track_descriptor"):
            continue
        sequence = sequences.setdefault(packet.trusted_packet_sequence_id, _Sequence())
        _take_state(packet, sequence)
        ts_ns = _timestamp(packet, sequence)
        if packet.HasField("track_event"):
            _take_event(read, sequence, open_slices, ts_ns, packet.track_event)
    assert not any(open_slices.values()), "slices never ended"
    return read


def _take_state(packet, sequence: _Sequence) -> None:
    if packet.sequence_flags & packet.SEQ_INCREMENTAL_STATE_CLEARED:
        sequence.__init__()
    for entry in packet.interned_data.event_names:
        sequence.event_names[entry.iid] = entry.name
    for entry in packet.interned_data.debug_annotation_names:
        sequence.arg_names[entry.iid] = entry.name
    for clock in packet.clock_snapshot.clocks:
        if clock.is_incremental:
            assert clock.unit_multiplier_ns in (0, 1), "only ns clocks are read"
            sequence.incremental_clocks[clock.clock_id] = clock.timestamp
    if packet.HasField("trace_packet_defaults"):
        sequence.clock_id = packet.trace_packet_defaults.timestamp_clock_id
        defaults = packet.trace_packet_defaults.track_event_defaults
        sequence.track_uuid = defaults.track_uuid
        sequence.extra_uuids = list(defaults.extra_counter_track_uuids)
        sequence.extra_double_uuids = list(defaults.extra_double_counter_track_uuids)


def _timestamp(packet, sequence: _Sequence) -> int:
    """The packet's time on the trace's clock (the snapshots here map each incremental clock
    to it one to one)."""
    clock_id = packet.timestamp_clock_id or sequence.clock_id
    if clock_id not in sequence.incremental_clocks:
        assert not clock_id or packet.HasField("clock_snapshot"), f"unknown clock {clock_id}"
        return packet.timestamp
    if packet.HasField("timestamp"):
        sequence.incremental_clocks[clock_id] += packet.timestamp
    return sequence.incremental_clocks[clock_id]


def _take_event(read: ReadTrace, sequence: _Sequence, open_slices, ts_ns: int, event) -> None:
    track = event.track_uuid or sequence.track_uuid
    read.timestamps.setdefault(track, []).append(ts_ns)
    for uuids, values in (
        (event.extra_counter_track_uuids or sequence.extra_uuids, event.extra_counter_values),
        (
            event.extra_double_counter_track_uuids or sequence.extra_double_uuids,
            event.extra_double_counter_values,
        ),
    ):
        if values:  # the trace processor takes values only with a track for each
            for uuid, value in zip(uuids, values, strict=True):
                read.counters.setdefault(uuid, []).append((ts_ns, value))
    stack = open_slices.setdefault(track, [])
    if event.type == TrackEvent.TYPE_SLICE_END:
        stack.pop().end_ns = ts_ns
        return
    name = event.name or sequence.event_names[event.name_iid]
    args = {
        (a.name or sequence.arg_names[a.name_iid]): _arg_value(a) for a in event.debug_annotations
    }
    new = Slice(name, ts_ns, depth=len(stack), args=args)
    for flow_id in [*event.flow_ids, *event.terminating_flow_ids]:
        read.flows.setdefault(flow_id, []).append((track, new))
    if event.type == TrackEvent.TYPE_INSTANT:
        new.end_ns = ts_ns
        read.instants.setdefault(track, []).append(new)
        return
    read.slices.setdefault(track, []).append(new)
    stack.append(new)


def _arg_value(annotation):
    kind = annotation.WhichOneof("value")
    return getattr(annotation, kind)
