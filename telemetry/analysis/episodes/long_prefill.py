"""Long prefill chunks that stretch the decoding requests' iterations.

Chunked prefill puts a prompt chunk in the same iteration as the decoding requests: an
iteration with a chunk is stretched where it took ``long_prefill_ratio`` times its decode
baseline or more (latency.decode_baselines), its chunk explains that (its tokens at what a
prefill token added in the baseline time before it: latency.prefill_token_costs), and the
decoding requests notice it (latency.noticed: a pause of ``long_prefill_min_pause``, or
``long_prefill_min_share`` of their steps).

Not judged:
- an iteration during which the engine went silent (no message, heartbeats included, for
  longer than ``dead_after``: the whole process frozen): its time is the freeze's, which the
  silence is (a SIGSTOP inside a 128-token chunk made it an 11.5 s "long prefill", ranked
  above the silence and charged the same request-seconds twice);
- an iteration that came while the decode-only iterations were slowed from outside the batch
  (a slowdown that had shown a slowed iteration and was not over: slow_decode.py,
  _PaceBefore.in_slowdown): its time is the slowdown's. Another job on a 2-core CPU made a
  192-token chunk take 2.28 s, of which the chunk ~130 ms: "Long prefill chunks" with a
  pause of 1 s, and an action to lower the token budget, which could not have shortened it.
"""

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
from telemetry.analysis.episodes.latency import (
    Stretch,
    decode_baselines,
    decode_only_rows,
    max_share,
    noticed,
    noticed_text,
    prefill_token_costs,
)
from telemetry.analysis.episodes.silences import Silences
from telemetry.analysis.episodes.slow_decode import judged_pace
from telemetry.analysis.timeline import NS_PER_S, EngineTimeline
from telemetry.analysis.words import plural


def long_prefill_stretch(th: Thresholds) -> Stretch:
    return Stretch(
        th.long_prefill_ratio,
        th.long_prefill_min_extra_time * NS_PER_S,
        th.long_prefill_min_pause * NS_PER_S,
        th.long_prefill_min_share,
    )


def detect_long_prefill(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    """Decoding requests wait for a prefill chunk: their inter-token latency jumps."""
    elapsed = tl.col("elapsed_ns")
    prefill_tokens, decode_reqs = tl.col("num_prefill_tokens"), tl.col("num_decode_reqs")
    decode_only = decode_only_rows(tl)
    if decode_only.sum() < th.long_prefill_min_baseline_iterations:
        return []
    # Only iterations slower than the ratio times the fastest decode-only one can be stretched
    # (a baseline is a median of those): the rest need no baseline of their own.
    fastest_ns = float(elapsed[decode_only].min())
    candidates = np.flatnonzero(
        (prefill_tokens > 0)
        & (decode_reqs > 0)
        & tl.timed
        & (elapsed >= th.long_prefill_ratio * fastest_ns)
        & (elapsed - fastest_ns >= th.long_prefill_min_extra_time * NS_PER_S)
    )
    if (elapsed[candidates] > th.dead_after * NS_PER_S).any():  # else none holds a silence
        silent = Silences(tl, th.dead_after).overlap_ns(
            tl.col("start_ns")[candidates], tl.col("end_ns")[candidates]
        )
        candidates = candidates[silent == 0]  # a frozen process's time is the silence's
    pace = judged_pace(tl, th)  # not None: enough decode-only iterations
    candidates = candidates[~pace.in_slowdown(candidates)]  # the slowdown's time
    baselines = decode_baselines(tl, candidates, th)
    slow = elapsed[candidates]
    # NaN (no baseline) compares False: not judged
    slower = (slow >= th.long_prefill_ratio * baselines) & (
        slow - baselines >= th.long_prefill_min_extra_time * NS_PER_S
    )
    candidates, baselines = candidates[slower], baselines[slower]
    token_costs = prefill_token_costs(tl, candidates, baselines, th)
    stretched = prefill_tokens[candidates] * token_costs >= (th.long_prefill_ratio - 1) * baselines
    candidates, baselines = candidates[stretched], baselines[stretched]
    stretch = long_prefill_stretch(th)
    is_noticed, shares = noticed(tl, candidates, baselines, prefill_tokens > 0, stretch, th)
    index = candidates[is_noticed]
    baseline_of = dict(zip(candidates.tolist(), baselines.tolist(), strict=True))
    share_of = dict(zip(candidates.tolist(), shares.tolist(), strict=True))
    times, ends = tl.col("start_ns")[index].tolist(), tl.col("end_ns")[index].tolist()
    episodes = []
    for first, last in group_by_time(times, int(th.gap_merge_time * NS_PER_S), ends):
        rows = index[first : last + 1]
        worst = int(rows[np.argmax(elapsed[rows])])
        baseline_ns = baseline_of[worst]
        shares = [share_of[row] for row in rows.tolist()]
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
                    f"against a median decode-only iteration of {secs(baseline_ns)} in the "
                    f"{th.long_prefill_baseline_time:g} s before it"
                    f"{noticed_text(shares, stretch, th)}"
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
                    "max_stretched_share": max_share(shares),
                },
            )
        )
    return episodes
