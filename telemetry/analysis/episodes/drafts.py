"""Speculative decoding episodes: drafts that cost decoding requests more time than they save.

A draft token is scored by the target model beside its request's own token: it pays only when
enough of them are accepted. Whether they did is `tune`'s payoff (telemetry/analysis/tune.py,
``draft_payoff``): by the fit of iteration time over the timeline, a decoding request's time
per output token with the recorded drafts against without them. The episode is said only
where the fit prices a decode token and a draft token apart, over at least
``costly_drafts_min_iterations`` drafting iterations, and drafts add at least
``costly_drafts_min_added`` of the time per output token even ERROR_SIGMAS standard errors
in their favour: a claim the data hold, not the fit's noise.

The verdict is the whole timeline's (explain: the recording; the live sidecar: its window);
its episodes are the stretches of drafting iterations no more than ``idle_min_time`` apart.
"""

from __future__ import annotations

import numpy as np

from telemetry.analysis.episodes.episode import Episode, Thresholds, group_by_time, span_episode
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


def detect_costly_drafts(tl: EngineTimeline, th: Thresholds) -> list[Episode]:
    """Stretches of drafting iterations, where the timeline's drafts cost more than they save."""
    drafting = np.flatnonzero(tl.col("num_drafts") > 0)
    if drafting.size < th.costly_drafts_min_iterations:
        return []
    try:
        fit = fit_iteration_time(tl)
    except ValueError:  # too few timed iterations to fit
        return []
    payoff = draft_payoff(tl, fit)
    if (
        payoff is None
        or payoff.saving_error is None
        or "decode_tokens" not in fit.coefficients  # a draft token priced against nothing
        or -payoff.saving - ERROR_SIGMAS * payoff.saving_error < th.costly_drafts_min_added
    ):
        return []
    starts, ends = tl.col("start_ns")[drafting].tolist(), tl.col("end_ns")[drafting].tolist()
    groups = group_by_time(starts, int(th.idle_min_time * NS_PER_S), ends)
    return [_episode(tl, drafting[first : last + 1], fit, payoff) for first, last in groups]


def _episode(tl: EngineTimeline, rows: np.ndarray, fit: Fit, payoff: DraftPayoff) -> Episode:
    drafts, added = fit.drafts, -payoff.saving
    draft_cost, decode_cost = fit.coefficients["draft_tokens"], fit.coefficients["decode_tokens"]
    ms = 1000
    return span_episode(
        tl,
        int(rows[0]),
        int(rows[-1]),
        kind=KIND,
        title="Speculative decoding's drafts cost more than they save",
        evidence=(
            f"{plural(len(rows), 'iteration')} scored drafts: per decoding request and "
            f"iteration {drafts.draft_tokens_per_decode:.2f} draft tokens, "
            f"{drafts.output_tokens_per_decode - 1:.2f} accepted "
            f"({100 * drafts.acceptance_rate:.1f}% of draft tokens). By the fit of iteration "
            f"time, a draft token costs {draft_cost * 1e6:.0f} us and a decoding request's "
            f"own token {decode_cost * 1e6:.0f} us: at {payoff.num_decode_reqs:.1f} decoding "
            f"requests each gets an output token every "
            f"{payoff.token_time_with_drafts * ms:.1f} ms with drafts, every "
            f"{payoff.token_time_without_drafts * ms:.1f} ms without: drafts add {added:.0%} "
            f"(± {ERROR_SIGMAS * payoff.saving_error:.0%})"
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
            "added_share": added,
            "added_share_error": payoff.saving_error,
            "token_time_with_drafts_s": payoff.token_time_with_drafts,
            "token_time_without_drafts_s": payoff.token_time_without_drafts,
            "acceptance_rate": drafts.acceptance_rate,
        },
    )
