"""Prometheus sink: ingest records/s vs prometheus_client instruments, and visibility latency.

    .venv/bin/python bench/prometheus_ingest.py [--records 100000] [--repeats 5] [--probes 300]

1. Ingest, one core (the process is pinned to one CPU), the same pre-built records through:
   - our sink (plain ints and lists per record, metric families built only at scrape time);
   - a baseline sink updating prometheus_client Gauge/Counter/Histogram instruments per record
     (label children bound once up front, as a careful user would; each update takes a lock),
     with the inter-token latency observed once per iteration (conservative) or once per
     generated token (the same histogram as ours: the client has no weighted observe);
   each alone, and behind the sidecar's Ingest (msgpack decode + sequence checks) from frames;
   and Ingest with a sink that does nothing (what decode + sequence checks cost alone).
2. Visibility: a real `iterscope sidecar` process; this process publishes one record at a time
   with telemetry.lane.publisher.ZmqPublisher and polls GET /metrics until the record's iteration
   shows, while a second engine process streams background records. Latency = publish to
   the first scrape that shows it (includes one full scrape). Reports p50 / p99.

The last line of output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import msgspec

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from prometheus_client import (  # noqa: E402
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from telemetry.lane.publisher import ZmqPublisher  # noqa: E402
from telemetry.lane.record import (  # noqa: E402
    EVENT_FINISHED,
    EVENT_FIRST_TOKEN,
    FINISH_REASONS,
    Heartbeat,
    IterationRecord,
    RequestMilestone,
    iteration_record,
    make_encoder,
)
from telemetry.lane.record import heartbeat as lane_heartbeat  # noqa: E402
from telemetry.sidecar.engine_view import EngineView  # noqa: E402
from telemetry.sidecar.ingest import Ingest  # noqa: E402
from telemetry.sidecar.sink import Sink  # noqa: E402
from telemetry.sidecar.sinks.prometheus import (  # noqa: E402
    HISTOGRAMS,
    WAITING_REASONS,
    PrometheusSink,
)
from tests.helpers.processes import start_metrics_sidecar  # noqa: E402

LABELS = ("engine", "model_name")
MS = 1_000_000


NUM_RUNNING = 50  # decode requests in every iteration
OUTPUT_TOKENS = 200  # per request
REQUEST_PERIOD = OUTPUT_TOKENS // NUM_RUNNING  # iterations between two admissions: 4


def make_records(num_records: int, seed: int = 3) -> list[IterationRecord]:
    """A decode-heavy steady state: 50 running requests of 200 output tokens, so every 4th
    iteration admits a request (a 512-token prefill whose first token comes out of it: a
    first-token event) and another 4th iteration finishes one (a finish event), as the engine
    sends them: two separate milestones per request."""
    rng = random.Random(seed)
    records = []
    start_ns = 10**12
    for index in range(num_records):
        iteration = index + 1
        elapsed_ns = rng.randint(9, 12) * MS
        end_ns = start_ns + elapsed_ns
        milestones = []
        num_prefill_tokens = 0
        if iteration % REQUEST_PERIOD == 1:  # admitted, prefilled, first token
            num_prefill_tokens = 512
            arrival_ns = start_ns - rng.randint(5, 500) * MS
            milestones.append(
                RequestMilestone(
                    request_id=f"r{iteration}",
                    event=EVENT_FIRST_TOKEN,
                    arrival_ns=arrival_ns,
                    first_scheduled_ns=start_ns,
                    first_token_ns=end_ns,
                    finished_ns=0,
                    num_prompt_tokens=640,
                    num_cached_tokens=128,
                    num_output_tokens=1,
                    num_preemptions=0,
                    finish_reason=0,
                )
            )
        if iteration % REQUEST_PERIOD == 3:  # the request admitted 200 tokens ago finishes
            first_token_ns = start_ns - OUTPUT_TOKENS * 12 * MS
            arrival_ns = first_token_ns - rng.randint(20, 520) * MS
            milestones.append(
                RequestMilestone(
                    request_id=f"r{iteration}",
                    event=EVENT_FINISHED,
                    arrival_ns=arrival_ns,
                    first_scheduled_ns=first_token_ns - 12 * MS,
                    first_token_ns=first_token_ns,
                    finished_ns=end_ns,
                    num_prompt_tokens=640,
                    num_cached_tokens=128,
                    num_output_tokens=OUTPUT_TOKENS,
                    num_preemptions=rng.choice((0, 0, 0, 1)),
                    finish_reason=rng.choice((0, 1)),
                )
            )
        records.append(
            iteration_record(
                0,
                iteration + iteration // 100,
                iteration,
                start_ns=start_ns,
                elapsed_ns=elapsed_ns,
                num_prefill_reqs=int(num_prefill_tokens > 0),
                num_prefill_tokens=num_prefill_tokens,
                num_decode_reqs=NUM_RUNNING,
                num_decode_tokens=NUM_RUNNING,
                num_running_reqs=NUM_RUNNING + 1,
                num_waiting_reqs=3,
                num_waiting_kv_reqs=3,
                num_kv_blocks_used=3500,
                num_kv_blocks_free=65459,
                num_kv_tokens=56000,
                num_prefix_query_tokens=num_prefill_tokens + 128 * (num_prefill_tokens > 0),
                num_prefix_hit_tokens=128 * (num_prefill_tokens > 0),
                milestones=milestones,
            )
        )
        start_ns += 12 * MS
    return records


def first_heartbeat() -> Heartbeat:
    return lane_heartbeat(
        0, 1, 10**12 - MS, time.time_ns(), model_name="bench", num_kv_blocks_total=68959, pid=1
    )


class NothingSink(Sink):
    """A Sink doing nothing: Ingest's own cost (decode, sequence checks, the engine view)."""


class InstrumentSink(NothingSink):
    """Baseline: the same series as prometheus_client instruments, updated per record.

    The client has no weighted observe: ``itl_per_token`` observes the inter-token latency
    once per generated token (the same histogram as ours); without it, once per iteration
    (a cheaper, lesser histogram: the conservative baseline).
    """

    def __init__(self, registry: CollectorRegistry, itl_per_token: bool = True) -> None:
        self.itl_repeats = None if itl_per_token else 1
        labels = ("0", "bench")

        def gauge(name: str, *extra: str):
            return Gauge("iterscope_" + name, name, [*LABELS, *extra], registry=registry)

        def counter(name: str, *extra: str):
            return Counter("iterscope_" + name, name, [*LABELS, *extra], registry=registry)

        self.running = gauge("requests_running").labels(*labels)
        self.waiting = gauge("requests_waiting").labels(*labels)
        by_reason = gauge("requests_waiting_by_reason", "reason")
        self.waiting_by_reason = [
            (by_reason.labels(*labels, reason), field) for reason, field in WAITING_REASONS
        ]
        self.usage = gauge("kv_cache_usage_ratio").labels(*labels)
        self.used = gauge("kv_blocks_used").labels(*labels)
        self.free = gauge("kv_blocks_free").labels(*labels)
        self.total = gauge("kv_blocks_capacity").labels(*labels)
        self.kv_tokens = gauge("kv_tokens").labels(*labels)
        self.iterations = counter("iterations").labels(*labels)
        self.prompt_tokens = counter("prompt_tokens").labels(*labels)
        self.cached_tokens = counter("prompt_tokens_cached").labels(*labels)
        self.generation_tokens = counter("generation_tokens").labels(*labels)
        self.preemptions = counter("preemptions").labels(*labels)
        self.queries = counter("prefix_cache_queries").labels(*labels)
        self.hits = counter("prefix_cache_hits").labels(*labels)
        self.received = counter("records_received").labels(*labels)
        finished = counter("requests_finished", "finish_reason")
        self.finished = [finished.labels(*labels, reason) for reason in FINISH_REASONS]
        self.histograms = {
            name: Histogram(
                "iterscope_" + name, name, LABELS, buckets=bounds, registry=registry
            ).labels(*labels)
            for name, (_, bounds) in HISTOGRAMS.items()
        }
        self.last_end_ns = 0
        self.last_iteration = 0

    def on_iteration(self, record: IterationRecord, engine: EngineView) -> None:
        self.received.inc()
        self.iterations.inc()
        self.prompt_tokens.inc(record.num_prefill_tokens)
        self.generation_tokens.inc(record.num_decode_tokens)
        self.preemptions.inc(record.num_preemptions)
        self.queries.inc(record.num_prefix_query_tokens)
        self.hits.inc(record.num_prefix_hit_tokens)
        self.running.set(record.num_running_reqs)
        self.waiting.set(record.num_waiting_reqs)
        for child, field in self.waiting_by_reason:
            child.set(getattr(record, field))
        total = record.num_kv_blocks_used + record.num_kv_blocks_free
        self.usage.set(record.num_kv_blocks_used / total if total else 0.0)
        self.used.set(record.num_kv_blocks_used)
        self.free.set(record.num_kv_blocks_free)
        self.total.set(total)
        self.kv_tokens.set(record.num_kv_tokens)
        histograms = self.histograms
        end_ns = record.start_ns + record.elapsed_ns
        histograms["iteration_duration_seconds"].observe(record.elapsed_ns / 1e9)
        histograms["iteration_tokens"].observe(record.num_prefill_tokens + record.num_decode_tokens)
        histograms["iteration_context_tokens"].observe(record.num_prefill_tokens)
        histograms["iteration_generation_requests"].observe(record.num_decode_reqs)
        if record.num_decode_reqs and record.iteration == self.last_iteration + 1:
            interval = (end_ns - self.last_end_ns) / 1e9
            for _ in range(self.itl_repeats or record.num_decode_reqs):
                histograms["inter_token_latency_seconds"].observe(interval)
        self.last_iteration, self.last_end_ns = record.iteration, end_ns
        for milestone in record.milestones:
            self.on_milestone(milestone)

    def on_milestone(self, milestone: RequestMilestone) -> None:
        """As the sink: TTFT at the first-token event, the rest at the finish."""
        histograms = self.histograms
        if milestone.event & EVENT_FIRST_TOKEN:
            histograms["time_to_first_token_seconds"].observe(
                (milestone.first_token_ns - milestone.arrival_ns) / 1e9
            )
            self.cached_tokens.inc(milestone.num_cached_tokens)
        if not milestone.event & EVENT_FINISHED:
            return
        self.finished[milestone.finish_reason].inc()
        decode_ns = milestone.finished_ns - milestone.first_token_ns
        for name, nanoseconds in (
            ("e2e_request_latency_seconds", milestone.finished_ns - milestone.arrival_ns),
            ("request_queue_time_seconds", milestone.first_scheduled_ns - milestone.arrival_ns),
            (
                "request_prefill_time_seconds",
                milestone.first_token_ns - milestone.first_scheduled_ns,
            ),
            ("request_decode_time_seconds", decode_ns),
        ):
            histograms[name].observe(nanoseconds / 1e9)
        histograms["time_per_output_token_seconds"].observe(
            decode_ns / (milestone.num_output_tokens - 1) / 1e9
        )
        histograms["request_prompt_tokens"].observe(milestone.num_prompt_tokens)
        histograms["request_generation_tokens"].observe(milestone.num_output_tokens)
        histograms["request_preemptions"].observe(milestone.num_preemptions)

    def on_heartbeat(self, heartbeat: Heartbeat, engine: EngineView) -> None:
        self.received.inc()


def time_sink(make_sink, records: list[IterationRecord]) -> float:
    """records/s of one run of sink.on_iteration on every record, with the engine view's
    update that Ingest makes after it (the sink reads the queues and KV gauges from there)."""
    sink, engine, heartbeat = make_sink(), EngineView(0), first_heartbeat()
    engine.take_anchor(heartbeat)
    sink.on_heartbeat(heartbeat, engine)
    engine.apply_heartbeat(heartbeat)
    on_iteration, apply_iteration = sink.on_iteration, engine.apply_iteration
    start = time.perf_counter()
    for record in records:
        on_iteration(record, engine)
        apply_iteration(record)
    return len(records) / (time.perf_counter() - start)


def time_ingest(make_sink, frames: list[bytes]) -> float:
    """records/s of one run through the sidecar's Ingest (decode + seq checks + the sink)."""
    ingest = Ingest([make_sink()])
    ingest.on_frame(make_encoder().encode(first_heartbeat()), 0)
    on_frame = ingest.on_frame
    start = time.perf_counter()
    for frame in frames:
        on_frame(frame, 0)
    return len(frames) / (time.perf_counter() - start)


def measure_ingest(num_records: int, repeats: int) -> dict:
    """Best of ``repeats`` for each variant, the variants interleaved within each repeat so
    that load from other processes hits them alike."""
    records = make_records(num_records)
    encoder = make_encoder()
    frames = [encoder.encode(record) for record in records]
    ours = lambda: PrometheusSink(CollectorRegistry())  # noqa: E731
    baseline = lambda: InstrumentSink(CollectorRegistry(), itl_per_token=False)  # noqa: E731
    same_itl = lambda: InstrumentSink(CollectorRegistry(), itl_per_token=True)  # noqa: E731
    runs = {
        "sink_records_per_s": lambda: time_sink(ours, records),
        "baseline_sink_records_per_s": lambda: time_sink(baseline, records),
        "baseline_itl_per_token_sink_records_per_s": lambda: time_sink(same_itl, records),
        "ingest_records_per_s": lambda: time_ingest(ours, frames),
        "baseline_ingest_records_per_s": lambda: time_ingest(baseline, frames),
        "ingest_nothing_sink_records_per_s": lambda: time_ingest(NothingSink, frames),
    }
    figures = dict.fromkeys(runs, 0.0)
    for _ in range(repeats):
        for name, run in runs.items():
            figures[name] = max(figures[name], run())
    figures["sink_speedup"] = figures["sink_records_per_s"] / figures["baseline_sink_records_per_s"]
    figures["sink_speedup_itl_per_token"] = (
        figures["sink_records_per_s"] / figures["baseline_itl_per_token_sink_records_per_s"]
    )
    figures["ingest_speedup"] = (
        figures["ingest_records_per_s"] / figures["baseline_ingest_records_per_s"]
    )
    ingest = Ingest([PrometheusSink(CollectorRegistry())])
    ingest.on_frame(encoder.encode(first_heartbeat()), 0)
    for frame in frames:
        ingest.on_frame(frame, 0)
    sink = ingest.sinks[0]
    start = time.perf_counter()
    exposition = generate_latest(sink.registry)
    figures["scrape_ms_one_engine"] = (time.perf_counter() - start) * 1e3
    figures["exposition_bytes_one_engine"] = len(exposition)
    return figures


def background_engine(address: str, rate_per_s: float, duration_s: float) -> None:
    """Engine 0: records at ``rate_per_s`` (run as a child process)."""
    publisher = ZmqPublisher(address, engine_index=0, facts={"model_name": "bench"})
    records = make_records(int(rate_per_s * duration_s) + 1)
    period_s = 1.0 / rate_per_s
    next_s = time.monotonic()
    try:
        for record in records:
            publisher.publish(record)
            next_s += period_s
            delay = next_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
    finally:
        publisher.close()


def scrape_iterations(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    match = re.search(r'^iterscope_iterations_total\{engine="1",[^}]*\} (\S+)$', text, re.M)
    return int(float(match[1])) if match else 0


def measure_visibility(num_probes: int, background_rate: float) -> dict:
    directory = Path(tempfile.mkdtemp(prefix="iterscope-bench-"))
    address = f"ipc://{directory}/lane.sock"
    sidecar, port = start_metrics_sidecar(directory, address)
    url = f"http://127.0.0.1:{port}/metrics"
    background = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--background",
            address,
            str(background_rate),
            str(num_probes * 0.05 + 30),
        ],
        cwd=REPO_ROOT,
    )
    publisher = ZmqPublisher(address, engine_index=1, facts={"model_name": "probe"})
    latencies_ms = []
    scrape_ms = []
    try:
        time.sleep(1.0)  # connected, first heartbeats in
        template = make_records(1)[0]
        for probe in range(1, num_probes + 1):
            record = msgspec.structs.replace(template, engine_index=1, iteration=probe)
            start = time.perf_counter()
            publisher.publish(record)
            while True:
                scrape_start = time.perf_counter()
                seen = scrape_iterations(url)
                scrape_ms.append((time.perf_counter() - scrape_start) * 1e3)
                if seen >= probe:
                    break
            latencies_ms.append((time.perf_counter() - start) * 1e3)
            time.sleep(0.02)
    finally:
        publisher.close()
        background.terminate()
        background.wait(timeout=10)
        sidecar.terminate()
        sidecar.wait(timeout=10)
    latencies_ms.sort()
    return {
        "visible_p50_ms": statistics.median(latencies_ms),
        "visible_p99_ms": latencies_ms[math.ceil(0.99 * len(latencies_ms)) - 1],  # nearest rank
        "visible_max_ms": latencies_ms[-1],
        "scrape_p50_ms_two_engines": statistics.median(scrape_ms),
        "num_probes": num_probes,
        "background_records_per_s": background_rate,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--probes", type=int, default=300)
    parser.add_argument(
        "--background-rate",
        type=float,
        default=2000.0,
        help="records/s from a second engine during the visibility probes",
    )
    parser.add_argument("--background", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.background:
        address, rate, duration = args.background
        background_engine(address, float(rate), float(duration))
        return
    cpu = sorted(os.sched_getaffinity(0))[0]
    os.sched_setaffinity(0, {cpu})  # "one core": this process, one CPU
    figures = measure_ingest(args.records, args.repeats)
    print(f"ingest, one core, {args.records} records (sink only):")
    print(f"  our sink           {figures['sink_records_per_s']:>12,.0f} records/s")
    print(
        f"  instrument sink    {figures['baseline_sink_records_per_s']:>12,.0f} records/s"
        f"   ratio {figures['sink_speedup']:.1f}x  (ITL observed once per iteration)"
    )
    print(
        f"  instrument sink    {figures['baseline_itl_per_token_sink_records_per_s']:>12,.0f}"
        f" records/s   ratio {figures['sink_speedup_itl_per_token']:.1f}x  (ITL once per token,"
        " the same histogram as ours)"
    )
    print("ingest, one core, frames through the sidecar's Ingest (decode + seq + sink):")
    print(f"  our sink           {figures['ingest_records_per_s']:>12,.0f} records/s")
    print(
        f"  instrument sink    {figures['baseline_ingest_records_per_s']:>12,.0f} records/s"
        f"   ratio {figures['ingest_speedup']:.1f}x  (ITL observed once per iteration)"
    )
    print(
        f"  a sink doing nothing {figures['ingest_nothing_sink_records_per_s']:>10,.0f}"
        " records/s  (Ingest alone: decode + sequence checks)"
    )
    print(
        f"scrape of one engine: {figures['scrape_ms_one_engine']:.1f} ms, "
        f"{figures['exposition_bytes_one_engine']} bytes"
    )
    os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    visibility = measure_visibility(args.probes, args.background_rate)
    print(
        f"record visible in /metrics (publish -> scrape shows it), {args.probes} probes, "
        f"background {args.background_rate:.0f} records/s:"
    )
    print(
        f"  p50 {visibility['visible_p50_ms']:.1f} ms, p99 {visibility['visible_p99_ms']:.1f}"
        f" ms, max {visibility['visible_max_ms']:.1f} ms (one scrape: "
        f"{visibility['scrape_p50_ms_two_engines']:.1f} ms p50)"
    )
    print(json.dumps({**figures, **visibility}, sort_keys=True))


if __name__ == "__main__":
    main()
