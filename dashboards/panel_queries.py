"""Read the panel queries back out of generated dashboard JSON, with variables substituted.

Grafana fills in ``$model_name``, ``$instance``, ``$engine`` and ``$__rate_interval`` before
it queries Prometheus; ``substitute`` does the same so tests can run every panel query against
promtool or a real Prometheus.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from dashboards.build import JSON_DIR

ALL_VALUES = {"model_name": ".*", "instance": ".*", "engine": ".*", "__rate_interval": "1m"}
_VARIABLE = re.compile(r"\$\{?(\w+)\}?")


@dataclass(frozen=True)
class PanelQuery:
    dashboard: str  # JSON file stem, e.g. "overview"
    panel: str  # panel title
    ref_id: str
    expr: str  # as written in the dashboard, with $variables


def load_dashboards(json_dir: Path = JSON_DIR) -> dict[str, dict]:
    """File stem -> parsed dashboard JSON, for every dashboards/json/*.json."""
    return {path.stem: json.loads(path.read_text()) for path in sorted(json_dir.glob("*.json"))}


def iter_panels(dashboard: dict) -> list[dict]:
    """Every panel, including those nested in rows, rows themselves excluded."""
    panels = []
    for panel in dashboard.get("panels", []):
        if panel.get("type") == "row":
            panels.extend(panel.get("panels", []))
        else:
            panels.append(panel)
    return panels


def panel_queries(json_dir: Path = JSON_DIR) -> list[PanelQuery]:
    """Every query target of every panel of every dashboard."""
    return [
        PanelQuery(name, panel["title"], target["refId"], target["expr"])
        for name, dashboard in load_dashboards(json_dir).items()
        for panel in iter_panels(dashboard)
        for target in panel.get("targets", [])
    ]


def substitute(expr: str, values: dict[str, str] | None = None) -> str:
    """Replace $name / ${name} with values (default: All for labels, 1m for rate windows).

    Raises ValueError on a variable with no value, so a new variable cannot slip through.
    """
    values = {**ALL_VALUES, **(values or {})}

    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name not in values:
            raise ValueError(f"no value for dashboard variable ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(replace, expr)
