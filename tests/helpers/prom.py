"""Prometheus in tests: scrape a /metrics page, and run a real Prometheus (or another server
with /-/ready, such as Alertmanager) on 127.0.0.1 with a free port and a temp dir.

    samples = scrape(port)            # {(name, sorted labels): value}
    total(samples, "iterscope_iterations_total", engine="0")

    prom = start_prometheus(tmp_path, ["127.0.0.1:9470"], rule_files=[rules_path])
    try:
        prom.wait_for_targets()
        value = prom.wait_for_value("rate(iterscope_iterations_total[5s])")
        firing = prom.alerts()
    finally:
        prom.stop()

The binary comes from the Debian package (/usr/bin/prometheus, `make prometheus`); without it
start_prometheus raises, so a test needing it fails loudly instead of being skipped.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.net import free_port
from tests.helpers.processes import stop_process
from tests.helpers.wait import wait_until

PROMETHEUS_BINARY = "/usr/bin/prometheus"
STARTUP_TIMEOUT_S = 30.0

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# A /metrics page ------------------------------------------------------------------------------


def metrics_text(where: int | str, timeout_s: float = 10.0) -> str:
    """The text of a /metrics page: ``where`` is a port on 127.0.0.1 or a whole URL."""
    url = f"http://127.0.0.1:{where}/metrics" if isinstance(where, int) else where
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


def parse_samples(text: str) -> Samples:
    """Every sample of an exposition, keyed by (sample name, sorted labels)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def scrape(where: int | str) -> Samples:
    """Every sample of the /metrics page at ``where`` (a port on 127.0.0.1, or a URL), keyed
    by (sample name, sorted labels)."""
    return parse_samples(metrics_text(where))


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(
        value
        for (sample, sample_labels), value in samples.items()
        if sample == name and set(labels.items()) <= set(sample_labels)
    )


# A real Prometheus or Alertmanager ------------------------------------------------------------


def find_prometheus() -> str:
    binary = shutil.which("prometheus") or PROMETHEUS_BINARY
    if not Path(binary).exists():
        raise RuntimeError(
            "prometheus binary not found (install it with `make prometheus`, i.e. "
            "apt-get install prometheus)"
        )
    return binary


def http_get_json(url: str, timeout_s: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return json.loads(response.read())


class ReadyServer:
    """A server the test started (Prometheus, Alertmanager): its URL, its log, and stop()."""

    name = "server"

    def __init__(self, process: subprocess.Popen, url: str, log_path: Path) -> None:
        self.process = process
        self.url = url
        self.log_path = log_path

    def ready(self) -> bool:
        """Whether /-/ready answers 200 (Prometheus and Alertmanager both serve it)."""
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def log_tail(self, num_chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def check_running(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with {self.process.returncode}\n{self.log_tail()}"
            )

    def wait_until(
        self, probe: Callable[[], object], timeout_s: float, what: str | Callable[[], str]
    ):
        """Poll ``probe`` until it returns something other than None (0.0 counts), failing
        at once if the server exits; AssertionError with the log's tail on timeout."""

        def outcome() -> tuple | None:
            self.check_running()
            value = probe()
            return None if value is None else (value,)

        def description() -> str:
            return f"{self.name}: {what() if callable(what) else what}\n{self.log_tail()}"

        return wait_until(outcome, timeout_s, description, interval_s=0.25)[0]

    def stop(self) -> None:
        stop_process(self.process)

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


class PrometheusHandle(ReadyServer):
    """A running Prometheus: its URL and the HTTP API calls tests need."""

    name = "Prometheus"

    def api(self, path: str, **params: str) -> dict:
        """GET /api/v1/<path>; returns ``data``, raises on an error status."""
        query = urllib.parse.urlencode(params)
        body = http_get_json(f"{self.url}/api/v1/{path}" + (f"?{query}" if query else ""))
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus {path} failed: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query; the result list (``[{"metric": {...}, "value": [ts, "1.5"]}]``)."""
        data = self.api("query", query=expr)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def alerts(self) -> list[dict]:
        """Active (pending or firing) alerts, each with labels, annotations and state."""
        return self.api("alerts")["alerts"]

    def targets(self) -> list[dict]:
        return self.api("targets")["activeTargets"]

    def wait_for_targets(self, timeout_s: float = 30.0) -> list[dict]:
        """Poll until every configured target has been scraped successfully."""

        def all_up() -> list[dict] | None:
            targets = self.targets()
            healthy = targets and all(target["health"] == "up" for target in targets)
            return targets if healthy else None

        return self.wait_until(all_up, timeout_s, "all scrape targets up")

    def wait_for_value(
        self,
        expr: str,
        predicate: Callable[[float], bool] = lambda v: True,
        timeout_s: float = 30.0,
    ) -> float:
        """Poll ``expr`` until its first sample is a number for which ``predicate`` holds."""

        def sample() -> float | None:
            result = self.query(expr)
            if not result:
                return None
            number = float(result[0]["value"][1])
            return number if number == number and predicate(number) else None  # not NaN

        return self.wait_until(sample, timeout_s, f"a value for {expr!r}")


def write_config(
    directory: Path,
    scrape_targets: Sequence[str],
    rule_files: Sequence[str | Path],
    scrape_interval: str,
    eval_interval: str,
) -> Path:
    config = {
        "global": {
            "scrape_interval": scrape_interval,
            "scrape_timeout": scrape_interval,
            "evaluation_interval": eval_interval,
        },
        "rule_files": [str(Path(path).resolve()) for path in rule_files],
        "scrape_configs": [
            {
                "job_name": "iterscope",
                "static_configs": [{"targets": list(scrape_targets)}],
            }
        ],
    }
    path = directory / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def start_prometheus(
    tmp_path: Path,
    scrape_targets: Sequence[str],
    rule_files: Sequence[str | Path] = (),
    eval_interval: str = "1s",
    scrape_interval: str = "1s",
) -> PrometheusHandle:
    """Start Prometheus scraping ``scrape_targets`` ("host:port"), ready to answer queries."""
    binary = find_prometheus()
    directory = Path(tmp_path) / f"prometheus-{time.monotonic_ns()}"
    directory.mkdir(parents=True)
    config_path = write_config(
        directory, scrape_targets, rule_files, scrape_interval, eval_interval
    )
    return start_server(
        PrometheusHandle,
        directory,
        "prometheus",
        lambda port: [
            binary,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
    )


Server = TypeVar("Server", bound=ReadyServer)


def start_server(
    make_handle: Callable[[subprocess.Popen, str, Path], Server],
    directory: Path,
    name: str,
    command: Callable[[int], list[str]],
) -> Server:
    """Run ``command(port)`` on a free 127.0.0.1 port, logging into ``directory``, until its
    /-/ready answers. Three tries: the free port may be taken between probing and binding."""
    last_log = ""
    for _ in range(3):
        port = free_port()
        log_path = directory / f"{name}-{port}.log"
        with open(log_path, "wb") as log_file:
            process = subprocess.Popen(command(port), stdout=log_file, stderr=subprocess.STDOUT)
        handle = make_handle(process, f"http://127.0.0.1:{port}", log_path)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while process.poll() is None and time.monotonic() < deadline:
            if handle.ready():
                return handle
            time.sleep(0.1)
        handle.stop()
        last_log = handle.log_tail()
    raise RuntimeError(f"{name} did not become ready\n{last_log}")
