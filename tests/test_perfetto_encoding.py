"""The hand-encoded trace (proto_wire.py, perfetto_trace.py) reads back as the trace built with
perfetto's own TraceProtoBuilder did, and its encoder writes what protobuf writes.

tests/data/timeline_golden holds three scenario recordings, a small one with preempted requests
(their marks among their phases), and the traces that the earlier, object-built writer
(commit 14452ea) made of them (gzip): each recording is converted again and both traces
are read with perfetto's protos (tests/helpers/perfetto_reader.py) and compared track by track:
names, slices with their times, depths and args, instants, counter samples.
"""

import gzip
import math
import random
from pathlib import Path

import numpy as np
import pytest
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import DebugAnnotation, TrackEvent

from telemetry.analysis import proto_wire as wire
from telemetry.analysis.actions import finding_action
from telemetry.analysis.episodes import INFO, Thresholds, detect_episodes
from telemetry.analysis.findings import build_findings, episode_cost
from telemetry.analysis.perfetto_trace import annotation
from telemetry.analysis.timeline import read_timelines
from telemetry.analysis.timeline_command import main
from tests.helpers.perfetto_reader import read_trace

GOLDEN = Path(__file__).parent / "data" / "timeline_golden"
RECORDINGS = ["story1_KV_cliff", "KV_capacity", "preemption_storm", "preemptions"]
# A finding slice's args that today's rules write, compared with them, not with the golden
TODAYS_ARGS = ("cost_request_s", "action", "evidence", "explanation")


def by_name(trace):
    """The trace keyed by track names (uuids may differ): each track's slices, instants and
    counter samples; the processes' names and labels."""
    name = {uuid: d.name or d.process.process_name for uuid, d in trace.tracks.items()}
    drawn = {}
    for what, table in (("slices", trace.slices), ("instants", trace.instants)):
        for uuid, slices in table.items():
            drawn[(what, name[uuid])] = [
                (s.name, s.start_ns, s.end_ns, s.depth, s.args) for s in slices
            ]
    for uuid, samples in trace.counters.items():
        drawn[("counter", name[uuid])] = samples
    processes = {
        (d.process.pid, d.process.process_name, tuple(d.process.process_labels))
        for d in trace.processes().values()
    }
    counters = {(d.name, d.counter.unit, d.counter.unit_name) for d in trace.tracks.values()}
    return drawn, processes, counters


def pop_args(drawn, name: str) -> dict:
    """The findings' arg ``name`` taken out of ``by_name``'s slices: {(start, end): value}."""
    values = {}
    for (what, _), slices in drawn[0].items():
        for slice_name, start_ns, end_ns, _, args in slices if what == "slices" else ():
            if slice_name.startswith("finding ") and name in args:
                values[(start_ns, end_ns)] = args.pop(name)
    return values


@pytest.mark.parametrize("recording", RECORDINGS)
def test_the_trace_reads_back_as_the_object_built_one_did(recording, tmp_path):
    source = tmp_path / f"{recording}.jsonl"
    source.write_bytes(gzip.decompress((GOLDEN / f"{recording}.jsonl.gz").read_bytes()))
    before = tmp_path / "before.pftrace"
    before.write_bytes(gzip.decompress((GOLDEN / f"{recording}.pftrace.gz").read_bytes()))
    after = tmp_path / "after.pftrace"
    assert main([str(source), "-o", str(after)]) == 0
    drawn = by_name(read_trace(after))
    today = {name: pop_args(drawn, name) for name in TODAYS_ARGS}
    costs, actions = today["cost_request_s"], today["action"]
    golden = by_name(read_trace(before))
    for name in TODAYS_ARGS:
        pop_args(golden, name)
    assert drawn == golden
    # the costs, actions, evidence and explanations are today's rules' (an episode no longer
    # costs the iteration that starts as its last one ends, actions are drawn from the 30 s
    # before an episode, a KV saturation counts the preemption that ended it, as they were
    # not when the golden traces were made)
    (timeline,) = read_timelines([source])[0].values()
    episodes = detect_episodes(timeline)
    drawn_episodes = [
        e for f in build_findings(timeline, episodes, Thresholds()) for e in f.episodes
    ]
    for name in ("evidence", "explanation"):
        assert today[name] == {(e.start_ns, e.end_ns): getattr(e, name) for e in drawn_episodes}
    assert costs == {
        (e.start_ns, e.end_ns): pytest.approx(episode_cost(timeline, e, Thresholds()))
        for e in episodes
        if e.severity != INFO
    }
    assert actions == {
        (e.start_ns, e.end_ns): finding_action(timeline, finding, Thresholds())
        for finding in build_findings(timeline, episodes, Thresholds())
        for e in finding.episodes
    }
    assert any(what == "instants" for what, _ in drawn[0]) == (recording == "preemptions")
    if recording != "preemptions":  # a few packets: the clock snapshot outweighs the savings
        assert after.stat().st_size < 0.95 * before.stat().st_size


def test_varints_are_protobuf_s():
    rng = random.Random(5)
    values = [
        0,
        1,
        127,
        128,
        300,
        2**63 - 1,
        -1,
        -(2**63),
        *(rng.getrandbits(60) for _ in range(50)),
    ]
    values += [-rng.getrandbits(40) for _ in range(20)]
    for value in values:
        expected = TrackEvent(extra_counter_values=[value]).SerializeToString()
        assert wire.tag(12, wire.VARINT) + wire.varint(value) == expected, value
    column = wire.varint_column(np.array(values, np.int64))
    assert wire.join_rows([column]) == b"".join(wire.varint(v) for v in values)


def test_rows_join_in_order_and_optional_fields_vanish():
    values = np.array([5, 0, 1000, 7])
    rows = wire.length_delimited_columns(
        b"\x22",
        [
            wire.constant(b"\x08\x01", 4),
            *wire.optional(wire.field_columns(b"\x20", wire.varint_column(values)), values != 0),
            wire.double_column(np.array([0.5, -1.0, math.pi, 1e300])),
        ],
    )
    expected = b""
    for value, number in zip(values, [0.5, -1.0, math.pi, 1e300], strict=True):
        inner = b"\x08\x01" + (b"\x20" + wire.varint(int(value)) if value else b"")
        inner += wire.double(number)
        expected += wire.length_delimited(b"\x22", inner)
    assert wire.join_rows(rows) == expected


@pytest.mark.parametrize(
    ("name", "value"),
    [("ttft_ms", 12.5), ("title", "KV cache full"), ("not interned", -3), ("x", True)],
)
def test_an_annotation_is_what_protobuf_writes(name, value):
    parsed = TrackEvent.FromString(annotation(name, value)).debug_annotations[0]
    assert (parsed.name_iid > 0) == (name != "not interned" and name != "x")
    assert parsed.name in ("", name)
    kind = parsed.WhichOneof("value")
    assert getattr(parsed, kind) == value
    assert type(getattr(parsed, kind)) is type(value)
    assert isinstance(parsed, DebugAnnotation)
