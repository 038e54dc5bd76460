"""Sidecar ingest rate with the log and JSONL sinks on, in records per second on one core.

Three figures from one run, on the same pre-encoded frames (steady decode records of one
engine, a heartbeat every 1,000 records, consecutive seqs):
  in_process  Ingest.on_frame alone: typed decode, seq check, status, log + JSONL sinks
  over_ipc    a sender process pushes the frames over ipc:// to a LaneLoop.run() loop in this
              process (ZMQ receive included; the sender uses another core)
  bare_pull   the floor: the same sender and frames into a bare ZMQ PULL loop that receives
              each frame and does nothing with it; over_ipc / bare_pull is the sidecar's
              share of what the lane itself allows

    .venv/bin/python bench/sidecar_ingest.py [--records 300000]

The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from telemetry.lane.record import heartbeat, iteration_record, make_encoder  # noqa: E402
from telemetry.sidecar.ingest import Ingest  # noqa: E402
from telemetry.sidecar.lane_loop import LaneLoop  # noqa: E402
from telemetry.sidecar.sinks.jsonl import JsonlSink  # noqa: E402
from telemetry.sidecar.sinks.log import LogSink  # noqa: E402

WALL_OFFSET_NS = 1_700_000_000_000_000_000


def make_frames(num_records: int) -> list[bytes]:
    encoder = make_encoder()
    frames, seq, start_ns = [], 0, 1_000_000_000
    for iteration in range(1, num_records + 1):
        start_ns += 10_000_000
        if iteration % 1000 == 1:
            seq += 1
            frames.append(
                encoder.encode(
                    heartbeat(
                        0,
                        seq,
                        start_ns,
                        start_ns + WALL_OFFSET_NS,
                        last_iteration=iteration - 1,
                        num_running_reqs=50,
                        device_name="CPU",
                    )
                )
            )
        seq += 1
        running = 48 + iteration % 5
        frames.append(
            encoder.encode(
                iteration_record(
                    0,
                    seq,
                    iteration,
                    start_ns=start_ns,
                    elapsed_ns=9_000_000,
                    num_decode_reqs=running,
                    num_decode_tokens=running,
                    num_running_reqs=running,
                    num_kv_blocks_used=3500,
                    num_kv_blocks_free=65459,
                    num_kv_tokens=56000,
                )
            )
        )
    return frames


def make_ingest(directory: str) -> Ingest:
    lines: list[str] = []
    log = LogSink(emit=lambda level, text: lines.append(text))
    return Ingest([log, JsonlSink(f"{directory}/rec.jsonl", max_bytes=1 << 30)])


def in_process_rate(frames: list[bytes], directory: str) -> float:
    ingest = make_ingest(directory)
    start = time.perf_counter()
    for number, frame in enumerate(frames):
        ingest.on_frame(frame, number)
        if number % 10_000 == 0:
            ingest.tick(number)
    ingest.close()
    return len(frames) / (time.perf_counter() - start)


def send_frames(address: str, num_records: int) -> None:
    frames = make_frames(num_records)
    socket = zmq.Context.instance().socket(zmq.PUSH)
    socket.connect(address)
    for frame in frames:
        socket.send(frame)
    socket.close(linger=-1)


def over_ipc_rate(num_records: int, num_frames: int, directory: str) -> float:
    address = f"ipc://{directory}/lane.sock"
    ingest = make_ingest(directory + "/ipc")
    sidecar = LaneLoop(address, ingest, rcvhwm=1_000_000)
    sender = multiprocessing.get_context("spawn").Process(
        target=send_frames, args=(address, num_records)
    )
    sender.start()
    times: dict[str, float] = {}

    def watch() -> None:
        while ingest.health.num_frames == 0:
            time.sleep(0.0005)
        times["first"] = time.perf_counter()
        while ingest.health.num_frames < num_frames:
            time.sleep(0.001)
        times["last"] = time.perf_counter()
        sidecar.stop()

    watcher = threading.Thread(target=watch)
    watcher.start()
    sidecar.run()
    watcher.join()
    sender.join()
    ingest.close()
    return (num_frames - 1) / (times["last"] - times["first"])


def bare_pull_rate(num_records: int, num_frames: int, directory: str) -> float:
    """Frames per second a PULL socket receives from the same sender, doing nothing else."""
    address = f"ipc://{directory}/bare.sock"
    socket = zmq.Context.instance().socket(zmq.PULL)
    socket.setsockopt(zmq.RCVHWM, 1_000_000)
    socket.bind(address)
    sender = multiprocessing.get_context("spawn").Process(
        target=send_frames, args=(address, num_records)
    )
    sender.start()
    receive = socket.recv
    receive()
    first = time.perf_counter()
    for _ in range(num_frames - 1):
        receive()
    last = time.perf_counter()
    sender.join()
    socket.close(linger=0)
    return (num_frames - 1) / (last - first)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=300_000)
    args = parser.parse_args(argv)
    frames = make_frames(args.records)
    with tempfile.TemporaryDirectory() as directory:
        in_process = in_process_rate(frames, directory)
        over_ipc = over_ipc_rate(args.records, len(frames), directory)
        bare_pull = bare_pull_rate(args.records, len(frames), directory)
    figures = {
        "num_frames": len(frames),
        "in_process_records_per_s": round(in_process),
        "over_ipc_records_per_s": round(over_ipc),
        "bare_pull_frames_per_s": round(bare_pull),
        "ipc_over_in_process": round(over_ipc / in_process, 2),
        "share_of_bare_pull": round(over_ipc / bare_pull, 3),
    }
    print(f"{len(frames)} frames through decode + seq/status + log + JSONL sinks:")
    print(f"  in process: {in_process:,.0f} records/s")
    print(f"  over ipc:   {over_ipc:,.0f} records/s (ZMQ receive included)")
    print(
        f"  bare PULL:  {bare_pull:,.0f} frames/s: the sidecar runs at "
        f"{100 * over_ipc / bare_pull:.0f}% of the lane's own limit"
    )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
