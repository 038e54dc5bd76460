"""`iterscope demo`, shortened: SmolLM2 behind the server and its sidecar, a ramping load that
fills the small KV cache until requests wait, log lines, live findings as they open, /metrics,
a recording, the bench summary and the explain summary, whose finding 1 the sidecar reported
live, and the recording's Perfetto timeline next to it, named with how to open it."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx
import msgspec
import pytest

from telemetry.lane.record import IterationRecord
from telemetry.lane.recording import Line
from tests.helpers import REPO
from tests.helpers.perfetto_reader import read_trace

pytestmark = pytest.mark.live

# Seconds of load. The demo sends for 80% of it, 4 s at each step of --ramp 2,6; the cache
# holds about 3 of these requests (272 tokens), so it fills and requests wait within a second of
# the step to 6 (16 s, as before, only ran the same load longer).
DURATION_S = "10"


def test_short_demo(tmp_path):
    record_path = tmp_path / "demo.jsonl"
    command = [
        sys.executable,
        "-m",
        "engine.entrypoints.cli",
        "demo",
        "--duration",
        DURATION_S,
        "--ramp",
        "2,6",
        "--input-len",
        "48",
        "--output-len",
        "24",
        "--kv-cache-memory",
        "12MiB",
        "--metrics-port",
        "0",
        "--log-interval",
        "3",
        "--record",
        str(record_path),
    ]
    process = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines, metrics_text = [], ""
    deadline = time.monotonic() + 240
    try:
        for line in process.stdout:
            lines.append(line)
            match = re.search(r"metrics (http://\S+/metrics)", line)
            if match and line.startswith(">>> server"):
                metrics_text = httpx.get(match.group(1), timeout=10).text
            assert time.monotonic() < deadline, "".join(lines)
        assert process.wait(30) == 0, "".join(lines)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = "".join(lines)
    assert "iterscope_kv_blocks_capacity" in metrics_text
    assert re.search(r"\| .*Engine 000: Avg prompt throughput: .* tokens/s", output), output
    # float32 on every CPU (demo --dtype): the same cache size and answer everywhere (in
    # bfloat16 the answer's first token, a near tie, goes the other way and names no city)
    assert "dtype float32 (--dtype float32)" in output, output
    assert "KV cache size: 272 tokens" in output, output
    assert re.search(r">>> smollm2: .*Paris", output), output  # one answer before the load
    assert ">>> load: up to 6 requests at once" in output
    assert re.search(r"Successful requests:\s+[1-9]", output)
    assert re.search(r"Failed requests:\s+0\n", output)
    assert "Mean TTFT (ms):" in output
    assert "Engine 0, model smollm2 on CPU" in output  # the explain summary
    # The sidecar said why while it happened, and explain's finding 1 is among what it said
    # (finding_log.py: "<what> since <time> (<where>, <so far>, <cost>): <evidence>. Action: ")
    live = r"\| WARNING .* Engine 000: .* since \S+ \(.* so far, .*\): .*\. Action: "
    assert re.search(live, output), output
    first = re.search(r"^  1\. (.+?): \d+ times?, ", output, re.MULTILINE)
    assert first, output
    assert f"Engine 000: {first.group(1)} since " in output, output
    decoder = msgspec.json.Decoder(Line)  # notes too: records kept
    records = [
        m
        for m in map(decoder.decode, record_path.read_bytes().splitlines())
        if isinstance(m, IterationRecord)
    ]
    assert max(r.num_waiting_kv_reqs for r in records) > 0  # the cache filled; requests waited
    assert max(r.num_kv_blocks_used for r in records) >= 0.9 * (
        records[-1].num_kv_blocks_used + records[-1].num_kv_blocks_free
    )
    # The timeline: next to the recording, named with how to open it, every iteration in it
    trace_path = record_path.with_suffix(".pftrace")
    assert f">>> timeline written to {trace_path} (" in output, output
    assert "open https://ui.perfetto.dev and drop the file on it" in output
    trace = read_trace(trace_path)
    (process_uuid,) = trace.processes()
    iterations = trace.slices[trace.track_named("iterations", process_uuid)]
    assert sorted(s.args["iteration"] for s in iterations) == sorted(r.iteration for r in records)
    finished = {m.request_id for r in records for m in r.milestones}
    drawn = {
        s.name.removeprefix("request ")
        for lane in trace.children(process_uuid, "requests ")
        for s in trace.slices[lane]
        if s.depth == 0
    }
    assert drawn == finished and finished
