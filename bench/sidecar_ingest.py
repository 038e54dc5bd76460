"""Sidecar ingest rate with the log and JSONL sinks on, in records per second on one core, and
what the live findings (telemetry/analysis/live_findings.py) cost of it.

Figures from one run, on the same pre-encoded frames (decode records of one engine, a heartbeat
every 1,000 records, consecutive seqs; every 6,000 records, 60 s of engine time, 1,500 of them
with the KV cache 97% full and 4 requests waiting for it, so the live findings' window search
finds, opens and closes kv_saturation and waiting_kv findings as it would on a loaded engine):
  in_process  Ingest.on_frame alone: typed decode, seq check, status, live findings, log +
              JSONL sinks; the clock read and ticks as the LaneLoop does them
  over_ipc    a sender process pushes the frames over ipc:// to a LaneLoop.run() loop in this
              process (ZMQ receive included; the sender uses another core)
  bare_pull   the floor: the same sender and frames into a bare ZMQ PULL loop that receives
              each frame and does nothing with it; over_ipc / bare_pull is the sidecar's
              share of what the lane itself allows
  no_sink     over_ipc with no sink and live findings off: the LaneLoop, decode, checks and
              engine view alone, so the share splits into theirs and the sinks'
  findings    in_process and over_ipc again with live findings off (`--no-live-findings`),
              side by side with on, rounds alternating which goes first: on / off is what
              the live findings leave of the ingest rate. The window is searched at most
              once a second of the sidecar's clock (the first search, at the start, finds a
              window nearly empty), so a pass must last seconds for the searches to weigh as
              they do in a long run: the default 1,500,000 records take 2-4 s per pass here;
              the number of searches and their time are reported, and a warning says when a
              pass had fewer than MIN_SEARCHES

    .venv/bin/python bench/sidecar_ingest.py [--records 1500000] [--rounds 2]

The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from telemetry.lane.record import heartbeat, iteration_record, make_encoder  # noqa: E402
from telemetry.sidecar.ingest import TICK_INTERVAL_S, Ingest  # noqa: E402
from telemetry.sidecar.lane_loop import LaneLoop  # noqa: E402
from telemetry.sidecar.sinks.jsonl import JsonlSink  # noqa: E402
from telemetry.sidecar.sinks.log import LogSink  # noqa: E402

WALL_OFFSET_NS = 1_700_000_000_000_000_000
NUM_KV_BLOCKS = 68_959
PRESSURE_EVERY = 6_000  # records (60 s of engine time)
PRESSURE_RECORDS = 1_500  # of those, the first this many: KV 97% full, 4 waiting for KV
CLOCK_EVERY = 1_000  # in process: frames stamped with one clock read (the LaneLoop: a batch)
MIN_SEARCHES = 3  # fewer in a findings-on pass: too short for the searches to weigh
STUCK_AFTER_S = 30.0  # over ipc: no frame for this long, and some are missing: give up


def make_frames(num_records: int) -> list[bytes]:
    encoder = make_encoder()
    frames, seq, start_ns = [], 0, 1_000_000_000
    for iteration in range(1, num_records + 1):
        start_ns += 10_000_000
        pressed = iteration % PRESSURE_EVERY < PRESSURE_RECORDS
        waiting = 4 if pressed else 0
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
                        num_waiting_reqs=waiting,
                        device_name="CPU",
                        num_kv_blocks_total=NUM_KV_BLOCKS,
                    )
                )
            )
        seq += 1
        running = 48 + iteration % 5
        kv_used = 67_000 if pressed else 3500
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
                    num_waiting_reqs=waiting,
                    num_waiting_kv_reqs=waiting,
                    num_kv_blocks_used=kv_used,
                    num_kv_blocks_free=NUM_KV_BLOCKS - kv_used,
                    num_kv_tokens=kv_used * 16,
                )
            )
        )
    return frames


@dataclass
class Pass:
    """One pass over the frames: its rate, and what the live findings did (0s when off)."""

    records_per_s: float
    elapsed_s: float
    cpu_s: float  # of the ingest thread: what other jobs on the cores change least
    num_searches: int = 0
    search_time_s: float = 0.0
    num_findings: int = 0  # opened


def make_ingest(directory: str, live_findings: bool, sinks: bool = True) -> Ingest:
    """The log and JSONL sinks, or (``sinks`` False) none: the loop and Ingest's own work."""
    if not sinks:
        return Ingest([], live_findings=live_findings)
    lines: list[str] = []
    log = LogSink(emit=lambda level, text: lines.append(text))
    jsonl = JsonlSink(f"{directory}/rec.jsonl", max_bytes=1 << 30)
    return Ingest([log, jsonl], live_findings=live_findings)


def finished_pass(ingest: Ingest, num_frames: int, elapsed_s: float, cpu_s: float) -> Pass:
    ingest.close()
    result = Pass(num_frames / elapsed_s, elapsed_s, cpu_s)
    findings = ingest.engines[0].findings
    if findings is not None:
        result.num_searches = findings.num_searches
        result.search_time_s = findings.search_time_s
        result.num_findings = int(sum(count for count, _ in findings.totals.values()))
    return result


def in_process_rate(frames: list[bytes], directory: str, live_findings: bool) -> Pass:
    ingest = make_ingest(directory, live_findings)
    on_frame, tick_ns = ingest.on_frame, int(TICK_INTERVAL_S * 1e9)
    start, start_cpu = time.perf_counter(), time.thread_time()
    now_ns = next_tick_ns = time.monotonic_ns()
    for number, frame in enumerate(frames):
        if number % CLOCK_EVERY == 0:
            now_ns = time.monotonic_ns()
            if now_ns >= next_tick_ns:
                ingest.tick(now_ns)
                next_tick_ns = now_ns + tick_ns
        on_frame(frame, now_ns)
    elapsed_s, cpu_s = time.perf_counter() - start, time.thread_time() - start_cpu
    return finished_pass(ingest, len(frames), elapsed_s, cpu_s)


def receive_hwm(num_frames: int) -> int:
    """A receive queue that holds the whole run: with a full queue, the sender's last frames
    (about a send HWM of them) were sometimes lost at its exit, seen here with 1,001,000 frames
    and a queue of 1,000,000."""
    return num_frames + 10_000


def send_frames(address: str, num_records: int) -> None:
    frames = make_frames(num_records)
    context = zmq.Context.instance()
    socket = context.socket(zmq.PUSH)
    socket.connect(address)
    for frame in frames:
        socket.send(frame)
    socket.close(linger=-1)
    context.term()  # waits until the frames still queued here (beyond the HWMs) are sent


def watch(ingest: Ingest, num_frames: int, loop: LaneLoop, times: dict[str, float]) -> None:
    """Times the first and the last frame in; stops the loop after the last, or after
    STUCK_AFTER_S without a new frame (the caller reports what is missing)."""
    while ingest.health.num_frames == 0:
        time.sleep(0.0005)
    times["first"] = time.perf_counter()
    num_seen, seen_at = 0, time.perf_counter()
    while ingest.health.num_frames < num_frames:
        time.sleep(0.001)
        if ingest.health.num_frames > num_seen:
            num_seen, seen_at = ingest.health.num_frames, time.perf_counter()
        elif time.perf_counter() - seen_at > STUCK_AFTER_S:
            break
    times["last"] = time.perf_counter()
    loop.stop()


def over_ipc_rate(
    num_records: int, num_frames: int, directory: str, live_findings: bool, sinks: bool = True
) -> Pass:
    address = f"ipc://{directory}/lane.sock"
    ingest = make_ingest(directory, live_findings, sinks)
    sidecar = LaneLoop(address, ingest, rcvhwm=receive_hwm(num_frames))
    sender = multiprocessing.get_context("spawn").Process(
        target=send_frames, args=(address, num_records)
    )
    sender.start()
    times: dict[str, float] = {}
    watcher = threading.Thread(target=watch, args=(ingest, num_frames, sidecar, times))
    watcher.start()
    start_cpu = time.thread_time()  # run() waits in poll, which takes no CPU time
    sidecar.run()
    cpu_s = time.thread_time() - start_cpu
    watcher.join()
    sender.join()
    if ingest.health.num_frames < num_frames:
        raise RuntimeError(
            f"only {ingest.health.num_frames} of {num_frames} frames arrived over ipc"
        )
    return finished_pass(ingest, num_frames - 1, times["last"] - times["first"], cpu_s)


def bare_pull_rate(num_records: int, num_frames: int, directory: str) -> float:
    """Frames per second a PULL socket receives from the same sender, doing nothing else."""
    address = f"ipc://{directory}/bare.sock"
    socket = zmq.Context.instance().socket(zmq.PULL)
    socket.setsockopt(zmq.RCVHWM, receive_hwm(num_frames))
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


def mean_rate(passes: list[Pass]) -> float:
    return statistics.fmean(p.records_per_s for p in passes)


def cpu_ratio(on: list[Pass], off: list[Pass]) -> float:
    """Records per CPU second of the ingest thread, on / off."""
    return sum(p.cpu_s for p in off) / sum(p.cpu_s for p in on)


def findings_passes(
    frames: list[bytes], num_records: int, rounds: int
) -> tuple[dict[bool, list[Pass]], dict[bool, list[Pass]]]:
    """In process and over ipc, each with live findings on (True) and off, ``rounds`` times,
    alternating which goes first."""
    in_process: dict[bool, list[Pass]] = {True: [], False: []}
    over_ipc: dict[bool, list[Pass]] = {True: [], False: []}
    for number in range(rounds):
        order = (True, False) if number % 2 == 0 else (False, True)
        for live_findings in order:
            with tempfile.TemporaryDirectory() as directory:
                in_process[live_findings].append(in_process_rate(frames, directory, live_findings))
        for live_findings in order:
            with tempfile.TemporaryDirectory() as directory:
                over_ipc[live_findings].append(
                    over_ipc_rate(num_records, len(frames), directory, live_findings)
                )
    return in_process, over_ipc


def report(figures: dict, num_searches: int) -> None:
    """The figures in words, then as the last line one JSON object."""
    f = figures
    print(f"{f['num_frames']} frames through decode + seq/status + log + JSONL sinks:")
    print(f"  in process: {f['in_process_records_per_s']:,} records/s")
    print(f"  over ipc:   {f['over_ipc_records_per_s']:,} records/s (ZMQ receive included)")
    print(
        f"  bare PULL:  {f['bare_pull_frames_per_s']:,} frames/s: the sidecar runs at "
        f"{100 * f['share_of_bare_pull']:.0f}% of the lane's own limit"
    )
    print(
        f"  over ipc with no sink and findings off: {f['no_sink_records_per_s']:,} records/s, "
        f"{100 * f['no_sink_share_of_bare_pull']:.0f}% of it (the loop, decode and checks alone)"
    )
    print(
        f"live findings on / off, mean of {f['rounds']} rounds: over ipc "
        f"{f['findings_on_per_s']:,} / {f['findings_off_per_s']:,} = {f['findings_ratio']:.3f} "
        f"(rounds: {f['findings_ratio_per_round']}); in process {f['in_process_records_per_s']:,}"
        f" / {f['in_process_findings_off_per_s']:,} = {f['in_process_findings_ratio']:.3f}"
    )
    print(
        f"  per CPU second of the ingest thread (what other jobs change least): over ipc "
        f"{f['findings_cpu_ratio']:.3f}, in process {f['in_process_findings_cpu_ratio']:.3f}"
    )
    print(
        f"  over ipc, per pass: {f['findings_searches_per_pass']} window searches taking "
        f"{f['findings_search_ms_per_pass']} ms ({100 * f['findings_search_share']:.1f}% of the "
        f"time), {f['findings_opened_per_pass']} findings opened"
    )
    if num_searches < MIN_SEARCHES:
        print(
            f"  warning: a findings-on pass searched its window only {num_searches} times; "
            "the run is too short for the searches to weigh as in a long run (more --records)"
        )
    print(json.dumps(figures))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1_500_000)
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="pairs of findings on / off passes, alternating which goes first (default 2)",
    )
    args = parser.parse_args(argv)
    if args.records < 1 or args.rounds < 1:
        parser.error("--records and --rounds must be at least 1")
    frames = make_frames(args.records)
    in_process, over_ipc = findings_passes(frames, args.records, args.rounds)
    with tempfile.TemporaryDirectory() as directory:
        bare_pull = bare_pull_rate(args.records, len(frames), directory)
    with tempfile.TemporaryDirectory() as directory:
        no_sink = over_ipc_rate(args.records, len(frames), directory, False, sinks=False)
    in_on, in_off = mean_rate(in_process[True]), mean_rate(in_process[False])
    ipc_on, ipc_off = mean_rate(over_ipc[True]), mean_rate(over_ipc[False])
    searched = over_ipc[True]
    figures = {
        "num_frames": len(frames),
        "rounds": args.rounds,
        "in_process_records_per_s": round(in_on),
        "over_ipc_records_per_s": round(ipc_on),
        "bare_pull_frames_per_s": round(bare_pull),
        "ipc_over_in_process": round(ipc_on / in_on, 2),
        "share_of_bare_pull": round(ipc_on / bare_pull, 3),
        "no_sink_records_per_s": round(no_sink.records_per_s),
        "no_sink_share_of_bare_pull": round(no_sink.records_per_s / bare_pull, 3),
        "findings_on_per_s": round(ipc_on),
        "findings_off_per_s": round(ipc_off),
        "findings_ratio": round(ipc_on / ipc_off, 3),
        "findings_ratio_per_round": [
            round(on.records_per_s / off.records_per_s, 3)
            for on, off in zip(over_ipc[True], over_ipc[False], strict=True)
        ],
        "findings_cpu_ratio": round(cpu_ratio(over_ipc[True], over_ipc[False]), 3),
        "in_process_findings_off_per_s": round(in_off),
        "in_process_findings_ratio": round(in_on / in_off, 3),
        "in_process_findings_cpu_ratio": round(cpu_ratio(in_process[True], in_process[False]), 3),
        "findings_searches_per_pass": [p.num_searches for p in searched],
        "findings_search_ms_per_pass": [round(p.search_time_s * 1e3, 1) for p in searched],
        "findings_search_share": round(
            statistics.fmean(p.search_time_s / p.elapsed_s for p in searched), 4
        ),
        "findings_opened_per_pass": [p.num_findings for p in searched],
    }
    report(figures, min(p.num_searches for p in searched + in_process[True]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
