"""How far a live sidecar NVTX range sits from the real iteration it describes.

An engine-like loop publishes IterationRecords over the real telemetry lane (ZmqPublisher,
ipc) for iterations whose start and end it knows; the real sidecar (`iterscope sidecar
--nvtx`) runs under the NVTX capture tool (tests/nvtx_capture), which stamps every range
with CLOCK_MONOTONIC, the clock of the engine's ``time.monotonic_ns()``. Per iteration N:

    offset       = sidecar range start(N) - start of iteration N   (the lag Nsight shows)
    length_error = sidecar range length(N) - length of iteration N (0 when paced exactly)

    .venv/bin/python bench/nvtx_offset.py [--num-iterations 2000] [--iteration-ms 5]
        [--nvtx-delay-ms 50]

The sidecar paces its ranges (telemetry/sidecar/sinks/nvtx_pacer.py): the offset should be one
constant lag (least lane latency + the delay) and the length error near zero. Prints p50 /
p99 of each, in microseconds, and the share of ranges shorter than half their iteration;
the last line is JSON.
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

from telemetry.lane.publisher import ZmqPublisher  # noqa: E402


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def start_sidecar(
    address: str, tool: Path, capture_path: Path, delay_ms: float
) -> subprocess.Popen:
    env = dict(
        os.environ,
        NVTX_INJECTION64_PATH=str(tool),
        NVTX_CAPTURE_PATH=str(capture_path),
        PYTHONPATH=str(REPO),
    )
    command = [
        sys.executable,
        "-m",
        "engine.entrypoints.cli",
        "sidecar",
        "--address",
        address,
        "--nvtx",
        "--nvtx-delay-ms",
        str(delay_ms),
        "--no-log",
        "--no-metrics",
    ]
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


def captured_ranges(capture_path: Path) -> dict[int, tuple[int, int]]:
    """{iteration (the range payload): (range start, range end)} from the capture file."""
    starts, ends, iterations = {}, {}, {}
    for line in capture_path.read_text().splitlines():
        fields = line.split("\t")
        if fields[0] == "start" and fields[2] == "iterscope":
            starts[fields[3]] = int(fields[1])
            iterations[fields[3]] = int(fields[4])
        elif fields[0] == "end" and fields[2] == "iterscope":
            ends[fields[3]] = int(fields[1])
    return {
        iterations[range_id]: (starts[range_id], ends[range_id])
        for range_id in starts
        if range_id in ends
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-iterations", type=int, default=2000)
    parser.add_argument("--iteration-ms", type=float, default=5.0)
    parser.add_argument("--nvtx-delay-ms", type=float, default=50.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        tool = build_capture_tool(tmp_dir)
        address, capture_path = f"ipc://{tmp_dir}/lane.sock", tmp_dir / "capture.tsv"
        sidecar = start_sidecar(address, tool, capture_path, args.nvtx_delay_ms)
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
        ranges = captured_ranges(capture_path)

    offset, length_error, num_short = [], [], 0
    for iteration, (range_start_ns, range_end_ns) in ranges.items():
        start_ns, end_ns = times[iteration]
        offset.append((range_start_ns - start_ns) / 1e3)
        length_error.append(((range_end_ns - range_start_ns) - (end_ns - start_ns)) / 1e3)
        num_short += (range_end_ns - range_start_ns) < (end_ns - start_ns) / 2
    figures = {
        "num_iterations": args.num_iterations,
        "iteration_ms": args.iteration_ms,
        "nvtx_delay_ms": args.nvtx_delay_ms,
        "num_ranges": len(ranges),
        "short_range_share": round(num_short / max(1, len(ranges)), 4),
    }
    for name, values in (("offset", offset), ("length_error", length_error)):
        for label, fraction in (("p1", 0.01), ("p50", 0.50), ("p99", 0.99)):
            figures[f"{name}_{label}_us"] = round(percentile(values, fraction), 1)
    print(
        f"{len(ranges)} ranges for {args.num_iterations} iterations of "
        f"{args.iteration_ms} ms, --nvtx-delay-ms {args.nvtx_delay_ms}"
    )
    print(
        f"range start - iteration start (lag): p1 {figures['offset_p1_us']} us, "
        f"p50 {figures['offset_p50_us']} us, p99 {figures['offset_p99_us']} us"
    )
    print(
        f"range length - iteration length: p1 {figures['length_error_p1_us']} us, "
        f"p50 {figures['length_error_p50_us']} us, p99 {figures['length_error_p99_us']} us"
    )
    print(f"ranges shorter than half their iteration: {100 * figures['short_range_share']:.2f}%")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
