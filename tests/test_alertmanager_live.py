"""The shipped Alertmanager config (deploy/alertmanager/alertmanager.yml), run by a real
Alertmanager.

Its inhibit rules decide which pages are never sent, so a wrong `equal:` list or matcher would
silently suppress real alerts. Each test starts Alertmanager (Debian's prometheus-alertmanager,
`make alertmanager`) on the repository's config, unchanged, posts alerts labelled as the rules
in dashboards/alerts/ label them, and reads back which alert inhibits which.

Alertmanager evaluates inhibition when alerts are read, after its inhibitor has seen the
source alert, so the tests poll GET /api/v2/alerts until the expected state shows up (or a
few seconds pass) and then compare the whole picture.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO
from tests.helpers.prom import ReadyServer, start_server

pytestmark = pytest.mark.live

CONFIG = REPO / "deploy" / "alertmanager" / "alertmanager.yml"
RULE_FILES = sorted((REPO / "dashboards" / "alerts").glob("*.yml"))
SETTLE_TIMEOUT_S = 10.0

# An alert as the tests name it: (alertname, instance, engine, model_name).
AlertKey = tuple[str, str, str, str]

DOWN = "IterscopeEngineDown"
CONFLICT = "IterscopeEngineIndexConflict"
DROPPING = "IterscopeTelemetryDropping"
SATURATED = "IterscopeKVCacheSaturated"
STALLED = "IterscopeEngineStalled"
QUEUE = "IterscopeQueueBuildUp"
POD_A, POD_B = "10.0.0.1:9470", "10.0.0.2:9470"
MODEL, OTHER_MODEL = "smollm2-135m", "other-model"


def find_binary(*names: str) -> str:
    """The first of ``names`` on PATH or in /usr/bin; fails the test if none is installed."""
    for name in names:
        path = shutil.which(name) or f"/usr/bin/{name}"
        if Path(path).exists():
            return path
    pytest.fail(
        f"{' / '.join(names)} not found: run `make alertmanager` "
        "(apt-get install prometheus-alertmanager)"
    )


def rule_labels() -> dict[str, dict[str, str]]:
    """Alert name -> the labels its rule adds (severity), over every rule file."""
    labels = {}
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:  # not a recording rule (the alert thresholds)
                    labels[rule["alert"]] = rule.get("labels", {})
    return labels


RULE_LABELS = rule_labels()


def alert_labels(key: AlertKey) -> dict[str, str]:
    """The labels Prometheus sends for ``key``: the rule's labels and the series' labels."""
    alertname, instance, engine, model_name = key
    return {
        "alertname": alertname,
        **RULE_LABELS[alertname],
        "job": "iterscope",
        "instance": instance,
        "engine": engine,
        "model_name": model_name,
    }


def key_of(labels: dict[str, str]) -> AlertKey:
    return (labels["alertname"], labels["instance"], labels["engine"], labels["model_name"])


class Alertmanager(ReadyServer):
    """A running Alertmanager: post alerts, read back who inhibits whom."""

    name = "Alertmanager"

    def post(self, keys: list[AlertKey]) -> None:
        """Fire one alert per key, as Prometheus would (ending in an hour)."""
        now = datetime.now(timezone.utc)
        alerts = [
            {
                "labels": alert_labels(key),
                "startsAt": now.isoformat(),
                "endsAt": (now + timedelta(hours=1)).isoformat(),
            }
            for key in keys
        ]
        request = urllib.request.Request(
            f"{self.url}/api/v2/alerts",
            data=json.dumps(alerts).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200, response.read()

    def inhibitions(self) -> dict[AlertKey, set[AlertKey]]:
        """Every alert -> the alerts inhibiting it (empty: not inhibited)."""
        with urllib.request.urlopen(f"{self.url}/api/v2/alerts", timeout=10) as response:
            alerts = json.loads(response.read())
        by_fingerprint = {alert["fingerprint"]: key_of(alert["labels"]) for alert in alerts}
        result = {}
        for alert in alerts:
            status = alert["status"]
            sources = {by_fingerprint.get(fp, ("?", fp, "", "")) for fp in status["inhibitedBy"]}
            assert (status["state"] == "suppressed") == bool(sources), alert
            result[key_of(alert["labels"])] = sources
        return result


def start_alertmanager(tmp_path: Path) -> Alertmanager:
    """Alertmanager on the repository's config, 127.0.0.1 and a free port, without gossip."""
    binary = find_binary("alertmanager", "prometheus-alertmanager")
    return start_server(
        Alertmanager,
        tmp_path,
        "alertmanager",
        lambda port: [
            binary,
            f"--config.file={CONFIG}",
            f"--storage.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
            "--log.level=warn",
        ],
    )


@pytest.fixture
def alertmanager(tmp_path: Path) -> Iterator[Alertmanager]:
    manager = start_alertmanager(tmp_path)
    try:
        yield manager
    finally:
        manager.stop()


def settled_inhibitions(
    manager: Alertmanager, expected: dict[AlertKey, set[AlertKey]]
) -> dict[AlertKey, set[AlertKey]]:
    """Poll until the state is ``expected`` (every posted alert back), or time runs out.

    A state with one expected inhibition proves the inhibitor has seen the source alert, so
    the other alerts of that same read were judged against it too.
    """
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        observed = manager.inhibitions()
        if observed == expected or time.monotonic() > deadline:
            return observed
        time.sleep(0.05)


def engine_alerts(instance: str, engine: str, model_name: str = MODEL) -> list[AlertKey]:
    """Alerts that inhibit rules may target, of one engine."""
    return [(name, instance, engine, model_name) for name in (SATURATED, STALLED, QUEUE, DROPPING)]


def check_inhibitions(
    manager: Alertmanager, posted: list[AlertKey], inhibited: dict[AlertKey, AlertKey]
) -> None:
    """Post ``posted``; exactly the keys of ``inhibited`` end up inhibited, each by its value."""
    manager.post(posted)
    expected = {key: ({inhibited[key]} if key in inhibited else set()) for key in posted}
    observed = settled_inhibitions(manager, expected)
    wrong = {
        key: f"inhibited by {sorted(observed.get(key, {'<missing>'}))}, expected {sorted(want)}"
        for key, want in expected.items()
        if observed.get(key) != want
    }
    assert not wrong, "\n".join(f"{key}: {why}" for key, why in wrong.items())


def test_amtool_accepts_config():
    result = subprocess.run(
        [find_binary("amtool"), "check-config", str(CONFIG)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 inhibit rules" in result.stdout, result.stdout


def test_nothing_is_inhibited_without_a_source_alert(alertmanager):
    posted = [*engine_alerts(POD_A, "0"), *engine_alerts(POD_A, "1"), *engine_alerts(POD_B, "0")]
    check_inhibitions(alertmanager, posted, inhibited={})


def test_engine_down_inhibits_only_its_own_engine(alertmanager):
    down = (DOWN, POD_A, "0", MODEL)
    own = engine_alerts(POD_A, "0") + [(CONFLICT, POD_A, "0", MODEL)]
    others = [*engine_alerts(POD_A, "1"), *engine_alerts(POD_B, "0")]
    check_inhibitions(
        alertmanager,
        [down, *own, *others],
        inhibited={key: down for key in own},
    )


def test_index_conflict_inhibits_only_dropping_of_its_engine(alertmanager):
    conflict = (CONFLICT, POD_A, "0", MODEL)
    # model_name follows the latest heartbeat, so the dropping alert may carry the other one.
    dropping = [(DROPPING, POD_A, "0", MODEL), (DROPPING, POD_A, "0", OTHER_MODEL)]
    others = [
        (SATURATED, POD_A, "0", MODEL),
        (STALLED, POD_A, "0", MODEL),
        (QUEUE, POD_A, "0", MODEL),
        (DROPPING, POD_A, "1", MODEL),
        (DROPPING, POD_B, "0", MODEL),
    ]
    check_inhibitions(
        alertmanager,
        [conflict, *dropping, *others],
        inhibited={key: conflict for key in dropping},
    )
