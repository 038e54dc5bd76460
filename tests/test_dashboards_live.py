"""Dashboards and alerts against live data: a real Prometheus scrapes `iterscope sidecar`, fed
by a real engine-core process (engine/core_process.py) whose small KV cache a workload keeps
saturated.

- every panel query of every dashboard, with the variables substituted by the values their own
  variable queries find, returns data through /api/v1/query;
- IterscopeKVCacheSaturated reaches firing in /api/v1/alerts;
- the sidecar's live findings of that saturation (KV waiting, preemptions) fill the Overview's
  Why now and Open findings panels, and IterscopeFinding fires quoting the action that the
  sidecar's /findings gives for the finding;
- IterscopeEngineStalled (and IterscopeEngineDown) fire once the engine process is paused
  (SIGSTOP) with work waiting.

The rules Prometheus loads are a test copy of dashboards/alerts/*.yml with every ``for:`` cut
to 2 s and every range window to 5 s; the shipped files are not changed. The engine runs the
real scheduler, block pool, engine loop and telemetry publisher on the deterministic fake
model of tests/helpers/fake_runner.py (a few ms per forward pass), so the test fits in CI's
time.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.live

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # dashboards/ is not an installed package

from dashboards.panel_queries import panel_queries, substitute  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core_client import EngineCoreClient  # noqa: E402
from engine.request import SamplingParams  # noqa: E402
from tests.helpers.fake_runner import BLOCK_SIZE, FakeRunner, load_fake_model  # noqa: E402
from tests.helpers.processes import start_metrics_sidecar, stop_process  # noqa: E402
from tests.helpers.prom import PrometheusHandle, http_get_json, start_prometheus  # noqa: E402
from tests.helpers.wait import wait_until  # noqa: E402

ALERTS_DIR = REPO_ROOT / "dashboards" / "alerts"
FAKE_FORWARD_S = 0.004  # what one fake forward pass takes
NUM_KV_BLOCKS = 48  # of BLOCK_SIZE tokens: a few requests fill it
FAKE_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 8 * 4  # K+V x layers x kv heads x head dim x fp32
NUM_OUTSTANDING_REQS = 16  # the feeder keeps this many submitted and unfinished
PROMPT_PREFIX = list(range(1, 13))  # shared by every prompt: prefix-cache hits
RATE_WINDOW = "15s"  # stands in for Grafana's $__rate_interval


class PacedFakeRunner(FakeRunner):
    """The fake runner with the duration of a (very small) real forward pass."""

    def execute(self, scheduled):
        time.sleep(FAKE_FORWARD_S)
        return super().execute(scheduled)


def shortened_rule_copy(tmp_path: Path) -> list[Path]:
    """dashboards/alerts/*.yml with ``for:`` cut to 2 s, and range windows and ``offset``s
    to 5 s (a rule comparing a window with one before it keeps the two of equal length)."""
    paths = []
    for path in sorted(ALERTS_DIR.glob("*.yml")):
        data = yaml.safe_load(path.read_text())
        for group in data["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:  # a recording rule (an alert threshold) takes no for:
                    rule["for"] = "2s"
                expr = re.sub(r"\[\d+[smh]\]", "[5s]", rule["expr"])
                rule["expr"] = re.sub(r"offset \d+[smh]", "offset 5s", expr)
        copy = tmp_path / f"test-{path.name}"
        copy.write_text(yaml.safe_dump(data))
        paths.append(copy)
    return paths


class Feeder(threading.Thread):
    """Keeps NUM_OUTSTANDING_REQS requests in the engine, more than its KV cache holds."""

    def __init__(self, client: EngineCoreClient) -> None:
        super().__init__(name="feeder", daemon=True)
        self.client = client
        self.streams = []
        self.num_submitted = 0
        self.num_finished = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.streams = [stream for stream in self.streams if not self.drain(stream)]
            while len(self.streams) < NUM_OUTSTANDING_REQS:
                self.submit()
            self.halt.wait(0.02)

    def submit(self) -> None:
        self.num_submitted += 1
        prompt = PROMPT_PREFIX + [(self.num_submitted * 7 + i) % 60 + 1 for i in range(12)]
        params = SamplingParams(max_tokens=24 + self.num_submitted % 16, temperature=0)
        self.streams.append(self.client.add_request(prompt, params))

    def drain(self, stream) -> bool:
        """Read what the stream has; True once it finished."""
        try:
            while not stream.get(timeout=0).finished:
                pass
        except queue.Empty:
            return False
        self.num_finished += 1
        return True


def start_engine(address: str) -> EngineCoreClient:
    config = EngineConfig(
        model="fake-llm",
        block_size=BLOCK_SIZE,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=128,
        kv_cache_memory_bytes=NUM_KV_BLOCKS * BLOCK_SIZE * FAKE_KV_BYTES_PER_TOKEN,
        telemetry_address=address,
    )
    client = EngineCoreClient(config, load_fake_model, PacedFakeRunner, startup_timeout_s=60)
    assert client.ready.num_kv_blocks == NUM_KV_BLOCKS
    return client


def wait_for_alert(prometheus: PrometheusHandle, name: str, timeout_s: float) -> dict:
    """Poll /api/v1/alerts until ``name`` is firing; returns that alert."""

    def firing():
        for alert in prometheus.alerts():
            if alert["labels"]["alertname"] == name and alert["state"] == "firing":
                return alert
        return None

    return prometheus.wait_until(firing, timeout_s, f"firing {name}")


def variable_values(prometheus: PrometheusHandle) -> dict[str, str]:
    """What Grafana's model_name, instance and engine variables would offer, as a regex of all
    values."""
    values = {}
    for label in ("model_name", "instance", "engine"):
        found = prometheus.api(f"label/{label}/values", **{"match[]": "iterscope_engine_state"})
        found = [value for value in found if value]
        assert found, f"the {label} variable finds no values"
        values[label] = "|".join(found)
    values["__rate_interval"] = RATE_WINDOW
    return values


def engine_state_code(prometheus: PrometheusHandle) -> float:
    """The Overview's Engine state panel for engine 0: 0 idle, 1 running, 2 stalled, 3 dead."""
    (expr,) = [q.expr for q in panel_queries() if q.panel == "Engine state"]
    result = prometheus.query(substitute(expr, {"model_name": ".*", "engine": "0"}))
    return float(result[0]["value"][1])


def has_number(result: list[dict]) -> bool:
    return any(float(sample["value"][1]) == float(sample["value"][1]) for sample in result)


def check_every_panel_query(prometheus: PrometheusHandle, instance: str, timeout_s: float) -> None:
    """Every panel query returns at least one sample that is a number (not NaN), but those of
    speculative decoding's series, which only an engine that scores drafts has (a vLLM
    source; tests/test_dashboards.py computes them with promtool)."""
    values = variable_values(prometheus)
    assert values["model_name"] == "fake-llm" and values["engine"] == "0"
    assert values["instance"] == instance
    pending = {
        (q.dashboard, q.panel, q.ref_id): substitute(q.expr, values)
        for q in panel_queries()
        if "iterscope_spec_decode_" not in q.expr
    }

    def all_have_data() -> bool:
        for key, expr in list(pending.items()):
            if has_number(prometheus.query(expr)):
                del pending[key]
        return not pending

    wait_until(
        all_have_data,
        timeout_s,
        lambda: f"data in every panel query; without: {pending}",
        interval_s=0.5,
    )


def check_finding_alert(prometheus: PrometheusHandle, instance: str) -> None:
    """IterscopeFinding fires for a kind of finding the sidecar's /findings lists, its
    summary and description quoting the title and action of one of them (the latest, read
    by the annotations' query from iterscope_finding_info: a saturated cache opens KV findings
    one after another, each with its own action, and the alert is one series per kind)."""

    def alert_of_a_listed_finding() -> tuple[dict, dict] | None:
        findings = http_get_json(f"http://{instance}/findings")["findings"]
        for alert in prometheus.alerts():
            labels, annotations = alert["labels"], alert["annotations"]
            if labels["alertname"] != "IterscopeFinding" or alert["state"] != "firing":
                continue
            action = annotations["description"].partition("Action of the latest: ")[2]
            for finding in findings:
                if (finding["kind"], finding["action"]) == (labels["kind"], action):
                    return alert, finding
        return None

    alert, finding = prometheus.wait_until(
        alert_of_a_listed_finding, 30, "IterscopeFinding firing for a finding in /findings"
    )
    labels = alert["labels"]
    assert labels["instance"] == instance and labels["engine"] == "0"
    assert labels["severity"] == "warning"  # the saturation's findings are tuning findings
    assert set(labels) >= {"kind", "model_name"} and not {"title", "action"} & set(labels)
    summary = alert["annotations"]["summary"]
    assert summary.startswith(f"Engine 0 on {instance} (fake-llm): "), summary
    titles = {f["title"] for f in http_get_json(f"http://{instance}/findings")["findings"]}
    assert summary.partition("(fake-llm): ")[2] in titles | {finding["title"]}, summary


def test_dashboards_and_alerts_on_a_live_engine(tmp_path):
    address = f"ipc://{tmp_path}/lane.sock"
    sidecar, port = start_metrics_sidecar(tmp_path, address)
    prometheus = client = feeder = None
    try:
        rule_files = shortened_rule_copy(tmp_path)
        prometheus = start_prometheus(tmp_path, [f"127.0.0.1:{port}"], rule_files)
        client = start_engine(address)
        feeder = Feeder(client)
        feeder.start()
        prometheus.wait_for_targets(timeout_s=30)

        instance = f"127.0.0.1:{port}"  # the scrape target
        alert = wait_for_alert(prometheus, "IterscopeKVCacheSaturated", timeout_s=40)
        assert alert["labels"]["engine"] == "0" and alert["labels"]["instance"] == instance
        assert f"engine 0 on {instance}" in alert["annotations"]["summary"]
        assert float(alert["value"]) >= 0.95  # the KV usage ratio
        assert alert["annotations"]["runbook_url"].endswith("IterscopeKVCacheSaturated.md")
        check_every_panel_query(prometheus, instance, timeout_s=30)
        check_finding_alert(prometheus, instance)
        assert feeder.num_finished > 0
        assert engine_state_code(prometheus) == 1  # running

        os.kill(client.process.pid, signal.SIGSTOP)  # the feeder still keeps requests queued
        try:
            feeder.halt.set()
            feeder.join(timeout=5)
            # The stall needs work waiting (Prometheus scrapes every second).
            prometheus.wait_for_value(
                'iterscope_requests_waiting{engine="0"}', lambda waiting: waiting > 0, timeout_s=10
            )
            stalled = wait_for_alert(prometheus, "IterscopeEngineStalled", timeout_s=30)
            assert float(stalled["value"]) > 0  # requests waiting or running
            wait_for_alert(prometheus, "IterscopeEngineDown", timeout_s=20)
            assert engine_state_code(prometheus) == 3  # dead: a paused process sends no heartbeat
        finally:
            os.kill(client.process.pid, signal.SIGCONT)
    finally:
        if feeder is not None:
            feeder.halt.set()
        if client is not None:
            client.shutdown(timeout_s=10)
        if prometheus is not None:
            prometheus.stop()
        stop_process(sidecar)
