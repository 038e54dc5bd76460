"""Regenerate the Kubernetes manifests that mirror dashboards/ (run from anywhere):

    python deploy/generate.py           write deploy/k8s/generated/*.yaml
    python deploy/generate.py --check   exit 1 if they are out of date

- ``prometheusrule.yaml``: one PrometheusRule (prometheus-operator) holding every rule group
  of ``dashboards/alerts/*.yml``, unchanged, in file-name order.
- ``grafana-dashboards.yaml``: one ConfigMap per ``dashboards/json/*.json``, its data the
  file's exact text, labelled ``grafana_dashboard: "1"`` for Grafana's dashboard sidecar.

The output depends only on those files, so regenerating an unchanged tree changes nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
ALERTS_DIR = REPO / "dashboards" / "alerts"
DASHBOARDS_DIR = REPO / "dashboards" / "json"
GENERATED_DIR = REPO / "deploy" / "k8s" / "generated"
PROMETHEUS_RULE_FILE = "prometheusrule.yaml"
DASHBOARD_CONFIGMAPS_FILE = "grafana-dashboards.yaml"
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
        documents, Dumper=_BlockStyleDumper, sort_keys=False, width=1 << 16,
        allow_unicode=True, explicit_start=True,
    )
    return HEADER.format(source=source) + body


def prometheus_rule(alerts_dir: Path = ALERTS_DIR) -> dict:
    """A PrometheusRule with the groups of every rules file, refusing duplicate group names."""
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
        configmaps.append({
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": f"iterscope-dashboard-{path.stem.replace('_', '-')}",
                "labels": {"app.kubernetes.io/name": "iterscope", **DASHBOARD_LABEL},
                "annotations": dict(DASHBOARD_FOLDER_ANNOTATION),
            },
            "data": {path.name: text},
        })
    if not configmaps:
        raise ValueError(f"no dashboards in {dashboards_dir}/*.json")
    return configmaps


def render() -> dict[str, str]:
    """File name (under deploy/k8s/generated) -> its full text."""
    return {
        PROMETHEUS_RULE_FILE: dump([prometheus_rule()], "dashboards/alerts/*.yml"),
        DASHBOARD_CONFIGMAPS_FILE: dump(dashboard_configmaps(), "dashboards/json/*.json"),
    }


def stale_files(rendered: dict[str, str], generated_dir: Path = GENERATED_DIR) -> list[str]:
    """Names of generated files missing or different from ``rendered``."""
    return [
        name for name, text in rendered.items()
        if not (generated_dir / name).is_file() or (generated_dir / name).read_text() != text
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale files")
    args = parser.parse_args(argv)
    try:
        rendered = render()
    except (OSError, ValueError, yaml.YAMLError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    stale = stale_files(rendered, GENERATED_DIR)
    if args.check:
        for name in stale:
            print(f"stale: deploy/k8s/generated/{name}; run `python deploy/generate.py`")
        return 1 if stale else 0
    GENERATED_DIR.mkdir(parents=True, exist_ok=True)
    for name in stale:
        (GENERATED_DIR / name).write_text(rendered[name])
        print(f"wrote deploy/k8s/generated/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
