"""The 10-second log line and Prometheus' rate() agree, computed from the same records.

One synthetic engine stream goes through the sidecar's Ingest into the log sink and the
Prometheus sink. Each time the log sink prints a line (it closes a window of record time),
the test scrapes the Prometheus sink: that is the counter value at the window boundary.
Those values, placed at the boundaries, are given to Prometheus' own PromQL engine
(`promtool test rules`), which must compute rate(...[10s]) equal to the throughput printed.
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from telemetry.lane.record import (
    Heartbeat,
    IterationRecord,
    heartbeat,
    iteration_record,
    make_encoder,
)
from telemetry.sidecar.ingest import Ingest
from telemetry.sidecar.sinks.log import LogSink
from telemetry.sidecar.sinks.prometheus import PrometheusSink

pytestmark = pytest.mark.live

INTERVAL_S = 10
WALL_BASE_NS = 1_700_000_000 * 10**9  # a window boundary
MONO_BASE_NS = 5_000 * 10**9
LINE = re.compile(
    r"Avg prompt throughput: ([\d.]+) tokens/s, "
    r"Avg generation throughput: ([\d.]+) tokens/s"
)
COUNTERS = ("iterscope_prompt_tokens_total", "iterscope_generation_tokens_total")


def synthetic_stream(duration_s: float, seed: int = 7) -> list[IterationRecord | Heartbeat]:
    """Heartbeats every second and a record every 20 ms with random token counts."""
    rng = random.Random(seed)
    messages: list[IterationRecord | Heartbeat] = []
    seq = 0
    iteration = 0
    for step in range(int(duration_s / 0.02)):
        now_ns = MONO_BASE_NS + step * 20_000_000
        seq += 1
        if step % 50 == 0:
            messages.append(
                heartbeat(
                    0,
                    seq,
                    now_ns,
                    now_ns - MONO_BASE_NS + WALL_BASE_NS,
                    last_iteration=iteration,
                    num_waiting_reqs=1,
                    num_running_reqs=8,
                    model_name="tiny",
                    device_name="CPU",
                    num_kv_blocks_total=1000,
                    pid=1,
                )
            )
            seq += 1
        iteration += 1
        messages.append(
            iteration_record(
                0,
                seq,
                iteration,
                start_ns=now_ns + 1_000_000,
                elapsed_ns=15_000_000,
                num_prefill_reqs=1,
                num_prefill_tokens=rng.randint(0, 512),
                num_decode_reqs=8,
                num_decode_tokens=rng.randint(0, 64),
                num_running_reqs=8,
                num_waiting_reqs=1,
                num_waiting_kv_reqs=1,
                num_kv_blocks_used=300,
                num_kv_blocks_free=700,
                num_kv_tokens=4800,
            )
        )
    return messages


def counter_values(registry: CollectorRegistry) -> dict[str, float]:
    text = generate_latest(registry).decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in COUNTERS
    }


def promtool_rate_test(
    tmp_path, boundary_values: list[dict[str, float]], lines: list[tuple[float, float]]
) -> subprocess.CompletedProcess:
    """A promtool unit test: at each window end, rate(counter[10s]) is the logged figure."""
    labels = '{engine="0",model_name="tiny"}'
    input_series = [
        {
            "series": name + labels,
            "values": " ".join(str(values[name]) for values in boundary_values),
        }
        for name in COUNTERS
    ]
    expr_tests = [
        # Rounded to 0.1 as the log line prints it (rate itself carries float noise).
        {
            "expr": f"round(rate({name}[{INTERVAL_S}s]) * 10) / 10",
            "eval_time": f"{(index + 1) * INTERVAL_S}s",
            "exp_samples": [{"labels": labels, "value": figures[position]}],
        }
        for index, figures in enumerate(lines)
        for position, name in enumerate(COUNTERS)
    ]
    test_file = tmp_path / "rate_test.yml"
    test_file.write_text(
        yaml.safe_dump(
            {
                "rule_files": [],
                "evaluation_interval": f"{INTERVAL_S}s",
                "tests": [
                    {
                        "interval": f"{INTERVAL_S}s",
                        "input_series": input_series,
                        "promql_expr_test": expr_tests,
                    }
                ],
            }
        )
    )
    promtool = shutil.which("promtool") or "/usr/bin/promtool"
    return subprocess.run(
        [promtool, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=60
    )


def test_log_throughput_equals_prometheus_rate_over_the_same_windows(tmp_path):
    registry = CollectorRegistry()
    prometheus_sink = PrometheusSink(registry)
    boundary_values = [dict.fromkeys(COUNTERS, 0.0)]  # before the first window
    lines: list[tuple[float, float]] = []

    def emit(level: int, text: str) -> None:
        match = LINE.search(text)
        if match:  # a window just closed; the record that closed it is not counted yet
            lines.append((float(match[1]), float(match[2])))
            boundary_values.append(counter_values(registry))

    ingest = Ingest([LogSink(interval_s=INTERVAL_S, emit=emit), prometheus_sink])
    encoder = make_encoder()
    for message in synthetic_stream(duration_s=3.5 * INTERVAL_S):
        sent_ns = (
            message.ts_ns
            if isinstance(message, Heartbeat)
            else (message.start_ns + message.elapsed_ns)
        )
        ingest.on_frame(encoder.encode(message), now_ns=sent_ns)
    assert len(lines) == 3
    assert all(prompt > 0 and generation > 0 for prompt, generation in lines)
    result = promtool_rate_test(tmp_path, boundary_values, lines)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_rate_check_fails_when_figures_differ(tmp_path):
    """The promtool comparison is real: a figure off by 0.1 tokens/s fails it."""
    boundary_values = [dict.fromkeys(COUNTERS, 0.0), {COUNTERS[0]: 1000.0, COUNTERS[1]: 500.0}]
    assert promtool_rate_test(tmp_path, boundary_values, [(100.0, 50.0)]).returncode == 0
    assert promtool_rate_test(tmp_path, boundary_values, [(100.1, 50.0)]).returncode != 0
