"""Prometheus alert rules: valid, documented, and pinned by promtool unit tests."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # dashboards/ is not an installed package

from dashboards.metric_names import SERIES_NAMES  # noqa: E402

ALERTS_DIR = REPO / "dashboards" / "alerts"
RULE_FILES = sorted(ALERTS_DIR.glob("*.yml"))
TEST_FILES = sorted((ALERTS_DIR / "tests").glob("*.yml"))
EXPECTED_ALERTS = {
    "IterscopeKVCacheSaturated",
    "IterscopeKVCacheNearFull",
    "IterscopePreemptionStorm",
    "IterscopeQueueBuildUp",
    "IterscopeEngineStalled",
    "IterscopeKVBlocksLeaked",
    "IterscopeEngineDown",
    "IterscopeTelemetryDropping",
    "IterscopeTelemetryUndecodable",
}
RUNBOOK_SECTIONS = ("## What it means", "## How to confirm on the dashboards", "## What to change")


def promtool() -> str:
    path = shutil.which("promtool") or "/usr/bin/promtool"
    if not Path(path).exists():
        pytest.fail("promtool not found: run `make prometheus` (Debian package prometheus)")
    return path


def run_promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [promtool(), *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def load_rules() -> dict[str, dict]:
    """Alert name -> rule, over every rule file."""
    rules = {}
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                rules[rule["alert"]] = rule
    return rules


RULES = load_rules()


def test_rule_files_pass_promtool_check():
    result = run_promtool("check", "rules", *map(str, RULE_FILES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass():
    result = run_promtool("test", "rules", *[p.name for p in TEST_FILES], cwd=TEST_FILES[0].parent)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_of_the_issue_exists():
    assert set(RULES) == EXPECTED_ALERTS


@pytest.mark.parametrize("name", sorted(EXPECTED_ALERTS))
def test_alert_is_documented(name):
    rule = RULES[name]
    annotations = rule["annotations"]
    assert annotations["summary"]
    assert "{{ $value" in annotations["description"], "description must show the current value"
    assert annotations["runbook_url"] == f"docs/runbooks/{name}.md"
    runbook = (REPO / annotations["runbook_url"]).read_text()
    assert runbook.startswith(f"# {name}\n")
    for section in RUNBOOK_SECTIONS:
        assert section in runbook, f"{name} runbook lacks {section!r}"
    assert rule["labels"]["severity"] in ("warning", "critical")


@pytest.mark.parametrize("name", sorted(EXPECTED_ALERTS))
def test_alert_reads_only_contract_metrics(name):
    metrics = set(re.findall(r"\biterscope_\w+", RULES[name]["expr"]))
    assert metrics and metrics <= SERIES_NAMES, metrics - SERIES_NAMES


def unit_test_cases() -> dict[str, list[list]]:
    """Alert name -> the exp_alerts lists of every promtool test case that evaluates it."""
    cases: dict[str, list[list]] = {}
    for path in TEST_FILES:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                cases.setdefault(case["alertname"], []).append(case.get("exp_alerts") or [])
    return cases


@pytest.mark.parametrize("name", sorted(EXPECTED_ALERTS))
def test_each_alert_has_firing_and_not_firing_cases(name):
    cases = unit_test_cases().get(name, [])
    assert any(cases), f"{name}: no promtool case where it fires"
    assert any(not alerts for alerts in cases), f"{name}: no promtool case where it stays quiet"


@pytest.mark.parametrize("name", sorted(EXPECTED_ALERTS))
def test_unit_tests_fail_when_the_alert_never_fires(name, tmp_path):
    """Replace one alert's expression with one that never fires: promtool must notice."""
    for path in RULE_FILES:
        data = yaml.safe_load(path.read_text())
        for group in data["groups"]:
            for rule in group["rules"]:
                if rule["alert"] == name:
                    rule["expr"] = "vector(1) < 0"
        (tmp_path / path.name).write_text(yaml.safe_dump(data))
    tests_dir = tmp_path / "tests"
    tests_dir.mkdir()
    for path in TEST_FILES:
        shutil.copy(path, tests_dir / path.name)
    result = run_promtool("test", "rules", *[p.name for p in TEST_FILES], cwd=tests_dir)
    assert result.returncode != 0
    assert name in result.stdout + result.stderr


def test_kv_panel_thresholds_are_the_alert_thresholds():
    from dashboards.common import KV_NEAR_FULL_RATIO, KV_SATURATED_RATIO

    def threshold(name: str) -> float:
        match = re.search(r"iterscope_kv_cache_usage_ratio >= ([\d.]+)", RULES[name]["expr"])
        return float(match[1])

    assert threshold("IterscopeKVCacheNearFull") == KV_NEAR_FULL_RATIO
    assert threshold("IterscopeKVCacheSaturated") == KV_SATURATED_RATIO
