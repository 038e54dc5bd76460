"""Engine-side cost of telemetry per iteration, and the wire size of a record.

Side by side in one run, alternating blocks of iterations:
  lane     fill an IterationRecord from the scheduler's counts and hand it to
           ZmqPublisher.publish (the engine thread's whole cost); its sender thread encodes
           and sends it without blocking to a real sidecar process on ipc://. The process
           CPU per iteration, sender thread included, is printed too
  logging  what reviewers rejected for vLLM: format the equivalent per-iteration line in the
           engine and emit it through `logging` (a StreamHandler on /dev/null, so no disk or
           terminal cost is counted: the comparison favours logging)
Each call is timed alone with perf_counter_ns; the timer's own cost is printed too.

    .venv/bin/python bench/telemetry_cost.py [--iterations 200000] [--pace-us 0]

The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from telemetry.lane.publisher import ZmqPublisher  # noqa: E402
from telemetry.lane.record import (  # noqa: E402
    IterationRecord,
    RequestMilestone,
    iteration_record,
    make_encoder,
)
from telemetry.sidecar.process import start_sidecar  # noqa: E402

BLOCK = 10_000


def counts(iteration: int) -> tuple[int, ...]:
    """Scheduler counts of a steady decode iteration, varying a little."""
    running = 48 + iteration % 5
    return (running, running, running, iteration % 3, 3500 + iteration % 7, 65459, 56000)


def lane_iteration(publisher: ZmqPublisher, iteration: int, start_ns: int) -> None:
    running, gen_reqs, gen_tokens, waiting, used, free, kv_tokens = counts(iteration)
    # The constructor with every field, as engine/core.py builds its records: the cost timed
    # is the engine's, without the dict merge of telemetry.lane.record.iteration_record.
    publisher.publish(
        IterationRecord(
            0,
            0,
            iteration,
            start_ns,
            10_250_000,
            0,
            0,
            gen_reqs,
            gen_tokens,
            running,
            waiting,
            waiting,
            0,
            0,
            used,
            free,
            kv_tokens,
            0,
            0,
            0,
        )
    )


def logging_iteration(logger: logging.Logger, iteration: int, start_ns: int) -> None:
    running, gen_reqs, gen_tokens, waiting, used, free, kv_tokens = counts(iteration)
    total = used + free
    logger.info(
        f"Iteration({iteration}): 0 context requests, 0 context tokens, {gen_reqs} generation "
        f"requests, {gen_tokens} generation tokens, iteration elapsed time: "
        f"{10_250_000 / 1e6:.2f} ms, kv cache: {100 * used / total:.1f}% "
        f"({used}/{total} blocks, {kv_tokens} tokens)"
    )


def time_block(
    function, target, first_iteration: int, samples: list[int], pace_s: float = 0.0
) -> None:
    """BLOCK calls, each timed alone; ``pace_s`` > 0 sleeps that long after each (the GIL
    released, as a forward pass in torch releases it), so the sender thread does its work
    between iterations as it does beside a real engine."""
    clock = time.perf_counter_ns
    for iteration in range(first_iteration, first_iteration + BLOCK):
        start = clock()
        function(target, iteration, start)
        samples.append(clock() - start)
        if pace_s:
            time.sleep(pace_s)


def timer_overhead_ns() -> float:
    clock = time.perf_counter_ns
    samples = []
    for _ in range(BLOCK):
        start = clock()
        samples.append(clock() - start)
    return statistics.median(samples)


def percentile(samples: list[int], fraction: float) -> float:
    ordered = sorted(samples)
    return float(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))])


def record_sizes() -> dict[str, int]:
    encoder = make_encoder()
    steady = iteration_record(
        0,
        2**31,
        123_456_789,
        start_ns=time.monotonic_ns(),
        elapsed_ns=10_250_000,
        num_decode_reqs=50,
        num_decode_tokens=50,
        num_running_reqs=50,
        num_kv_blocks_used=3500,
        num_kv_blocks_free=65459,
        num_kv_tokens=56000,
    )
    milestone = RequestMilestone("cmpl-0123456789abcdef", 2, 1, 2, 3, 4, 512, 0, 128, 0, 0)
    with_finish = msgspec.structs.replace(steady, milestones=[milestone])
    return {
        "steady_decode_record_bytes": len(encoder.encode(steady)),
        "record_with_one_finish_bytes": len(encoder.encode(with_finish)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iterations", type=int, default=200_000, help="per method")
    parser.add_argument(
        "--pace-us",
        type=float,
        default=0.0,
        help="sleep this long after each timed call, the GIL released as in a forward pass "
        "(default 0: back to back, records far faster than any engine makes them)",
    )
    args = parser.parse_args(argv)
    logger = logging.getLogger("bench.engine")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    devnull = open(os.devnull, "w")
    handler = logging.StreamHandler(devnull)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s"))
    logger.addHandler(handler)
    sidecar = start_sidecar(["--no-metrics"], stderr=subprocess.DEVNULL)
    publisher = ZmqPublisher(sidecar.address, 0, heartbeat_interval_s=3600)
    time.sleep(0.5)
    lane, logged = [], []
    try:
        lane_cpu_ns = logging_cpu_ns = 0
        for block in range(max(1, args.iterations // BLOCK)):
            cpu_start = time.process_time_ns()
            time_block(lane_iteration, publisher, 1 + block * BLOCK, lane, args.pace_us / 1e6)
            publisher.flush()  # the sender thread's encode + send, counted in CPU time
            lane_cpu_ns += time.process_time_ns() - cpu_start
            cpu_start = time.process_time_ns()
            time_block(logging_iteration, logger, 1 + block * BLOCK, logged, args.pace_us / 1e6)
            logging_cpu_ns += time.process_time_ns() - cpu_start
        num_dropped = publisher.num_dropped_total
    finally:
        publisher.close()
        sidecar.stop()
        devnull.close()
    figures = {
        "lane_p50_ns": percentile(lane, 0.5),
        "lane_p99_ns": percentile(lane, 0.99),
        "logging_p50_ns": percentile(logged, 0.5),
        "logging_p99_ns": percentile(logged, 0.99),
        "lane_cpu_per_iteration_ns": lane_cpu_ns / len(lane),
        "logging_cpu_per_iteration_ns": logging_cpu_ns / len(logged),
        "timer_overhead_ns": timer_overhead_ns(),
        "num_iterations_each": len(lane),
        "pace_us": args.pace_us,
        "lane_num_dropped": num_dropped,
        **record_sizes(),
    }
    figures["logging_over_lane_p50"] = round(figures["logging_p50_ns"] / figures["lane_p50_ns"], 1)
    figures["logging_over_lane_p99"] = round(figures["logging_p99_ns"] / figures["lane_p99_ns"], 1)
    print(f"per iteration, {len(lane)} iterations each, alternating blocks of {BLOCK}:")
    print(
        f"  lane (fill + hand-off):      p50 {figures['lane_p50_ns']:.0f} ns, "
        f"p99 {figures['lane_p99_ns']:.0f} ns ({num_dropped} dropped)"
    )
    print(
        f"  in-process logging line:    p50 {figures['logging_p50_ns']:.0f} ns, "
        f"p99 {figures['logging_p99_ns']:.0f} ns"
    )
    print(
        f"  logging / lane: {figures['logging_over_lane_p50']}x at p50, "
        f"{figures['logging_over_lane_p99']}x at p99 "
        f"(timer overhead {figures['timer_overhead_ns']:.0f} ns, included in both)"
    )
    print(
        f"  process CPU per iteration, all threads (lane incl. the sender thread's encode + "
        f"send): lane {figures['lane_cpu_per_iteration_ns']:.0f} ns, "
        f"logging {figures['logging_cpu_per_iteration_ns']:.0f} ns"
    )
    print(
        f"steady decode record: {figures['steady_decode_record_bytes']} bytes; "
        f"with one finish milestone: {figures['record_with_one_finish_bytes']} bytes"
    )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
