"""How far a live sidecar NVTX range sits from the real iteration it describes.

An engine-like loop publishes IterationRecords over the real telemetry lane (ZmqPublisher,
ipc) for iterations whose start and end it knows; the real sidecar (`iterscope sidecar
--nvtx`) runs under the NVTX capture tool (tests/nvtx_capture), which stamps every range
with CLOCK_MONOTONIC, the clock of the engine's ``time.monotonic_ns()``. Per iteration N:

    latency     = sidecar range start(N) - end of iteration N     (lane + ingest + NVTX call)
    offset      = sidecar range start(N) - start of iteration N   (what Nsight shows)
    next_offset = sidecar range start(N) - start of iteration N+1 (the one the range overlaps)

    .venv/bin/python bench/nvtx_offset.py [--num-iterations 2000] [--iteration-ms 5]

Prints p50 / p99 of each, in microseconds; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from nvtx_cost import build_capture_tool, decode_record  # noqa: E402

from telemetry.publisher import ZmqPublisher  # noqa: E402


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def start_sidecar(address: str, tool: Path, capture_path: Path) -> subprocess.Popen:
    env = dict(os.environ, NVTX_INJECTION64_PATH=str(tool), NVTX_CAPTURE_PATH=str(capture_path),
               PYTHONPATH=str(REPO))
    command = [sys.executable, "-m", "engine.cli", "sidecar", "--address", address, "--nvtx",
               "--no-log", "--no-metrics"]
    return subprocess.Popen(command, env=env, cwd=REPO, stderr=subprocess.DEVNULL)


def run_engine(address: str, num_iterations: int, iteration_s: float) -> dict[int, tuple]:
    """Sleep-based iterations, one record each; {iteration: (start_ns, end_ns)}."""
    publisher = ZmqPublisher(address, engine_index=0)
    times = {}
    try:
        for iteration in range(1, num_iterations + 1):
            start_ns = time.monotonic_ns()
            time.sleep(iteration_s)
            end_ns = time.monotonic_ns()
            record = decode_record(iteration)
            record.start_ns, record.elapsed_ns = start_ns, end_ns - start_ns
            publisher.publish(record)
            times[iteration] = (start_ns, end_ns)
    finally:
        publisher.close()
    return times


def range_starts(capture_path: Path) -> dict[int, int]:
    """{iteration (the range payload): range start time} from the capture file."""
    starts = {}
    for line in capture_path.read_text().splitlines():
        fields = line.split("\t")
        if fields[0] == "start" and fields[2] == "iterscope":
            starts[int(fields[4])] = int(fields[1])
    return starts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-iterations", type=int, default=2000)
    parser.add_argument("--iteration-ms", type=float, default=5.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        tool = build_capture_tool(tmp_dir)
        address, capture_path = f"ipc://{tmp_dir}/lane.sock", tmp_dir / "capture.tsv"
        sidecar = start_sidecar(address, tool, capture_path)
        try:
            deadline = time.monotonic() + 30
            while not (tmp_dir / "lane.sock").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # the PULL socket accepts connections
            times = run_engine(address, args.num_iterations, args.iteration_ms / 1000)
            time.sleep(0.5)
        finally:
            sidecar.send_signal(signal.SIGINT)
            sidecar.wait(30)
        starts = range_starts(capture_path)

    latency, offset, next_offset = [], [], []
    for iteration, range_start_ns in starts.items():
        start_ns, end_ns = times[iteration]
        latency.append((range_start_ns - end_ns) / 1e3)
        offset.append((range_start_ns - start_ns) / 1e3)
        if iteration + 1 in times:
            next_offset.append((range_start_ns - times[iteration + 1][0]) / 1e3)
    figures = {"num_iterations": args.num_iterations, "iteration_ms": args.iteration_ms,
               "num_ranges": len(starts)}
    for name, values in (("latency", latency), ("offset", offset),
                         ("next_offset", next_offset)):
        figures[f"{name}_p50_us"] = round(percentile(values, 0.50), 1)
        figures[f"{name}_p99_us"] = round(percentile(values, 0.99), 1)
    print(f"{len(starts)} ranges for {args.num_iterations} iterations of "
          f"{args.iteration_ms} ms")
    print(f"range start - iteration end (latency): p50 {figures['latency_p50_us']} us, "
          f"p99 {figures['latency_p99_us']} us")
    print(f"range start - iteration start: p50 {figures['offset_p50_us']} us, "
          f"p99 {figures['offset_p99_us']} us")
    print(f"range start - next iteration start: p50 {figures['next_offset_p50_us']} us, "
          f"p99 {figures['next_offset_p99_us']} us")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
