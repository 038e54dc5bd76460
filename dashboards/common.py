"""Factory helpers shared by every iterscope dashboard: variables, queries, default panels.

Every panel query selects its series with ``SELECTOR`` so the dashboard variables
(datasource, model_name, instance, engine) filter every panel the same way. Queries use
Grafana's ``$__rate_interval`` for rate windows; the live test substitutes it with a fixed
window.

An engine is identified by ``(instance, engine)``, never by ``engine`` alone: in Kubernetes
every replica pod runs its own engine 0 behind its own sidecar, so ``engine="0"`` names one
engine per pod. Per-engine views group ``by (instance, engine)`` (``PER_ENGINE``) and label
their lines ``ENGINE_LEGEND``; fleet-wide totals (quantiles, reasons) group by neither.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard, heatmap, prometheus, table, timeseries
from grafana_foundation_sdk.builders.common import (
    GraphThresholdsStyleConfig,
    StackingConfig,
    VizLegendOptions,
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    GraphThresholdsStyleMode,
    LegendDisplayMode,
    LegendPlacement,
    StackingMode,
    TableAutoCellOptions,
)
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    DataTransformerConfig,
    Threshold,
    ThresholdsMode,
    VariableRefresh,
    VariableSort,
)
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
SELECTOR = 'model_name=~"$model_name", instance=~"$instance", engine=~"$engine"'
# Series of the sidecar itself (empty engine and model_name) are filtered by instance only.
SIDECAR_SELECTOR = 'instance=~"$instance"'
# The labels that identify one engine across replicas, and the legend naming it.
PER_ENGINE = "instance, engine"
ENGINE_LEGEND = "{{instance}} engine {{engine}}"
RATE = "$__rate_interval"
QUANTILES = (0.5, 0.95, 0.99)
# The series every engine exports from its first heartbeat on; the variables list its labels.
VARIABLE_SOURCE_METRIC = "iterscope_engine_state"
# Thresholds of the KV usage panels, the same numbers as the KV alerts.
KV_NEAR_FULL_RATIO = 0.90
KV_SATURATED_RATIO = 0.95
KV_BLOCKED_SHARE = 0.5  # IterscopeKVCacheSaturated: share of iterations leaving requests waiting


def series(metric: str, extra_labels: str = "") -> str:
    """``metric{<dashboard selector>[, extra_labels]}``."""
    labels = f"{SELECTOR}, {extra_labels}" if extra_labels else SELECTOR
    return f"{metric}{{{labels}}}"


def engine_legend(prefix: str = "") -> str:
    """``ENGINE_LEGEND`` after an optional word saying which line of the panel it is."""
    return f"{prefix} {ENGINE_LEGEND}" if prefix else ENGINE_LEGEND


def rate(metric: str, by: str = PER_ENGINE, extra_labels: str = "") -> str:
    """Per-second rate of a counter, summed by the given labels."""
    return f"sum by ({by}) (rate({series(metric, extra_labels)}[{RATE}]))"


def quantile(q: float, histogram: str, by: str = "") -> str:
    """The q-quantile of a histogram over the selected engines (``by`` adds grouping labels)."""
    group = f"le, {by}" if by else "le"
    return (
        f"histogram_quantile({q}, sum by ({group}) (rate({series(histogram + '_bucket')}[{RATE}])))"
    )


def histogram_mean(histogram: str, by: str = PER_ENGINE) -> str:
    """Mean observation of a histogram: rate of its sum over rate of its count."""
    return (
        f"sum by ({by}) (rate({series(histogram + '_sum')}[{RATE}]))"
        f" / sum by ({by}) (rate({series(histogram + '_count')}[{RATE}]))"
    )


def query(expr: str, legend: str, ref_id: str) -> prometheus.Dataquery:
    """A range query; ``ref_id`` is always set so panels keep stable query ids."""
    return prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(ref_id).range()


def label_table(title: str, description: str, metric: str, columns: tuple[str, ...]) -> table.Panel:
    """One row per series of an info-style ``metric`` (value 1, facts in labels) now: its
    ``columns`` labels in that order, no time or value column; long texts wrap."""
    expr = f"max by ({', '.join(columns)}) ({series(metric)})"
    target = query(expr, engine_legend(), "A").instant().format(PromQueryFormat.TABLE)
    organize = DataTransformerConfig(
        id_val="organize",
        options={
            "excludeByName": {"Time": True, "Value": True},
            "indexByName": {name: index for index, name in enumerate(columns)},
        },
    )
    return (
        table.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .with_target(target)
        .transformations([organize])
        .cell_options(TableAutoCellOptions(wrap_text=True))
        .height(8)
        .span(24)
    )


def quantile_queries(histogram: str) -> list[prometheus.Dataquery]:
    """p50, p95 and p99 of a histogram, one query each (ref ids A, B, C)."""
    return [
        query(quantile(q, histogram), f"p{round(q * 100)}", ref_id)
        for q, ref_id in zip(QUANTILES, "ABC", strict=True)
    ]


def legend() -> VizLegendOptions:
    return (
        VizLegendOptions()
        .display_mode(LegendDisplayMode.LIST)
        .placement(LegendPlacement.BOTTOM)
        .show_legend(True)
    )


def timeseries_panel(
    title: str,
    description: str,
    queries: list[prometheus.Dataquery],
    unit: str = "short",
    stacked: bool = False,
) -> timeseries.Panel:
    """The default time series panel: one line per query series, legend at the bottom."""
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .targets(queries)
        .unit(unit)
        .min(0)
        .line_width(1)
        .fill_opacity(10)
        .legend(legend())
        .height(8)
        .span(12)
    )
    if stacked:
        panel = panel.stacking(StackingConfig().mode(StackingMode.NORMAL)).fill_opacity(40)
    return panel


def thresholds(steps: list[tuple[float | None, str]]) -> dashboard.ThresholdsConfig:
    """Absolute thresholds; the first step's value is None (minus infinity)."""
    return (
        dashboard.ThresholdsConfig()
        .mode(ThresholdsMode.ABSOLUTE)
        .steps([Threshold(value=value, color=color) for value, color in steps])
    )


KV_THRESHOLDS = [(None, "green"), (KV_NEAR_FULL_RATIO, "orange"), (KV_SATURATED_RATIO, "red")]


def with_threshold_lines(
    panel: timeseries.Panel, steps: list[tuple[float | None, str]]
) -> timeseries.Panel:
    """Draw the thresholds on the graph as dashed lines."""
    return panel.thresholds(thresholds(steps)).thresholds_style(
        GraphThresholdsStyleConfig().mode(GraphThresholdsStyleMode.DASHED)
    )


def heatmap_panel(title: str, description: str, histogram: str, unit: str) -> heatmap.Panel:
    """A heatmap of a Prometheus histogram's buckets (increase per interval, by ``le``)."""
    expr = f"sum by (le) (increase({series(histogram + '_bucket')}[{RATE}]))"
    target = query(expr, "{{le}}", "A").format(PromQueryFormat.HEATMAP)
    return (
        heatmap.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .with_target(target)
        .calculate(False)
        .y_axis(heatmap.YAxisConfig().unit(unit))
        .color(heatmap.HeatmapColorOptions().scheme("Oranges"))
        .height(8)
        .span(12)
    )


def variables() -> list:
    """datasource, model_name, instance and engine; the last three multi-valued, All = .*.

    ``instance`` is the scrape target (in Kubernetes, the pod): each variable offers only the
    values the variables before it select.
    """
    datasource = dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus")
    model_name = label_variable(
        "model_name", "Model", f"label_values({VARIABLE_SOURCE_METRIC}, model_name)"
    )
    instance = label_variable(
        "instance",
        "Instance",
        f'label_values({VARIABLE_SOURCE_METRIC}{{model_name=~"$model_name"}}, instance)',
    )
    engine = label_variable(
        "engine",
        "Engine",
        f'label_values({VARIABLE_SOURCE_METRIC}{{model_name=~"$model_name", '
        'instance=~"$instance"}, engine)',
    )
    return [datasource, model_name, instance, engine]


def label_variable(name: str, label: str, values_query: str) -> dashboard.QueryVariable:
    return (
        dashboard.QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query({"query": values_query, "refId": f"{name}-values"})
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )


def new_dashboard(uid: str, title: str, description: str) -> dashboard.Dashboard:
    """A dashboard with the shared variables, time range and tags."""
    return (
        dashboard.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["iterscope"])
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .time("now-1h", "now")
        .refresh("10s")
        .variables(variables())
    )


def to_json(builder: dashboard.Dashboard) -> str:
    """Deterministic JSON: panels numbered in order, keys sorted, two-space indent."""
    model = builder.build()
    for panel_id, panel in enumerate(all_panels(model), start=1):
        panel.id_val = panel_id
    return JSONEncoder(sort_keys=True, indent=2).encode(model) + "\n"


def all_panels(model) -> list:
    """Top-level panels and the panels inside rows, in order."""
    panels = []
    for panel in model.panels or []:
        panels.append(panel)
        panels.extend(getattr(panel, "panels", None) or [])
    return panels
