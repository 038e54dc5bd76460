"""FPM ingest rate: forward-pass metrics messages per second through the sidecar's FPM path on
one core (goal: >= 200,000 messages/s, issue #29).

The same pre-encoded FPM messages (one producer, consecutive seqs, a busy mixed iteration
each, an all-zero heartbeat every 1,000) go through:
  in_process  FpmEngines.on_frames alone: decode, numbering, Ingest (seq and status checks,
              live findings on, no sinks), the clock read per 1,000 messages as the LaneLoop
              reads it per batch
  over_tcp    a producer process publishes them on tcp://127.0.0.1 (a PUB socket, as SGLang
              and Dynamo do) to `iterscope sidecar --fpm`'s loop, LaneLoop.run() with an
              FpmSubscriber, in this process (ZMQ receive included), while it sends: the
              producer's send rate (reported) bounds it
  over_tcp_queued  the same, but the loop starts once the producer sent every message into
              the SUB socket's queue: the sidecar's own limit, ZMQ's receive included
  bare_sub    a bare SUB loop that receives each message's three frames from the same
              producer while it sends, and does nothing with them
This process is pinned to one core and the producer to another where the machine has two
(os.sched_setaffinity); the JSON figures hold the ingest thread's CPU time too, which other
jobs on the cores change least.

    .venv/bin/python bench/fpm_ingest.py [--messages 1000000]

The last line is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sidecar_ingest import watch  # noqa: E402  (the same wait, 30 s without a frame)
from telemetry.sidecar.fpm_encode import frames, idle_message  # noqa: E402
from telemetry.sidecar.fpm_engines import FpmEngines  # noqa: E402
from telemetry.sidecar.fpm_socket import FpmSubscriber  # noqa: E402
from telemetry.sidecar.ingest import Ingest  # noqa: E402
from telemetry.sidecar.lane_loop import LaneLoop  # noqa: E402
from telemetry.sources.fpm import (  # noqa: E402
    ForwardPassMetrics,
    QueuedRequests,
    ScheduledRequests,
)

HEARTBEAT_EVERY = 1000
CLOCK_EVERY = 1000
INGEST_CORE, PRODUCER_CORE = 0, 1


# A mixed iteration: a prefill chunk of 128 tokens on 32 cached, 6 decodes holding 600.
BUSY = ForwardPassMetrics(
    version=1,
    scheduled_requests=ScheduledRequests(1, 128, 0.0, 32, 6, 600, 25.0),
    queued_requests=QueuedRequests(3, 900, 0.0, 1, 0, 0.0),
    worker_id="bench",
    wall_time=0.02,
)


def make_messages(num_messages: int) -> list[list[bytes]]:
    idle = idle_message("bench", 0, 0)
    return [
        list(frames(seq, idle if seq % HEARTBEAT_EVERY == 0 else BUSY))
        for seq in range(num_messages)
    ]


def pin(core: int) -> None:
    """Run on ``core`` where the machine has it (a one-core machine shares it)."""
    if core < (os.cpu_count() or 1):
        os.sched_setaffinity(0, {core})


def in_process_rate(messages: list[list[bytes]]) -> dict[str, float]:
    ingest = Ingest([])
    engines = FpmEngines(ingest, producer="sglang")
    start, start_cpu = time.perf_counter(), time.thread_time()
    now_ns = 0
    for number, message in enumerate(messages):
        if number % CLOCK_EVERY == 0:
            now_ns = time.monotonic_ns()
        engines.on_frames(message, now_ns)
    elapsed_s, cpu_s = time.perf_counter() - start, time.thread_time() - start_cpu
    assert ingest.engines[0].view.totals.num_iterations > 0
    return {"per_s": len(messages) / elapsed_s, "per_cpu_s": len(messages) / cpu_s}


def publish(endpoint: str, num_messages: int, sent_per_s: Synchronized) -> None:
    """The producer: an XPUB (a PUB that reports its subscriber) sends once one subscribed,
    so no message is lost to the subscription's delay; then it waits for the last ones.
    ``sent_per_s``: how fast it handed them to ZMQ (a receiver cannot go faster)."""
    pin(PRODUCER_CORE)
    messages = make_messages(num_messages)
    context = zmq.Context()
    socket = context.socket(zmq.XPUB)
    socket.setsockopt(zmq.SNDHWM, num_messages + 10_000)
    socket.bind(endpoint)
    socket.recv()  # the subscription
    send, more = socket.send, zmq.SNDMORE
    start = time.perf_counter()
    for topic, seq, payload in messages:  # three sends: 0.9 us, send_multipart's 2.8 us
        send(topic, more)
        send(seq, more)
        send(payload)
    sent_per_s.value = num_messages / (time.perf_counter() - start)
    socket.close(linger=-1)
    context.term()


class Producer:
    """The producer process publishing ``num_messages`` on tcp://127.0.0.1:``port``."""

    def __init__(self, port: int, num_messages: int) -> None:
        spawn = multiprocessing.get_context("spawn")
        self.sent_per_s = spawn.Value("d", 0.0)
        self.process = spawn.Process(
            target=publish, args=(f"tcp://127.0.0.1:{port}", num_messages, self.sent_per_s)
        )
        self.process.start()

    def join(self) -> float:
        """Wait for it to finish; how fast it sent."""
        self.process.join()
        return self.sent_per_s.value


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def over_tcp_rate(num_messages: int, directory: str, queued: bool) -> dict[str, float]:
    """Ingest while the producer sends, or (``queued``) once it sent all of them into the
    SUB socket's queue: the sidecar's own limit, ZMQ's receive from the queue included."""
    port = free_port()
    producer = Producer(port, num_messages)
    ingest = Ingest([])
    subscriber = FpmSubscriber(
        [f"tcp://127.0.0.1:{port}"],
        FpmEngines(ingest, producer="sglang"),
        rcvhwm=num_messages + 10_000,
    )
    loop = LaneLoop(f"ipc://{directory}/lane.sock", ingest, subscribers=[subscriber])
    times: dict[str, float] = {}
    watcher = threading.Thread(target=watch, args=(ingest, num_messages, loop, times))
    sent_per_s = producer.join() if queued else 0.0
    watcher.start()
    start_cpu = time.thread_time()  # run() waits in poll, which takes no CPU time
    loop.run()
    cpu_s = time.thread_time() - start_cpu
    watcher.join()
    sent_per_s = sent_per_s or producer.join()
    received = ingest.health.num_frames
    if received < num_messages:
        raise RuntimeError(f"only {received} of {num_messages} messages arrived over tcp")
    return {
        "per_s": (num_messages - 1) / (times["last"] - times["first"]),
        "per_cpu_s": num_messages / cpu_s,
        "num_dropped": float(ingest.engines[0].view.num_dropped_total),
        "sent_per_s": sent_per_s,
    }


def bare_sub_rate(num_messages: int) -> dict[str, float]:
    """Messages per second a SUB receives from the same producer, doing nothing else."""
    port = free_port()
    producer = Producer(port, num_messages)
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.setsockopt(zmq.RCVHWM, num_messages + 10_000)
    socket.connect(f"tcp://127.0.0.1:{port}")
    receive = socket.recv  # three copies, no check: the cheapest receive of a message
    receive(), receive(), receive()
    first = time.perf_counter()
    for _ in range(num_messages - 1):
        receive(), receive(), receive()
    last = time.perf_counter()
    sent_per_s = producer.join()
    socket.close(linger=0)
    context.term()
    return {"per_s": (num_messages - 1) / (last - first), "sent_per_s": sent_per_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    pin(INGEST_CORE)
    in_process = in_process_rate(make_messages(args.messages))
    with tempfile.TemporaryDirectory() as directory:
        over_tcp = over_tcp_rate(args.messages, directory, queued=False)
    with tempfile.TemporaryDirectory() as directory:
        queued = over_tcp_rate(args.messages, directory, queued=True)
    bare_sub = bare_sub_rate(args.messages)
    figures = {
        "num_messages": args.messages,
        "in_process_messages_per_s": round(in_process["per_s"]),
        "in_process_messages_per_cpu_s": round(in_process["per_cpu_s"]),
        "over_tcp_messages_per_s": round(over_tcp["per_s"]),
        "over_tcp_messages_per_cpu_s": round(over_tcp["per_cpu_s"]),
        "over_tcp_num_dropped": int(over_tcp["num_dropped"]),
        "producer_sent_per_s": round(over_tcp["sent_per_s"]),
        "over_tcp_queued_messages_per_s": round(queued["per_s"]),
        "over_tcp_queued_messages_per_cpu_s": round(queued["per_cpu_s"]),
        "bare_sub_messages_per_s": round(bare_sub["per_s"]),
        "bare_sub_producer_sent_per_s": round(bare_sub["sent_per_s"]),
        "share_of_bare_sub": round(over_tcp["per_s"] / bare_sub["per_s"], 3),
        "goal_messages_per_s": 200_000,
    }
    print(f"{args.messages:,} FPM messages (decode, numbering, Ingest; no sinks), one core:")
    print(f"  in process: {figures['in_process_messages_per_s']:,} messages/s")
    print(
        f"  over tcp:   {figures['over_tcp_messages_per_s']:,} messages/s (ZMQ included; the "
        f"producer sent {figures['producer_sent_per_s']:,}/s)"
    )
    print(
        f"  over tcp, from the queue: {figures['over_tcp_queued_messages_per_s']:,} messages/s "
        "(the producer done first: the sidecar's own limit)"
    )
    print(
        f"  bare SUB:   {figures['bare_sub_messages_per_s']:,} messages/s "
        "(bounded by the producer's sends)"
    )
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
