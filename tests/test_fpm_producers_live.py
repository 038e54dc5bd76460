"""Real FPM producers and consumers against the sidecar, not re-implementations: SGLang's own
publisher (its ``forward_pass_metrics`` module from the pinned ``sglang`` wheel, in a process
of its own) and Dynamo's instrumented vLLM scheduler (the pinned ``ai-dynamo`` and
``ai-dynamo-runtime`` wheels, in a real `vllm serve` of the CPU build) feeding ``iterscope
sidecar --fpm``, and Dynamo's own decoder reading what ``iterscope serve
--fpm-port PORT`` publishes. `make fpm-wheels` (part of `make test`) unpacks the
wheels into .cache/fpm-wheels; the schema modules are loaded by file path (sglang's package
__init__ imports torch), and the directory is on the PYTHONPATH of `vllm serve` only."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import msgspec
import openai
import pytest
import zmq

from bench.vllm_server import BEST_CPU_FLAGS, engine_core_pid, start_vllm, stop_server
from telemetry.lane.record import Heartbeat, IterationRecord
from telemetry.lane.recording import Line  # the sidecar's notes too
from telemetry.sidecar.process import start_sidecar
from tests.helpers import REPO
from tests.helpers.ahead import ahead, take
from tests.helpers.findings import assert_replay_agrees_with_explain
from tests.helpers.net import free_port
from tests.helpers.processes import explain_engines
from tests.helpers.prom import scrape, total
from tests.helpers.serve import tiny_server
from tests.helpers.wait import wait_until

FPM_WHEELS = REPO / ".cache" / "fpm-wheels"
SGLANG_FPM = FPM_WHEELS / "sglang" / "srt" / "observability" / "forward_pass_metrics.py"
DYNAMO_FPM = FPM_WHEELS / "dynamo" / "common" / "forward_pass_metrics.py"

# A process publishing with SGLang's own _FpmPublisherThread and ForwardPassMetrics, driven
# by lines on stdin as SGLang's scheduler drives it: "busy N" publishes N iterations (the
# scheduler is busy: no heartbeats), "idle" lets the thread heartbeat, "version" publishes
# one message of version 2. It answers each line with "ok".
SGLANG_DRIVER = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("sglang_fpm", sys.argv[1])
fpm = sys.modules["sglang_fpm"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fpm)
publisher = fpm._FpmPublisherThread(sys.argv[2], worker_id="sglang-w", dp_rank=0)
scheduled = fpm.ScheduledRequestMetrics(
    num_prefill_requests=1, sum_prefill_tokens=128, var_prefill_length=0.0,
    sum_prefill_kv_tokens=32, num_decode_requests=6, sum_decode_kv_tokens=600,
    var_decode_kv_tokens=25.0)
queued = fpm.QueuedRequestMetrics(num_prefill_requests=3, sum_prefill_tokens=900)
for line in sys.stdin:
    command = line.split()
    if command[0] == "busy":
        publisher.set_idle(False)
        for _ in range(int(command[1])):
            publisher.publish(fpm.ForwardPassMetrics(
                worker_id="sglang-w", wall_time=0.02,
                scheduled_requests=scheduled, queued_requests=queued))
    elif command[0] == "idle":
        publisher.set_idle(True)
    elif command[0] == "version":
        publisher.publish(fpm.ForwardPassMetrics(version=2, worker_id="sglang-w"))
    print("ok", flush=True)
"""


def wheel_module(name: str, path: Path) -> ModuleType:
    """A module of the unpacked wheels, loaded by file path."""
    if not path.exists():
        raise AssertionError(f"{path} is missing: `make fpm-wheels` unpacks it")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # msgspec resolves the Structs' annotations through it
    spec.loader.exec_module(module)
    return module


class SglangProducer:
    """SGLang's publisher in a process of its own, bound on ``endpoint``."""

    def __init__(self, endpoint: str) -> None:
        if not SGLANG_FPM.exists():
            raise AssertionError(f"{SGLANG_FPM} is missing: `make fpm-wheels` unpacks it")
        self.process = subprocess.Popen(
            [sys.executable, "-c", SGLANG_DRIVER, str(SGLANG_FPM), endpoint],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )

    def do(self, command: str) -> None:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        assert self.process.stdout.readline() == "ok\n"

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(10)


def state_of(url: str, state: str, engine: str = "0") -> float:
    return total(scrape(url), "iterscope_engine_state", engine=engine, state=state)


def test_sglangs_own_publisher_feeds_the_sidecar_through_idle_busy_killed_and_restarted(
    tmp_path,
):
    """SGLang heartbeats only while idle: silent while idle never happens (it stays idle past
    --dead-after), silent mid-load shows dead, never stalled; killed shows dead; restarted
    (seq from 0 again) is the same engine met again, not 2^64 messages lost."""
    endpoint = f"ipc://{tmp_path / 'sglang-fpm.0'}"
    recording = tmp_path / "run.jsonl"
    args = ["--fpm", endpoint, "--fpm-producer", "sglang", "--fpm-model", "qwen"]
    args += ["--record", str(recording), "--metrics-port", "0", "--dead-after", "2"]
    args += ["--log-interval", "0.5"]
    producer = SglangProducer(endpoint)
    log_path = tmp_path / "sidecar.log"
    with open(log_path, "wb") as log:
        sidecar = start_sidecar(args, stderr=log)
    url = sidecar.metrics_url
    try:
        producer.do("idle")
        wait_until(lambda: state_of(url, "idle") == 1, 20, "the SGLang engine idle")
        deadline = time.monotonic() + 2.8  # past --dead-after, on heartbeats alone
        while time.monotonic() < deadline:
            assert state_of(url, "idle") == 1
            time.sleep(0.25)
        producer.do("busy 40")
        samples = wait_until(
            lambda: (s := scrape(url)) and total(s, "iterscope_iterations_total") == 40 and s,
            10,
            "40 iterations",
        )
        assert total(samples, "iterscope_prompt_tokens_total", engine="0") == 40 * 128
        assert total(samples, "iterscope_generation_tokens_total", engine="0") == 40 * 6
        assert total(samples, "iterscope_requests_waiting", engine="0") == 3
        assert total(samples, "iterscope_requests_running", engine="0") == 7
        assert total(samples, "iterscope_kv_tokens", engine="0") == 32 + 128 + 600
        wait_until(lambda: state_of(url, "dead") == 1, 10, "silent mid-load: dead")
        assert state_of(url, "stalled") == 0
        producer.do("version")
        wait_until(
            lambda: total(scrape(url), "iterscope_frames_undecodable_total", reason="version"),
            10,
            "the version-2 message refused",
        )
        producer.kill()
        producer = SglangProducer(endpoint)  # restarted: its seq from 0 again
        producer.do("idle")
        wait_until(lambda: state_of(url, "idle") == 1, 20, "the restarted engine idle")
        producer.do("busy 5")
        samples = wait_until(
            lambda: (s := scrape(url)) and total(s, "iterscope_iterations_total") == 45 and s,
            10,
            "5 more iterations from the restarted producer",
        )
        assert total(samples, "iterscope_records_dropped_total", engine="0") < 10
        assert total(samples, "iterscope_engine_state", engine="1") == 0  # no second engine
        producer.kill()
        wait_until(lambda: state_of(url, "dead") == 1, 10, "killed: dead")
    finally:
        producer.kill()
        assert sidecar.stop() == 0
    log_text = log_path.read_text()
    assert "Engine 000: Avg prompt throughput" in log_text
    assert "Running: 7 reqs, Waiting: 3 reqs, KV cache usage: not reported" in log_text
    check_recording(recording)
    # one implementation of each rule: the sidecar replaying it finds what explain finds
    assert_replay_agrees_with_explain(recording)


def check_recording(recording: Path) -> None:
    """The recording holds the 45 iterations and `iterscope explain` reads it as SGLang's."""
    lines = recording.read_bytes().splitlines()  # a fact may hold a space
    messages = [msgspec.json.decode(line, type=Line) for line in lines]
    records = [m for m in messages if type(m) is IterationRecord]
    assert len(records) == 45
    assert {h.source for h in messages if type(h) is Heartbeat} == {"fpm-sglang"}
    assert {r.elapsed_ns for r in records} == {20_000_000}
    (engine,) = explain_engines(recording)
    assert engine["facts"] == {"model_name": "qwen", "source": "fpm-sglang"}
    assert engine["summary"]["num_iterations"] == 45


def test_dynamos_decoder_reads_what_iterscope_serve_publishes_with_fpm_port(tmp_path):
    """Our engine, served as a user serves it, speaks FPM: every message decodes with
    Dynamo's own decoder, is numbered from 0 (counter_id = seq), matches the recording's
    records, and an idle engine heartbeats about once a second."""
    dynamo = wheel_module("dynamo_fpm", DYNAMO_FPM)
    port = free_port()
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    received: list[tuple[int, object, float]] = []

    def receive(timeout_ms: int) -> bool:
        if not sub.poll(timeout_ms):
            return False
        topic, seq, payload = sub.recv_multipart()
        assert topic == b""
        metrics = dynamo.decode(payload)
        assert metrics is not None, payload
        received.append((int.from_bytes(seq, "big"), metrics, time.monotonic()))
        return True

    def heartbeat_after_work() -> bool:
        receive(100)
        busy_at = [i for i, (_, metrics, _) in enumerate(received) if metrics.wall_time > 0]
        return bool(busy_at) and busy_at[-1] < len(received) - 1

    sidecar_args = [f"--fpm-port={port}", "--sidecar-arg=--fpm-worker-id=it-w"]
    try:
        with tiny_server(tmp_path, *sidecar_args) as server:
            wait_until(lambda: receive(100), 20, "a heartbeat on the FPM port")
            client = server.openai_client()
            client.completions.create(model="tiny-llama", prompt="hello there", max_tokens=8)
            wait_until(heartbeat_after_work, 20, "a heartbeat after the request's iterations")
            heartbeat_at = received[-1][2]
            wait_until(lambda: receive(100) and received[-1][2] > heartbeat_at, 5, "the next")
            interval_s = received[-1][2] - heartbeat_at
            records = server.records()
    finally:
        sub.close(linger=0)
        context.term()
    seqs = [seq for seq, _, _ in received]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert all(metrics.counter_id == seq for seq, metrics, _ in received)
    assert {(m.worker_id, m.dp_rank, m.version) for _, m, _ in received} == {("it-w", 0, 1)}
    busy = [m for _, m, _ in received if m.wall_time > 0]
    assert len(busy) == len(records[-len(busy) :]) > 0
    for metrics, record in zip(busy, records[-len(busy) :], strict=True):
        scheduled = metrics.scheduled_requests
        assert scheduled.sum_prefill_tokens == record.num_prefill_tokens
        assert scheduled.num_prefill_requests == record.num_prefill_reqs
        assert scheduled.num_decode_requests == record.num_decode_reqs
        assert metrics.wall_time == record.elapsed_ns / 1e9
    assert sum(m.scheduled_requests.num_decode_requests for m in busy) >= 7
    last = received[-1][1]
    assert last.scheduled_requests == dynamo.ScheduledRequestMetrics()
    assert last.queued_requests == dynamo.QueuedRequestMetrics()  # idle: all zero
    assert 0.8 < interval_s < 2.0


@ahead(fixture="dynamo_stack", tmp_name="dynamo_vllm")
@contextlib.contextmanager
def dynamo_vllm_stack(tmp: Path, _: None, **vllm_kwargs) -> Iterator[dict]:
    """A sidecar subscribed to `vllm serve` with Dynamo's instrumented scheduler."""
    if not (FPM_WHEELS / "dynamo" / "vllm" / "instrumented_scheduler.py").exists():
        raise AssertionError(f"{FPM_WHEELS} lacks ai-dynamo: `make fpm-wheels` unpacks it")
    fpm_port, api_port = free_port(), free_port()
    args = ["--fpm", f"tcp://127.0.0.1:{fpm_port}", "--fpm-producer", "dynamo-vllm"]
    args += ["--metrics-port", "0", "--no-log", "--dead-after", "2"]
    sidecar = start_sidecar(args)
    env = {
        "PYTHONPATH": str(FPM_WHEELS),
        "DYN_FORWARDPASS_METRIC_PORT": str(fpm_port),
        "DYN_FPM_WORKER_ID": "dynamo-w",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    scheduler = "dynamo.vllm.instrumented_scheduler.InstrumentedScheduler"
    flags = (*BEST_CPU_FLAGS, "--scheduler-cls", scheduler)
    server = None
    try:
        server = start_vllm(api_port, env, tmp / "vllm.log", flags, **vllm_kwargs)
        yield {"sidecar": sidecar, "server": server, "api_port": api_port}
    finally:
        if server is not None:
            stop_server(server)
        sidecar.stop()


@pytest.fixture
def dynamo_stack(tmp_path_factory):
    """dynamo_vllm_stack, started ahead (tests/helpers/ahead.py)."""
    with take(dynamo_vllm_stack, None, tmp_path_factory) as started:
        yield started


def test_dynamos_instrumented_vllm_scheduler_feeds_the_sidecar_from_a_real_vllm(dynamo_stack):
    """Dynamo's scheduler heartbeats after any second without a message: idle on heartbeats;
    one request's iterations counted as vLLM served them; its engine core killed: dead."""
    url = dynamo_stack["sidecar"].metrics_url
    wait_until(lambda: state_of(url, "idle") == 1, 30, "Dynamo's vLLM engine idle")
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{dynamo_stack['api_port']}/v1", api_key="none"
    )
    usage = client.completions.create(model="smollm2", prompt="Hello there", max_tokens=12)
    assert usage.usage is not None
    num_prompt_tokens, num_output_tokens = usage.usage.prompt_tokens, usage.usage.completion_tokens
    samples = wait_until(
        lambda: (
            (s := scrape(url)) and total(s, "iterscope_iterations_total") == num_output_tokens and s
        ),
        10,
        "one iteration per output token",
    )
    # the prefill makes the first token; each later token is one decode
    assert total(samples, "iterscope_prompt_tokens_total") == num_prompt_tokens
    assert total(samples, "iterscope_generation_tokens_total") == num_output_tokens - 1
    wait_until(lambda: state_of(url, "idle") == 1, 10, "idle again on heartbeats")
    os.kill(engine_core_pid(dynamo_stack["server"].pid), signal.SIGKILL)
    wait_until(lambda: state_of(url, "dead") == 1, 15, "its engine core killed: dead")
    assert dynamo_stack["sidecar"].stop() == 0
