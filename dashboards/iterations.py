"""Iterations: what each engine iteration did. Duration, batch composition, KV, waiting reasons.

This is where an operator sees whether requests are batched together (decoding requests per
iteration), why requests wait (KV capacity, sequence limit, token budget) and whether KV blocks
stay held while nothing runs.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard
from grafana_foundation_sdk.models.dashboard import DynamicConfigValue

from dashboards.common import (
    KV_BLOCKED_SHARE,
    PER_ENGINE,
    RATE,
    engine_legend,
    heatmap_panel,
    histogram_mean,
    new_dashboard,
    quantile_queries,
    query,
    rate,
    series,
    timeseries_panel,
    with_threshold_lines,
)

UID = "iterscope-iterations"


def iteration_duration_heatmap() -> dashboard.Panel:
    return heatmap_panel(
        "Iteration duration heatmap",
        "How many iterations fell in each duration bucket per interval, over the selected engines.",
        "iterscope_iteration_duration_seconds",
        unit="s",
    )


def iteration_duration_quantiles() -> dashboard.Panel:
    return timeseries_panel(
        "Iteration duration quantiles",
        "p50, p95 and p99 of the time one iteration (schedule, forward pass, update) takes.",
        quantile_queries("iterscope_iteration_duration_seconds"),
        unit="s",
    )


def tokens_per_iteration() -> dashboard.Panel:
    return timeseries_panel(
        "Tokens per iteration",
        "p50, p95 and p99 of prefill plus decode tokens computed in one iteration, to "
        "compare with max_num_batched_tokens.",
        quantile_queries("iterscope_iteration_tokens"),
    )


def batch_composition() -> dashboard.Panel:
    return timeseries_panel(
        "Batch composition: prefill vs decode tokens",
        "Mean prefill tokens and decode tokens per iteration, stacked, per engine (decode "
        "tokens: one per decoding request, more with speculative decoding's accepted tokens).",
        [
            query(
                histogram_mean("iterscope_iteration_context_tokens"),
                engine_legend("prefill"),
                "A",
            ),
            query(mean_decode_tokens(), engine_legend("decode"), "B"),
        ],
        stacked=True,
    )


def mean_decode_tokens() -> str:
    """Decode tokens per iteration: all of an iteration's tokens less its prefill tokens, both
    histograms observed once per iteration (so one count divides both sums)."""
    tokens, prefill = "iterscope_iteration_tokens", "iterscope_iteration_context_tokens"
    return (
        f"(sum by ({PER_ENGINE}) (rate({series(tokens + '_sum')}[{RATE}]))"
        f" - sum by ({PER_ENGINE}) (rate({series(prefill + '_sum')}[{RATE}])))"
        f" / sum by ({PER_ENGINE}) (rate({series(tokens + '_count')}[{RATE}]))"
    )


def batch_size() -> dashboard.Panel:
    return timeseries_panel(
        "Batch size: decoding requests per iteration",
        "Mean requests decoded together per iteration next to the running requests, "
        "per engine: equal values mean requests are batched, not queued one by one.",
        [
            query(
                histogram_mean("iterscope_iteration_generation_requests"),
                engine_legend("decode reqs / iteration"),
                "A",
            ),
            query(series("iterscope_requests_running"), engine_legend("running"), "B"),
        ],
    )


def iterations_per_second() -> dashboard.Panel:
    return timeseries_panel(
        "Iterations per second",
        "Iterations finished per second per engine; zero while work waits means a stall.",
        [query(rate("iterscope_iterations_total"), engine_legend(), "A")],
        unit="ops",
    )


def kv_blocks() -> dashboard.Panel:
    return timeseries_panel(
        "KV blocks used and free",
        "KV cache blocks in use and free per engine, with the total; blocks used while nothing "
        "runs are a leak.",
        [
            query(series("iterscope_kv_blocks_used"), engine_legend("used"), "A"),
            query(series("iterscope_kv_blocks_free"), engine_legend("free"), "B"),
            query(series("iterscope_kv_blocks_capacity"), engine_legend("total"), "C"),
        ],
    )


def kv_tokens() -> dashboard.Panel:
    return timeseries_panel(
        "Tokens in KV cache",
        "Tokens whose keys and values are held in the KV cache, per engine.",
        [query(series("iterscope_kv_tokens"), engine_legend(), "A")],
    )


def prefix_hit_rate() -> dashboard.Panel:
    hits = rate("iterscope_prefix_cache_hits_total")
    queries = rate("iterscope_prefix_cache_queries_total")
    return timeseries_panel(
        "Prefix cache hit rate",
        "Share of prompt tokens looked up in the prefix cache that were found there, per engine.",
        [query(f"{hits} / {queries}", engine_legend(), "A")],
        unit="percentunit",
    ).max(1)


def waiting_by_reason() -> dashboard.Panel:
    return timeseries_panel(
        "Waiting requests by reason",
        "Requests waiting for admission, split by what stopped admission: KV capacity "
        "(kv_capacity), the sequence limit (seq_limit: max_num_seqs), the token budget "
        "(token_budget: max_num_batched_tokens), the engine holding them back, not for a "
        "limit (other: vLLM's prefill cadence, --prefill-schedule-interval, a grammar still "
        "compiling, a remote KV transfer), or a source that does not say why (unknown: vLLM's "
        "stat-logger plugin, FPM producers).",
        [
            query(
                f"sum by (reason) ({series('iterscope_requests_waiting_by_reason')})",
                "{{reason}}",
                "A",
            )
        ],
        stacked=True,
    )


def kv_blocked_share() -> dashboard.Panel:
    blocked = rate("iterscope_kv_blocked_iterations_total")
    iterations = rate("iterscope_iterations_total")
    panel = timeseries_panel(
        "Iterations leaving requests waiting for KV",
        "Share of iterations after which requests waited for a free KV block (preempted or "
        "not admitted), counted at every iteration rather than sampled, per engine; above the "
        "red line with KV usage at 95% for 2 minutes, IterscopeKVCacheSaturated fires.",
        [query(f"{blocked} / {iterations}", engine_legend(), "A")],
        unit="percentunit",
    ).max(1)
    return with_threshold_lines(panel, [(None, "green"), (KV_BLOCKED_SHARE, "red")])


def spec_decode_acceptance() -> dashboard.Panel:
    """vLLM's two figures of speculative decoding (its SpecDecodingProm docstring's queries):
    the share of draft tokens accepted, and the mean acceptance length, on a right axis of
    its own. Engines without speculative decoding have no such series, so no line."""
    accepted = rate("iterscope_spec_decode_accepted_tokens_total")
    drafted = rate("iterscope_spec_decode_draft_tokens_total")
    drafts = rate("iterscope_spec_decode_drafts_total")
    right_axis = [
        DynamicConfigValue(id_val="unit", value="short"),
        DynamicConfigValue(id_val="custom.axisPlacement", value="right"),
    ]
    return timeseries_panel(
        "Speculative decoding acceptance",
        "Share of the draft tokens scored that were accepted (left axis) and the mean "
        "acceptance length, 1 + accepted tokens per draft, the bonus token counted (right "
        "axis), per engine; only engines that use speculative decoding (vLLM sources with "
        "--speculative-config) have lines.",
        [
            query(f"{accepted} / {drafted}", engine_legend("draft acceptance rate"), "A"),
            query(f"1 + {accepted} / {drafts}", engine_legend("mean acceptance length"), "B"),
        ],
        unit="percentunit",
    ).override_by_query("B", right_axis)


def build() -> dashboard.Dashboard:
    board = new_dashboard(
        UID,
        "iterscope / Iterations",
        "Per-iteration view of iterscope engines: duration, batch composition, KV cache and "
        "why requests wait.",
    )
    panels = [
        iteration_duration_heatmap(),
        iteration_duration_quantiles(),
        iterations_per_second(),
        tokens_per_iteration(),
        batch_composition(),
        batch_size(),
        kv_blocks(),
        kv_tokens(),
        waiting_by_reason(),
        kv_blocked_share(),
        prefix_hit_rate(),
        spec_decode_acceptance(),
    ]
    for panel in panels:
        board = board.with_panel(panel)
    return board
