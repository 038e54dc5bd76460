"""A synthetic engine for the sidecar's process-level tests, until a real engine loop is used.

Run as a script (start_engine below), it iterates at a fixed pace, publishing one
IterationRecord per iteration through the real ZmqPublisher (heartbeats come from the
publisher's own thread), until SIGTERM or --duration; then it writes a JSON report:

    last_seq           every message it tried to send (records + heartbeats)
    num_dropped_total  sends that failed (full queue / no sidecar)
    samples            [[start_ns, iteration_ns, publish_ns], ...] per iteration
    max_rss_bytes      sampled once a second and at the end

tests/test_sidecar_engine.py checks the synthetic engine itself.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script

from telemetry.lane.publisher import ZmqPublisher  # noqa: E402
from tests.helpers.lane import synthetic_record  # noqa: E402
from tests.helpers.processes import rss_bytes  # noqa: E402

SCRIPT = Path(__file__).resolve()


def run(args: argparse.Namespace) -> dict:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    publisher = ZmqPublisher(
        args.address,
        args.engine_index,
        facts={"device_name": "CPU", "model_name": "synthetic"},
        sndhwm=args.sndhwm,
        heartbeat_interval_s=args.heartbeat_interval,
    )
    samples = []
    max_rss = rss_bytes()
    next_rss_ns = time.monotonic_ns() + 1_000_000_000
    deadline_ns = time.monotonic_ns() + int(args.duration * 1e9)
    iteration = 0
    while not stop.is_set() and time.monotonic_ns() < deadline_ns:
        iteration += 1
        start_ns = time.monotonic_ns()
        time.sleep(args.iteration_time)  # the "forward pass"
        elapsed_ns = time.monotonic_ns() - start_ns
        record = synthetic_record(args.engine_index, iteration, start_ns, elapsed_ns)
        publish_start_ns = time.monotonic_ns()
        publisher.publish(record)
        end_ns = time.monotonic_ns()
        samples.append((start_ns, end_ns - start_ns, end_ns - publish_start_ns))
        if end_ns >= next_rss_ns:
            max_rss = max(max_rss, rss_bytes())
            next_rss_ns = end_ns + 1_000_000_000
    publisher.close()
    return {
        "last_seq": publisher.num_sent_total + publisher.num_dropped_total,
        "num_dropped_total": publisher.num_dropped_total,
        "num_iterations": iteration,
        "samples": samples,
        "max_rss_bytes": max(max_rss, rss_bytes()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", required=True)
    parser.add_argument("--report", required=True)
    parser.add_argument("--engine-index", type=int, default=0)
    parser.add_argument("--iteration-time", type=float, default=0.001, metavar="S")
    parser.add_argument("--duration", type=float, default=60.0, metavar="S")
    parser.add_argument("--sndhwm", type=int, default=8192)
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    args = parser.parse_args(argv)
    report = run(args)
    Path(args.report).write_text(json.dumps(report))
    return 0


def start_engine(address: str, report: Path, *extra: str) -> subprocess.Popen:
    """Start the synthetic engine as a process of its own."""
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), "--address", address, "--report", str(report), *extra]
    )


def stop_engine(process: subprocess.Popen, report: Path) -> dict:
    """SIGTERM the synthetic engine, wait for it, and read its report."""
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=20)
    return json.loads(report.read_text())


if __name__ == "__main__":
    sys.exit(main())
