"""Decode latency's baselines and stretches, shared by the long-prefill (long_prefill.py) and
slowed-decode (slow_decode.py) detectors.

An iteration is judged against the iterations before it only (``decode_baselines``): the median
of the decode-only iterations of the ``long_prefill_baseline_time`` before it that computed as
many decoding requests as it did or more, at least ``long_prefill_min_baseline_iterations`` of them
(where fewer did, that many of the most, scaled up to its own: a batch bigger than any
before is never judged against smaller ones, which had made a 34-request iteration 14x "its
baseline" of 16 to 27 requests). So a judgment never changes as later records come, and the
live sidecar, which keeps that much history before every iteration it judges
(telemetry/analysis/live_findings.py), judges each iteration as `explain` does.

A stretched iteration is a finding only where the decoding requests notice it
(``noticed``): it paused them for the detector's minimum pause or longer beyond the baseline,
or iterations stretched as much hold at least its minimum share of the decoding requests'
steps in the baseline time before it (1 in 100 of them sets the p99 inter-token latency). A
prompt now and then beside a request or two on a CPU (a 150 ms iteration against 40 ms, every
30 s) is neither, and said nothing of (it opened a finding, and with a prompt a minute, an
alert, on healthy load).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from telemetry.analysis.episodes.episode import (
    Thresholds,
    past_bounds,
    pct,
)
from telemetry.analysis.timeline import NS_PER_S, EngineTimeline


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
