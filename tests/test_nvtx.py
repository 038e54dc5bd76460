"""NVTX sinks, checked with real tools compiled here with gcc and run in a child process that
feeds the sink synthetic records: live mode under tests/nvtx_capture/nvtx_capture.c (an NVTX
injection library, built against the headers of nvidia-nvtx-cu12), exact mode through
nvtx.writer into tests/nvtxw_capture/nvtxw_capture.c (a recording NVTXW backend)."""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import shutil
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest

from engine.nvtx_markers import NullMarkers, make_markers
from telemetry.lane.record import IterationRecord, iteration_record
from telemetry.sidecar.engine_view import EngineView
from telemetry.sidecar.iteration_line import format_iteration_line
from telemetry.sidecar.sinks import nvtx_ranges
from telemetry.sidecar.sinks.nvtx_pacer import END, START, RangePacer
from tests.helpers.processes import child_pythonpath

REPO = Path(__file__).resolve().parent.parent
CAPTURE_SOURCE = REPO / "tests" / "nvtx_capture" / "nvtx_capture.c"

RUN_MARKERS = """
from engine.nvtx_markers import NvtxMarkers, make_markers

markers = make_markers(True)
assert isinstance(markers, NvtxMarkers), markers
for iteration in range(1, 6):
    markers.begin(iteration)
    markers.end()
"""

FEED_SINK = """
import sys, time
import msgspec
from telemetry.lane.record import IterationRecord
from telemetry.sidecar.engine_view import EngineView
from telemetry.sidecar.sinks.nvtx_ranges import NvtxSink

records = msgspec.msgpack.Decoder(list[IterationRecord]).decode(open(sys.argv[1], "rb").read())
batch = int(sys.argv[2])
sink = NvtxSink()
if not sink.enabled:
    sys.exit("the NVTX domain is disabled: the capture tool was not loaded")
# As a live engine and its publisher: iterations now, records handed over in batches.
base_ns = time.monotonic_ns() - records[0].start_ns + 1_000_000
for record in records:
    record.start_ns += base_ns
for first in range(0, len(records), batch):
    sent = records[first : first + batch]
    last_end_ns = sent[-1].start_ns + sent[-1].elapsed_ns
    time.sleep(max(0, last_end_ns - time.monotonic_ns()) / 1e9)
    for record in sent:
        sink.on_iteration(record, EngineView(record.engine_index))
sink.close()
"""


def nvtx_include_dir() -> Path:
    """The NVTX C headers of an installed nvidia-nvtx-cu12 (nvidia/nvtx/include), or of
    CUDA 13's wheels (nvidia/cu13/include, as the GPU machines' image has them)."""
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else ():
        for include in (Path(root) / "nvtx" / "include", Path(root) / "cu13" / "include"):
            if (include / "nvtx3" / "nvToolsExt.h").exists():
                return include
    raise RuntimeError("NVTX C headers not found: pip install nvidia-nvtx-cu12")


def compile_library(source: Path, library: Path, *flags: str) -> Path:
    """Build ``source`` into the shared library ``library`` with gcc (warnings are errors)."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError(f"gcc is needed to build {source.name}")
    subprocess.run(
        [
            gcc,
            "-shared",
            "-fPIC",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            *flags,
            str(source),
            "-o",
            str(library),
            "-lpthread",
        ],
        check=True,
    )
    return library


@pytest.fixture(scope="module")
def capture_library(tmp_path_factory) -> Path:
    library = tmp_path_factory.mktemp("nvtx") / "libnvtx_capture.so"
    return compile_library(CAPTURE_SOURCE, library, f"-I{nvtx_include_dir()}")


def make_records(
    num_records: int, engine_index: int = 0, elapsed_ns: int = 1_000_000
) -> list[IterationRecord]:
    """Iterations every 20 ms, each ``elapsed_ns`` (+ 1 us per iteration) long."""
    records = []
    for i in range(1, num_records + 1):
        records.append(
            iteration_record(
                engine_index,
                i,
                100 + i,
                start_ns=i * 20_000_000,
                elapsed_ns=elapsed_ns + i * 1000,
                num_prefill_reqs=i % 2,
                num_prefill_tokens=(i % 2) * 512,
                num_decode_reqs=i,
                num_decode_tokens=i,
                num_running_reqs=i + i % 2,
                num_waiting_reqs=7 - i % 7,
                num_kv_blocks_used=100 * i,
                num_kv_blocks_free=5000 - 100 * i,
                num_kv_tokens=1600 * i,
            )
        )
    return records


def run_with_capture(
    library: Path, script: str, args: list[str], tmp_path: Path
) -> list[list[str]]:
    """Run ``script`` in a child process under the capture tool; its NVTX events, split."""
    capture_path = tmp_path / "capture.tsv"
    env = dict(
        os.environ,
        NVTX_INJECTION64_PATH=str(library),
        NVTX_CAPTURE_PATH=str(capture_path),
        PYTHONPATH=child_pythonpath(),
    )
    subprocess.run([sys.executable, "-c", script, *args], check=True, env=env, cwd=REPO, timeout=60)
    return [line.split("\t") for line in capture_path.read_text().splitlines()]


def capture(
    library: Path, records: list[IterationRecord], tmp_path: Path, batch: int = 4
) -> list[list[str]]:
    """The live sink's NVTX events for ``records``, fed in real time ``batch`` at a time."""
    records_path = tmp_path / "records.msgpack"
    records_path.write_bytes(msgspec.msgpack.encode(records))
    return run_with_capture(library, FEED_SINK, [str(records_path), str(batch)], tmp_path)


@pytest.mark.live
def test_one_range_per_iteration_with_the_iteration_line(capture_library, tmp_path):
    records = make_records(20)
    events = capture(capture_library, records, tmp_path)
    starts = [e for e in events if e[0] == "start"]
    assert len(starts) == len(records)
    for start, record in zip(starts, records, strict=True):
        _, _, domain, _, payload, message = start
        assert domain == "iterscope"
        assert message == format_iteration_line(record)
        assert int(payload) == record.iteration
    # Every range ends, and the range of iteration N ends before that of N+1 starts.
    order = [(e[0], e[3]) for e in events if e[0] in ("start", "end")]
    expected = []
    for start in starts:
        expected += [("start", start[3]), ("end", start[3])]
    assert order == expected
    assert "Iteration(101): 1 context requests, 512 context tokens" in starts[0][5]


@pytest.mark.live
def test_counters_for_kv_usage_running_and_waiting(capture_library, tmp_path):
    records = make_records(10, engine_index=2)
    events = capture(capture_library, records, tmp_path)
    samples: dict[str, list[float]] = {}
    for _, _, domain, name, value in (e for e in events if e[0] == "counter"):
        assert domain == "iterscope"
        samples.setdefault(name, []).append(float(value))
    assert samples == {
        "engine 2: KV cache usage (%)": [
            pytest.approx(100 * r.num_kv_blocks_used / 5000) for r in records
        ],
        "engine 2: running requests": [r.num_running_reqs for r in records],
        "engine 2: waiting requests": [r.num_waiting_reqs for r in records],
    }


@pytest.mark.live
def test_ranges_keep_their_iterations_lengths_although_records_arrive_in_batches(
    capture_library, tmp_path
):
    """Records come 5 at a time (the publisher's send period); ranges drawn on arrival would
    last microseconds. Paced, each lasts about as long as its iteration: the median must be
    over half of it (a loose bound: the exact placement is RangePacer's test below)."""
    records = make_records(20, elapsed_ns=12_000_000)
    events = capture(capture_library, records, tmp_path, batch=5)
    starts = {e[3]: int(e[1]) for e in events if e[0] == "start"}
    ends = {e[3]: int(e[1]) for e in events if e[0] == "end"}
    assert len(starts) == len(ends) == len(records)
    durations = sorted(ends[range_id] - starts[range_id] for range_id in starts)
    assert durations[len(durations) // 2] > 6_000_000, durations


def paced(pacer: RangePacer, now_ns: int) -> list[tuple[str, int]]:
    return [
        ("start" if kind == START else "end", record.iteration)
        for kind, record in pacer.pop_due(now_ns)
    ]


def test_pacer_places_ranges_at_their_times_plus_the_least_latency_and_the_delay():
    delay_ns = 50_000_000
    pacer = RangePacer(delay_ns)
    records = make_records(8, elapsed_ns=8_000_000)  # starts every 20 ms, 8 ms long
    for first in (0, 4):  # two batches; each arrives 0.1 ms after its last iteration ended
        batch = records[first : first + 4]
        arrival_ns = batch[-1].start_ns + batch[-1].elapsed_ns + 100_000
        for record in batch:
            pacer.add(record, arrival_ns)
    lag_ns = 100_000 + delay_ns  # the least latency seen, then the delay
    # Every range sits exactly `lag` late, the first batch's too: the lag is applied when an
    # event falls due, after the whole batch lowered the latency estimate.
    for record in records:
        start = record.start_ns + lag_ns
        end = record.start_ns + record.elapsed_ns + lag_ns
        assert paced(pacer, start - 1) == []
        assert paced(pacer, start) == [("start", record.iteration)]
        assert paced(pacer, end - 1) == []
        assert paced(pacer, end) == [("end", record.iteration)]
    assert pacer.next_due_ns() is None


def test_pacer_keeps_order_and_maps_each_engines_clock_apart():
    """Engine 1 runs on another host (another monotonic clock); each engine's ranges sit at
    its own lag. A late sidecar gets every due event at once, in time order."""
    delay_ns = 10_000_000
    pacer = RangePacer(delay_ns)
    local = make_records(3, engine_index=0)
    remote = make_records(3, engine_index=1)
    for record in remote:
        record.start_ns += 5 * 10**12 + 500_000  # 0.5 ms after engine 0's, in its own clock
    arrival_ns = local[-1].start_ns + local[-1].elapsed_ns + 1_000
    for record in local:  # the batch arrives in one go: its last record sets the lag
        pacer.add(record, arrival_ns)
    for record in remote:
        pacer.add(record, arrival_ns + 500_000)
    lag_ns = 1_000 + delay_ns
    assert pacer.next_due_ns() == local[0].start_ns + lag_ns
    due = pacer.pop_due(10**18)
    assert pacer.next_due_ns() is None
    expected = []
    for a, b in zip(local, remote, strict=True):
        expected += [
            (START, 0, a.iteration),
            (START, 1, b.iteration),
            (END, 0, a.iteration),
            (END, 1, b.iteration),
        ]
    assert [(kind, r.engine_index, r.iteration) for kind, r in due] == expected


def test_without_a_tool_the_sink_is_off(capsys):
    if os.environ.get("NVTX_INJECTION64_PATH"):
        pytest.fail("run this test without an NVTX tool attached")
    parser = argparse.ArgumentParser()
    nvtx_ranges.add_arguments(parser)
    assert nvtx_ranges.build(parser.parse_args([])) is None
    assert nvtx_ranges.build(parser.parse_args(["--nvtx"])) is None
    assert "no NVTX tool is attached" in capsys.readouterr().err
    sink = nvtx_ranges.NvtxSink()
    sink.on_iteration(make_records(1)[0], EngineView(0))  # a no-op, not an error
    sink.close()


@pytest.mark.live
def test_engine_markers_one_range_per_iteration_with_iteration_payload(capture_library, tmp_path):
    events = run_with_capture(capture_library, RUN_MARKERS, [], tmp_path)
    assert [e[0] for e in events] == ["push", "pop"] * 5
    pushes = [e for e in events if e[0] == "push"]
    assert [(e[2], e[4], e[5]) for e in pushes] == [
        ("iterscope", str(i), "iteration") for i in range(1, 6)
    ]


def test_engine_markers_off_or_without_a_tool_are_null():
    assert isinstance(make_markers(False), NullMarkers)
    assert isinstance(make_markers(True), NullMarkers)  # no NVTX tool in this process


def test_iteration_line_matches_the_design_example():
    record = make_records(1)[0]
    for name, value in dict(
        iteration=188,
        num_prefill_reqs=0,
        num_prefill_tokens=0,
        num_decode_reqs=50,
        num_decode_tokens=50,
        elapsed_ns=10_250_000,
        num_kv_blocks_used=3500,
        num_kv_blocks_free=65459,
        num_kv_tokens=56000,
    ).items():
        setattr(record, name, value)
    assert format_iteration_line(record) == (
        "Iteration(188): 0 context requests, 0 context tokens, 50 generation requests, "
        "50 generation tokens, iteration elapsed time: 10.25 ms, "
        "kv cache: 5.1% (3500/68959 blocks, 56000 tokens)"
    )


# --- exact-timestamp mode (NvtxWriterSink) against a real NVTXW backend ----------------------
#
# tests/nvtxw_capture/nvtxw_capture.c is a recording NVTXW backend: nvtx.writer loads it like
# Nsight Systems' backend and calls it through the NVTXW interface table; it writes every call
# to a file. The tests decode the payload bytes with the schemas nvtx.writer registered, so a
# wrong timestamp, value, message or layout in what the sink sends fails here.

# From NVIDIA's nvToolsExtPayload.h: payload entry types, entry flags, schema type and flags.
ENTRY_TYPE_FORMATS = {  # fixed-size entry types -> struct format
    15: "i",
    16: "I",
    17: "q",
    18: "Q",  # INT32, UINT32, INT64, UINT64
    20: "d",
    44: "d",  # DOUBLE, FLOAT64
    67: "Q",
    68: "I",
    69: "I",  # RANGE_ID, CATEGORY, COLOR_ARGB
    80: "Q",  # NVTX_REGISTERED_STRING_HANDLE
}
ENTRY_TYPE_CSTRING_UTF8 = 76
ENTRY_TYPE_CATEGORY = 68
ENTRY_TYPE_COLOR_ARGB = 69
ENTRY_TYPE_REGISTERED_STRING = 80
ENTRY_FLAG_EVENT_MESSAGE = 1 << 10
ENTRY_FLAG_TIMESTAMP = 2 << 10
ENTRY_ROLE_MASK = 7 << 12
ENTRY_ROLE_RANGE_BEGIN = 1 << 12
ENTRY_ROLE_RANGE_END = 2 << 12
SCHEMA_TYPE_STATIC = 1
SCHEMA_FLAG_RANGE_STARTEND = 3 << 3
TIMESTAMP_TYPE_CLOCK_MONOTONIC = 14  # NVTX_TIMESTAMP_TYPE_CPU_CLOCK_GETTIME_MONOTONIC
COUNTER_FORMATS = {17: "q", 20: "d", 44: "d"}  # scalar counter schema ids: INT64, DOUBLE, FLOAT64

NVTXW_BACKEND_SOURCE = REPO / "tests" / "nvtxw_capture" / "nvtxw_capture.c"

FEED_WRITER_SINK = """
import argparse, sys
import msgspec
from telemetry.lane.record import IterationRecord
from telemetry.sidecar.engine_view import EngineView
from telemetry.sidecar.sinks import nvtx_ranges
from telemetry.sidecar.sinks.nvtx_pacer import END, START, RangePacer

backend, config, records_path = sys.argv[1:]
parser = argparse.ArgumentParser()
nvtx_ranges.add_arguments(parser)
sink = nvtx_ranges.build(parser.parse_args(
    ["--nvtx-writer-backend", backend, "--nvtx-writer-config", config]))
assert isinstance(sink, nvtx_ranges.NvtxWriterSink), sink
records = msgspec.msgpack.Decoder(list[IterationRecord]).decode(open(records_path, "rb").read())
for record in records:
    sink.on_iteration(record, EngineView(record.engine_index))
sink.close()
"""


@pytest.fixture(scope="module")
def nvtxw_backend(tmp_path_factory) -> Path:
    return compile_library(
        NVTXW_BACKEND_SOURCE, tmp_path_factory.mktemp("nvtxw") / "libnvtxw_capture.so"
    )


@dataclass
class SchemaEntry:
    flags: int
    type: int
    name: str
    offset: int

    @property
    def role(self) -> int:
        return self.flags & ENTRY_ROLE_MASK


@dataclass
class PayloadSchema:
    type: int
    flags: int
    static_size: int
    entries: list[SchemaEntry] = field(default_factory=list)


@dataclass
class NvtxwCapture:
    """What the recording backend received, keyed by the IDs it handed out."""

    interface_versions: list[int] = field(default_factory=list)
    sessions: dict[int, tuple[str | None, str | None]] = field(default_factory=dict)
    ended_sessions: list[int] = field(default_factory=list)
    domains: dict[int, str | None] = field(default_factory=dict)
    categories: dict[tuple[int, int], str] = field(default_factory=dict)  # (domain, id)
    strings: dict[int, str] = field(default_factory=dict)  # handle -> text
    schemas: dict[int, PayloadSchema] = field(default_factory=dict)
    counters: dict[int, tuple[int, str, int]] = field(default_factory=dict)  # domain, name, schema
    counter_semantics: dict[int, tuple[str, float, float]] = field(default_factory=dict)
    streams: dict[int, tuple[str, int, int]] = field(default_factory=dict)  # name, domain, clock
    closed_streams: list[int] = field(default_factory=list)
    events: list[tuple[int, list[tuple[int, bytes]]]] = field(default_factory=list)
    samples: list[tuple[int, int, int, bytes]] = field(default_factory=list)  # stream, ts, id
    other: list[list[str]] = field(default_factory=list)  # batches, unsupported calls
    finalized: bool = False


def text(field_: str) -> str | None:
    return None if field_ == "-" else bytes.fromhex(field_).decode()


def read_nvtxw_capture(path: Path) -> NvtxwCapture:
    """Parse the backend's file (format in the header of nvtxw_capture.c)."""
    capture = NvtxwCapture()
    for line in path.read_text().splitlines():
        kind, *f = line.split("\t")
        if kind == "interface":
            capture.interface_versions.append(int(f[0]))
        elif kind == "session_begin":
            capture.sessions[int(f[0])] = (text(f[1]), text(f[2]))
        elif kind == "session_end":
            capture.ended_sessions.append(int(f[0]))
        elif kind == "domain":
            capture.domains[int(f[1])] = text(f[2])
        elif kind == "category":
            capture.categories[int(f[0]), int(f[1])] = text(f[2])
        elif kind == "string":
            capture.strings[int(f[1])] = text(f[2])
        elif kind == "schema":
            capture.schemas[int(f[1])] = PayloadSchema(
                type=int(f[3]), flags=int(f[4]), static_size=int(f[6])
            )
        elif kind == "entry":
            capture.schemas[int(f[0])].entries.append(
                SchemaEntry(flags=int(f[2]), type=int(f[3]), name=text(f[4]), offset=int(f[6]))
            )
        elif kind == "counter":
            capture.counters[int(f[1])] = (int(f[0]), text(f[3]), int(f[2]))
            if len(f) > 5:  # counter semantics: unit, min, max
                limits = struct.unpack("=2d", bytes.fromhex(f[6]) + bytes.fromhex(f[7]))
                capture.counter_semantics[int(f[1])] = (text(f[5]), *limits)
        elif kind == "stream_open":
            capture.streams[int(f[1])] = (text(f[2]), int(f[3]), int(f[5]))
        elif kind == "stream_close":
            capture.closed_streams.append(int(f[0]))
        elif kind == "event":
            pairs = zip(f[1::2], f[2::2], strict=True)
            capture.events.append((int(f[0]), [(int(s), bytes.fromhex(b)) for s, b in pairs]))
        elif kind == "counter_sample":
            capture.samples.append((int(f[0]), int(f[1]), int(f[2]), bytes.fromhex(f[3])))
        elif kind == "finalize":
            capture.finalized = True
        else:
            capture.other.append([kind, *f])
    return capture


def decode_payload(schema: PayloadSchema, data: bytes) -> list[tuple[SchemaEntry, object]]:
    """Each entry of ``schema`` with its value read from ``data`` (native byte order)."""
    if schema.type == SCHEMA_TYPE_STATIC:
        assert len(data) == schema.static_size, (len(data), schema)
    values = []
    for entry in schema.entries:
        if entry.type == ENTRY_TYPE_CSTRING_UTF8:  # runs to a NUL or the end of the payload
            value = data[entry.offset :].split(b"\0")[0].decode()
        else:
            value = struct.unpack_from(ENTRY_TYPE_FORMATS[entry.type], data, entry.offset)[0]
        values.append((entry, value))
    return values


@dataclass
class Range:
    stream: int
    start: int
    end: int
    message: str | None
    color: int | None
    category: int | None


def decode_ranges(capture: NvtxwCapture) -> list[Range]:
    """Every start/end range event, from its payloads as the registered schemas lay them out."""
    ranges = []
    for stream, payloads in capture.events:
        decoded = [decode_payload(capture.schemas[schema_id], data) for schema_id, data in payloads]
        assert capture.schemas[payloads[0][0]].flags == SCHEMA_FLAG_RANGE_STARTEND
        found: dict[str, object] = {}
        for entry, value in (pair for payload in decoded for pair in payload):
            if entry.flags & ENTRY_FLAG_TIMESTAMP and entry.role == ENTRY_ROLE_RANGE_BEGIN:
                found["start"] = value
            elif entry.flags & ENTRY_FLAG_TIMESTAMP and entry.role == ENTRY_ROLE_RANGE_END:
                found["end"] = value
            elif entry.flags & ENTRY_FLAG_EVENT_MESSAGE:
                is_handle = entry.type == ENTRY_TYPE_REGISTERED_STRING
                found["message"] = capture.strings[value] if is_handle else value
            elif entry.type == ENTRY_TYPE_COLOR_ARGB:
                found["color"] = value
            elif entry.type == ENTRY_TYPE_CATEGORY:
                found["category"] = value
        ranges.append(
            Range(
                stream=stream,
                start=found["start"],
                end=found["end"],
                message=found.get("message"),
                color=found.get("color"),
                category=found.get("category"),
            )
        )
    return ranges


def run_writer_sink(
    backend: Path, config: str, records: list[IterationRecord], tmp_path: Path
) -> NvtxwCapture:
    """Feed ``records`` to the sink built from the sidecar's CLI, in a child process."""
    records_path = tmp_path / "records.msgpack"
    records_path.write_bytes(msgspec.msgpack.encode(records))
    capture_path = tmp_path / "nvtxw.tsv"
    env = dict(os.environ, ITERSCOPE_NVTXW_CAPTURE=str(capture_path), PYTHONPATH=child_pythonpath())
    subprocess.run(
        [sys.executable, "-c", FEED_WRITER_SINK, str(backend), config, str(records_path)],
        check=True,
        env=env,
        cwd=REPO,
        timeout=60,
    )
    return read_nvtxw_capture(capture_path)


@pytest.mark.live
def test_writer_mode_writes_ranges_and_counters_at_the_engine_timestamps(nvtxw_backend, tmp_path):
    engine_records = {0: make_records(5, engine_index=0), 3: make_records(4, engine_index=3)}
    records = [r for pair in itertools.zip_longest(*engine_records.values()) for r in pair if r]
    config = "first=1\nsecond=two words"
    capture = run_writer_sink(nvtxw_backend, config, records, tmp_path)

    assert capture.interface_versions == [2]
    assert list(capture.sessions.values()) == [("iterscope", config)]
    assert capture.ended_sessions == list(capture.sessions) and capture.finalized
    assert list(capture.domains.values()) == ["iterscope"]
    (domain,) = capture.domains
    stream_ids = {name: stream for stream, (name, _, _) in capture.streams.items()}
    assert sorted(capture.streams.values()) == [
        ("engine 0", domain, TIMESTAMP_TYPE_CLOCK_MONOTONIC),
        ("engine 3", domain, TIMESTAMP_TYPE_CLOCK_MONOTONIC),
    ]
    assert sorted(capture.closed_streams) == sorted(capture.streams)
    assert capture.other == []  # no batches, no call the backend does not support

    ranges = decode_ranges(capture)
    assert len(ranges) == len(records)
    for engine, expected in engine_records.items():
        assert [
            (r.start, r.end, r.message, r.color, capture.categories[domain, r.category])
            for r in ranges
            if r.stream == stream_ids[f"engine {engine}"]
        ] == [
            (
                record.start_ns,
                record.start_ns + record.elapsed_ns,
                format_iteration_line(record),
                nvtx_ranges.RANGE_COLOR,
                f"engine {engine}",
            )
            for record in expected
        ]

    for engine, expected in engine_records.items():
        samples = []
        for stream, timestamp, counter_id, data in capture.samples:
            if stream == stream_ids[f"engine {engine}"]:
                counter_domain, name, schema_id = capture.counters[counter_id]
                assert counter_domain == domain
                (value,) = struct.unpack(COUNTER_FORMATS[schema_id], data)
                samples.append((name, timestamp, value))
        prefix = f"engine {engine}: "
        assert samples == [
            sample
            for record in expected
            for sample in (
                (
                    prefix + "KV cache usage (%)",
                    record.start_ns + record.elapsed_ns,
                    pytest.approx(100 * record.num_kv_blocks_used / 5000, abs=1e-9),
                ),
                (
                    prefix + "running requests",
                    record.start_ns + record.elapsed_ns,
                    record.num_running_reqs,
                ),
                (
                    prefix + "waiting requests",
                    record.start_ns + record.elapsed_ns,
                    record.num_waiting_reqs,
                ),
            )
        ]

    semantics = {
        capture.counters[counter_id][1]: value
        for counter_id, value in capture.counter_semantics.items()
    }
    assert semantics == {
        f"engine {engine}: KV cache usage (%)": ("%", 0.0, 100.0) for engine in engine_records
    }


def test_writer_mode_with_a_missing_backend_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot load the NVTXW backend"):
        nvtx_ranges.NvtxWriterSink(str(tmp_path / "missing.so"))


@pytest.mark.live
def test_writer_mode_with_a_library_that_is_no_nvtxw_backend_is_a_clear_error(tmp_path):
    source = tmp_path / "not_a_backend.c"
    source.write_text("int iterscope_unrelated(void) { return 0; }\n")
    library = compile_library(source, tmp_path / "libnot_a_backend.so")
    with pytest.raises(ValueError, match="cannot load the NVTXW backend.*symbol missing"):
        nvtx_ranges.NvtxWriterSink(str(library))


@pytest.mark.live
def test_writer_mode_with_a_refused_session_is_a_clear_error(nvtxw_backend, tmp_path, monkeypatch):
    monkeypatch.setenv("ITERSCOPE_NVTXW_CAPTURE", str(tmp_path / "capture.txt"))
    with pytest.raises(ValueError, match="refused the session"):
        nvtx_ranges.NvtxWriterSink(str(nvtxw_backend), config="refuse-session")
    assert "finalize" in (tmp_path / "capture.txt").read_text()  # the backend was closed
