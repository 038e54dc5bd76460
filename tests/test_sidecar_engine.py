"""A synthetic engine for the sidecar's process-level tests, until a real engine loop is used.

Run as a script, it iterates at a fixed pace, publishing one IterationRecord per iteration
through the real ZmqPublisher (heartbeats come from the publisher's own thread), until
SIGTERM or --duration; then it writes a JSON report:

    last_seq           every message it tried to send (records + heartbeats)
    num_dropped_total  sends that failed (full queue / no sidecar)
    samples            [[start_ns, iteration_ns, publish_ns], ...] per iteration
    max_rss_bytes      sampled once a second and at the end

The test in this file checks the synthetic engine itself.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from telemetry.lane.publisher import ZmqPublisher  # noqa: E402
from telemetry.lane.record import (  # noqa: E402
    IterationRecord,
    iteration_record,
    make_decoder,
)

pytestmark = pytest.mark.live

SCRIPT = Path(__file__).resolve()


def synthetic_record(engine_index: int, iteration: int, start_ns: int, elapsed_ns: int,
                     num_running_reqs: int = 8, num_waiting_reqs: int = 2) -> IterationRecord:
    """A steady decode iteration: one generation token per running request."""
    return iteration_record(
        engine_index, 0, iteration, start_ns=start_ns, elapsed_ns=elapsed_ns,
        num_decode_reqs=num_running_reqs, num_decode_tokens=num_running_reqs,
        num_running_reqs=num_running_reqs, num_waiting_reqs=num_waiting_reqs,
        num_waiting_kv_reqs=num_waiting_reqs, num_kv_blocks_used=100, num_kv_blocks_free=900,
        num_kv_tokens=1600,
    )


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as file:
        return int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run(args: argparse.Namespace) -> dict:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    publisher = ZmqPublisher(
        args.address, args.engine_index, facts={"device_name": "CPU", "model_name": "synthetic"},
        sndhwm=args.sndhwm, heartbeat_interval_s=args.heartbeat_interval,
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


def test_synthetic_engine_sends_consecutive_seqs(tmp_path):
    address = f"ipc://{tmp_path}/lane.sock"
    pull = zmq.Context.instance().socket(zmq.PULL)
    pull.bind(address)
    engine = start_engine(address, tmp_path / "report.json", "--duration", "0.5")
    decoder = make_decoder()
    messages = []
    try:
        assert engine.wait(timeout=30) == 0
        while pull.poll(200):
            messages.append(decoder.decode(pull.recv()))
    finally:
        engine.kill()
        pull.close(linger=0)
    report = json.loads((tmp_path / "report.json").read_text())
    records = [m for m in messages if isinstance(m, IterationRecord)]
    assert records and report["num_iterations"] >= len(records)
    seqs = [m.seq for m in messages]
    assert seqs == sorted(seqs) and seqs[-1] <= report["last_seq"]
    # Every seq is delivered or counted as dropped by the engine.
    assert len(set(seqs)) + report["num_dropped_total"] == report["last_seq"]
    assert msgspec.structs.asdict(records[0])["num_decode_tokens"] == 8


if __name__ == "__main__":
    sys.exit(main())
