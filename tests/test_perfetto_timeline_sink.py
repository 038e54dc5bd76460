"""`iterscope sidecar --timeline PATH`: live Perfetto traces, rotated by size, each complete,
the same trace `iterscope timeline` draws from the same messages, never holding up ingest."""

import threading
from itertools import pairwise

from scenarios.synthetic import SCENARIOS

from telemetry.analysis.timeline_command import main as timeline_main
from telemetry.lane.record import Heartbeat, IterationRecord
from telemetry.lane.recording import message_time_ns, rotated_path
from telemetry.sidecar import cli as sidecar_cli
from telemetry.sidecar.sinks import perfetto_timeline
from telemetry.sidecar.sinks.perfetto_timeline import PerfettoTimelineSink
from tests.helpers.perfetto_reader import read_trace
from tests.helpers.sink_feed import send

HOUR_S = 3600.0  # an interval the writer thread never reaches in a test: writes are explicit


def slices_by_track(trace):
    return {
        trace.tracks[uuid].name: [(s.name, s.start_ns, s.end_ns, s.args) for s in slices]
        for uuid, slices in trace.slices.items()
    }


def test_the_live_trace_is_the_one_iterscope_timeline_draws_from_the_same_messages(tmp_path):
    sim = SCENARIOS["stall"][0]()
    sink = PerfettoTimelineSink(tmp_path / "live.pftrace", interval_s=HOUR_S)
    send(sink, *sim.messages)
    sink.close()
    assert sink.last_write_time > 0 and sink.num_lines_lost == 0
    recording = sim.write(tmp_path / "rec.jsonl")
    assert timeline_main([str(recording), "-o", str(tmp_path / "offline.pftrace")]) == 0
    live = read_trace(tmp_path / "live.pftrace")
    offline = read_trace(tmp_path / "offline.pftrace")
    assert slices_by_track(live) == slices_by_track(offline)
    assert live.counters == offline.counters
    assert any(name.startswith("findings") for name in slices_by_track(live))


def test_files_rotate_by_size_and_each_is_a_complete_trace(tmp_path):
    sim = SCENARIOS["healthy"][0]()
    path = tmp_path / "live.pftrace"
    sink = PerfettoTimelineSink(path, max_bytes=20_000, max_files=3, interval_s=HOUR_S)
    records = [m for m in sim.messages if isinstance(m, IterationRecord)]
    first_heartbeat = next(m for m in sim.messages if isinstance(m, Heartbeat))
    for start in range(0, len(sim.messages), 100):  # the writer's turns, 100 messages apart
        send(sink, *sim.messages[start : start + 100])
        sink.write()
    sink.close()
    files = [rotated_path(path, generation) for generation in range(3)]
    assert all(f.exists() for f in files) and not rotated_path(path, 3).exists()
    drawn = []
    for f in reversed(files):
        trace = read_trace(f)  # complete: every slice ends, every name resolves
        ((process_uuid, process),) = trace.processes().items()
        assert first_heartbeat.model_name in process.process.process_name
        iterations = trace.slices[trace.track_named("iterations", process_uuid)]
        drawn += [s.args["iteration"] for s in iterations]
    assert drawn == sorted(set(drawn))  # no iteration in two files
    assert drawn[-1] == records[-1].iteration  # the newest file ends with the last one
    assert len(drawn) < len(records)  # the oldest files were deleted


def findings_of(trace):
    return [
        s
        for uuid in trace.processes()
        for lane in trace.children(uuid, "findings ")
        for s in trace.slices[lane]
    ]


def live_files(tmp_path, messages, splits):
    """The messages fed to a sink that rotates at each index in ``splits``: its files, the
    oldest first."""
    path = tmp_path / "live.pftrace"
    sink = PerfettoTimelineSink(path, max_bytes=1, max_files=len(splits) + 1, interval_s=HOUR_S)
    for start, end in pairwise([0, *splits]):
        send(sink, *messages[start:end])
        sink.write()  # a file, full at once: rotated
    sink.max_bytes = 1 << 30  # the last stays current
    send(sink, *messages[splits[-1] :])
    sink.close()
    return [read_trace(rotated_path(path, n)) for n in range(len(splits), -1, -1)]


def waiting_scenario(tmp_path):
    """The token-budget scenario's messages and its one finding, 24 s of waiting, as
    `iterscope timeline` draws it from the whole recording."""
    sim = SCENARIOS["token budget"][0]()
    recording = sim.write(tmp_path / "rec.jsonl")
    assert timeline_main([str(recording), "-o", str(tmp_path / "offline.pftrace")]) == 0
    (whole,) = findings_of(read_trace(tmp_path / "offline.pftrace"))
    return sim.messages, whole


def split_at(messages, ts_ns):
    return next(i for i, m in enumerate(messages) if message_time_ns(m) >= ts_ns)


def test_a_finding_that_spans_a_rotation_is_whole_in_the_file_where_it_ends(tmp_path):
    """The first file ends in the middle of the waiting and draws it cut there; the next
    draws it whole, from its start in the first, marked as continued."""
    messages, whole = waiting_scenario(tmp_path)
    middle_ns = (whole.start_ns + whole.end_ns) // 2
    first, second = live_files(tmp_path, messages, [split_at(messages, middle_ns)])
    (cut,) = findings_of(first)
    assert (cut.name, cut.start_ns) == (whole.name, whole.start_ns)
    assert cut.end_ns < middle_ns and "continued" not in cut.args
    (continued,) = findings_of(second)
    drawn = (continued.name, continued.start_ns, continued.end_ns)
    assert drawn == (whole.name, whole.start_ns, whole.end_ns)
    assert continued.args["continued"].startswith("began in the file before; drawn whole")
    assert continued.args["action"] == whole.args["action"]


def test_a_finding_longer_than_a_file_says_it_began_earlier_still(tmp_path):
    """Rotations at a third and two thirds of the waiting: the last file draws it from the
    start of the file before, and says it began before that."""
    messages, whole = waiting_scenario(tmp_path)
    length_ns = whole.end_ns - whole.start_ns
    splits = [split_at(messages, whole.start_ns + k * length_ns // 3) for k in (1, 2)]
    *_, last = live_files(tmp_path, messages, splits)
    (continued,) = findings_of(last)
    assert continued.start_ns > whole.start_ns and continued.end_ns == whole.end_ns
    assert continued.args["continued"].startswith("began before the file before")


def test_ingest_never_waits_for_a_stuck_writer(tmp_path, monkeypatch):
    released = threading.Event()
    entered = threading.Event()

    def stuck_write_trace(timelines, out, thresholds=None, earlier=None):
        entered.set()
        released.wait()
        raise OSError("the disk went away")

    monkeypatch.setattr(perfetto_timeline, "write_trace", stuck_write_trace)
    sim = SCENARIOS["healthy"][0]()
    sink = PerfettoTimelineSink(tmp_path / "live.pftrace", interval_s=0.01, max_pending=50)
    send(sink, sim.messages[0])
    assert entered.wait(10), "the writer thread never wrote"
    ingest = threading.Thread(target=send, args=(sink, *sim.messages[1:201]))
    ingest.start()
    ingest.join(60)  # a liveness bound, not a timing: a blocked ingest never gets here
    finished_while_stuck = not ingest.is_alive() and not released.is_set()
    released.set()
    sink.close()
    assert finished_while_stuck  # 200 messages taken past a writer stuck for good
    # 50 held for the writer, 150 dropped and counted; then, the writes failing, the 51
    # messages held for the next try are cut to max_pending: one more
    assert sink.num_lines_lost == 150 + 1
    assert sink.last_write_time == 0.0  # no write succeeded
    assert sink.num_errors >= 1  # /metrics: sink_errors_total{sink="timeline"}


def test_the_sidecar_offers_the_flags(tmp_path):
    modules = sidecar_cli.load_sink_modules()
    assert perfetto_timeline in modules
    parser = sidecar_cli.build_parser(modules)
    args = parser.parse_args(
        ["--timeline", str(tmp_path / "t.pftrace"), "--timeline-max-bytes", "1000"]
    )
    sink = perfetto_timeline.build(args)
    try:
        assert isinstance(sink, PerfettoTimelineSink)
        assert (sink.path, sink.max_bytes) == (tmp_path / "t.pftrace", 1000)
    finally:
        sink.close()
    assert perfetto_timeline.build(parser.parse_args([])) is None
