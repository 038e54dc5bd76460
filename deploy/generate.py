"""Regenerate the deployment files that mirror dashboards/ (run from anywhere):

    python deploy/generate.py           write them
    python deploy/generate.py --check   exit 1 if they are out of date

- ``prometheus/rules/iterscope.yml``: every rule group of ``dashboards/alerts/*.yml`` in
  file-name order, with ``deploy/alerting.yml`` applied: each alert's ``runbook_url`` under
  its ``runbook_base_url``, each ``iterscope:alert_threshold:<name>`` recording rule set to its
  threshold. The compose stack's Prometheus loads it.
- ``k8s/generated/prometheusrule.yaml``: the same groups in one PrometheusRule
  (prometheus-operator).
- ``k8s/generated/grafana-dashboards.yaml``: one ConfigMap per ``dashboards/json/*.json``, its
  data the file's exact text, labelled ``grafana_dashboard: "1"`` for Grafana's dashboard
  sidecar.

The output depends only on those files, so regenerating an unchanged tree changes nothing.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
ALERTS_DIR = REPO / "dashboards" / "alerts"
DASHBOARDS_DIR = REPO / "dashboards" / "json"
DEPLOY_DIR = REPO / "deploy"
ALERTING_CONFIG = DEPLOY_DIR / "alerting.yml"
# Paths of the generated files, relative to DEPLOY_DIR.
RULES_FILE = "prometheus/rules/iterscope.yml"
PROMETHEUS_RULE_FILE = "k8s/generated/prometheusrule.yaml"
DASHBOARD_CONFIGMAPS_FILE = "k8s/generated/grafana-dashboards.yaml"
THRESHOLD_RECORD_PREFIX = "iterscope:alert_threshold:"
# The Grafana Helm chart's dashboard sidecar watches ConfigMaps with this label.
DASHBOARD_LABEL = {"grafana_dashboard": "1"}
DASHBOARD_FOLDER_ANNOTATION = {"grafana_folder": "iterscope"}
CONFIGMAP_MAX_BYTES = 1 << 20  # Kubernetes refuses larger ConfigMaps
HEADER = "# Generated from {source} by `python deploy/generate.py`; do not edit.\n"


class _BlockStyleDumper(yaml.SafeDumper):
    """Multi-line strings (PromQL, dashboard JSON) as literal blocks, so diffs stay readable."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_BlockStyleDumper.add_representer(str, _represent_str)


def dump(documents: list[dict], source: str) -> str:
    body = yaml.dump_all(
        documents,
        Dumper=_BlockStyleDumper,
        sort_keys=False,
        width=1 << 16,
        allow_unicode=True,
        explicit_start=True,
    )
    return HEADER.format(source=source) + body


def rule_groups(alerts_dir: Path = ALERTS_DIR) -> list[dict]:
    """The groups of every rules file in file-name order, refusing duplicate group names."""
    groups: list[dict] = []
    seen: dict[str, str] = {}
    for path in sorted(alerts_dir.glob("*.yml")):
        content = yaml.safe_load(path.read_text())
        if not isinstance(content, dict) or not isinstance(content.get("groups"), list):
            raise ValueError(f"{path}: not a Prometheus rules file (no top-level 'groups' list)")
        for group in content["groups"]:
            name = group.get("name")
            if name in seen:
                raise ValueError(f"rule group {name!r} is in both {seen[name]} and {path.name}")
            seen[name] = path.name
            groups.append(group)
    if not groups:
        raise ValueError(f"no rule groups in {alerts_dir}/*.yml")
    return groups


def apply_alerting(groups: list[dict], config: dict) -> list[dict]:
    """``groups`` with the runbook base and thresholds of an alerting config applied.

    Every alert gets ``<runbook_base_url>/<alert>.md``; every threshold recording rule gets
    ``vector(<value>)``. A threshold the rules lack, or a rule the config does not set, is an
    error: either would silently keep a value the operator did not choose.
    """
    base = str(config["runbook_base_url"]).rstrip("/")
    if not base.startswith(("https://", "http://")):
        raise ValueError(f"runbook_base_url {base!r} is not an absolute http(s) URL")
    thresholds = {name: float(value) for name, value in config["thresholds"].items()}
    applied = copy.deepcopy(groups)
    unset = []
    for rule in (rule for group in applied for rule in group["rules"]):
        if "alert" in rule:
            rule["annotations"]["runbook_url"] = f"{base}/{rule['alert']}.md"
        elif rule["record"].startswith(THRESHOLD_RECORD_PREFIX):
            name = rule["record"].removeprefix(THRESHOLD_RECORD_PREFIX)
            if name not in thresholds:
                unset.append(name)
                continue
            rule["expr"] = f"vector({thresholds.pop(name):g})"
    if unset or thresholds:
        raise ValueError(f"thresholds not set: {unset}; not in the rules: {sorted(thresholds)}")
    return applied


def load_alerting(path: Path = ALERTING_CONFIG) -> dict:
    config = yaml.safe_load(path.read_text())
    if not isinstance(config, dict) or not {"runbook_base_url", "thresholds"} <= set(config):
        raise ValueError(f"{path}: needs runbook_base_url and thresholds")
    return config


def prometheus_rule(groups: list[dict]) -> dict:
    """A PrometheusRule holding ``groups``."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "iterscope-alerts", "labels": {"app.kubernetes.io/name": "iterscope"}},
        "spec": {"groups": groups},
    }


def dashboard_configmaps(dashboards_dir: Path = DASHBOARDS_DIR) -> list[dict]:
    """One ConfigMap per dashboard JSON file, named iterscope-dashboard-<file stem>."""
    configmaps = []
    for path in sorted(dashboards_dir.glob("*.json")):
        text = path.read_text()
        if len(text.encode()) >= CONFIGMAP_MAX_BYTES:
            raise ValueError(f"{path} is {len(text.encode())} bytes: too large for a ConfigMap")
        configmaps.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": f"iterscope-dashboard-{path.stem.replace('_', '-')}",
                    "labels": {"app.kubernetes.io/name": "iterscope", **DASHBOARD_LABEL},
                    "annotations": dict(DASHBOARD_FOLDER_ANNOTATION),
                },
                "data": {path.name: text},
            }
        )
    if not configmaps:
        raise ValueError(f"no dashboards in {dashboards_dir}/*.json")
    return configmaps


def render() -> dict[str, str]:
    """Path (relative to deploy/) of each generated file -> its full text."""
    groups = apply_alerting(rule_groups(), load_alerting())
    rules_source = "dashboards/alerts/*.yml and deploy/alerting.yml"
    return {
        RULES_FILE: dump([{"groups": groups}], rules_source),
        PROMETHEUS_RULE_FILE: dump([prometheus_rule(groups)], rules_source),
        DASHBOARD_CONFIGMAPS_FILE: dump(dashboard_configmaps(), "dashboards/json/*.json"),
    }


def stale_files(rendered: dict[str, str], deploy_dir: Path = DEPLOY_DIR) -> list[str]:
    """Paths of generated files missing or different from ``rendered``."""
    return [
        name
        for name, text in rendered.items()
        if not (deploy_dir / name).is_file() or (deploy_dir / name).read_text() != text
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    try:
        rendered = render()
    except (OSError, KeyError, ValueError, yaml.YAMLError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    stale = stale_files(rendered, DEPLOY_DIR)
    if args.check:
        for name in stale:
            print(f"stale: deploy/{name}; run `python deploy/generate.py`")
        return 1 if stale else 0
    for name in stale:
        (DEPLOY_DIR / name).parent.mkdir(parents=True, exist_ok=True)
        (DEPLOY_DIR / name).write_text(rendered[name])
        print(f"wrote deploy/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
