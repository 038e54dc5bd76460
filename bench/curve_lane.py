"""What CURVE costs the engine on a tcp telemetry lane: plain tcp versus CURVE tcp, side by side.

    .venv/bin/python bench/curve_lane.py [--records 20000] [--rate 5000] [--rounds 2]

An engine-side ZmqPublisher sends paced steady-state decode records to a PULL socket in another
process (CURVE server set up by telemetry.lane.curve when on). Per mode, interleaved over rounds:
the publish() call cost (p50, p99 in ns), the engine process's CPU time per record (user +
system of the whole process, so ZMQ's I/O thread, where CURVE encrypts, is included; the
sender sleeps between batches of 50), and the records delivered. The last line is one JSON
object with the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import socket
import tempfile
import time

import zmq

from telemetry.lane import curve
from telemetry.lane.publisher import ZmqPublisher
from telemetry.lane.record import IterationRecord, iteration_record

MODES = ("tcp", "tcp+curve")
BATCH = 50  # records sent back to back, then a sleep that keeps the mean rate


def decode_record() -> IterationRecord:
    return iteration_record(
        0,
        0,
        1,
        start_ns=time.monotonic_ns(),
        elapsed_ns=10_250_000,
        num_decode_reqs=50,
        num_decode_tokens=50,
        num_running_reqs=50,
        num_kv_blocks_used=3500,
        num_kv_blocks_free=65459,
        num_kv_tokens=56000,
    )


def receiver(address: str, keys_dir: str | None, ready, result) -> None:
    """Count frames until none arrives for 1 s after the first one."""
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    if keys_dir:
        curve.configure_server(pull, keys_dir)
    pull.bind(address)
    ready.set()
    num_frames = 0
    while pull.poll(10_000 if num_frames == 0 else 1000):
        pull.recv()
        num_frames += 1
    pull.close(linger=0)
    curve.stop_server_auth(context)
    context.term()
    result.put(num_frames)


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_mode(mode: str, keys_dir: str, num_records: int, rate_per_s: float) -> dict:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    curve_dir = keys_dir if mode == "tcp+curve" else None
    ready, result = multiprocessing.Event(), multiprocessing.Queue()
    process = multiprocessing.Process(target=receiver, args=(address, curve_dir, ready, result))
    process.start()
    ready.wait(10)
    context = zmq.Context()
    publisher = ZmqPublisher(
        address, 0, heartbeat_interval_s=3600, context=context, curve_keys_dir=curve_dir
    )
    record = decode_record()
    while publisher.num_sent_total == 0:  # wait for the (CURVE) handshake
        publisher.publish(record)
        time.sleep(0.01)
    batch_interval_s = BATCH / rate_per_s
    call_ns = []
    cpu_start_s = cpu_s()
    for _ in range(num_records // BATCH):
        for _ in range(BATCH):
            start_ns = time.perf_counter_ns()
            publisher.publish(record)
            call_ns.append(time.perf_counter_ns() - start_ns)
        time.sleep(batch_interval_s)
    time.sleep(0.2)  # let the I/O thread finish sending
    cpu_used_s = cpu_s() - cpu_start_s
    publisher.close()
    context.term()
    num_received = result.get(timeout=30)
    process.join(10)
    call_ns.sort()
    return {
        "publish_p50_ns": call_ns[len(call_ns) // 2],
        "publish_p99_ns": call_ns[int(len(call_ns) * 0.99)],
        "cpu_us_per_record": cpu_used_s / len(call_ns) * 1e6,
        "num_received": num_received,
        "num_dropped": publisher.num_dropped_total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=5000.0, help="records per second")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    keys_dir = tempfile.mkdtemp(prefix="iterscope-curve-bench-")
    curve.generate_keys(keys_dir, ["engine"])
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            runs[mode].append(run_mode(mode, keys_dir, args.records, args.rate))
    figures = {}
    for mode, results in runs.items():
        best = min(results, key=lambda r: r["publish_p50_ns"])
        figures[mode] = {
            "publish_p50_ns": best["publish_p50_ns"],
            "publish_p99_ns": min(r["publish_p99_ns"] for r in results),
            "cpu_us_per_record": round(min(r["cpu_us_per_record"] for r in results), 3),
            "num_received": [r["num_received"] for r in results],
            "num_dropped": [r["num_dropped"] for r in results],
        }
        print(
            f"{mode:>10}: publish p50 {figures[mode]['publish_p50_ns']} ns, "
            f"p99 {figures[mode]['publish_p99_ns']} ns, "
            f"process CPU {figures[mode]['cpu_us_per_record']:.2f} us/record, "
            f"received {figures[mode]['num_received']} of {args.records}+"
        )
    ratio = figures["tcp+curve"]["publish_p50_ns"] / figures["tcp"]["publish_p50_ns"]
    cpu_ratio = figures["tcp+curve"]["cpu_us_per_record"] / figures["tcp"]["cpu_us_per_record"]
    print(f"curve/plain: publish p50 {ratio:.2f}x, process CPU per record {cpu_ratio:.2f}x")
    figures["publish_p50_ratio_curve_over_plain"] = round(ratio, 3)
    figures["cpu_ratio_curve_over_plain"] = round(cpu_ratio, 3)
    figures.update(records=args.records, rate_per_s=args.rate, rounds=args.rounds)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
