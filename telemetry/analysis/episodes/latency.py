"""Latency episodes: long prefill chunks that stretch the decoding requests' iterations.

An iteration is judged against the iterations before it only (``decode_baselines``): the median
of the decode-only iterations of the ``long_prefill_baseline_time`` before it that computed as
many decoding requests as it did or more, at least ``long_prefill_min_baseline_iterations`` of them
(where fewer did, that many of the most, scaled up to its own: a batch bigger than any
before is never judged against smaller ones, which had made a 34-request iteration 14x "its
baseline" of 16 to 27 requests). So a judgment never changes as later records come, and the
live sidecar, which keeps that much history before every iteration it judges
(telemetry/analysis/live_findings.py), judges each iteration as `explain` does.

A stretched iteration is a finding only where the decoding requests notice it
(``noticed``): it paused them for ``long_prefill_min_pause`` or longer beyond the baseline, or
iterations stretched as much hold at least ``long_prefill_min_share`` of the decoding requests'
steps in the baseline time before it (1 in 100 of them sets the p99 inter-token latency). A
prompt now and then beside a request or two on a CPU (a 150 ms iteration against 40 ms, every
30 s) is neither, and said nothing of (it opened a finding, and with a prompt a minute, an
alert, on healthy load).

An iteration during which the engine went silent (no message, heartbeats included, for
longer than ``dead_after``: the whole process frozen) is not judged: its time is the
freeze's, which the silence is (a SIGSTOP inside a 128-token chunk made it an 11.5 s "long
prefill", ranked above the silence and charged the same request-seconds twice).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from telemetry.analysis.episodes.episode import (
    TUNE_TEXT,
    Episode,
    Thresholds,
    flag_text,
    group_by_time,
    past_bounds,
    pct,
    secs,
    span_episode,
)
from telemetry.analysis.episodes.silences import Silences
from telemetry.analysis.timeline import NS_PER_S, EngineTimeline
from telemetry.analysis.words import plural


def _history(
    tl: EngineTimeline, among: np.ndarray, rows: np.ndarray, th: Thresholds, itself: bool
) -> list[tuple[int, int]]:
    """For each of ``rows``, the (first, last) slice of the iterations ``among`` that started
    within ``long_prefill_baseline_time`` before it (past_bounds)."""
    firsts, lasts = past_bounds(tl, among, rows, th.long_prefill_baseline_time, itself)
    return list(zip(firsts.tolist(), lasts.tolist(), strict=True))


def decode_only_rows(tl: EngineTimeline) -> np.ndarray:
    """A mask of tl's timed iterations that decoded and carried no prompt chunk."""
    return (tl.col("num_prefill_tokens") == 0) & (tl.col("num_decode_reqs") > 0) & tl.timed


def decode_baselines(tl: EngineTimeline, rows: np.ndarray, th: Thresholds) -> np.ndarray:
    """For each of ``rows``, what the decode-only iterations that started within
    ``long_prefill_baseline_time`` before it say its decoding should take (ns): the median
    time of its peers, those that decoded as many requests or more (the work of a decode:
    each request's token, and the draft tokens it scores), while there are
    ``long_prefill_min_baseline_iterations`` of them; else of that many that decoded the
    most, each scaled up to the row's requests: by the time a request adds, where the
    iterations before say it (_time_per_request), else as if all of its time grew in
    proportion, which overstates it (part of an iteration's time is fixed; so a batch that
    grew while the engine slowed is judged, never blamed for the growth). NaN with fewer
    iterations than that."""
    decode_only = decode_only_rows(tl)
    elapsed = tl.col("elapsed_ns")[decode_only].astype(float)
    requests = tl.col("num_decode_reqs")[decode_only].astype(float)  # > 0: decode-only
    firsts, lasts = past_bounds(tl, decode_only, rows, th.long_prefill_baseline_time, False)
    own_requests = np.maximum(tl.col("num_decode_reqs")[rows], 1).astype(float)
    least = th.long_prefill_min_baseline_iterations
    baselines = np.full(len(rows), np.nan)
    for number, (first, last) in enumerate(zip(firsts.tolist(), lasts.tolist(), strict=True)):
        baselines[number] = peer_median(
            requests[first:last], elapsed[first:last], own_requests[number], least
        )
    return baselines


def peer_median(requests: np.ndarray, elapsed: np.ndarray, own: float, least: int) -> float:
    """The baseline of an iteration that decoded ``own`` requests, from the decode-only
    iterations of its past (their decoding requests and times): decode_baselines' rule."""
    if len(requests) < least:
        return math.nan
    peers = requests >= own
    if peers.sum() >= least:
        return float(np.median(elapsed[peers]))
    most = np.argpartition(-requests, least - 1)[:least]  # scaled up to its own
    scaled = elapsed[most] * (own / requests[most]).clip(min=1.0)
    near = own <= 2 * requests[most].min()  # twice the requests of the ones scaled, at most
    per_request = _time_per_request(requests, elapsed) if near else None
    if per_request is not None:  # the fixed part of their time does not grow
        scaled = np.minimum(scaled, elapsed[most] + per_request * (own - requests[most]))
    return float(np.median(scaled))


def _time_per_request(requests: np.ndarray, elapsed: np.ndarray) -> float | None:
    """What one more decoding request adds to a decode-only iteration, fitted (least squares)
    over those given, where they say it: their requests at least 2-fold apart and the slope
    above 0 by 2 standard errors (tune's rule for a cost it can measure). None otherwise:
    then time is taken to grow in proportion (all of it per request), which overstates it:
    decodes of 4-8 requests taking 20 ms + 1 ms a request made the baseline of 14 requests
    49 ms where 34 is right, so a slowdown of 4x read as 2.8x. peer_median uses it only up
    to twice the fewest requests of the iterations it scales up: a CPU's decode turns from
    reading weights to computing as its batch grows, so a slope fitted on 1-2 requests
    understates what 64 add, and a burst after a quiet spell would be called slowed; beyond
    that, proportion it is (twice the most seen was not enough: one iteration of a new size,
    slowed but not found so, let a 17-request batch be judged on a fit over 4 to 8)."""
    if len(requests) < 3 or requests.min() * 2 > requests.max():
        return None
    centered = requests - requests.mean()
    spread = float(centered @ centered)
    slope = float(centered @ elapsed) / spread
    residuals = elapsed - elapsed.mean() - slope * centered
    error = math.sqrt(float(residuals @ residuals) / (len(requests) - 2) / spread)
    return slope if slope > 2 * error else None


def prefill_token_costs(
    tl: EngineTimeline, rows: np.ndarray, baselines: np.ndarray, th: Thresholds
) -> np.ndarray:
    """For each of ``rows``, what a prefill token adds to an iteration, robustly: the median,
    over the timed iterations with a prefill chunk that started within the baseline time
    before it (itself included), of its time beyond the row's baseline per chunk token. So a
    slow iteration counts only where its chunk explains the slowness, not a hiccup."""
    with_prefill = (tl.col("num_prefill_tokens") > 0) & tl.timed
    elapsed, tokens = tl.col("elapsed_ns")[with_prefill], tl.col("num_prefill_tokens")[with_prefill]
    costs = np.zeros(len(rows))
    for number, (first, last) in enumerate(_history(tl, with_prefill, rows, th, itself=True)):
        span = slice(first, last)
        costs[number] = np.median((elapsed[span] - baselines[number]) / tokens[span])
    return costs


@dataclass(frozen=True)
class Stretch:
    """When an iteration is stretched beyond its baseline, and when decoding requests notice
    it (a long prefill's, a slowed decode's thresholds)."""

    ratio: float  # at least this many times the baseline
    min_extra_ns: float  # and this much over it
    min_pause_ns: float  # noticed: a pause this long beyond the baseline
    min_share: float  # or such iterations this share of the decoding steps before it

    def is_stretched(self, elapsed: np.ndarray, baseline: float | np.ndarray) -> np.ndarray:
        return (elapsed >= self.ratio * baseline) & (elapsed - baseline >= self.min_extra_ns)


def long_prefill_stretch(th: Thresholds) -> Stretch:
    return Stretch(
        th.long_prefill_ratio,
        th.long_prefill_min_extra_time * NS_PER_S,
        th.long_prefill_min_pause * NS_PER_S,
        th.long_prefill_min_share,
    )


def _stretched_shares(
    tl: EngineTimeline,
    rows: np.ndarray,
    baselines: np.ndarray,
    stretchable: np.ndarray,
    stretch: Stretch,
    th: Thresholds,
) -> np.ndarray:
    """For each of ``rows``, the share of the decoding requests' steps (decoding requests
    summed over timed iterations) within ``long_prefill_baseline_time`` before it, itself
    included, that were in an iteration of ``stretchable`` (a mask of tl's rows) stretched as
    much against the row's baseline."""
    decode_reqs = tl.col("num_decode_reqs")
    decoding = (decode_reqs > 0) & tl.timed
    steps, elapsed = decode_reqs[decoding], tl.col("elapsed_ns")[decoding]
    can_stretch = stretchable[decoding]
    firsts, lasts = past_bounds(tl, decoding, rows, th.long_prefill_baseline_time, itself=True)
    shares = np.zeros(len(rows))
    for number, (first, last, baseline) in enumerate(zip(firsts, lasts, baselines, strict=True)):
        span = slice(first, last)
        stretched = can_stretch[span] & stretch.is_stretched(elapsed[span], baseline)
        shares[number] = steps[span][stretched].sum() / steps[span].sum()
    return shares


def noticed(
    tl: EngineTimeline,
    rows: np.ndarray,
    baselines: np.ndarray,
    stretchable: np.ndarray,
    stretch: Stretch,
    th: Thresholds,
) -> tuple[np.ndarray, np.ndarray]:
    """Which of ``rows`` (stretched iterations of ``stretchable``) the decoding requests notice
    (the module's docstring), and each one's share of stretched steps (NaN where its pause
    alone decides)."""
    pause = tl.col("elapsed_ns")[rows] - baselines >= stretch.min_pause_ns
    shares = np.full(len(rows), np.nan)
    shares[~pause] = _stretched_shares(
        tl, rows[~pause], baselines[~pause], stretchable, stretch, th
    )
    return pause | (shares >= stretch.min_share), shares


def max_share(shares: list[float]) -> float | None:
    """The largest share of stretched steps among an episode's iterations (None: each was a
    pause long enough to be noticed, judged without one)."""
    return max((share for share in shares if not math.isnan(share)), default=None)


def noticed_text(shares: list[float], stretch: Stretch, th: Thresholds) -> str:
    """What made the episode's iterations noticed, for its evidence (noticed)."""
    share = max_share(shares)
    if share is None:
        return (
            f"; a pause of {stretch.min_pause_ns / NS_PER_S:g} s or more in every decoding stream"
        )
    return (
        f"; stretched iterations held up to {pct(share)} of the decoding requests' steps in "
        f"{th.long_prefill_baseline_time:g} s (1% or more sets their p99 inter-token latency)"
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
