"""What the figures of FPM engines mean: their iteration times (``wall_time``, which each
producer measures differently: telemetry/sources/fpm.py PRODUCERS) and, for Dynamo's own
recordings (telemetry/sources/fpm_taps.py), how the recording was captured. `explain` and
`tune` print these lines beside their figures."""

from __future__ import annotations

import argparse

import numpy as np

from telemetry.analysis.timeline import EngineTimeline
from telemetry.sources.fpm import GPU_TIME_PRODUCERS, PRODUCERS, producer_of
from telemetry.sources.fpm_taps import SAMPLED, TRACE_SCHEMA, TapCapture

# What an iteration time fitted or summed means, by what wall_time measures.
TIME_MEANING = {
    "gpu": "the model's GPU time only (no scheduling or sampling on the CPU): iteration "
    "times, ITL and busy time are lower bounds, and limits chosen by them may be too high",
    "dynamo-vllm": "the whole iteration as a decoding request sees it, update to update "
    "(the first batch after idle: schedule to update)",
}
UNNAMED = (
    "iteration times are FPM wall_time from a producer not named (--fpm-producer): what "
    "they measure is not known, and it differs by producer (docs/fpm.md)"
)


def wall_time_line(timeline: EngineTimeline) -> str | None:
    """What the engine's iteration times are, for an FPM engine; None for others."""
    producer = producer_of(str(timeline.facts.get("source", "")))
    if producer is None:
        return None
    kind = "gpu" if producer in GPU_TIME_PRODUCERS else producer
    if kind not in TIME_MEANING:
        return UNNAMED
    return (
        f"iteration times are FPM wall_time from {producer}: {PRODUCERS[producer]}, so "
        f"{TIME_MEANING[kind]}"
    )


def capture_lines(capture: TapCapture, timelines: list[EngineTimeline]) -> list[str]:
    """How a Dynamo FPM recording was captured and what that means for each figure."""
    if capture.mode != SAMPLED:
        what = (
            "every message the receiver got"
            if capture.format != TRACE_SCHEMA
            else ("every message (full capture)")
        )
        return [
            f"Dynamo FPM recording ({capture.format}): {what}; a gap in counter_id is "
            "messages lost before the recording (telemetry gaps); times are the recorder's"
        ]
    interval = capture.sample_interval_s or 0.0
    scale = samples_scale(capture, timelines)
    stands_for = f"about {scale:.0f} iterations while busy" if scale else "an unknown number"
    return [
        f"Sampled Dynamo FPM recording ({capture.format}, capture_mode sampled): one message "
        f"per stream about every {interval:.3g} s (the latest of its interval), not every "
        f"iteration; each stands for {stands_for}. So:",
        "  - iterations, tokens and throughputs count the sampled iterations only, not the "
        "engine's totals",
        "  - costs (busy time, findings' request-seconds) are the samples': scale them by "
        "the same factor",
        "  - queues, KV and iteration times are those of the iterations sampled: an episode "
        "shorter than the interval may be missed",
        "  - counter_ids skipped between samples are iterations not sampled, not losses: no "
        "telemetry gap comes of them",
    ]


def samples_scale(capture: TapCapture, timelines: list[EngineTimeline]) -> float | None:
    """Iterations one sample stands for while busy: the interval / the median iteration
    time of the samples (iterations back to back); None when not sampled or not known."""
    elapsed = [tl.col("elapsed_ns")[tl.col("elapsed_ns") > 0] for tl in timelines]
    elapsed_ns = np.concatenate(elapsed) if elapsed else np.array([])
    if capture.mode != SAMPLED or not capture.sample_interval_s or not len(elapsed_ns):
        return None
    return max(1.0, capture.sample_interval_s * 1e9 / float(np.median(elapsed_ns)))


def capture_json(capture: TapCapture, timelines: list[EngineTimeline]) -> dict:
    """`explain --json`'s ``fpm_recording``."""
    return {
        "format": capture.format,
        "capture_mode": capture.mode,
        "sample_interval_s": capture.sample_interval_s,
        "iterations_per_sample": samples_scale(capture, timelines),
        "notes": capture_lines(capture, timelines),
    }


def tune_lines(timeline: EngineTimeline) -> list[str]:
    """What `tune`'s fit of an FPM engine stands on: its iteration times, and samples."""
    lines = [line for line in (wall_time_line(timeline),) if line]
    capture = timeline.capture
    if capture is not None and capture.mode == SAMPLED:
        lines.append(
            f"fitted on sampled iterations (one per stream about every "
            f"{capture.sample_interval_s or 0:.3g} s): each sample is a whole iteration, so "
            "the fit holds, on fewer points; the batch sizes seen are the samples' only"
        )
    return lines


def add_fpm_producer_argument(parser: argparse.ArgumentParser) -> None:
    """--fpm-producer, for Dynamo's FPM recordings (explain and tune)."""
    parser.add_argument(
        "--fpm-producer",
        choices=list(PRODUCERS),
        default="unknown",
        help="who produced a Dynamo FPM recording, which says what its wall_time means "
        "(docs/fpm.md; default: unknown); iterscope's recordings say it themselves",
    )
