"""Prometheus alert rules: valid, documented, and pinned by promtool unit tests."""

from __future__ import annotations

import concurrent.futures
import logging
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # dashboards/ is not an installed package

from dashboards.metric_names import SERIES_NAMES  # noqa: E402

ALERTS_DIR = REPO / "dashboards" / "alerts"
RULE_FILES = sorted(ALERTS_DIR.glob("*.yml"))
# What `make dashboards` (deploy/generate.py) writes from RULE_FILES for the deployments.
DEPLOYED_RULES_FILE = REPO / "deploy" / "prometheus" / "rules" / "iterscope.yml"
PROMETHEUS_RULE_FILE = REPO / "deploy" / "k8s" / "generated" / "prometheusrule.yaml"
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
    "IterscopeEngineIndexConflict",
    "IterscopeRecordingFailing",
    "IterscopeSidecarAbsent",
    "IterscopeAPIServerDown",
    "IterscopeTTFTHigh",
    "IterscopeInterTokenLatencyHigh",
    "IterscopeHTTPErrors",
    "IterscopeFinding",
    "IterscopeFindingsWindowShort",
}
# Where runbook_url points by default: the docs/runbooks/ of the project's repository.
# deploy/alerting.yml replaces the base in the rules deploy/ ships (tests/test_deploy.py).
RUNBOOK_BASE_URL = "https://github.com/iterscope/iterscope/blob/main/docs/runbooks"
# Series the alerts may read that are not the sidecar's: the API server's own HTTP series.
API_SERIES = {"http_requests_total", "iterscope_api_sidecar_reachable"}  # the API port's own
RUNBOOK_SECTIONS = ("## What it means", "## How to confirm on the dashboards", "## What to change")
# Live finding kinds that IterscopeFinding leaves out, and the alert that pages for each.
FINDING_KINDS_WITH_OWN_ALERT = {
    "stall": "IterscopeEngineStalled",
    "spinning": "IterscopeEngineStalled",
    "dead": "IterscopeEngineDown",
}
KIND_MATCHER = re.compile(r'\bkind\s*(=~|!~|!=|=)\s*"([^"]*)"')
# by/without clauses of aggregations and on/ignoring clauses of binary operators.
LABEL_CLAUSE = re.compile(r"\b(by|without|on|ignoring)\s*\(([^)]*)\)")


def promtool() -> str:
    path = shutil.which("promtool") or "/usr/bin/promtool"
    if not Path(path).exists():
        pytest.fail("promtool not found: run `make prometheus` (Debian package prometheus)")
    return path


def run_promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def load_rules() -> dict[str, list[dict]]:
    """Alert name -> its rules, over every rule file (recording rules left out). Most alerts
    have one rule; IterscopeFinding has three (one per severity, one for an unknown cost)."""
    rules: dict[str, list[dict]] = {}
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    rules.setdefault(rule["alert"], []).append(rule)
    return rules


RULES = load_rules()


def prometheus_rule_groups() -> list[dict]:
    """The rule groups of the generated PrometheusRule (Kubernetes)."""
    (rule,) = [
        document
        for document in yaml.safe_load_all(PROMETHEUS_RULE_FILE.read_text())
        if document and document.get("kind") == "PrometheusRule"
    ]
    return rule["spec"]["groups"]


def shipped_rule_files(directory: Path) -> list[Path]:
    """Every rules file iterscope ships: the defaults of dashboards/alerts/, the generated file
    the compose stack's Prometheus loads, and the PrometheusRule's groups, written as a rules
    file into ``directory`` (promtool reads no Kubernetes object)."""
    k8s_rules = directory / "prometheusrule-groups.yml"
    k8s_rules.write_text(yaml.safe_dump({"groups": prometheus_rule_groups()}))
    return [*RULE_FILES, DEPLOYED_RULES_FILE, k8s_rules]


@pytest.mark.live
def test_shipped_rule_files_pass_promtool_check_with_lint_fatal(tmp_path):
    """`promtool check rules --lint-fatal`: valid, and no lint finding either (two rules of one
    alert name with the same labels are duplicates, which Prometheus cannot tell apart)."""
    result = run_promtool("check", "rules", "--lint-fatal", *map(str, shipped_rule_files(tmp_path)))
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_two_rules_of_a_rules_file_share_a_name_and_labels(tmp_path):
    """promtool's duplicate-rule lint, without promtool: within one rules file, no two rules
    (alerting or recording) have the same name and the same labels. IterscopeFinding's two
    warning rules differ by the label cost="unknown"."""
    for path in shipped_rule_files(tmp_path):
        seen: dict[tuple, str] = {}
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                name = rule.get("alert") or rule["record"]
                key = (name, tuple(sorted((rule.get("labels") or {}).items())))
                assert key not in seen, f"{path.name}: {key} in {seen.get(key)} and {group['name']}"
                seen[key] = group["name"]


@pytest.mark.live
def test_promtool_unit_tests_pass():
    result = run_promtool("test", "rules", *[p.name for p in TEST_FILES], cwd=TEST_FILES[0].parent)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_of_the_issue_exists():
    assert set(RULES) == EXPECTED_ALERTS


@pytest.mark.parametrize("name", sorted(EXPECTED_ALERTS))
def test_alert_is_documented(name):
    for rule in RULES[name]:
        annotations = rule["annotations"]
        assert annotations["summary"]
        # the value, but where there is none to show (a finding whose cost is unknown)
        if "is not in the records" not in annotations["description"]:
            assert "{{ $value" in annotations["description"], "description must show the value"
        runbook = runbook_of(annotations["runbook_url"]).read_text()
        assert runbook.startswith(f"# {name}\n")
        for section in RUNBOOK_SECTIONS:
            assert section in runbook, f"{name} runbook lacks {section!r}"
        assert rule["labels"]["severity"] in ("warning", "critical")


def runbook_of(url: str) -> Path:
    """The file of this repository a runbook URL opens, when the repository is published at
    the default base."""
    assert url.startswith(RUNBOOK_BASE_URL + "/"), f"{url} is not under {RUNBOOK_BASE_URL}"
    return REPO / "docs" / "runbooks" / url.removeprefix(RUNBOOK_BASE_URL + "/")


@pytest.mark.parametrize("name", sorted(EXPECTED_ALERTS))
def test_runbook_url_is_absolute_and_opens_the_alerts_runbook(name):
    """Alertmanager and Grafana link runbook_url as it is: only an absolute URL opens."""
    for rule in RULES[name]:
        url = rule["annotations"]["runbook_url"]
        assert re.fullmatch(r"https://[^/\s]+/\S+", url), url
        assert runbook_of(url) == REPO / "docs" / "runbooks" / f"{name}.md"
        assert runbook_of(url).is_file(), f"{url}: no runbook {runbook_of(url)}"


def test_every_runbook_has_an_alert():
    runbooks = {path.stem for path in (REPO / "docs" / "runbooks").glob("*.md")}
    assert runbooks == EXPECTED_ALERTS


@pytest.mark.parametrize("name", sorted(EXPECTED_ALERTS))
def test_alert_reads_only_contract_metrics(name):
    exprs = " ".join(rule["expr"] for rule in RULES[name])
    metrics = set(re.findall(r"(?<![:\w])(?:iterscope|http)_\w+", exprs))
    assert metrics and metrics <= SERIES_NAMES | API_SERIES, metrics - SERIES_NAMES


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


# The rewrites the promtool unit tests must notice, by the test that makes each.
REWRITES: dict[str, Callable[[str], str]] = {
    # an expression that never fires
    "test_unit_tests_fail_when_the_alert_never_fires": lambda expr: "vector(1) < 0",
    # the instance label aggregated away (pods that each run engine 0 merged into one alert)
    "test_unit_tests_fail_when_the_alert_merges_replicas": (
        lambda expr: f"max without (instance) ({expr})"
    ),
}
PROMTOOL_AT_ONCE = 2  # promtool runs side by side: two took 0.68x the time of one after another


def promtool_test_with_expr(directory: Path, name: str, rewrite: Callable[[str], str]) -> str:
    """Run every promtool unit test on a copy of the rules in ``directory`` where each rule of
    alert ``name`` has the expression ``rewrite(its expression)``.

    Returns promtool's output; fails the calling test if promtool passed all the same.
    """
    for path in RULE_FILES:
        data = yaml.safe_load(path.read_text())
        for group in data["groups"]:
            for rule in group["rules"]:
                if rule.get("alert") == name:
                    rule["expr"] = rewrite(rule["expr"])
        (directory / path.name).write_text(yaml.safe_dump(data))
    tests_dir = directory / "tests"
    tests_dir.mkdir()
    for path in TEST_FILES:
        shutil.copy(path, tests_dir / path.name)
    result = run_promtool("test", "rules", *[p.name for p in TEST_FILES], cwd=tests_dir)
    assert result.returncode != 0, f"promtool tests pass with {name} rewritten"
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def rewritten_runs(request, tmp_path_factory) -> dict:
    """(test name, alert) -> the future of promtool_test_with_expr for every rewrite test the
    session selected, PROMTOOL_AT_ONCE at a time (32 runs of ~2 s each)."""
    pool = concurrent.futures.ThreadPoolExecutor(PROMTOOL_AT_ONCE)
    runs = {}
    for item in request.session.items:
        if item.module is not request.module or item.originalname not in REWRITES:
            continue
        name = item.callspec.params["name"]
        directory = tmp_path_factory.mktemp(name)  # here: mktemp is not thread-safe
        rewrite = REWRITES[item.originalname]
        runs[item.originalname, name] = pool.submit(
            promtool_test_with_expr, directory, name, rewrite
        )
    yield runs
    pool.shutdown(cancel_futures=True)


@pytest.mark.live
@pytest.mark.parametrize("name", sorted(EXPECTED_ALERTS))
def test_unit_tests_fail_when_the_alert_never_fires(name, rewritten_runs):
    """Replace one alert's expression with one that never fires: promtool must notice."""
    output = rewritten_runs["test_unit_tests_fail_when_the_alert_never_fires", name].result()
    assert name in output


@pytest.mark.live
@pytest.mark.parametrize("name", sorted(EXPECTED_ALERTS))
def test_unit_tests_fail_when_the_alert_merges_replicas(name, rewritten_runs):
    """Aggregate the instance label away (pods that each run engine 0 merged into one alert):
    the two-replica promtool tests must notice."""
    output = rewritten_runs["test_unit_tests_fail_when_the_alert_merges_replicas", name].result()
    assert name in output and "replicas with engine 0" in output


@pytest.mark.parametrize("name", sorted(EXPECTED_ALERTS))
def test_alert_keeps_and_names_the_instance(name):
    """An engine is (instance, engine): a page must name the pod, and no clause may drop it."""
    for rule in RULES[name]:
        assert "{{ $labels.instance }}" in rule["annotations"]["summary"]
        for clause, labels in LABEL_CLAUSE.findall(rule["expr"]):
            names = {label.strip() for label in labels.split(",")}
            if clause in ("by", "on"):
                assert "instance" in names, f"{clause} ({labels}) drops instance"
            else:
                assert "instance" not in names, f"{clause} ({labels}) drops instance"


def replica_cases(name: str) -> list[list[str]]:
    """For each promtool case of ``name`` firing only for engine 0: the instances it names."""
    instances = []
    for path in TEST_FILES:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                alerts = case.get("exp_alerts") or []
                if (
                    case["alertname"] == name
                    and alerts
                    and all(alert["exp_labels"].get("engine", "") in ("0", "") for alert in alerts)
                ):
                    instances.append(sorted(a["exp_labels"].get("instance") for a in alerts))
    return instances


@pytest.mark.parametrize("name", sorted(EXPECTED_ALERTS))
def test_each_replica_fires_its_own_alert(name):
    """Two pods both with engine 0: one fires alone, then both fire as two alerts."""
    cases = replica_cases(name)
    assert ["pod-a"] in cases, f"{name}: no case where only pod-a fires"
    assert ["pod-a", "pod-b"] in cases, f"{name}: no case where both pods fire apart"


def test_kv_panel_thresholds_are_the_alert_thresholds():
    from dashboards.common import KV_NEAR_FULL_RATIO, KV_SATURATED_RATIO

    def threshold(name: str) -> float:
        (rule,) = RULES[name]
        match = re.search(r"iterscope_kv_cache_usage_ratio(?:\[\w+\]\))? >= ([\d.]+)", rule["expr"])
        return float(match[1])

    assert threshold("IterscopeKVCacheNearFull") == KV_NEAR_FULL_RATIO
    assert threshold("IterscopeKVCacheSaturated") == KV_SATURATED_RATIO


def test_kv_blocked_panel_threshold_is_the_alert_share():
    from dashboards.common import KV_BLOCKED_SHARE

    (rule,) = RULES["IterscopeKVCacheSaturated"]
    expr = rule["expr"]
    match = re.search(
        r"increase\(iterscope_kv_blocked_iterations_total\[(\w+)\]\)\s*"
        r"> ([\d.]+) \* increase\(iterscope_iterations_total\[(\w+)\]\)",
        expr,
    )
    assert match and match[1] == match[3], expr
    assert float(match[2]) == KV_BLOCKED_SHARE


def finding_kinds_selected(expr: str) -> set[str]:
    """The live finding kinds an expression's one ``kind`` matcher selects (Prometheus
    anchors regular expressions)."""
    from telemetry.analysis.live_findings import FINDING_KINDS

    ((op, value),) = KIND_MATCHER.findall(expr)
    selected = {
        kind
        for kind in FINDING_KINDS
        if (kind == value if "~" not in op else re.fullmatch(value, kind) is not None)
    }
    return set(FINDING_KINDS) - selected if op.startswith("!") else selected


def test_finding_alert_places_every_finding_kind_once():
    """Every live finding kind either has an IterscopeFinding rule, exactly one, critical for a
    fault and warning for a tuning finding, or pages through an alert of its own (never both:
    one page per cause)."""
    from telemetry.analysis.findings import COST_LABELS, FAULT_KINDS
    from telemetry.analysis.live_findings import FINDING_KINDS

    severities: dict[str, list[str]] = {kind: [] for kind in FINDING_KINDS}
    for rule in RULES["IterscopeFinding"]:
        for kind in finding_kinds_selected(rule["expr"]):
            severities[kind].append(rule["labels"]["severity"])
    for kind, found in severities.items():
        if kind in FINDING_KINDS_WITH_OWN_ALERT:
            (own_rule,) = RULES[FINDING_KINDS_WITH_OWN_ALERT[kind]]
            assert not found and own_rule["labels"]["severity"] == "critical", kind
        else:
            assert found == ["critical" if kind in FAULT_KINDS else "warning"], (kind, found)
    # a kind whose cost the records cannot measure warns by the rule that says so, not by one
    # that would say it holds up 0.0 requests (the silence's "dead" pages on its own)
    unknown = {
        kind
        for kind in FINDING_KINDS
        if COST_LABELS.get(kind) == "unknown" and kind not in FINDING_KINDS_WITH_OWN_ALERT
    }
    (unknown_rule,) = [r for r in RULES["IterscopeFinding"] if "cost" not in r["expr"]]
    assert (
        finding_kinds_selected(unknown_rule["expr"])
        == unknown
        == {
            "telemetry_gap",
            "futile_speculation",
        }
    )
    assert "not in the records" in unknown_rule["annotations"]["description"]
    runbook = (REPO / "docs" / "runbooks" / "IterscopeFinding.md").read_text()
    for kind in FINDING_KINDS:
        assert f"`{kind}`" in runbook, f"the runbook says nothing of {kind}"


def test_conflict_runbook_quotes_the_sidecars_log_lines(caplog):
    """The runbook tells operators to look for the sidecar's ERROR lines: quote them as the
    sidecar and its log sink write them today (pids as in the runbook's example)."""
    from telemetry.lane.record import heartbeat as lane_heartbeat
    from telemetry.sidecar.ingest import Ingest
    from telemetry.sidecar.sinks.log import LogSink

    log_sink_lines = []
    log_sink = LogSink(emit=lambda level, text: log_sink_lines.append(text), interval_s=10)
    ingest = Ingest([log_sink])
    with caplog.at_level(logging.ERROR, logger="iterscope.sidecar"):
        for seq, pid in ((1, 4123), (1, 4871), (2, 4123)):  # two live processes, one index
            heartbeat = lane_heartbeat(0, seq, seq, seq, pid=pid)
            ingest.on_message(heartbeat, now_ns=seq)
    log_sink.tick(20 * 10**9)
    sidecar_lines = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    conflict_lines = [line for line in log_sink_lines if "two engine processes" in line]
    assert len(sidecar_lines) == 1 and len(conflict_lines) == 1
    runbook = (REPO / "docs" / "runbooks" / "IterscopeEngineIndexConflict.md").read_text()
    assert sidecar_lines[0] in runbook
    assert conflict_lines[0] in runbook


def duration_s(text: str) -> int:
    """Seconds of a Prometheus duration of one unit (``30s``, ``5m``, ``1h``)."""
    value, unit = re.fullmatch(r"(\d+)([smh])", text).groups()
    return int(value) * {"s": 1, "m": 60, "h": 3600}[unit]


def test_findings_window_alert_fires_after_the_10_minutes_its_texts_say():
    """IterscopeFindingsWindowShort: every window of max_over_time below 50 s for the whole
    `for:` is below 50 s for range + for, which its description, runbook and the alerts table
    of docs/dashboards.md call 10 minutes; the offset (the series that old) holds a new engine
    to the same 10 minutes. findings_test.yml pins both at the boundary."""
    (rule,) = RULES["IterscopeFindingsWindowShort"]
    expr = " ".join(rule["expr"].split())
    match = re.fullmatch(
        r"max_over_time\(iterscope_findings_window_seconds\[(\w+)\]\) < 50 and "
        r"iterscope_findings_window_seconds offset (\w+)",
        expr,
    )
    assert match, expr
    assert match[1] == match[2], expr
    assert duration_s(match[1]) + duration_s(rule["for"]) == 10 * 60
    assert "for 10 minutes" in rule["annotations"]["description"]
    runbook = (REPO / "docs" / "runbooks" / "IterscopeFindingsWindowShort.md").read_text()
    assert "For 10 minutes this engine's window held less than 50 s" in runbook
    assert f"`max_over_time(iterscope_findings_window_seconds[{match[1]}]) < 50`" in runbook
    table = (REPO / "docs" / "dashboards.md").read_text()
    assert f"`max_over_time(iterscope_findings_window_seconds[{match[1]}]) < 50` for " in table


def test_near_full_runbook_does_not_say_nobody_waits_for_kv():
    """IterscopeKVCacheNearFull reads the usage alone, and IterscopeKVCacheSaturated needs 95%
    and most iterations blocked: between 90% and 95% with requests waiting for KV, the near
    full alert fires alone (kv_cache_test.yml, engine 2). Its runbook must say so."""
    (near_full,) = RULES["IterscopeKVCacheNearFull"]
    (saturated,) = RULES["IterscopeKVCacheSaturated"]
    assert "kv_blocked" not in near_full["expr"] and "kv_blocked" in saturated["expr"]
    runbook = (REPO / "docs" / "runbooks" / "IterscopeKVCacheNearFull.md").read_text()
    assert not re.search(r"nothing is (queued|waiting) for kv", runbook, re.IGNORECASE)
    assert "between 90% and 95%" in runbook and "`kv_capacity`" in runbook


def test_finding_runbook_says_the_kv_kinds_draw_their_values_from_their_own_episodes():
    """The KV kinds a too-small cache opens share a remedy, not an action: each action's
    numbers come from the requests of its own episode (actions._kv_action), so they differ."""
    runbook = (REPO / "docs" / "runbooks" / "IterscopeFinding.md").read_text()
    assert "all with the same action" not in runbook
    assert "same remedy" in runbook and "its own episode" in runbook


def test_stall_runbook_names_what_the_rule_reads():
    """IterscopeEngineStalled counts tokens, not iterations (a spinning loop iterates)."""
    (rule,) = RULES["IterscopeEngineStalled"]
    assert "iterscope_iterations_total" not in rule["expr"]
    runbook = (REPO / "docs" / "runbooks" / "IterscopeEngineStalled.md").read_text()
    assert "reads the iteration counter" not in runbook
    assert "reads the token counters" in runbook


def test_finding_alert_keys_on_labels_that_stay_while_a_cause_persists():
    """A finding that reopens with another action is another iterscope_finding_info series: the
    rules read iterscope_finding_active (engine and kind), and the annotations, not the labels,
    carry the latest title and action."""
    for rule in RULES["IterscopeFinding"]:
        assert "iterscope_finding_active" in rule["expr"]
        assert "iterscope_finding_info" not in rule["expr"]
        assert "iterscope_finding_info" in rule["annotations"]["description"]
        assert "open for 5 minutes" not in rule["annotations"]["description"]


def test_stalled_runbook_says_engine_down_inhibits_it():
    """The shipped Alertmanager config inhibits every alert of an engine while
    IterscopeEngineDown fires, IterscopeEngineStalled included: the runbooks that tell the two
    apart must say so."""
    config = yaml.safe_load((REPO / "deploy" / "alertmanager" / "alertmanager.yml").read_text())
    (down_rule,) = [
        rule
        for rule in config["inhibit_rules"]
        if rule["source_matchers"] == ['alertname="IterscopeEngineDown"']
    ]
    assert 'alertname!="IterscopeEngineDown"' in down_rule["target_matchers"]
    for name in ("IterscopeEngineStalled", "IterscopeEngineDown"):
        runbook = (REPO / "docs" / "runbooks" / f"{name}.md").read_text()
        assert "deploy/alertmanager/alertmanager.yml" in runbook and "inhibit" in runbook, name
