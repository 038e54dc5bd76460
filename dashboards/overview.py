"""Overview: is the service healthy? Throughput, queues, KV usage, latency, engine state, and
why now: the live findings open on each engine (what `iterscope explain` would say)."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard, statetimeline, table
from grafana_foundation_sdk.models.dashboard import (
    ValueMap,
    ValueMappingResult,
)

from dashboards.common import (
    DATASOURCE,
    KV_THRESHOLDS,
    PER_ENGINE,
    engine_legend,
    label_table,
    new_dashboard,
    quantile_queries,
    query,
    rate,
    series,
    timeseries_panel,
    with_threshold_lines,
)

UID = "iterscope-overview"
# Numeric code of each engine state on the state timeline.
STATE_CODES = {
    "idle": (0, "blue"),
    "running": (1, "green"),
    "stalled": (2, "orange"),
    "dead": (3, "red"),
    "closed": (4, "grey"),  # its lane closed with nothing in flight: a shutdown
}
# The columns of the open findings table, in order: an engine, then what is wrong and the fix.
FINDING_COLUMNS = ("instance", "engine", "kind", "title", "action")


def engine_state_expr() -> str:
    """One series per engine (instance, engine): the code of its current state (STATE_CODES).

    iterscope_engine_state is 1 for the current state and 0 for the others, so the current
    state's code is the maximum of state * code over the states.
    """
    terms = []
    for state, (code, _) in STATE_CODES.items():
        state_label = f'state="{state}"'
        terms.append(f"{series('iterscope_engine_state', state_label)} * {code}")
    return f"max by ({PER_ENGINE}) (" + " or ".join(terms) + ")"


def engine_state() -> statetimeline.Panel:
    mapping = ValueMap(
        options={
            str(code): ValueMappingResult(text=state, color=color, index=code)
            for state, (code, color) in STATE_CODES.items()
        }
    )
    return (
        statetimeline.Panel()
        .title("Engine state")
        .description(
            "Per engine: idle (nothing to do), running (iterating), stalled (work waits but no "
            "iteration finishes) or dead (no heartbeat)."
        )
        .datasource(DATASOURCE)
        .with_target(query(engine_state_expr(), engine_legend(), "A"))
        .mappings([mapping])
        .height(8)
        .span(12)
    )


def why_now() -> statetimeline.Panel:
    """A row per engine and finding kind, drawn while a finding of that kind is open; kinds
    never open in the time range have no row."""
    expr = f"max by ({PER_ENGINE}, kind) ({series('iterscope_finding_active')} == 1)"
    open_state = ValueMap(options={"1": ValueMappingResult(text="open", color="orange")})
    return (
        statetimeline.Panel()
        .title("Why now")
        .description(
            "Per engine and kind, when a live finding (what iterscope explain would say of the "
            "last minutes) was open: the cause of what the other panels show."
        )
        .datasource(DATASOURCE)
        .with_target(query(expr, engine_legend("{{kind}}"), "A"))
        .mappings([open_state])
        .height(8)
        .span(12)
    )


def open_findings() -> table.Panel:
    """One row per open finding: its engine, kind, title and the action that fixes it (an
    action is a few lines long: the cells wrap)."""
    return label_table(
        "Open findings",
        "Each live finding open now, with its title and the one action that fixes it "
        "(the IterscopeFinding alert quotes the same text).",
        "iterscope_finding_info",
        FINDING_COLUMNS,
    )


def kv_usage() -> dashboard.Panel:
    panel = timeseries_panel(
        "KV cache usage per engine",
        "Fraction of KV cache blocks in use per engine; orange and red lines are the near-full "
        "and saturated alert thresholds.",
        [query(series("iterscope_kv_cache_usage_ratio"), engine_legend(), "A")],
        unit="percentunit",
    ).max(1)
    return with_threshold_lines(panel, KV_THRESHOLDS)


def token_throughput() -> dashboard.Panel:
    return timeseries_panel(
        "Token throughput",
        "Prefill tokens computed, prompt tokens served from the prefix cache and output "
        "tokens decoded, per second per engine.",
        [
            query(rate("iterscope_prompt_tokens_total"), engine_legend("prefill"), "A"),
            query(
                rate("iterscope_prompt_tokens_cached_total"),
                engine_legend("prefix cache hits"),
                "B",
            ),
            query(rate("iterscope_generation_tokens_total"), engine_legend("decode"), "C"),
        ],
        unit="tokens/s",
    )


def requests_running_waiting() -> dashboard.Panel:
    return timeseries_panel(
        "Requests running and waiting",
        "Requests in the running batch and requests waiting for admission, per engine.",
        [
            query(series("iterscope_requests_running"), engine_legend("running"), "A"),
            query(series("iterscope_requests_waiting"), engine_legend("waiting"), "B"),
        ],
    )


def preemptions() -> dashboard.Panel:
    return timeseries_panel(
        "Preemptions per second",
        "Running requests evicted to free KV blocks (their KV is recomputed later), per second "
        "per engine.",
        [query(rate("iterscope_preemptions_total"), engine_legend(), "A")],
        unit="ops",
    )


def time_to_first_token() -> dashboard.Panel:
    return timeseries_panel(
        "Time to first token",
        "p50, p95 and p99 of the time from arrival to the first generated token.",
        quantile_queries("iterscope_time_to_first_token_seconds"),
        unit="s",
    )


def inter_token_latency() -> dashboard.Panel:
    return timeseries_panel(
        "Inter-token latency",
        "p50, p95 and p99 of the interval between consecutive generated tokens of a request.",
        quantile_queries("iterscope_inter_token_latency_seconds"),
        unit="s",
    )


def end_to_end_latency() -> dashboard.Panel:
    return timeseries_panel(
        "End-to-end request latency",
        "p50, p95 and p99 of the time from arrival to the last token of finished requests.",
        quantile_queries("iterscope_e2e_request_latency_seconds"),
        unit="s",
    )


# Where a request's time goes (TTFT = queue + prefill, end-to-end = TTFT + decode) and how fast
# its tokens come: (title, description, histogram) of one p50/p95/p99 panel each.
REQUEST_PHASES = [
    (
        "Queue time",
        "p50, p95 and p99 of the time from arrival to first scheduling (admission) of "
        "finished requests.",
        "iterscope_request_queue_time_seconds",
    ),
    (
        "Prefill time",
        "p50, p95 and p99 of the time from first scheduling to the first token of "
        "finished requests (prompt chunks included).",
        "iterscope_request_prefill_time_seconds",
    ),
    (
        "Decode time",
        "p50, p95 and p99 of the time from the first token to the last of finished requests.",
        "iterscope_request_decode_time_seconds",
    ),
    (
        "Time per output token",
        "p50, p95 and p99 of each finished request's decode time divided "
        "by its generated tokens after the first (TPOT).",
        "iterscope_time_per_output_token_seconds",
    ),
]


def request_phase_panels() -> list[dashboard.Panel]:
    return [
        timeseries_panel(title, description, quantile_queries(histogram), unit="s")
        for title, description, histogram in REQUEST_PHASES
    ]


def finish_reasons() -> dashboard.Panel:
    return timeseries_panel(
        "Finished requests by reason",
        "Requests finished per second by stop token (stop), length limit (length) or abort.",
        [
            query(
                rate("iterscope_requests_finished_total", by="finish_reason"),
                "{{finish_reason}}",
                "A",
            )
        ],
        unit="reqps",
        stacked=True,
    )


def build() -> dashboard.Dashboard:
    board = new_dashboard(
        UID,
        "iterscope / Overview",
        "Throughput, queues, KV cache usage, latency and engine state of iterscope engines.",
    )
    panels = [
        engine_state(),
        why_now(),
        open_findings(),
        kv_usage(),
        token_throughput(),
        requests_running_waiting(),
        preemptions(),
        finish_reasons(),
        time_to_first_token(),
        inter_token_latency(),
        end_to_end_latency(),
        *request_phase_panels(),
    ]
    for panel in panels:
        board = board.with_panel(panel)
    return board
