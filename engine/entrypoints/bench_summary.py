"""The figures of an `iterscope bench` run, its summary table and its JSON result file.

TPOT = (e2e - TTFT) / (output tokens - 1) per request; times in ms, throughputs per second.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np

from engine.entrypoints.bench_backends import RequestResult

PERCENTILE_NAMES = (("mean", None), ("median", 50.0), ("p99", 99.0))


def _stats_ms(name: str, values: list[float]) -> dict[str, float]:
    array = np.asarray(values, dtype=float) * 1000.0 if values else np.zeros(1)
    return {
        f"{stat}_{name}_ms": float(array.mean() if q is None else np.percentile(array, q))
        for stat, q in PERCENTILE_NAMES
    }


def summarize(results: list[RequestResult], duration_time: float) -> dict[str, Any]:
    """The figures of the summary table (times in ms, throughputs per second)."""
    done = [r for r in results if r.success]
    num_input_tokens = sum(r.num_prompt_tokens for r in done)
    num_output_tokens = sum(r.num_output_tokens for r in done)
    tpots = [
        (r.e2e_time - r.ttft_time) / (r.num_output_tokens - 1)
        for r in done
        if r.num_output_tokens > 1
    ]
    metrics: dict[str, Any] = {
        "duration_s": duration_time,
        "num_completed": len(done),
        "num_failed": len(results) - len(done),
        "total_input_tokens": num_input_tokens,
        "total_output_tokens": num_output_tokens,
        "request_throughput": len(done) / duration_time,
        "input_throughput": num_input_tokens / duration_time,
        "output_throughput": num_output_tokens / duration_time,
        "total_token_throughput": (num_input_tokens + num_output_tokens) / duration_time,
    }
    metrics.update(_stats_ms("ttft", [r.ttft_time for r in done]))
    metrics.update(_stats_ms("tpot", tpots))
    metrics.update(_stats_ms("itl", [gap for r in done for gap in r.itl_times]))
    metrics.update(_stats_ms("e2el", [r.e2e_time for r in done]))
    return metrics


def format_summary(metrics: dict[str, Any]) -> str:
    width = 50
    rows = [
        ("Successful requests:", metrics["num_completed"]),
        ("Failed requests:", metrics["num_failed"]),
        ("Benchmark duration (s):", f"{metrics['duration_s']:.2f}"),
        ("Total input tokens:", metrics["total_input_tokens"]),
        ("Total generated tokens:", metrics["total_output_tokens"]),
        ("Request throughput (req/s):", f"{metrics['request_throughput']:.2f}"),
        ("Input token throughput (tok/s):", f"{metrics['input_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{metrics['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{metrics['total_token_throughput']:.2f}"),
    ]
    lines = [" Benchmark result ".center(width, "=")]
    lines += [f"{label:<40}{value:>10}" for label, value in rows]
    for key, title in (
        ("ttft", "Time to first token"),
        ("tpot", "Time per output token (excl. 1st)"),
        ("itl", "Inter-token latency"),
        ("e2el", "End-to-end latency"),
    ):
        lines.append(f" {title} ".center(width, "-"))
        for stat, _ in PERCENTILE_NAMES:
            label = f"{stat.capitalize()} {key.upper()} (ms):"
            lines.append(f"{label:<40}{metrics[f'{stat}_{key}_ms']:>10.2f}")
    lines.append("=" * width)
    return "\n".join(lines)


def result_json(
    metrics: dict[str, Any], settings: dict[str, Any], results: list[RequestResult]
) -> dict[str, Any]:
    """What --result-file holds: settings, the summary figures and every request."""
    return {"settings": settings, **metrics, "requests": [asdict(r) for r in results]}
