"""A real Prometheus scrapes a real sidecar (`iterscope sidecar`) fed by a live engine.

The engine is the real engine-core process (engine/core_process.py: scheduler, block pool,
core loop, ZmqPublisher) on the deterministic fake model of tests/helpers/fake_runner.py,
paced to a few ms per forward pass so the test fits in CI's time. While a client keeps it busy,
/api/v1/query must return KV usage, the iteration rate and a TTFT quantile; once the client
has seen every request finish, Prometheus' counts must equal what the client saw.
"""

from __future__ import annotations

import threading
import time

import pytest

from engine.config import EngineConfig
from engine.core_client import EngineCoreClient
from engine.request import SamplingParams
from tests.helpers.fake_runner import BLOCK_SIZE, FakeRunner, load_fake_model
from tests.helpers.processes import start_metrics_sidecar, stop_process
from tests.helpers.prom import PrometheusHandle, start_prometheus

pytestmark = pytest.mark.live

NUM_KV_BLOCKS = 64
FAKE_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 8 * 4  # K+V x layers x kv heads x head dim x fp32
WAVE_SIZE = 6  # requests submitted together, then read to the end


class PacedFakeRunner(FakeRunner):
    """The fake model, taking as long as a very small real forward pass."""

    def execute(self, scheduled):
        time.sleep(0.003)
        return super().execute(scheduled)


class Client(threading.Thread):
    """Sends waves of requests until halted; counts what it saw finish."""

    def __init__(self, engine: EngineCoreClient) -> None:
        super().__init__(name="client", daemon=True)
        self.engine = engine
        self.halt = threading.Event()
        self.num_finished = 0
        self.num_output_tokens = 0
        self.error: Exception | None = None

    def run(self) -> None:
        wave = 0
        try:
            while not self.halt.is_set():
                wave += 1
                streams = [
                    self.engine.add_request(
                        [1 + (wave * 5 + i * 3 + j) % 60 for j in range(10 + i)],
                        SamplingParams(max_tokens=12 + i, temperature=0),
                    )
                    for i in range(WAVE_SIZE)
                ]
                for stream in streams:
                    for output in stream:
                        self.num_output_tokens += len(output.new_token_ids)
                    self.num_finished += 1
        except Exception as error:  # surfaced by the test
            self.error = error


def wait_for_equal(prometheus: PrometheusHandle, expr: str, expected: float) -> None:
    """Poll until ``expr`` equals ``expected`` (scrapes trail the engine by a second)."""
    last = [None]

    def equal() -> bool | None:
        result = prometheus.query(expr)
        last[0] = float(result[0]["value"][1]) if result else None
        return True if last[0] == expected else None

    prometheus.wait_until(equal, 20, lambda: f"{expr} == {expected} (it is {last[0]})")


def test_prometheus_scrapes_sidecar_fed_by_live_engine(tmp_path):
    address = f"ipc://{tmp_path}/lane.sock"
    sidecar, port = start_metrics_sidecar(tmp_path, address, "--vllm-compatible-names")
    engine = None
    prometheus = None
    client = None
    try:
        engine = EngineCoreClient(
            EngineConfig(
                model="fake-llm",
                block_size=BLOCK_SIZE,
                max_num_seqs=8,
                max_num_batched_tokens=64,
                max_model_len=128,
                telemetry_address=address,
                kv_cache_memory_bytes=NUM_KV_BLOCKS * BLOCK_SIZE * FAKE_KV_BYTES_PER_TOKEN,
            ),
            load_fake_model,
            PacedFakeRunner,
            startup_timeout_s=60,
        )
        prometheus = start_prometheus(tmp_path, [f"127.0.0.1:{port}"])
        prometheus.wait_for_targets(timeout_s=30)
        client = Client(engine)
        client.start()

        usage = prometheus.wait_for_value(
            'iterscope_kv_cache_usage_ratio{engine="0",model_name="fake-llm"}',
            lambda ratio: ratio > 0,
        )
        assert usage <= 1
        prometheus.wait_for_value("rate(iterscope_iterations_total[5s])", lambda rate: rate > 0)
        ttft_p90 = prometheus.wait_for_value(
            "histogram_quantile(0.9, sum by (le) "
            "(rate(iterscope_time_to_first_token_seconds_bucket[10s])))"
        )
        assert ttft_p90 > 0
        running = prometheus.query('iterscope_engine_state{state="running"}')
        assert float(running[0]["value"][1]) == 1
        # vLLM's names reach Prometheus as they are, colon included, so vLLM's own dashboards
        # and alert rules find them.
        prometheus.wait_for_value(
            'vllm:kv_cache_usage_perc{model_name="fake-llm"}', lambda ratio: ratio > 0
        )
        prometheus.wait_for_value("rate(vllm:generation_tokens_total[5s])", lambda rate: rate > 0)

        client.halt.set()
        client.join(timeout=60)
        assert client.error is None and not client.is_alive()
        assert client.num_finished >= WAVE_SIZE
        # Everything the client saw, Prometheus counts exactly: no record lost or doubled.
        # (records_dropped_total may be 1: a heartbeat sent before the lane connected.)
        wait_for_equal(prometheus, "sum(iterscope_requests_finished_total)", client.num_finished)
        wait_for_equal(
            prometheus, "sum(iterscope_request_generation_tokens_sum)", client.num_output_tokens
        )
    finally:
        if client is not None:
            client.halt.set()
        if prometheus is not None:
            prometheus.stop()
        if engine is not None:
            engine.shutdown()
        stop_process(sidecar)
