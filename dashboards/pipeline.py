"""Pipeline health: is the telemetry itself complete and fresh? Records, drops, heartbeats, lag."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard, table

from dashboards.common import (
    RATE,
    SIDECAR_SELECTOR,
    engine_legend,
    label_table,
    new_dashboard,
    query,
    rate,
    series,
    timeseries_panel,
)

UID = "iterscope-pipeline"
# The columns of the engines table: an engine, who reports it and which engine it is.
ENGINE_COLUMNS = ("instance", "engine", "model_name", "source", "version", "device", "pid")


def engines() -> table.Panel:
    return label_table(
        "Engines",
        "Each engine whose heartbeats named its process, with who fills its records (source) "
        "and which engine and version it is.",
        "iterscope_engine_info",
        ENGINE_COLUMNS,
    )


def records_received() -> dashboard.Panel:
    return timeseries_panel(
        "Records received per second",
        "Iteration records and heartbeats the sidecar received per second, per engine.",
        [query(rate("iterscope_records_received_total"), engine_legend(), "A")],
        unit="ops",
    )


def records_dropped() -> dashboard.Panel:
    dropped = rate("iterscope_records_dropped_total")
    received = rate("iterscope_records_received_total")
    return timeseries_panel(
        "Records dropped",
        "Records lost on the telemetry lane per second (sequence gaps), and that loss as a "
        "share of all records, per engine.",
        [
            query(dropped, engine_legend("dropped/s"), "A"),
            query(f"{dropped} / ({received} + {dropped})", engine_legend("dropped share"), "B"),
        ],
    )


def frames_undecodable() -> dashboard.Panel:
    # Filtered by instance only: frames from an unknown sender carry empty engine and
    # model_name labels. The total over the selected sidecars, by reason.
    expr = (
        f"sum by (reason) (rate(iterscope_frames_undecodable_total{{{SIDECAR_SELECTOR}}}[{RATE}]))"
    )
    return timeseries_panel(
        "Undecodable frames per second",
        "Frames the sidecar could not decode, by reason (malformed, truncated, oversized or "
        "another schema version), from any sender.",
        [query(expr, "{{reason}}", "A")],
        unit="ops",
    )


def frames_rejected() -> dashboard.Panel:
    # Sidecar-level: the engine a rejected frame claims is what cannot be trusted.
    expr = f"sum by (reason) (rate(iterscope_frames_rejected_total{{{SIDECAR_SELECTOR}}}[{RATE}]))"
    disconnects = f"sum(rate(iterscope_lane_disconnects_total{{{SIDECAR_SELECTOR}}}[{RATE}]))"
    handshakes = f"sum(rate(iterscope_lane_handshake_failures_total{{{SIDECAR_SELECTOR}}}[{RATE}]))"
    return timeseries_panel(
        "Rejected frames and lane disconnects per second",
        "Decoded frames that failed the sidecar's checks, by reason (a record before its "
        "engine's heartbeat, an engine beyond --max-engines, an implausible seq), lane "
        "connections that ended (engines exiting, senders cut off for over-size frames), and "
        "senders whose handshake failed (on a CURVE lane: no keys, or keys not trusted; their "
        "engines never show up).",
        [
            query(expr, "{{reason}}", "A"),
            query(disconnects, "disconnects/s", "B"),
            query(handshakes, "failed handshakes/s", "C"),
        ],
        unit="ops",
    )


def sink_failures() -> dashboard.Panel:
    # Sidecar-level, by sink: a recording on a full disk shows here.
    errors = f"sum by (sink) (rate(iterscope_sink_errors_total{{{SIDECAR_SELECTOR}}}[{RATE}]))"
    lost = f"sum by (sink) (rate(iterscope_sink_lines_lost_total{{{SIDECAR_SELECTOR}}}[{RATE}]))"
    return timeseries_panel(
        "Sink failures per second",
        "Calls on each sink of the sidecar that failed (a full disk under the recording), and "
        "lines a sink gave up writing.",
        [query(errors, "{{sink}} errors/s", "A"), query(lost, "{{sink}} lines lost/s", "B")],
        unit="ops",
    )


def otel_spans_dropped() -> dashboard.Panel:
    # A sidecar-level counter (empty engine and model_name labels): filtered by instance only.
    expr = f"sum(rate(iterscope_otel_spans_dropped_total{{{SIDECAR_SELECTOR}}}[{RATE}]))"
    return timeseries_panel(
        "OTel spans dropped per second",
        "Trace spans the sidecar dropped because the OTLP export queue was full.",
        [query(expr, "spans dropped/s", "A")],
        unit="ops",
    )


def heartbeat_age() -> dashboard.Panel:
    return timeseries_panel(
        "Heartbeat age",
        "Seconds since the last heartbeat of each engine; above a few seconds the engine is "
        "dead or paused.",
        [query(series("iterscope_heartbeat_age_seconds"), engine_legend(), "A")],
        unit="s",
    )


def sidecar_lag() -> dashboard.Panel:
    return timeseries_panel(
        "Sidecar lag",
        "Wall-clock seconds between now and the last record the sidecar ingested, per engine.",
        [query(series("iterscope_sidecar_lag_seconds"), engine_legend(), "A")],
        unit="s",
    )


def findings_window() -> dashboard.Panel:
    return timeseries_panel(
        "Live findings' window",
        "Seconds of each engine's messages the live findings searched last: 60 s (more while "
        "a finding is open); below, the engine's messages come faster than the sidecar's "
        "--findings-window holds 60 s of, and what is judged on the 40 s before an iteration "
        "may not be found live (IterscopeFindingsWindowShort).",
        [query(series("iterscope_findings_window_seconds"), engine_legend(), "A")],
        unit="s",
    )


def build() -> dashboard.Dashboard:
    board = new_dashboard(
        UID,
        "iterscope / Pipeline health",
        "Completeness and freshness of iterscope telemetry: the engines heard and who reports "
        "them, records, drops, undecodable and rejected frames, sink failures, dropped spans, "
        "heartbeats, sidecar lag and how much the live findings see.",
    )
    panels = [
        engines(),
        records_received(),
        records_dropped(),
        frames_undecodable(),
        frames_rejected(),
        sink_failures(),
        otel_spans_dropped(),
        heartbeat_age(),
        sidecar_lag(),
        findings_window(),
    ]
    for panel in panels:
        board = board.with_panel(panel)
    return board
