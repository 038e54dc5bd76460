"""NVTX sink, checked with a real NVTX tool: tests/nvtx_capture/nvtx_capture.c, compiled here
with gcc against the headers of nvidia-nvtx-cu12 and loaded through NVTX_INJECTION64_PATH
into a child process that feeds the sink synthetic records."""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from engine.nvtx_markers import NullMarkers, make_markers
from telemetry.iteration_line import format_iteration_line
from telemetry.record import IterationRecord
from telemetry.sinks import nvtx_ranges

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
from telemetry.record import IterationRecord
from telemetry.sinks.nvtx_ranges import NvtxSink

records = msgspec.msgpack.Decoder(list[IterationRecord]).decode(open(sys.argv[1], "rb").read())
sink = NvtxSink()
if not sink.enabled:
    sys.exit("the NVTX domain is disabled: the capture tool was not loaded")
for record in records:
    sink.on_iteration(record)
    if record.iteration == int(sys.argv[2]):  # an idle gap: the tick closes the range
        time.sleep(2 * record.elapsed_ns / 1e9)
        sink.tick(time.monotonic_ns())
sink.close()
"""


def nvtx_include_dir() -> Path:
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else ():
        include = Path(root) / "nvtx" / "include"
        if (include / "nvtx3" / "nvToolsExt.h").exists():
            return include
    raise RuntimeError("NVTX C headers not found: pip install nvidia-nvtx-cu12")


@pytest.fixture(scope="module")
def capture_library(tmp_path_factory) -> Path:
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError("gcc is needed to build the NVTX capture tool")
    library = tmp_path_factory.mktemp("nvtx") / "libnvtx_capture.so"
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", f"-I{nvtx_include_dir()}",
         str(CAPTURE_SOURCE), "-o", str(library), "-lpthread"],
        check=True,
    )
    return library


def make_records(num_records: int, engine_index: int = 0) -> list[IterationRecord]:
    records = []
    for i in range(1, num_records + 1):
        records.append(IterationRecord(
            engine_index=engine_index, seq=i, iteration=100 + i, start_ns=i * 20_000_000,
            elapsed_ns=1_000_000 + i * 1000, num_context_reqs=i % 2,
            num_context_tokens=(i % 2) * 512, num_generation_reqs=i, num_generation_tokens=i,
            num_running_reqs=i + i % 2, num_waiting_reqs=7 - i % 7, num_waiting_kv_reqs=0,
            num_waiting_seq_limit_reqs=0, num_waiting_budget_reqs=0,
            num_kv_blocks_used=100 * i, num_kv_blocks_free=5000 - 100 * i,
            num_kv_tokens=1600 * i, num_prefix_query_tokens=0, num_prefix_hit_tokens=0,
            num_preemptions=0,
        ))
    return records


def run_with_capture(library: Path, script: str, args: list[str],
                     tmp_path: Path) -> list[list[str]]:
    """Run ``script`` in a child process under the capture tool; its NVTX events, split."""
    capture_path = tmp_path / "capture.tsv"
    env = dict(os.environ, NVTX_INJECTION64_PATH=str(library),
               NVTX_CAPTURE_PATH=str(capture_path), PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-c", script, *args], check=True, env=env, cwd=REPO,
                   timeout=60)
    return [line.split("\t") for line in capture_path.read_text().splitlines()]


def capture(library: Path, records: list[IterationRecord], tmp_path: Path,
            idle_after: int = -1) -> list[list[str]]:
    records_path = tmp_path / "records.msgpack"
    records_path.write_bytes(msgspec.msgpack.encode(records))
    return run_with_capture(library, FEED_SINK, [str(records_path), str(idle_after)], tmp_path)


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


def test_counters_for_kv_usage_running_and_waiting(capture_library, tmp_path):
    records = make_records(10, engine_index=2)
    events = capture(capture_library, records, tmp_path)
    samples: dict[str, list[float]] = {}
    for _, _, domain, name, value in (e for e in events if e[0] == "counter"):
        assert domain == "iterscope"
        samples.setdefault(name, []).append(float(value))
    assert samples == {
        "engine 2: KV cache usage (%)": [
            pytest.approx(100 * r.num_kv_blocks_used / 5000) for r in records],
        "engine 2: running requests": [r.num_running_reqs for r in records],
        "engine 2: waiting requests": [r.num_waiting_reqs for r in records],
    }


def test_tick_closes_a_range_whose_iteration_had_no_successor(capture_library, tmp_path):
    records = make_records(3)
    events = capture(capture_library, records, tmp_path, idle_after=102)
    kinds = [(e[0], e[3]) for e in events if e[0] in ("start", "end")]
    assert kinds == [("start", "1"), ("end", "1"), ("start", "2"), ("end", "2"),
                     ("start", "3"), ("end", "3")]


def test_without_a_tool_the_sink_is_off(capsys):
    if os.environ.get("NVTX_INJECTION64_PATH"):
        pytest.fail("run this test without an NVTX tool attached")
    parser = argparse.ArgumentParser()
    nvtx_ranges.add_arguments(parser)
    assert nvtx_ranges.build(parser.parse_args([])) is None
    assert nvtx_ranges.build(parser.parse_args(["--nvtx"])) is None
    assert "no NVTX tool is attached" in capsys.readouterr().err
    sink = nvtx_ranges.NvtxSink()
    sink.on_iteration(make_records(1)[0])  # a no-op, not an error
    sink.close()


def test_engine_markers_one_range_per_iteration_with_iteration_payload(capture_library, tmp_path):
    events = run_with_capture(capture_library, RUN_MARKERS, [], tmp_path)
    assert [e[0] for e in events] == ["push", "pop"] * 5
    pushes = [e for e in events if e[0] == "push"]
    assert [(e[2], e[4], e[5]) for e in pushes] == [
        ("iterscope", str(i), "iteration") for i in range(1, 6)]


def test_engine_markers_off_or_without_a_tool_are_null():
    assert isinstance(make_markers(False), NullMarkers)
    assert isinstance(make_markers(True), NullMarkers)  # no NVTX tool in this process


class FakeStream:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def open(self) -> None:
        self.log.append(("open", self.name))

    def write_startend(self, start, end, *, message, color, category) -> None:
        self.log.append(("range", self.name, start, end, message, category))

    def write_counter_sample(self, counter, timestamp, value) -> None:
        self.log.append(("counter", self.name, counter, timestamp, value))


class FakeSession:
    """Stands in for nvtx.writer.Session: no NVTXW backend can be run here."""

    log: list = []

    def __init__(self, name, *, backend, config=None) -> None:
        self.log.append(("session", name, backend, config))

    def begin(self) -> None:
        self.log.append(("begin",))

    def end(self) -> None:
        self.log.append(("end",))

    def get_domain(self, name):
        self.log.append(("domain", name))
        return self

    def get_counter(self, name, dtype):
        return name

    def create_stream(self, name, *, domain, time_domain_id):
        self.log.append(("stream", name, time_domain_id))
        return FakeStream(self.log, name)


def test_writer_mode_places_ranges_at_the_engine_timestamps(monkeypatch):
    import nvtx
    from nvtx import writer

    class FakeBackend:
        closed = False

        def close(self):
            FakeBackend.closed = True

    FakeSession.log = []
    monkeypatch.setattr(writer, "Session", FakeSession)
    monkeypatch.setattr(writer, "load_backend", lambda path: FakeBackend())
    parser = argparse.ArgumentParser()
    nvtx_ranges.add_arguments(parser)
    sink = nvtx_ranges.build(parser.parse_args(
        ["--nvtx-writer-backend", "/opt/nsys/libNvtxwBackend.so", "--nvtx-writer-config", "k=v"]))
    assert isinstance(sink, nvtx_ranges.NvtxWriterSink)
    records = make_records(2, engine_index=1)
    for record in records:
        sink.on_iteration(record)
    sink.close()
    log = FakeSession.log
    assert ("domain", "iterscope") in log
    assert ("stream", "engine 1", nvtx.TimestampType.CPU_CLOCK_GETTIME_MONOTONIC) in log
    ranges = [entry for entry in log if entry[0] == "range"]
    assert ranges == [("range", "engine 1", r.start_ns, r.start_ns + r.elapsed_ns,
                       format_iteration_line(r), "engine 1") for r in records]
    counters = [entry[2:] for entry in log if entry[0] == "counter"]
    end_ns = records[0].start_ns + records[0].elapsed_ns
    assert counters[:3] == [("engine 1: KV cache usage (%)", end_ns, 2.0),
                            ("engine 1: running requests", end_ns, 2),
                            ("engine 1: waiting requests", end_ns, 6)]
    assert log[-1] == ("end",) and FakeBackend.closed


def test_iteration_line_matches_the_design_example():
    record = make_records(1)[0]
    for name, value in dict(iteration=188, num_context_reqs=0, num_context_tokens=0,
                            num_generation_reqs=50, num_generation_tokens=50,
                            elapsed_ns=10_250_000, num_kv_blocks_used=3500,
                            num_kv_blocks_free=65459, num_kv_tokens=56000).items():
        setattr(record, name, value)
    assert format_iteration_line(record) == (
        "Iteration(188): 0 context requests, 0 context tokens, 50 generation requests, "
        "50 generation tokens, iteration elapsed time: 10.25 ms, "
        "kv cache: 5.1% (3500/68959 blocks, 56000 tokens)")


def test_writer_mode_with_a_missing_backend_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="cannot load the NVTXW backend"):
        nvtx_ranges.NvtxWriterSink(str(tmp_path / "missing.so"))
