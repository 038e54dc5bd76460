"""Latency episodes: long prefill chunks that stretch the decoding requests' iterations."""

from __future__ import annotations

import numpy as np

from telemetry.analysis.episodes.episode import (
    TUNE_TEXT,
    Episode,
    Thresholds,
    flag_text,
    group_by_time,
    secs,
    span_episode,
)
from telemetry.analysis.timeline import NS_PER_S, EngineTimeline
from telemetry.analysis.words import plural


def detect_long_prefill(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    """Decoding requests wait for a prefill chunk: their inter-token latency jumps."""
    elapsed = tl.col("elapsed_ns")
    prefill_tokens, decode_reqs = tl.col("num_prefill_tokens"), tl.col("num_decode_reqs")
    decode_only = (prefill_tokens == 0) & (decode_reqs > 0) & tl.timed
    if decode_only.sum() < th.long_prefill_min_baseline_iterations:
        return []
    baseline_ns = float(np.median(elapsed[decode_only]))
    with_prefill = (prefill_tokens > 0) & tl.timed
    # What a prefill token costs, robustly (a median), so that a slow iteration counts only when
    # its chunk explains the slowness, not a hiccup of the machine (or warm-up).
    extra_per_token_ns = (elapsed[with_prefill] - baseline_ns) / prefill_tokens[with_prefill]
    prefill_token_ns = float(np.median(extra_per_token_ns)) if extra_per_token_ns.size else 0.0
    extra_ns = th.long_prefill_ratio * baseline_ns - baseline_ns
    stretched = (
        with_prefill
        & (decode_reqs > 0)
        & (elapsed >= th.long_prefill_ratio * baseline_ns)
        & (elapsed - baseline_ns >= th.long_prefill_min_extra_time * NS_PER_S)
        & (prefill_tokens * prefill_token_ns >= extra_ns)
    )
    index = np.flatnonzero(stretched)
    times, ends = tl.col("start_ns")[index].tolist(), tl.col("end_ns")[index].tolist()
    episodes = []
    for first, last in group_by_time(times, int(th.gap_merge_time * NS_PER_S), ends):
        rows = index[first : last + 1]
        worst = int(rows[np.argmax(elapsed[rows])])
        episodes.append(
            span_episode(
                tl,
                rows[0],
                rows[-1],
                kind="long_prefill",
                title="Long prefill chunks stretch decode latency",
                evidence=(
                    f"{plural(len(rows), 'iteration')} mixing up to "
                    f"{plural(int(prefill_tokens[rows].max()), 'prefill token')} with decoding "
                    f"requests took up to {secs(elapsed[worst])} (iteration "
                    f"{int(tl.col('iteration')[worst])}, {int(decode_reqs[worst])} decoding) "
                    f"against a median decode-only iteration of {secs(baseline_ns)}"
                ),
                explanation=(
                    "Chunked prefill puts a prompt chunk in the same iteration as the decoding "
                    "requests; each of them waits for the whole chunk, so their inter-token "
                    "latency spikes to the iteration time."
                ),
                setting=(
                    f"Lower {flag_text(tl, 'max_num_batched_tokens')} so chunks are smaller; "
                    f"{TUNE_TEXT} computes the largest budget that keeps it."
                ),
                numbers={
                    "num_iterations": len(rows),
                    "max_elapsed_s": elapsed[worst] / NS_PER_S,
                    "baseline_s": baseline_ns / NS_PER_S,
                },
            )
        )
    return episodes
