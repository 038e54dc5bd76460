"""Speculative decoding episodes: drafts that cost decoding requests more time than they save,
and speculation that gains nothing.

Costly drafts. A draft token is scored by the target model beside its request's own token: it
pays only when enough of them are accepted. Whether they did is `tune`'s payoff
(telemetry/analysis/tune.py, ``draft_payoff``): by the fit of iteration time, a decoding
request's time per output token with the recorded drafts against without them. The timeline is
cut into steps of ``costly_drafts_step_time`` (10 s, at multiples of it in record time), and
the drafting iterations of each step are judged on the fit over the
``costly_drafts_window_time`` (30 s) before the step. Drafts cost there where that fit prices
a draft token, over at least ``costly_drafts_min_iterations`` drafting iterations among which
the number of decoding requests varied (so that a decode token could be priced too; a cost
that comes out below 0 is next to nothing beside the iteration's base), and drafts add at
least ``costly_drafts_min_added`` of the time per output token even ERROR_SIGMAS standard
errors in their favour: a claim the data hold, not the fit's noise. Judged on the past only,
like a long prefill, so the live sidecar judges each step as `explain` does, as soon as its
first drafting iteration comes, and a load that changes is judged on itself: drafts that cost
under one load and pay under another are said where they cost (a verdict lags a change by up
to the window and a step). Episodes: the iterations so judged, no more than
``idle_min_time`` apart; each of their decode tokens came later by what drafts added by its
step's judgment. Where fewer tokens were accepted than ``futile_speculation_max_accepted`` of
the decoding requests' steps, the drafts bought nothing at all: that is the next kind's to
say, not this one's.

Futile speculation. An accepted token is the only thing speculative decoding buys: an output
token a decoding request gets without an iteration of its own. Each decoding iteration is
judged on the decoding iterations that started within ``futile_speculation_window_time``
before it (itself included): where speculative decoding was on (a draft was scored among them,
or the latest heartbeat says the engine's ``num_speculative_tokens``: a proposer that never
finds a draft still runs), at least ``futile_speculation_min_iterations`` of them, and their
accepted tokens were fewer than ``futile_speculation_max_accepted`` of their decoding
request-steps, speculation spared them at most that share of their iterations, whatever it
costs. What it costs (the proposer's work every step, the draft tokens scored) is not in the
records, so the finding's cost is unknown. Judged on the past only, like a long prefill: the
live sidecar keeps that window before every iteration it judges and judges it as `explain`
does. Episodes: the iterations so judged, no more than ``idle_min_time`` apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from telemetry.analysis.episodes.episode import (
    Episode,
    Thresholds,
    group_by_time,
    past_bounds,
    span_episode,
)
from telemetry.analysis.spec_decode import draft_slots, recorded_drafts
from telemetry.analysis.timeline import NS_PER_S, EngineTimeline
from telemetry.analysis.tune import (
    ERROR_SIGMAS,
    DraftPayoff,
    Fit,
    draft_payoff,
    fit_iteration_time,
)
from telemetry.analysis.words import plural

KIND = "costly_drafts"
FUTILE_KIND = "futile_speculation"


@dataclass(frozen=True)
class Judgment:
    """A step's verdict that drafts cost: the fit over the window before it, and its payoff."""

    fit: Fit
    payoff: DraftPayoff

    @property
    def added_token_time(self) -> float:
        """Seconds drafts add to each output token of a decoding request."""
        return self.payoff.token_time_with_drafts - self.payoff.token_time_without_drafts


def detect_costly_drafts(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    """Stretches of drafting iterations whose steps the window before each judges costly."""
    drafting = np.flatnonzero(tl.col("num_drafts") > 0)
    step_ns = int(th.costly_drafts_step_time * NS_PER_S)
    steps = tl.col("start_ns")[drafting] // step_ns
    judgments = {}
    for step in np.unique(steps).tolist():
        judgment = judge_step(tl, step * step_ns, th)
        if judgment is not None:
            judgments[step] = judgment
    costly = drafting[np.isin(steps, list(judgments))]
    starts, ends = tl.col("start_ns")[costly].tolist(), tl.col("end_ns")[costly].tolist()
    groups = group_by_time(starts, int(th.idle_min_time * NS_PER_S), ends)
    return [
        _episode(tl, costly[first : last + 1], judgments, step_ns, th) for first, last in groups
    ]


def judge_step(tl: EngineTimeline, step_start_ns: int, th: Thresholds) -> Judgment | None:
    """Whether drafts cost in the step that starts at ``step_start_ns``, by the fit over the
    iterations that started within costly_drafts_window_time before it; None where they pay,
    where the fit cannot tell (see the module's docstring) or has too few drafting iterations."""
    window_ns = int(th.costly_drafts_window_time * NS_PER_S)
    first, stop = tl.col("start_ns").searchsorted([step_start_ns - window_ns, step_start_ns])
    window = tl.part(int(first), int(stop))
    if np.count_nonzero(window.col("num_drafts")) < max(th.costly_drafts_min_iterations, 1):
        return None
    try:
        fit = fit_iteration_time(window)
    except ValueError:  # too few timed iterations to fit
        return None
    payoff = draft_payoff(window, fit)
    decode_reqs = window.col("num_decode_reqs")
    if (
        payoff is None
        or fit.drafts.output_tokens_per_decode - 1 < th.futile_speculation_max_accepted
        or payoff.saving_error is None
        or not np.ptp(decode_reqs[decode_reqs > 0])  # a decode token never priced
        or -payoff.saving - ERROR_SIGMAS * payoff.saving_error < th.costly_drafts_min_added
    ):
        return None
    return Judgment(fit, payoff)


def _episode(
    tl: EngineTimeline, rows: np.ndarray, judgments: dict, step_ns: int, th: Thresholds
) -> Episode:
    first, last = int(rows[0]), int(rows[-1])
    drafts = recorded_drafts(tl.part(first, last + 1))
    row_steps = (tl.col("start_ns")[rows] // step_ns).tolist()
    used = [judgments[step] for step in dict.fromkeys(row_steps)]  # in order, once each
    latest = used[-1]
    decode_tokens = tl.col("num_decode_tokens")[rows]
    added_token_time = float(
        (decode_tokens * [judgments[step].added_token_time for step in row_steps]).sum()
        / max(int(decode_tokens.sum()), 1)
    )
    added = -latest.payoff.saving
    return span_episode(
        tl,
        first,
        last,
        kind=KIND,
        title="Speculative decoding's drafts cost more than they save",
        evidence=(
            f"{plural(len(rows), 'iteration')} scored drafts: per decoding request and "
            f"iteration {drafts.draft_tokens_per_decode:.2f} draft tokens, "
            f"{drafts.output_tokens_per_decode - 1:.2f} accepted "
            f"({100 * drafts.acceptance_rate:.1f}% of draft tokens). "
            f"{_judgments_text(used, th)}: {_payoff_text(latest)}"
        ),
        explanation=(
            "Speculative decoding scores each draft token in the target model beside its "
            "request's own token, and keeps a draft only up to its first rejected token. Too "
            "few are accepted here to pay for the draft tokens scored: every decoding request "
            "gets its tokens later than it would without drafts."
        ),
        setting=(
            "Turn speculative decoding off (leave out --speculative-config), or lower its "
            f"num_speculative_tokens (drafts of up to {plural(drafts.max_draft_tokens, 'token')} "
            "now); `iterscope tune RECORDING --itl-target T` then says whether drafts pay."
        ),
        numbers={
            "num_iterations": len(rows),
            "num_judgments": len(used),
            "added_share": added,
            "added_share_error": latest.payoff.saving_error,
            "token_time_with_drafts_s": latest.payoff.token_time_with_drafts,
            "token_time_without_drafts_s": latest.payoff.token_time_without_drafts,
            "added_token_time_s": added_token_time,
            "acceptance_rate": drafts.acceptance_rate,
        },
    )


def _judgments_text(used: list[Judgment], th: Thresholds) -> str:
    """How the episode was judged: its steps' fits, and the range of what they said."""
    text = (
        f"Judged every {th.costly_drafts_step_time:g} s on the fit of iteration time over the "
        f"{th.costly_drafts_window_time:g} s before"
    )
    if len(used) > 1:
        shares = [-judgment.payoff.saving for judgment in used]
        text += (
            f", {len(used)} times, drafts adding {min(shares):.0%} to {max(shares):.0%}; "
            "by the latest"
        )
    return text


def _payoff_text(judgment: Judgment) -> str:
    fit, payoff = judgment.fit, judgment.payoff
    decode_cost = fit.coefficients.get("decode_tokens")  # none: it came out below 0
    decode_text = (
        f"{decode_cost * 1e6:.0f} us"
        if decode_cost is not None
        else f"too little to price beside an iteration's own {fit.base_time * 1000:.1f} ms"
    )
    ms = 1000
    return (
        f"a draft token costs {fit.coefficients['draft_tokens'] * 1e6:.0f} us and a decoding "
        f"request's own token {decode_text}: at {payoff.num_decode_reqs:.1f} decoding requests "
        f"each gets an output token every {payoff.token_time_with_drafts * ms:.1f} ms with drafts, "
        f"every {payoff.token_time_without_drafts * ms:.1f} ms without: drafts add "
        f"{-payoff.saving:.0%} (± {ERROR_SIGMAS * payoff.saving_error:.0%})"
    )


def detect_futile_speculation(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    """Stretches of decoding iterations whose recent past accepted next to no draft token
    while speculative decoding was on (see the module's docstring)."""
    if not tl.col("num_drafts").any() and not any(h.num_speculative_tokens for h in tl.heartbeats):
        return []  # never speculating (our own engine, an engine without the flag)
    is_decoding = tl.col("num_decode_reqs") > 0
    decoding = np.flatnonzero(is_decoding)
    if decoding.size < th.futile_speculation_min_iterations:
        return []
    window_s = th.futile_speculation_window_time
    firsts, lasts = past_bounds(tl, is_decoding, decoding, window_s, itself=True)

    def window_sums(column: np.ndarray) -> np.ndarray:
        sums = np.r_[0, np.cumsum(column[decoding])]
        return sums[lasts] - sums[firsts]

    steps, accepted = (
        window_sums(tl.col("num_decode_reqs")),
        window_sums(tl.col("num_accepted_tokens")),
    )
    speculating = (window_sums(tl.col("num_drafts") > 0) > 0) | (
        _configured_draft_length(tl, tl.col("start_ns")[decoding]) > 0
    )
    futile = (
        speculating
        & (lasts - firsts >= th.futile_speculation_min_iterations)
        & (accepted < th.futile_speculation_max_accepted * steps)
    )
    index = decoding[futile]
    times, ends = tl.col("start_ns")[index].tolist(), tl.col("end_ns")[index].tolist()
    groups = group_by_time(times, int(th.idle_min_time * NS_PER_S), ends)
    return [_futile_episode(tl, int(index[first]), int(index[last])) for first, last in groups]


def _configured_draft_length(tl: EngineTimeline, starts: np.ndarray) -> np.ndarray:
    """For each start time, the num_speculative_tokens of the latest heartbeat at or before
    it (0: none said, or no heartbeat yet): per heartbeat, so an engine restarted without
    speculative decoding is not taken for one with it."""
    said = np.array([h.num_speculative_tokens for h in tl.heartbeats] + [0], dtype=np.int64)
    times = np.array([h.ts_ns for h in tl.heartbeats], dtype=np.int64)
    latest = times.searchsorted(starts, side="right") - 1
    return said[latest]  # -1 (none yet) reads the 0 appended


def _futile_episode(tl: EngineTimeline, first: int, last: int) -> Episode:
    rows = slice(first, last + 1)
    decoding = tl.col("num_decode_reqs")[rows] > 0
    steps = int(tl.col("num_decode_reqs")[rows].sum())
    accepted = int(tl.col("num_accepted_tokens")[rows].sum())
    draft_tokens = int(tl.col("num_draft_tokens")[rows].sum())
    # steps + accepted tokens came in `steps` request-iterations; without drafts, one each
    saved = accepted / (steps + accepted)
    length = int(_configured_draft_length(tl, tl.col("start_ns")[rows]).max())
    if not length:  # not said: the longest mean draft of an iteration, rounded up
        length = draft_slots(recorded_drafts(tl))
    drafts_text = f"drafts of up to {plural(length, 'token')}"
    return span_episode(
        tl,
        first,
        last,
        kind=FUTILE_KIND,
        title="Speculative decoding gains nothing",
        evidence=(
            f"{plural(int(decoding.sum()), 'decoding iteration')} with speculative decoding on "
            f"({drafts_text}): {plural(draft_tokens, 'draft token')} proposed and scored "
            f"for {plural(steps, 'decoding request-step')}, {accepted} accepted "
            f"({accepted / steps:.2%} of the request-steps), so drafts spared the requests at "
            f"most {saved:.2%} of their iterations; what speculation costs each step is not "
            "in the records"
        ),
        explanation=(
            "Speculative decoding gains only by its accepted tokens, each an output token a "
            "request gets without an iteration of its own. Next to none were accepted here, "
            "while every step still pays for speculation: its proposer runs, and the draft "
            "tokens it finds are scored beside the requests' own."
        ),
        setting=(
            f"Leave out --speculative-config (num_speculative_tokens now {length}): it spared "
            "the decoding requests next to nothing. Where drafts should match this load "
            "(n-gram drafts on prompts that repeat, a draft model trained for it), serve the "
            "same load with and without it and compare the time per output token."
        ),
        numbers={
            "num_iterations": int(decoding.sum()),
            "num_decode_steps": steps,
            "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted,
            "accepted_share": accepted / steps,
            "saved_share": saved,
            "num_speculative_tokens": length,
        },
    )
