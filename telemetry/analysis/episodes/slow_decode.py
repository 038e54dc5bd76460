"""Decode iterations slowed by nothing in their batch: the host or device was busy elsewhere.

A decode-only iteration (no prompt chunk) is judged against the decode-only iterations of the
``long_prefill_baseline_time`` before it that decoded as many requests or more (or, where fewer
than ``long_prefill_min_baseline_iterations`` did, that many that decoded the most, scaled up
to its tokens: latency.decode_baselines, a long prefill's too), less those off pace, and
while a slowdown lasts, against those before it began, grown with the KV each decoding
request holds where it grew beyond twice (_PaceBefore): where it took ``slow_decode_ratio``
times their median or more, the same work ran that much faster before, so neither its batch,
a prompt nor its contexts explain the time; other processes on the engine's cores, memory
pressure, a throttled or shared device do. Like a long prefill (long_prefill.py), it is a finding
only where the decoding requests notice it: a pause of ``slow_decode_min_pause``
beyond the baseline, or such iterations at least ``slow_decode_min_share`` of the decoding
steps in the baseline time before it (they set the p99 inter-token latency). Judged on the past
only, as the live sidecar judges it. An episode is one slowdown: its slowed iterations and
every other one off pace in it (_PaceBefore.slowdowns_of).

Not judged: an iteration as long as the stall threshold's floor (``STALL_FLOOR_S``, or a fixed
``stall_after``) or longer, which is the stall rule's (liveness.py: a stall live and in explain
where the threshold of that moment was under it), and one the engine went silent in (frozen
whole: the silence's).

Where explain only had the long-prefill detector, a CPU engine whose decode-only iterations
went from 20 ms to 0.6-1.2 s while another job ran got "Long prefill chunks" (2.2 request-s)
and an action to lower the token budget, which cannot shorten an iteration with no prompt.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from telemetry.analysis.episodes.episode import (
    Episode,
    Thresholds,
    secs,
    span_episode,
)
from telemetry.analysis.episodes.latency import (
    Stretch,
    decode_only_rows,
    max_share,
    noticed,
    noticed_text,
    peer_median,
)
from telemetry.analysis.episodes.silences import Silences
from telemetry.analysis.stall_rule import STALL_FLOOR_S
from telemetry.analysis.timeline import NS_PER_S, EngineTimeline
from telemetry.analysis.words import plural

SLOW_DECODE_SETTING = (
    "Not a tuning setting: the same work ran faster just before, so something outside the "
    "engine's batch took its time: check what else runs on its host (other processes on its "
    "CPU cores, memory pressure and swapping, CPU frequency) or shares its device, and keep "
    "the engine's cores and device to itself."
)


def slow_decode_stretch(th: Thresholds) -> Stretch:
    return Stretch(
        th.slow_decode_ratio,
        th.slow_decode_min_extra_time * NS_PER_S,
        th.slow_decode_min_pause * NS_PER_S,
        th.slow_decode_min_share,
    )


def _candidates(
    tl: EngineTimeline, decode_only: np.ndarray, th: Thresholds, stretch: Stretch
) -> np.ndarray:
    """Decode-only iterations that may be slowed: stretched against the fastest decode-only
    one, shorter than the stall rule's floor, and not holding a silence."""
    elapsed = tl.col("elapsed_ns")
    fastest_ns = float(elapsed[decode_only].min())
    floor_ns = (th.stall_after or STALL_FLOOR_S) * NS_PER_S
    rows = np.flatnonzero(
        decode_only & stretch.is_stretched(elapsed, fastest_ns) & (elapsed < floor_ns)
    )
    if rows.size and (elapsed[rows] > th.dead_after * NS_PER_S).any():
        silent = Silences(tl, th.dead_after).overlap_ns(
            tl.col("start_ns")[rows], tl.col("end_ns")[rows]
        )
        rows = rows[silent == 0]
    return rows


class _PaceBefore:
    """The decode-only iterations' past as the slowed-decode rule reads it.

    Off pace: an iteration ``slow_decode_pace_ratio`` times its baseline or more (and
    ``slow_decode_pace_min_extra_time`` over it). It is left out of every later baseline, and
    it and the off-pace iterations after it make a slowdown, which ends once the decode-only
    iterations stay on pace for ``gap_merge_time``: an iteration in a slowdown is judged on
    the baseline time before the latest one on pace before it began. A slowdown that lasts had
    filled the 30 s before with slowed iterations (after 21 s of every decode 7x slower they
    were most of it, and the rest of a 2-minute slowdown read as the engine's pace); off pace
    is a lower bar than slowed (one iteration of a real CPU hog at 2.93x had ended it); and
    one iteration on pace does not end it (a hog that yielded for one 1.96x iteration, 30 s
    in, had left the hog's last 60 s judged on its own pace, 100 ms against 29).

    Every baseline grows with the KV a decoding request holds (tokens, else blocks) where it
    holds more than twice (the off-pace ratio) the median of the past it is drawn from, by the
    share beyond that: time grows at most in proportion to the KV read, and the off-pace bar
    already allows twice the time. So longer contexts are more work, not a slowdown (8
    requests of 7,500-token contexts took 74-101 ms against 22 ms for 8 short ones: "slowed
    from outside" for 22 s), while contexts 1.3-1.5x longer, which moved a real vLLM's decode
    by 5%, no longer grow it 1.3-1.5x (that had ended a slowdown 9 times in 30 s). More
    requests are the baseline rule's already. With nothing off pace and no context grown, the
    baseline is decode_baselines'.

    Iterations are judged in order, each on the judgments before it, so a judgment never
    changes as later records come; ``since_ns`` holds where each one's past begins (the live
    sidecar keeps that much, live_findings)."""

    def __init__(self, tl: EngineTimeline, decode_only: np.ndarray, th: Thresholds) -> None:
        self.decode_only = decode_only  # a mask of tl's rows
        self.positions = np.flatnonzero(decode_only)  # tl's rows of the decode-only iterations
        self.starts = tl.col("start_ns")[decode_only]
        self.elapsed = tl.col("elapsed_ns")[decode_only].astype(float)
        self.requests = tl.col("num_decode_reqs")[decode_only].astype(float)
        # the KV a decoding request holds: in tokens where the source says them (not the
        # stat-logger plugin), else in blocks (not FPM producers); NaN where it says neither
        held = tl.col("num_kv_tokens")[decode_only].astype(float)
        if not (held > 0).any():
            held = tl.col("num_kv_blocks_used")[decode_only].astype(float)
        self.context = np.where(held > 0, held, np.nan) / self.requests
        self.window_ns = int(th.long_prefill_baseline_time * NS_PER_S)
        self.least = th.long_prefill_min_baseline_iterations
        self.off_pace_stretch = Stretch(
            th.slow_decode_pace_ratio, th.slow_decode_pace_min_extra_time * NS_PER_S, 0.0, 0.0
        )
        self.slowed_stretch = slow_decode_stretch(th)
        self.gap_ns = int(th.gap_merge_time * NS_PER_S)  # on pace this long ends a slowdown
        self.elapsed_before = np.concatenate(([0.0], np.cumsum(self.elapsed)))
        self.off_pace = np.zeros(len(self.positions), dtype=bool)
        self.marked: list[int] = []  # the positions off pace, in order
        self.run_first = np.zeros(len(self.positions), dtype=np.int64)  # its slowdown's first
        self.first_slowed: dict[int, int] = {}  # a slowdown's first -> its first slowed
        # the fastest decode-only iteration of as many decoding requests or more, anywhere: a
        # lower bound of any baseline drawn from such peers (_surely_on_pace)
        self.levels, level_of = np.unique(self.requests, return_inverse=True)
        fastest = np.full(len(self.levels), np.inf)
        np.minimum.at(fastest, level_of, self.elapsed)
        self.fastest_from_level = np.minimum.accumulate(fastest[::-1])[::-1]
        self.began: dict[int, int] = {}  # row -> tl's row where the slowdown before it began
        self.grown: dict[int, float] = {}  # row -> its baseline's growth with the KV it holds
        self.since_ns: dict[int, int] = {}  # row -> where the past it was judged on begins
        self._paces: dict[tuple[int, int, float], tuple[float, float]] = {}  # _pace's
        # the rows judged (the candidates: judged_pace) and their baselines, NaN: not judged
        self.rows = np.zeros(0, dtype=np.int64)
        self.baselines = np.zeros(0)

    def judge(self, row: int) -> float:
        """The baseline of ``row`` (a decode-only iteration later than any judged before it),
        NaN where too few iterations say one; marks it off pace where stretched against it."""
        at = int(self.positions.searchsorted(row))
        first = self._slowdown_first(at)
        if first is None and self._surely_on_pace(at):
            return math.nan
        # the past ends before it; in a slowdown, at the latest on pace before it began
        latest, until = (at, at) if first is None else (first - 1, first)  # first >= 1
        if first is not None:
            self.began[row] = int(self.positions[first])
        baseline, context = self._pace(latest, until, max(self.requests[at], 1.0))
        # beyond what the off-pace bar allows; NaN where either is unknown: not grown
        grown = self.context[at] / context / self.off_pace_stretch.ratio
        if grown > 1.0:
            baseline *= grown
            self.grown[row] = grown
        self.since_ns[row] = int(self.starts[latest]) - self.window_ns
        if self.off_pace_stretch.is_stretched(self.elapsed[at], baseline):
            self.off_pace[at] = True
            self.marked.append(at)
            self.run_first[at] = at if first is None else first
            if self.slowed_stretch.is_stretched(self.elapsed[at], baseline):
                self.first_slowed.setdefault(int(self.run_first[at]), at)
        return baseline

    def _slowdown_first(self, at: int) -> int | None:
        """The first position of the slowdown the iteration at ``at`` is in: that of the
        latest one off pace before it, unless the decode-only iterations between them (on
        pace) took gap_ns or more (not the time between: a slowed prompt chunk or an idle
        spell is no pace); None: in no slowdown (judged in order: all marked are before it)."""
        if not self.marked or self._on_pace_ns(self.marked[-1], at) >= self.gap_ns:
            return None
        return int(self.run_first[self.marked[-1]])

    def _on_pace_ns(self, marked: int, at: int) -> float:
        """How long the decode-only iterations after position ``marked`` and before ``at``
        took."""
        return float(self.elapsed_before[at] - self.elapsed_before[marked + 1])

    def _surely_on_pace(self, at: int) -> bool:
        """Whether the iteration at ``at`` is on pace whatever its baseline comes to, so it
        needs none (a CPU engine's every decode of 16 requests is twice its fastest one, and
        drawing each one's baseline took 2.4 s over 100,000 iterations): for one in no
        slowdown, with at least as many peers on pace in its past as a baseline needs (so
        its baseline is their median, or more with its KV), and not stretched against the
        fastest iteration of as many requests or more anywhere (no such median is less)."""
        own = self.requests[at]
        first = int(self.starts.searchsorted(self.starts[at] - self.window_ns))
        peers = int(np.count_nonzero(self.requests[first:at] >= own))
        off_pace = len(self.marked) - bisect.bisect_left(self.marked, first)  # all before it
        if peers - off_pace < self.least:
            return False
        fastest = self.fastest_from_level[self.levels.searchsorted(own)]
        return not self.off_pace_stretch.is_stretched(self.elapsed[at], fastest)

    def _pace(self, latest: int, until: int, own: float) -> tuple[float, float]:
        """The baseline of ``own`` decoding requests from the iterations on pace before
        ``until`` that started within the baseline time before ``latest``'s start, and the
        median KV a decoding request held in them (NaN: none said). Drawn once for every
        iteration of a slowdown (a run of 20,000 had taken 74 us each), and kept with this
        object (a class-wide cache had kept up to 64 of them, each with its timeline's
        columns, alive in a live sidecar after their searches)."""
        key = (latest, until, own)
        if key not in self._paces:
            self._paces[key] = self._draw_pace(latest, until, own)
        return self._paces[key]

    def _draw_pace(self, latest: int, until: int, own: float) -> tuple[float, float]:
        first = int(self.starts.searchsorted(self.starts[latest] - self.window_ns))
        past = first + np.flatnonzero(~self.off_pace[first:until])
        baseline = peer_median(self.requests[past], self.elapsed[past], own, self.least)
        known = self.context[past][~np.isnan(self.context[past])]
        return baseline, float(np.median(known)) if len(known) else math.nan

    def slowdowns_of(self, rows: np.ndarray) -> list[np.ndarray]:
        """The slowdowns ``rows`` (slowed iterations, judged) are in, each as its rows: they
        and every iteration off pace in it, in order. The slowed ones show that the engine
        slowed, and the rest of the slowdown is the same work at least
        ``slow_decode_pace_ratio`` times slower than before it. Where a slowdown grows the
        batch past twice what ran before it (requests pile up), the baseline can only grow in
        proportion to the requests, an upper bound (peer_median): another job that made every
        iteration 4x slower for 90 s was found for its first 0.8 s only, while the batch grew
        from 13 to 32 requests at 2.4x that bound, and the queue it caused read as a
        --max-num-seqs limit. One slowdown is one episode, whatever the prompt chunks between
        its iterations (they had cut that one into 8)."""
        if not len(rows):
            return []
        marked = np.array(self.marked, dtype=np.int64)
        run_of = self.run_first[marked]
        runs = np.unique(self.run_first[self.positions.searchsorted(rows)])
        return [self.positions[marked[run_of == run]] for run in runs.tolist()]

    def in_slowdown(self, rows: np.ndarray) -> np.ndarray:
        """A mask of ``rows`` (tl's rows) that came in a slowdown (the latest decode-only
        iteration before each off pace, or in a slowdown not over yet) with a slowed
        iteration before it: an off-pace blip alone (a real vLLM's 2.2x at start-up) says
        less than that another job takes the engine's time."""
        marked = np.array(self.marked, dtype=np.int64)
        before = self.positions.searchsorted(rows)  # decode-only iterations before each
        latest = marked.searchsorted(before) - 1  # the latest off pace before it, if any
        mask = np.zeros(len(rows), dtype=bool)
        for number in np.flatnonzero(latest >= 0).tolist():
            last_off = int(marked[latest[number]])
            first_slowed = self.first_slowed.get(int(self.run_first[last_off]))
            mask[number] = (
                first_slowed is not None
                and first_slowed < before[number]
                and self._on_pace_ns(last_off, int(before[number])) < self.gap_ns
            )
        return mask

    def ongoing_since_ns(self) -> int | None:
        """Where the past begins of the slowdown that goes on at the last decode-only
        iteration, noticed or not (None: none goes on): its iterations are judged on it."""
        first = self._slowdown_first(len(self.positions))
        if first is None:
            return None
        return int(self.starts[max(first - 1, 0)]) - self.window_ns

    def ongoing(self, row: int) -> bool:
        """Whether the slowdown ``row`` (off pace) is in goes on at the last decode-only
        iteration (not over as far as the records say)."""
        at = int(self.positions.searchsorted(row))
        return bool(self._slowdown_first(len(self.positions)) == self.run_first[at])


@dataclass(frozen=True)
class SlowDecodeSearch:
    """The slowed-decode episodes of a timeline, and where the past begins of a slowdown that
    goes on at its end, noticed or not (None: none goes on). The live sidecar keeps that past
    in its window (live_findings): a slowdown off pace for 40 s before its first noticed
    iteration had been judged live on a window that dropped the pace before it, and found in
    explain only."""

    episodes: list[Episode]
    ongoing_since_ns: int | None


def detect_slow_decode(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    """Decode-only iterations far slower than the same work before them."""
    return search_slow_decode(tl, th).episodes


def judged_pace(tl: EngineTimeline, th: Thresholds) -> _PaceBefore | None:
    """The decode-only iterations of ``tl`` judged in order (``rows``, the candidates, and
    their ``baselines``; None: too few to judge), once per timeline and thresholds: the
    long-prefill detector reads its slowdowns too (long_prefill.py)."""
    key = ("slow_decode", th)
    if key not in tl.memo:
        tl.memo[key] = _judge(tl, th)
    return tl.memo[key]


def _judge(tl: EngineTimeline, th: Thresholds) -> _PaceBefore | None:
    decode_only = decode_only_rows(tl)
    if decode_only.sum() < th.long_prefill_min_baseline_iterations:
        return None
    pace = _PaceBefore(tl, decode_only, th)
    pace.rows = _candidates(tl, decode_only, th, pace.off_pace_stretch)
    pace.baselines = np.array([pace.judge(row) for row in pace.rows.tolist()], dtype=float)
    return pace


def search_slow_decode(tl: EngineTimeline, th: Thresholds) -> SlowDecodeSearch:
    """detect_slow_decode's episodes, and the pace of a slowdown going on at the end."""
    pace = judged_pace(tl, th)
    if pace is None:
        return SlowDecodeSearch([], None)
    rows, baselines = pace.rows, pace.baselines
    baseline_of = dict(zip(rows.tolist(), baselines.tolist(), strict=True))
    stretch = slow_decode_stretch(th)
    slowed = stretch.is_stretched(tl.col("elapsed_ns")[rows], baselines)  # NaN: not judged
    rows, baselines = rows[slowed], baselines[slowed]
    is_noticed, shares = noticed(tl, rows, baselines, pace.decode_only, stretch, th)
    share_of = dict(zip(rows.tolist(), shares.tolist(), strict=True))
    slowed_rows = set(rows.tolist())  # noticed or not: said apart from those only off pace
    episodes = [
        _episode(tl, slowdown, baseline_of, share_of, slowed_rows, pace, th)
        for slowdown in pace.slowdowns_of(rows[is_noticed])
    ]
    return SlowDecodeSearch(episodes, pace.ongoing_since_ns())


def _episode(
    tl: EngineTimeline,
    rows: np.ndarray,
    baseline_of: dict[int, float],
    share_of: dict[int, float],
    slowed_rows: set[int],
    pace: _PaceBefore,
    th: Thresholds,
) -> Episode:
    """``rows``: slowed iterations (``slowed_rows``) and others off pace in their slowdowns."""
    elapsed, stretch = tl.col("elapsed_ns"), slow_decode_stretch(th)
    worst = int(rows[np.argmax(elapsed[rows])])
    before, grown = "before it", pace.grown.get(worst, 1.0)
    if worst in pace.began:
        before = f"before the slowdown began at iteration {tl.col('iteration')[pace.began[worst]]}"
    shares = [share_of.get(row, math.nan) for row in rows.tolist()]  # NaN: off pace only
    num_slowed = sum(row in slowed_rows for row in rows.tolist())
    extra_ns = elapsed[rows] - np.array([baseline_of[row] for row in rows.tolist()])
    slowed_s = float((tl.col("num_decode_reqs")[rows] * extra_ns).sum()) / NS_PER_S
    return span_episode(
        tl,
        rows[0],
        rows[-1],
        kind="slow_decode",
        title="Decode iterations slowed from outside the batch",
        evidence=(
            f"{plural(len(rows), 'decode-only iteration')} took up to {secs(elapsed[worst])} "
            f"(iteration {int(tl.col('iteration')[worst])}, "
            f"{int(tl.col('num_decode_reqs')[worst])} decoding, no prompt) where decode-only "
            f"iterations of as many decoding requests took {secs(baseline_of[worst] / grown)} "
            f"in the {th.long_prefill_baseline_time:g} s {before} (median; those of fewer "
            "scaled up to its own, where too few decoded as many)"
            + (
                f", {grown:.1f}x that for the {grown * pace.off_pace_stretch.ratio:.1f}x KV each "
                "decoding request holds now"
                if grown > 1.0
                else ""
            )
            + _off_pace_text(len(rows) - num_slowed, num_slowed, stretch, pace)
            + noticed_text(shares, stretch, th)
        ),
        explanation=(
            "Neither a prompt chunk, a bigger batch nor longer contexts explain these "
            "iterations: at the pace before, the same work took half the time or less (a "
            "batch bigger than any before counted at the most it could take then), so the "
            "engine was slowed from outside, and every decoding request's tokens came that "
            "much later."
        ),
        setting=SLOW_DECODE_SETTING,
        ongoing=pace.ongoing(int(rows[-1])),
        numbers={
            "num_iterations": len(rows),
            "max_elapsed_s": elapsed[worst] / NS_PER_S,
            "baseline_s": baseline_of[worst] / NS_PER_S,
            "max_stretched_share": max_share(shares),
            # its cost (findings.py): each decoding request x its iteration's time beyond
            # the baseline, over the slowed iterations
            "slowed_request_s": slowed_s,
            # where the past its iterations were judged on begins (live_findings keeps it)
            "pace_since_ns": min(pace.since_ns[row] for row in rows.tolist()),
        },
    )


def _off_pace_text(num_off_pace: int, num_slowed: int, stretch: Stretch, pace: _PaceBefore) -> str:
    """What the episode's iterations took against their baselines, where some were off pace
    only (_PaceBefore.slowdowns_of)."""
    if not num_off_pace:
        return ""
    return (
        f"; {num_slowed} of them took {stretch.ratio:g}x their baseline or more, the other "
        f"{num_off_pace} {pace.off_pace_stretch.ratio:g}x or more in the same slowdown"
    )
