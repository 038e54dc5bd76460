"""Generated dashboards: up to date, well formed, every query valid PromQL on contract metrics."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

# dashboards/ is not an installed package (pyproject includes engine* and telemetry* only).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dashboards import build  # noqa: E402
from dashboards.metric_names import SERIES_NAMES  # noqa: E402
from dashboards.panel_queries import (  # noqa: E402
    iter_panels,
    load_dashboards,
    panel_queries,
    substitute,
)

# Sidecar-level series (empty engine/model_name): filtered by the instance variable only.
SIDECAR_SERIES = {
    "iterscope_frames_undecodable_total",
    "iterscope_frames_rejected_total",
    "iterscope_lane_disconnects_total",
    "iterscope_lane_handshake_failures_total",
    "iterscope_otel_spans_dropped_total",
    "iterscope_sink_errors_total",
    "iterscope_sink_lines_lost_total",
}
METRIC = re.compile(r"\biterscope_\w+")
# A metric and its label matchers, e.g. iterscope_kv_tokens{model_name=~"$model_name", ...}.
SELECTOR = re.compile(r"\b(iterscope_\w+)(\{[^}]*\})?")
# by/without clauses of aggregations and on/ignoring clauses of binary operators.
LABEL_CLAUSE = re.compile(r"\b(by|without|on|ignoring)\s*\(([^)]*)\)")
DASHBOARDS = load_dashboards()
QUERIES = panel_queries()
PANELS = [(name, panel) for name, board in DASHBOARDS.items() for panel in iter_panels(board)]


def test_checked_in_json_is_what_the_code_generates():
    rendered = build.render_all()
    assert sorted(rendered) == sorted(f"{name}.json" for name in DASHBOARDS)
    for file_name, text in rendered.items():
        assert (build.JSON_DIR / file_name).read_text() == text, f"{file_name} is stale"


def test_rendering_is_deterministic():
    assert build.render_all() == build.render_all()


def test_build_check_flags_a_stale_file(tmp_path):
    assert build.main(["--out", str(tmp_path)]) == 0
    assert build.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "overview.json").write_text("{}")
    assert build.main(["--check", "--out", str(tmp_path)]) == 1


def test_expected_dashboards_with_unique_uids():
    assert set(DASHBOARDS) == {"overview", "iterations", "pipeline"}
    uids = [board["uid"] for board in DASHBOARDS.values()]
    assert len(set(uids)) == len(uids)


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_variables_are_datasource_model_name_instance_engine(name):
    variables = {v["name"]: v for v in DASHBOARDS[name]["templating"]["list"]}
    assert list(variables) == ["datasource", "model_name", "instance", "engine"]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for label in ("model_name", "instance", "engine"):
        variable = variables[label]
        assert variable["type"] == "query"
        assert variable["multi"] and variable["includeAll"] and variable["allValue"] == ".*"
        assert variable["datasource"]["uid"] == "${datasource}"
        assert f", {label})" in variable["query"]["query"]
    # Each variable offers only what the ones before it select.
    assert 'model_name=~"$model_name"' in variables["instance"]["query"]["query"]
    assert 'instance=~"$instance"' in variables["engine"]["query"]["query"]


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_panel_ids_unique_and_grid_in_bounds(name):
    panels = iter_panels(DASHBOARDS[name])
    ids = [panel["id"] for panel in panels]
    assert len(set(ids)) == len(ids) and None not in ids
    cells = set()
    for panel in panels:
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, panel["title"]
        panel_cells = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not cells & panel_cells, f"{panel['title']} overlaps another panel"
        cells |= panel_cells


@pytest.mark.parametrize("name,panel", PANELS, ids=[f"{n}:{p['title']}" for n, p in PANELS])
def test_panel_has_one_sentence_description_and_queries(name, panel):
    description = panel.get("description", "")
    assert description.endswith(".") and ". " not in description, description
    assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    ref_ids = [target.get("refId") for target in panel["targets"]]
    assert ref_ids and all(ref_ids) and len(set(ref_ids)) == len(ref_ids)


@pytest.mark.parametrize(
    "query", QUERIES, ids=[f"{q.dashboard}:{q.panel}:{q.ref_id}" for q in QUERIES]
)
def test_query_uses_contract_metrics_and_the_variables(query):
    metrics = set(METRIC.findall(query.expr))
    assert metrics, query.expr
    assert metrics <= SERIES_NAMES, f"not in the metric contract: {metrics - SERIES_NAMES}"
    for metric, matchers in SELECTOR.findall(query.expr):
        if metric in SIDECAR_SERIES:
            assert matchers == '{instance=~"$instance"}', (metric, query.expr)
        else:
            assert matchers.startswith(
                '{model_name=~"$model_name", instance=~"$instance", engine=~"$engine"'
            ), (metric, query.expr)
    if "rate(" in query.expr or "increase(" in query.expr:
        assert "[$__rate_interval]" in query.expr


@pytest.mark.parametrize(
    "query", QUERIES, ids=[f"{q.dashboard}:{q.panel}:{q.ref_id}" for q in QUERIES]
)
def test_per_engine_queries_keep_the_instance(query):
    """Replicas each run an engine 0: grouping by engine without instance would add pods up."""
    for clause, labels in LABEL_CLAUSE.findall(query.expr):
        names = {label.strip() for label in labels.split(",")}
        if clause in ("by", "on"):
            assert "engine" not in names or "instance" in names, (clause, labels, query.expr)
        else:
            assert "instance" not in names, f"{clause} ({labels}) drops instance: {query.expr}"


@pytest.mark.parametrize("name,panel", PANELS, ids=[f"{n}:{p['title']}" for n, p in PANELS])
def test_per_engine_legends_name_the_instance(name, panel):
    for target in panel["targets"]:
        if "{{engine}}" in target["legendFormat"]:
            assert "{{instance}} engine {{engine}}" in target["legendFormat"], target


def test_queries_group_by_instance_and_engine_where_engines_are_shown():
    """Spot checks of the per-engine panels, and of totals that stay totals."""
    by_panel = {(q.dashboard, q.panel, q.ref_id): q.expr for q in QUERIES}
    assert by_panel[("overview", "Engine state", "A")].startswith("max by (instance, engine) (")
    assert by_panel[("overview", "Token throughput", "C")].startswith(
        "sum by (instance, engine) (rate(iterscope_generation_tokens_total{"
    )
    hit_rate = by_panel[("iterations", "Prefix cache hit rate", "A")]
    assert " / sum by (instance, engine) (" in hit_rate
    assert by_panel[("iterations", "Waiting requests by reason", "A")].startswith(
        "sum by (reason) ("
    )
    assert by_panel[("overview", "Time to first token", "A")].startswith(
        "histogram_quantile(0.5, sum by (le) ("
    )


def test_overview_shows_why_now_and_each_open_findings_action():
    """Issue #28: the live findings by engine and kind beside the engine state, and a table of
    the open ones with the action that fixes each."""
    panels = {panel["title"]: panel for panel in iter_panels(DASHBOARDS["overview"])}
    (why_now,) = panels["Why now"]["targets"]
    assert panels["Why now"]["type"] == "state-timeline"
    assert why_now["expr"].startswith("max by (instance, engine, kind) (iterscope_finding_active{")
    (target,) = panels["Open findings"]["targets"]
    assert target["format"] == "table" and target["instant"]
    (organize,) = panels["Open findings"]["transformations"]
    index = organize["options"]["indexByName"]
    columns = sorted(index, key=index.get)
    assert columns == ["instance", "engine", "kind", "title", "action"]
    assert target["expr"].startswith(f"max by ({', '.join(columns)}) (iterscope_finding_info{{")


def test_pipeline_health_lists_each_engine_with_who_reports_it_and_its_version():
    """Which engines the sidecar hears, and for a vLLM whether the scheduler source or the
    plugin (standing in on a version the scheduler source is not checked against) reports."""
    panels = {panel["title"]: panel for panel in iter_panels(DASHBOARDS["pipeline"])}
    (target,) = panels["Engines"]["targets"]
    assert target["format"] == "table" and target["instant"]
    (organize,) = panels["Engines"]["transformations"]
    index = organize["options"]["indexByName"]
    columns = sorted(index, key=index.get)
    assert columns == ["instance", "engine", "model_name", "source", "version", "device", "pid"]
    assert target["expr"].startswith(f"max by ({', '.join(columns)}) (iterscope_engine_info{{")


def test_user_stories_are_on_the_dashboards():
    """USER_STORIES.md: KV usage per engine, waiting by reason, batch composition, state, leaks."""
    by_dashboard: dict[str, str] = {}
    for query in QUERIES:
        by_dashboard[query.dashboard] = by_dashboard.get(query.dashboard, "") + query.expr
    assert "iterscope_kv_cache_usage_ratio" in by_dashboard["overview"]
    assert "iterscope_engine_state" in by_dashboard["overview"]
    assert "iterscope_preemptions_total" in by_dashboard["overview"]
    iterations = by_dashboard["iterations"]
    for metric in (
        "iterscope_requests_waiting_by_reason",
        "iterscope_iteration_context_tokens",
        "iterscope_iteration_generation_requests",
        "iterscope_kv_blocks_used",
        "iterscope_iterations_total",
        "iterscope_iteration_duration_seconds_bucket",
    ):
        assert metric in iterations, metric
    for metric in ("iterscope_records_dropped_total", "iterscope_heartbeat_age_seconds"):
        assert metric in by_dashboard["pipeline"], metric
    heatmaps = [p for _, p in PANELS if p["type"] == "heatmap"]
    assert heatmaps and heatmaps[0]["targets"][0]["format"] == "heatmap"


@pytest.mark.live
def test_every_query_is_valid_promql(tmp_path):
    """promtool parses each substituted panel query as a recording rule expression."""
    promtool = shutil.which("promtool") or "/usr/bin/promtool"
    rules = [
        {"record": f"panel:query:{i}", "expr": substitute(query.expr)}
        for i, query in enumerate(QUERIES)
    ]
    rule_file = tmp_path / "panels.yml"
    rule_file.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    result = subprocess.run(
        [promtool, "check", "rules", str(rule_file)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_substitute_rejects_unknown_variables():
    assert substitute('x{engine=~"$engine"}[$__rate_interval]') == 'x{engine=~".*"}[1m]'
    assert substitute('x{instance=~"$instance"}') == 'x{instance=~".*"}'
    assert substitute('x{a="${engine}"}', {"engine": "0"}) == 'x{a="0"}'
    with pytest.raises(ValueError, match=r"\$cluster"):
        substitute('x{c="$cluster"}')


SPEC_DECODE_PANEL = "Speculative decoding acceptance"


def test_speculative_decoding_panel_draws_acceptance_rate_and_length_per_engine():
    panels = {panel["title"]: panel for panel in iter_panels(DASHBOARDS["iterations"])}
    panel = panels[SPEC_DECODE_PANEL]
    assert "only engines that use speculative decoding" in panel["description"]
    rate_target, length_target = panel["targets"]
    assert rate_target["legendFormat"].startswith("draft acceptance rate {{instance}}")
    assert length_target["legendFormat"].startswith("mean acceptance length {{instance}}")
    assert panel["fieldConfig"]["defaults"]["unit"] == "percentunit"
    (override,) = panel["fieldConfig"]["overrides"]
    assert override["matcher"] == {"id": "byFrameRefID", "options": "B"}
    assert {"id": "custom.axisPlacement", "value": "right"} in override["properties"]


@pytest.mark.live
def test_speculative_decoding_panel_computes_vllms_rate_and_length(tmp_path):
    """Prometheus' own engine (promtool test rules) on the panel's queries as Grafana sends
    them: per minute 48 drafts, 144 draft tokens, 72 accepted give 50% and 2.5 (1 + 72 / 48),
    vLLM's draft acceptance rate and mean acceptance length."""
    queries = {q.ref_id: q.expr for q in QUERIES if q.panel == SPEC_DECODE_PANEL}
    engine = 'instance="pod-a:9470", engine="0", model_name="m"'
    growth = {"accepted_tokens": 72, "draft_tokens": 144, "drafts": 48}
    series = [
        {"series": f"iterscope_spec_decode_{name}_total{{{engine}}}", "values": f"0+{n}x10"}
        for name, n in growth.items()
    ]
    expected = {"A": 0.5, "B": 2.5}
    tests = {
        "interval": "1m",
        "input_series": series,
        "promql_expr_test": [
            {
                "expr": substitute(queries[ref_id], {"__rate_interval": "5m"}),
                "eval_time": "10m",
                "exp_samples": [{"labels": '{instance="pod-a:9470", engine="0"}', "value": value}],
            }
            for ref_id, value in expected.items()
        ],
    }
    test_file = tmp_path / "spec_decode_panel_test.yml"
    test_file.write_text(yaml.safe_dump({"tests": [tests]}))
    promtool = shutil.which("promtool") or "/usr/bin/promtool"
    result = subprocess.run(
        [promtool, "test", "rules", str(test_file)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
