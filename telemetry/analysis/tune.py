"""`iterscope tune RECORDING.jsonl --itl-target 50ms`: a token budget and a sequence limit.

A decoding request gets one token per iteration, so its inter-token latency (ITL) is the time of
the iterations it is part of. We fit, by least squares over the recorded iterations,

    iteration_time = base + prefill_token_time * prefill_tokens
                     + decode_token_time * decode_tokens + prefill_req_time * prefill_requests
                     + decode_kv_token_time * decode_kv_tokens
                     + prompt_step_time * (1 if the iteration carries prompts, else 0)

(decode requests equal decode tokens, one each, so they share one term; the prompt step term
is what an iteration costs for carrying any prompt at all: GPU engines replay decode-only
iterations from CUDA graphs and run the others eager or piecewise, ~10 ms more on an H200 for
SmolLM2 whatever the chunk, which a cost per token cannot hold; decode KV tokens, the
decoding requests' context that attention reads, only where the records say it: FPM engines,
whose predictions then put the recording's mean context behind each decoding request, or
``--decode-context TOKENS`` where the operator asks for another; draft tokens, see below). A
feature that never varies, or varies only as a combination of the others, is left out. Then
choose:

- max_num_seqs: the most decoding requests whose decode-only iteration, plus a prefill chunk of
  ``--min-chunk`` tokens, stays within the target; never more than fit in the KV cache at the
  recorded request length (prompt + output of finished requests), when that is known;
- max_num_batched_tokens: those decoding tokens plus the largest prefill chunk that keeps a
  mixed iteration within the target, rounded down to a multiple of 16.

Iterations far slower than the fit (a stall, a hiccup) are left out of the second fit pass.
Then a few iterations that alone hold most of the variance (no more than the fit has values,
which it can always pass through) are checked by the rest: where the fit of the rest misses
them, they are beyond where iteration time is linear in the batch (a 7,000-token prompt's
attention on a CPU) and left out too, and said (_beyond_linear_range).

Where nothing varied (no cost per decode token nor per prefill token), no limit is set: tune
refuses. Where the cost per decode token is not measured (decode_cost_unidentified: the
iterations without prompts decoded too few distinct, or too alike, numbers of requests to
tell it from the fixed cost, or it is not above 0 by ERROR_SIGMAS standard errors), tune says
so beside the --max-num-seqs that rests on it; one above the most requests decoded at once
is said to be extrapolated, as the actions say it.

Where the cost of an iteration that carries any prompt at all, before its first prompt token
(base + prompt step + prefill request + one decoding request), is already above the target, no
token budget meets it (PromptStepTooSlow), but only where the recording measured prompt steps
about as small as the claim is about (one rule for tune and for the actions that call
``recommend``). The fit draws a line through the recorded prompt steps; its value near 0 prompt
tokens is the fixed cost, measured only as far down as the steps went: a CPU computes bigger
steps faster per token, so a line through steps of 291 to 2,037 tokens put 50 ms on carrying
a prompt at all where 4-token steps took no more than decoding alone. Were the whole cost of
carrying the smallest recorded step per token, a chunk of C tokens (``per_token_chunk``)
would meet the target; the verdict stands where the smallest recorded step held at most
MEASURED_NEAR x C prompt tokens (the line is read at most halfway below what was measured),
or where C is under BUDGET_MULTIPLE tokens (no budget helps either way). Elsewhere (prompts
all of 479 tokens, or 291 batched into bigger steps, on vLLM's CPU build) the fixed cost is an
extrapolation: tune says so (PromptStepNotEstablished), with the smallest prompt step
recorded and the chunk to re-record at.

Speculative decoding (records with ``spec_decode``, telemetry/analysis/spec_decode.py): a
decoding request computes its one token and a draft of up to k tokens, and produces that
token and the draft's accepted tokens. Then:

- the fit's decode tokens are those produced less the accepted draft tokens (one per decoding
  request), and ``draft_tokens * draft_token_time`` is one more term: the draft tokens scored;
- k is the largest draft a decoding request took (the largest mean draft of one iteration,
  rounded up: vLLM schedules up to --num-speculative-tokens per request), and the budget holds
  ``max_num_seqs * (1 + k) + --min-chunk`` tokens (max_num_seqs is lowered until it does);
- the ITL target is per output token as a client counts it (its decode time over its output
  tokens, vLLM's time per output token): a decode iteration gives each decoding request
  ``t = 1 + mean accepted tokens`` (accepted tokens over decoding request-steps, drafting or
  not), so every iteration is held to ``itl_target * t``. A streaming client receives a
  request's tokens in bursts of 1 + accepted, one burst per iteration;
- limits are sized for the costlier end of the draft: every decoding request with a full
  draft of k tokens, or with none and the budget they leave to the prefill chunk; the
  decode-only iteration and its throughput (output tokens/s) put the recording's mean draft
  behind each decoding request, as they put its mean decode context.

Without drafts, k = 0 and t = 1: the limits and output are those of the model above.

Whether drafts pay (``draft_payoff``): a decode-only iteration of the recording's mean
number of decoding requests, by the fit, gives each request an output token every
``time / t`` with the recording's mean draft behind each request, and every ``time'`` with
none (the draft-token term, which also holds the proposer's own work per draft token, left
out). Only where the fit has a draft-token cost: where every decoding request drafted
alike, draft tokens move with decoding requests and their costs cannot be told apart (or the
cost came out below 0 and was dropped), which tune says. How sure that is: the share's
standard error (``saving_error``), carried from the covariance of the fitted costs (the
residuals' variance over the design, ``Fit.covariance``) to the share by its gradient; explain's
costly_drafts finding (telemetry/analysis/episodes/drafts.py) asks the share to hold at
two standard errors.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NoReturn

import numpy as np

from telemetry.analysis.cli_time import latency
from telemetry.analysis.fpm_recording import add_fpm_producer_argument, tune_lines
from telemetry.analysis.spec_decode import (
    Drafts,
    draft_slots,
    output_tokens_per_decode,
    recorded_drafts,
)
from telemetry.analysis.timeline import NS_PER_S, EngineTimeline, nothing_to_read, read_timelines
from telemetry.analysis.words import plural
from telemetry.lane.record import EVENT_FINISHED, UNKNOWN_ELAPSED, UNKNOWN_PREFILL_REQS

# Fit coefficients, in the order the fit tries them (feature_columns).
FEATURE_NAMES = [
    "prefill_tokens",
    "decode_tokens",
    "prefill_reqs",
    "decode_kv_tokens",
    "draft_tokens",
    "prompt_steps",
]
# What `tune --json` calls them, which scripts read (the names from before the vocabulary
# was prefill/decode, kept at this boundary): coefficients, and the Fit fields renamed since.
JSON_NAMES = {
    "prefill_tokens": "ctx_tokens",
    "decode_tokens": "gen_tokens",
    "prefill_reqs": "ctx_reqs",
    "max_decode_reqs_seen": "max_gen_reqs_seen",
}
UNTIMED_OR_UNSPLIT = UNKNOWN_ELAPSED | UNKNOWN_PREFILL_REQS  # rows the fit cannot use
OUTLIER_SIGMAS = 5.0
ERROR_SIGMAS = 2  # how many standard errors a figure's uncertainty is said in
# Why a fit may have no prompt token cost; its budget is then a guess (_budget).
NO_PREFILL_TOKEN_COST = (
    "no cost per prefill token could be fitted (prompt tokens did not vary apart from the "
    "rest, or their cost came out below 0)"
)
BUDGET_MULTIPLE = 16
# A fitted cost of carrying prompts at all is measured, not extrapolated, where the smallest
# recorded prompt step held at most this multiple of the chunk the claim is about (module doc).
MEASURED_NEAR = 2
MAX_SEQS_CAP = 4096
# Above this mean |error| a fit is rough: tune says so beside its values, and an action
# (actions.py) gives none from it. Steady recordings fit to 1-15% here; a run whose
# iterations wait on something the features do not hold (a loaded host, a frozen step
# left in) fits to 60-90%.
ROUGH_FIT_ERROR = 0.35
# A fit of p values passes through p iterations whatever the rest say: where p or fewer hold
# this share of the variance of iteration time, R^2 is theirs (_beyond_linear_range).
DOMINANT_SHARE = 0.9
# The cost per decode token is told from an iteration's fixed cost only where the fitted
# iterations without prompts decoded this many times as many requests at most as at fewest
# (decode_cost_unidentified).
DECODE_SPREAD = 2


@dataclass
class PromptStepSizes:
    """The prompt tokens of the fit's iterations that carried prompts: their lower and upper
    quartile, the fewest and the most, and the smallest step recorded (the fastest of those
    with the fewest prompt tokens): its decoding requests and time."""

    count: int
    lower_quartile: int
    upper_quartile: int
    smallest_tokens: int
    largest_tokens: int
    smallest_decode_reqs: int
    smallest_time: float


@dataclass
class Fit:
    """Seconds per unit of each feature; ``base_time`` is the fixed cost of an iteration."""

    base_time: float
    coefficients: dict[str, float]
    rmse_time: float
    mean_abs_error_ratio: float
    r_squared: float
    num_iterations: int
    num_outliers: int
    max_tokens_seen: int
    max_decode_reqs_seen: int
    num_beyond_linear: int = 0  # left out: they set the fit alone, the rest disagree
    # The fewest and the most decoding requests of the fitted iterations without prompts;
    # None: no fitted iteration decoded without prompts.
    decode_only_reqs: tuple[int, int] | None = None
    min_prompt_tokens_seen: int = 0  # the fewest prompt tokens a fitted iteration with any had
    prompt_step_sizes: PromptStepSizes | None = None  # None: no fitted iteration had prompts
    decode_context_tokens: float = 0.0  # mean decode KV tokens per decoding request (FPM)
    max_decode_context_seen: float = 0.0  # the largest of one iteration's own mean
    target_decode_context_tokens: int | None = None  # --decode-context, where it is honoured
    drafts: Drafts | None = None  # speculative decoding's, where the recording has drafts
    # Covariance of (base_time, *coefficients) in that order, from the fit's residuals; None
    # where too few iterations were left to estimate it.
    covariance: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def draft_slots(self) -> int:
        """Budget tokens a decoding request takes beside its own one: k, 0 without drafts."""
        return draft_slots(self.drafts)

    @property
    def output_tokens_per_decode(self) -> float:
        """Tokens a decoding request gets per iteration, t (1.0 without drafts)."""
        return output_tokens_per_decode(self.drafts)

    def iteration_target(self, itl_target: float) -> float:
        """The iteration time that gives an output token every ``itl_target`` seconds."""
        return itl_target * self.output_tokens_per_decode

    @property
    def predicted_decode_context_tokens(self) -> float:
        """The KV tokens predictions put behind each decoding request: the target where one
        is set (only on a fit with a decode-context cost: at_decode_context), else the
        recording's mean."""
        if self.target_decode_context_tokens is None:
            return self.decode_context_tokens
        return self.target_decode_context_tokens

    def predict(
        self,
        prefill_tokens: float = 0,
        decode_tokens: float = 0,
        prefill_reqs: float = 0,
        draft_tokens: float | None = None,
    ) -> float:
        """Seconds of an iteration of ``decode_tokens`` decoding requests; ``draft_tokens``
        their draft tokens, None: the recording's mean draft behind each (0 without drafts)."""
        row = self.design_row(prefill_tokens, decode_tokens, prefill_reqs, draft_tokens)
        return float(row @ self.weights)

    @property
    def weights(self) -> np.ndarray:
        """The base time, then the coefficients in their order: what design_row weighs."""
        return np.array([self.base_time, *self.coefficients.values()])

    def design_row(
        self,
        prefill_tokens: float = 0,
        decode_tokens: float = 0,
        prefill_reqs: float = 0,
        draft_tokens: float | None = None,
    ) -> np.ndarray:
        """An iteration's features as the fit weighs them: 1 (the base), then one value per
        coefficient, in their order (predict's arguments)."""
        if draft_tokens is None:
            draft_tokens = decode_tokens * (
                self.drafts.draft_tokens_per_decode if self.drafts else 0
            )
        values = {
            "prefill_tokens": prefill_tokens,
            "decode_tokens": decode_tokens,
            "prefill_reqs": prefill_reqs,
            "decode_kv_tokens": decode_tokens * self.predicted_decode_context_tokens,
            "draft_tokens": draft_tokens,
            "prompt_steps": float(prefill_tokens > 0 or prefill_reqs > 0),
        }
        return np.array([1.0, *(values[name] for name in self.coefficients)])

    def standard_error(self, name: str) -> float | None:
        """One standard error of the coefficient ``name``; None without a covariance."""
        if self.covariance is None:
            return None
        index = 1 + list(self.coefficients).index(name)
        return float(np.sqrt(max(self.covariance[index, index], 0.0)))

    def decode_request_time(self, draft_tokens: float | None = None) -> float:
        """What one more decoding request costs an iteration (its token, its context and its
        ``draft_tokens``, None: the mean draft)."""
        return self.predict(decode_tokens=1, draft_tokens=draft_tokens) - self.base_time

    def to_json(self) -> dict:
        """As `tune --json` prints it (JSON_NAMES); the drafts go beside it (main)."""
        fields = asdict(self)
        del fields["drafts"], fields["covariance"]
        data = {JSON_NAMES.get(key, key): value for key, value in fields.items()}
        data["coefficients"] = {
            JSON_NAMES.get(name, name): value for name, value in self.coefficients.items()
        }
        return data


def _least_squares(x: np.ndarray, y: np.ndarray, names: list[str]) -> dict[str, float]:
    """Fit with an intercept; features that never vary or vary only as a combination of the
    others are left out, and features whose coefficient comes out negative (noise) are
    dropped and the rest refitted, so costs are never < 0. A prefill token cost that comes
    out negative beside a prefill request cost drops the request cost instead: prompts of
    about one length make the two nearly one column, and the split between them noise; the
    token budget limits tokens, so their cost is what it must know (given to the requests,
    no budget would seem too large). A base that comes out negative is held at 0 (the rest
    refitted): the features then share what a narrow range of them left to the intercept."""
    names = _independent([n for i, n in enumerate(names) if np.ptp(x[:, i]) > 0], x)
    intercept = True
    while True:
        solution, *_ = np.linalg.lstsq(_design(x, names, intercept), y, rcond=None)
        if intercept and solution[0] < 0:
            intercept = False
            continue
        base, costs = (solution[0] if intercept else 0.0), solution[1:]
        negative = [n for n, c in zip(names, costs, strict=True) if c < 0]
        if not negative:
            return {"base": float(base), **dict(zip(names, map(float, costs), strict=True))}
        if negative[0] == "prefill_tokens" and "prefill_reqs" in names:
            names.remove("prefill_reqs")
        else:
            names.remove(negative[0])


def _independent(names: list[str], x: np.ndarray) -> list[str]:
    """``names`` in order, each kept only if its column adds to the rank of those kept (with
    the intercept): a decode context that is a fixed multiple of the decode count, say."""
    kept: list[str] = []
    for name in names:
        if np.linalg.matrix_rank(_design(x, [*kept, name])) == len(kept) + 2:
            kept.append(name)
    return kept


def _design(x: np.ndarray, names: list[str], intercept: bool = True) -> np.ndarray:
    """The fit's design matrix: a column of ones (the base, or of zeros where the base is
    held at 0), then the features ``names``."""
    ones = np.full(len(x), 1.0 if intercept else 0.0)
    return np.column_stack([ones, x[:, [FEATURE_NAMES.index(n) for n in names]]])


def _untimed_hint(tl: EngineTimeline) -> str:
    if tl.known(UNTIMED_OR_UNSPLIT).all():
        return ""
    return (
        " (the recording's source gave no iteration times or batch split: run vLLM 0.26 or "
        "later with --enable-logging-iteration-details, or iterscope's scheduler source)"
    )


def feature_columns(tl: EngineTimeline) -> np.ndarray:
    """The FEATURE_NAMES of each iteration, a column each. Decode tokens are one per decoding
    request: those produced less the accepted draft tokens (all those produced without
    drafts); draft tokens are those scored, accepted or not; decode KV tokens are FPM
    engines' only (0, so left out, elsewhere); prompt steps are 1 where the iteration carries
    prompt tokens."""
    columns = {
        "prefill_tokens": tl.col("num_prefill_tokens"),
        "decode_tokens": tl.col("num_decode_tokens") - tl.col("num_accepted_tokens"),
        "prefill_reqs": tl.col("num_prefill_reqs"),
        "decode_kv_tokens": tl.col("num_decode_kv_tokens"),
        "draft_tokens": tl.col("num_draft_tokens"),
        "prompt_steps": tl.col("num_prefill_tokens") > 0,
    }
    return np.column_stack([columns[name] for name in FEATURE_NAMES]).astype(float)


def fit_iteration_time(tl: EngineTimeline) -> Fit:
    """Least-squares fit of iteration time; raises ValueError when there is too little data
    (its message does not name the engine: the caller's line does)."""
    num_tokens = tl.num_computed_tokens
    busy = (num_tokens > 0) & tl.known(UNTIMED_OR_UNSPLIT)
    if busy.sum() < 10:
        raise ValueError(
            f"{plural(int(busy.sum()), 'iteration')} did work with a measured time and "
            "batch; at least 10 are needed to fit iteration time" + _untimed_hint(tl)
        )
    x = feature_columns(tl)[busy]
    y = tl.col("elapsed_ns")[busy] / NS_PER_S
    solution = _least_squares(x, y, FEATURE_NAMES)
    residuals = y - _predict(solution, x)
    sigma = 1.4826 * float(np.median(np.abs(residuals - np.median(residuals))))
    keep = residuals <= OUTLIER_SIGMAS * max(sigma, 1e-6)
    solution = _least_squares(x[keep], y[keep], FEATURE_NAMES)
    beyond = _beyond_linear_range(x, y, keep, len(solution))
    if beyond.any():
        keep &= ~beyond
        solution = _least_squares(x[keep], y[keep], FEATURE_NAMES)
    residuals = y[keep] - _predict(solution, x[keep])
    total_variance = float(((y[keep] - y[keep].mean()) ** 2).sum())
    covariance = _covariance(solution, x[keep], residuals)
    return Fit(
        base_time=solution.pop("base"),
        coefficients=solution,
        rmse_time=float(np.sqrt((residuals**2).mean())),
        mean_abs_error_ratio=float(np.mean(np.abs(residuals) / y[keep])),
        r_squared=1 - float((residuals**2).sum()) / total_variance if total_variance else 1.0,
        num_iterations=int(keep.sum()),
        num_outliers=int((~keep).sum()) - int(beyond.sum()),
        num_beyond_linear=int(beyond.sum()),
        decode_only_reqs=_decode_only_reqs(x[keep]),
        max_tokens_seen=int(num_tokens[busy].max()),
        max_decode_reqs_seen=int(tl.col("num_decode_reqs").max()),
        min_prompt_tokens_seen=_min_prompt_tokens(x[keep]),
        prompt_step_sizes=_prompt_step_sizes(
            x[keep], y[keep], tl.col("num_decode_reqs")[busy][keep]
        ),
        decode_context_tokens=_decode_context(x),
        max_decode_context_seen=_max_decode_context(x),
        drafts=recorded_drafts(tl),
        covariance=covariance,
    )


def _beyond_linear_range(
    x: np.ndarray, y: np.ndarray, keep: np.ndarray, num_values: int
) -> np.ndarray:
    """The kept rows to leave out as beyond the range where iteration time is linear in the
    batch (a mask over all rows; none as a rule). A fit of ``num_values`` values can pass
    through that many iterations whatever the rest say: where that many or fewer of the kept
    rows, the farthest from the mean time, hold DOMINANT_SHARE of its variance, R^2 is theirs
    and the costs they set are set by them alone (one 7,000-token prompt on a CPU gave 3.7 ms
    per prefill token and R^2 1.000 where 40-token steps cost under 1 ms a token). The rest,
    fitted without them, then check them: where it misses one by more than ROUGH_FIT_ERROR of
    its time (attention over a long chunk grows faster than its tokens), they are left out;
    where it predicts them, or cannot price what they hold (no other row carried prompts),
    they stay."""
    none = np.zeros(len(y), dtype=bool)
    rows = np.flatnonzero(keep)
    deviations = (y[rows] - y[rows].mean()) ** 2
    if not deviations.sum():
        return none
    order = np.argsort(deviations)[::-1]
    share = np.cumsum(deviations[order]) / deviations.sum()
    count = int(np.searchsorted(share, DOMINANT_SHARE)) + 1
    dominant = none.copy()
    dominant[rows[order[:count]]] = True
    rest = keep & ~dominant
    if count > num_values or rest.sum() <= num_values:
        return none
    full = set(_least_squares(x[keep], y[keep], FEATURE_NAMES))
    solution = _least_squares(x[rest], y[rest], FEATURE_NAMES)
    if not full <= set(solution):
        return none
    miss = np.abs(_predict(solution, x[dominant]) - y[dominant]) / y[dominant]
    return dominant if (miss > ROUGH_FIT_ERROR).any() else none


def _decode_only_reqs(x: np.ndarray) -> tuple[int, int] | None:
    """The fewest and the most decoding requests of the rows without prompt tokens that
    decoded any; None without such a row."""
    decodes = x[:, FEATURE_NAMES.index("decode_tokens")]
    decode_only = decodes[(x[:, FEATURE_NAMES.index("prefill_tokens")] == 0) & (decodes > 0)]
    if not decode_only.size:
        return None
    return int(decode_only.min()), int(decode_only.max())


def decode_cost_unidentified(fit: Fit) -> str | None:
    """Why the fit's cost per decode token is not measured; None where it is. It is the slope
    of iteration time in the decoding requests, told from the fixed cost (the base) only by
    how the requests varied among iterations that carry no prompt (beside a prompt, whose own
    cost is far larger and less linear, one decode more is lost in it: two recordings whose
    decodes varied only beside prompts gave 3.6 ms per decode token where 2 to 16 decoding
    alone gave 0.6). So it is measured only where:

    - the fitted iterations without prompts decoded at most DECODE_SPREAD times as many
      requests as at fewest, or more: short of that, the decodes' share of an iteration at
      the fewest is more than the range ever changed it by, and its split from the base is a
      guess (fits over 2 to 3 decoding requests gave 43 us to 15 ms per decode token where
      2 to 16 gave 0.6 ms);
    - the cost was fitted (not dropped as below 0), and is above 0 by ERROR_SIGMAS standard
      errors, where the fit has a covariance."""
    if fit.decode_only_reqs is None:
        return "no fitted iteration decoded without prompts"
    fewest, most = fit.decode_only_reqs
    if fewest == most:
        return (
            f"the fitted iterations without prompts all decoded {plural(fewest, 'request')} "
            "at once: from one count a decode token's cost cannot be told from an iteration's "
            "fixed cost"
        )
    if most < DECODE_SPREAD * fewest:
        return (
            f"the fitted iterations without prompts decoded {fewest} to {most} requests at "
            f"once, less than {DECODE_SPREAD}-fold apart: too narrow a range to tell a decode "
            "token's cost from an iteration's fixed cost"
        )
    cost = fit.coefficients.get("decode_tokens")
    if cost is None:
        return "its cost came out below 0 (noise) and was left out"
    error = fit.standard_error("decode_tokens")
    if error is not None and cost <= ERROR_SIGMAS * error:
        return (
            f"it came out {cost * 1e6:.0f} us, within {ERROR_SIGMAS} standard errors "
            f"(± {ERROR_SIGMAS * error * 1e6:.0f} us) of 0"
        )
    return None


def _covariance(
    solution: dict[str, float], x: np.ndarray, residuals: np.ndarray
) -> np.ndarray | None:
    """The covariance of the fitted (base, *coefficients), in ``solution``'s order: the
    residuals' variance times the inverse of the design's Gram matrix (a base held at 0,
    exactly 0 as no fit gives it, has none). None without more rows than fitted values."""
    intercept = solution["base"] != 0.0
    design = _design(x, [name for name in solution if name != "base"], intercept)
    degrees_of_freedom = len(x) - design.shape[1] + (not intercept)
    if degrees_of_freedom < 1:
        return None
    variance = float((residuals**2).sum()) / degrees_of_freedom
    return variance * np.linalg.pinv(design.T @ design)


def _min_prompt_tokens(x: np.ndarray) -> int:
    """The fewest prompt tokens of the rows that carry any (0 without such a row)."""
    prompt_tokens = x[:, FEATURE_NAMES.index("prefill_tokens")]
    carried = prompt_tokens[prompt_tokens > 0]
    return int(carried.min()) if carried.size else 0


def _prompt_step_sizes(
    x: np.ndarray, y: np.ndarray, decode_reqs: np.ndarray
) -> PromptStepSizes | None:
    """The sizes of the rows that carry prompts (``y`` their seconds, ``decode_reqs`` their
    decoding requests); None without such a row. The quartiles are recorded sizes (the lower
    one rounded down, the upper up)."""
    prompt_tokens = x[:, FEATURE_NAMES.index("prefill_tokens")]
    carried = prompt_tokens > 0
    if not carried.any():
        return None
    tokens = prompt_tokens[carried]
    smallest = np.flatnonzero(carried & (prompt_tokens == tokens.min()))
    fastest = int(smallest[np.argmin(y[smallest])])
    return PromptStepSizes(
        count=int(carried.sum()),
        lower_quartile=int(np.percentile(tokens, 25, method="lower")),
        upper_quartile=int(np.percentile(tokens, 75, method="higher")),
        smallest_tokens=int(tokens.min()),
        largest_tokens=int(tokens.max()),
        smallest_decode_reqs=int(decode_reqs[fastest]),
        smallest_time=float(y[fastest]),
    )


def _decode_context(x: np.ndarray) -> float:
    """Mean decode KV tokens per decoding request over the fit's rows (0 without any)."""
    decode_tokens = x[:, FEATURE_NAMES.index("decode_tokens")].sum()
    decode_kv_tokens = x[:, FEATURE_NAMES.index("decode_kv_tokens")].sum()
    return float(decode_kv_tokens / decode_tokens) if decode_tokens else 0.0


def _max_decode_context(x: np.ndarray) -> float:
    """The largest decode KV tokens per decoding request of one iteration (0 without any)."""
    decode_tokens = x[:, FEATURE_NAMES.index("decode_tokens")]
    decode_kv_tokens = x[:, FEATURE_NAMES.index("decode_kv_tokens")]
    decoding = decode_tokens > 0
    return float((decode_kv_tokens[decoding] / decode_tokens[decoding]).max(initial=0.0))


def at_decode_context(fit: Fit, tokens: int | None) -> tuple[Fit, str | None]:
    """``fit`` predicting at ``tokens`` of context per decoding request (None: the recorded
    mean), and why that cannot be honoured where it cannot (the fit is then unchanged): only a
    fit with a cost of its own for the decodes' context can price another context."""
    if tokens is None:
        return fit, None
    if "decode_kv_tokens" in fit.coefficients:
        return replace(fit, target_decode_context_tokens=tokens), None
    if not fit.decode_context_tokens:
        return fit, "the recording holds no decoding request's context (FPM engines' records do)"
    return fit, (
        "the fit found no cost of the decoding requests' context apart from their number "
        "(the context did not vary apart from it, or its cost came out below 0): each "
        f"decode's cost holds the recorded mean of {fit.decode_context_tokens:.0f} KV tokens"
    )


def _predict(solution: dict[str, float], x: np.ndarray) -> np.ndarray:
    y = np.full(len(x), solution["base"])
    for name, coefficient in solution.items():
        if name != "base":
            y += coefficient * x[:, FEATURE_NAMES.index(name)]
    return y


def kv_max_seqs(tl: EngineTimeline) -> tuple[int | None, float | None]:
    """(requests that fit in the KV cache at the length of a running request, that length).

    That length: the mean length (prompt + output tokens) of the requests that finished, each
    weighted by how long it ran, first scheduled to finish. A request the cache holds at any
    moment is more often a long one, which holds its blocks longer: many short requests and a
    few long ones fill the cache with the long ones, which the plain mean understates. The
    plain mean where a finished request's times are not known."""
    finished = [m for r in tl.records for m in r.milestones if m.event & EVENT_FINISHED]
    block_size = int(tl.facts.get("block_size", 0))
    if not finished or not block_size or not tl.num_kv_blocks_total:
        return None, None
    lengths = np.array([m.num_prompt_tokens + m.num_output_tokens for m in finished], float)
    ran_ns = np.array(
        [m.finished_ns - m.first_scheduled_ns if m.first_scheduled_ns else 0 for m in finished],
        float,
    )
    if (ran_ns > 0).all():
        mean_length = float(np.average(lengths, weights=ran_ns))
    else:
        mean_length = float(lengths.mean())
    return requests_held(tl.num_kv_blocks_total, block_size, mean_length), mean_length


def requests_held(num_blocks: int, block_size: int, tokens: float) -> int:
    """How many requests of ``tokens`` tokens ``num_blocks`` KV blocks hold (at least 1)."""
    return max(1, int(num_blocks // math.ceil(tokens / block_size)))


@dataclass
class Recommendation:
    itl_target: float
    max_num_seqs: int
    max_num_batched_tokens: int
    decode_iteration_time: float
    worst_iteration_time: float
    generation_throughput: float
    prompt_throughput: float
    limited_by: str
    decode_reqs_seen: int = 0  # the most decoding requests in one recorded iteration
    min_prompt_tokens_seen: int = 0  # the fewest prompt tokens of a fitted iteration with any
    notes: list[str] = field(default_factory=list)
    # Why the cost per decode token that max_num_seqs rests on is not measured; None: it is.
    decode_cost_unidentified: str | None = None


class PromptStepTooSlow(ValueError):
    """No budget meets the target: an iteration that carries any prompt at all, before its
    first prompt token, is slower than the target (a fixed cost: no smaller chunk helps), and
    the recording measured prompt steps near the size that claim is about (the module doc)."""


class PromptStepNotEstablished(ValueError):
    """By the fit no budget would meet the target, as for PromptStepTooSlow, but the fixed
    cost that says so is extrapolated: read as per token, the cost of carrying the smallest
    recorded prompt step would leave room for a chunk of BUDGET_MULTIPLE tokens or more, and
    that step was over MEASURED_NEAR times the chunk (the module doc). Whether a budget meets
    the target is then not known; re-recording smaller prompt steps settles it."""


def recommend(
    fit: Fit, itl_target: float, min_chunk_tokens: int = 512, kv_seqs: int | None = None
) -> Recommendation:
    """Largest max_num_seqs and budget whose iterations keep within itl_target (seconds) per
    output token: within fit.iteration_target(itl_target) each (the module doc)."""
    _check_costs_fitted(fit)
    iteration_target = fit.iteration_target(itl_target)
    slots = 1 + fit.draft_slots  # budget tokens per decoding request
    decode_token_time = fit.decode_request_time(fit.draft_slots)
    prefill_token_time = fit.coefficients.get("prefill_tokens", 0.0)
    fixed_time = fit.predict(prefill_reqs=1)  # the base, a prompt's and a prompt step's costs
    floor = fixed_time + decode_token_time  # beside one decoding request, before any token
    if floor > iteration_target:
        _prompt_step_too_slow(fit, itl_target, floor)
    room_time = iteration_target - fixed_time - prefill_token_time * min_chunk_tokens
    if room_time < decode_token_time:
        fastest = fit.predict(
            decode_tokens=1,
            prefill_tokens=min_chunk_tokens,
            prefill_reqs=1,
            draft_tokens=fit.draft_slots,
        )
        raise ValueError(
            f"an ITL target of {itl_target * 1000:.1f} ms{_iteration_text(fit, itl_target)} is "
            f"below the fastest iteration that decodes one request{_draft_text(fit)} beside a "
            f"{min_chunk_tokens}-token prefill chunk ({fastest * 1000:.1f} ms by the fit); "
            "raise the target or lower --min-chunk"
        )
    latency_seqs = int(room_time // decode_token_time) if decode_token_time > 0 else MAX_SEQS_CAP
    max_num_seqs = min(latency_seqs, MAX_SEQS_CAP)
    limited_by = "latency target" if latency_seqs < MAX_SEQS_CAP else f"tune's cap, {MAX_SEQS_CAP}"
    if kv_seqs is not None and kv_seqs < max_num_seqs:
        max_num_seqs, limited_by = kv_seqs, "KV cache capacity"
    budget = _budget(fit, iteration_target, max_num_seqs, min_chunk_tokens)
    if budget - max_num_seqs * slots < min_chunk_tokens:  # a full batch would starve prompts
        max_num_seqs, limited_by = (budget - min_chunk_tokens) // slots, "latency target"
    decode_time = fit.predict(decode_tokens=max_num_seqs)
    chunk_only_time = fit.predict(prefill_tokens=budget, prefill_reqs=1)
    return Recommendation(
        itl_target=itl_target,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        decode_iteration_time=decode_time,
        worst_iteration_time=worst_iteration_time(fit, budget, max_num_seqs),
        generation_throughput=max_num_seqs * fit.output_tokens_per_decode / decode_time,
        prompt_throughput=budget / chunk_only_time,
        limited_by=limited_by,
        decode_reqs_seen=fit.max_decode_reqs_seen,
        min_prompt_tokens_seen=fit.min_prompt_tokens_seen,
        notes=_extrapolation_notes(fit, max_num_seqs, budget),
        decode_cost_unidentified=decode_cost_unidentified(fit),
    )


def _check_costs_fitted(fit: Fit) -> None:
    """Raise where the fit has neither a cost per decode token nor one per prefill token:
    every iteration then costs the same whatever its batch, and nothing sets a limit (a
    recording of 4 requests decoding and no prompt gave --max-num-seqs 4096, tune's cap)."""
    if {"decode_tokens", "prefill_tokens"} & set(fit.coefficients):
        return
    prefill_why = (
        "no fitted iteration computed prompt tokens"
        if fit.prompt_step_sizes is None
        else "prompt tokens did not vary apart from the rest, or their cost came out below 0"
    )
    raise ValueError(
        "no limit can be set from this recording: the fit has no cost per decode token "
        f"({decode_cost_unidentified(fit)}) and none per prefill token ({prefill_why}): "
        "iteration time did not vary with the batch; tune a recording whose requests "
        "decoding at once varied (several concurrencies) and that computed prompts"
    )


def per_token_chunk(fit: Fit, itl_target: float) -> int | None:
    """The prompt tokens a chunk beside one decoding request (and its full draft) could hold
    within the target were the whole cost of carrying the smallest recorded prompt step per
    token, which prompt steps of one size cannot rule out; None without a recorded prompt
    step. Below 0 where not even a decode-only iteration of one request meets the target."""
    sizes = fit.prompt_step_sizes
    if sizes is None:
        return None
    smallest = sizes.smallest_tokens
    carrying = fit.predict(prefill_tokens=smallest, prefill_reqs=1) - fit.base_time
    room = fit.iteration_target(itl_target) - fit.predict(
        decode_tokens=1, draft_tokens=fit.draft_slots
    )
    return math.floor(room / carrying * smallest) if carrying > 0 else None


def _prompt_step_too_slow(fit: Fit, itl_target: float, floor: float) -> NoReturn:
    """Raise why no budget meets the target: PromptStepTooSlow where the recording measured
    prompt steps near the chunk a per-token reading allows, or where even that reading leaves
    only a chunk under BUDGET_MULTIPLE tokens; else PromptStepNotEstablished, with what was
    measured and what would settle it (the module doc)."""
    ms = 1000
    carrying = fit.predict(prefill_reqs=1) - fit.base_time  # a prompt's and a prompt step's
    of_it = f", {carrying * ms:.1f} ms of it for carrying a prompt at all" if carrying else ""
    target = f"an ITL target of {itl_target * ms:.1f} ms{_iteration_text(fit, itl_target)}"
    sizes, chunk = fit.prompt_step_sizes, per_token_chunk(fit, itl_target)
    if (
        sizes is None
        or chunk is None
        or chunk < BUDGET_MULTIPLE
        or sizes.smallest_tokens <= MEASURED_NEAR * chunk
    ):
        raise PromptStepTooSlow(
            f"{target} is below the fastest iteration that decodes one request"
            f"{_draft_text(fit)} beside a prompt ({floor * ms:.1f} ms by the fit before its "
            f"first prompt token{of_it}): no token budget or --min-chunk meets it; raise the "
            "target"
        )
    low, high = sizes.lower_quartile, sizes.upper_quartile
    if sizes.smallest_tokens == sizes.largest_tokens:
        spread = f"all {plural(sizes.smallest_tokens, 'prompt token')}"
    else:
        spread = f"{sizes.smallest_tokens} to {sizes.largest_tokens} prompt tokens"
        if low == high:
            spread += f", at least half of them {low}"
        elif high - low < sizes.largest_tokens - sizes.smallest_tokens:
            spread += f", half of them {low} to {high}"
    decodes = sizes.smallest_decode_reqs
    beside = plural(decodes, "decoding request") if decodes else "no decoding request"
    raise PromptStepNotEstablished(
        f"whether any token budget meets {target} is not established: the fit puts the fastest "
        f"iteration that decodes one request{_draft_text(fit)} beside a prompt at "
        f"{floor * ms:.1f} ms before its first prompt token{of_it}, but that fixed cost is "
        f"extrapolated: the smallest of the {plural(sizes.count, 'fitted iteration')} with "
        f"prompts ({spread}) held {plural(sizes.smallest_tokens, 'prompt token')} beside "
        f"{beside} and took {sizes.smallest_time * ms:.1f} ms, more than {MEASURED_NEAR}x "
        f"the {chunk}-token chunk beside one decoding request{_draft_text(fit)} that would "
        "meet the target were the cost of carrying it all per token, and below the steps "
        "measured the cost of carrying prompts at all and their tokens' cannot be told apart "
        "(a CPU computes bigger steps faster per token): re-record with prompt steps of "
        f"{chunk} tokens or fewer (a lower --max-num-batched-tokens, or shorter prompts) and "
        "tune that recording to confirm"
    )


def _draft_ends(fit: Fit) -> tuple[int, ...]:
    """The drafts per decoding request that bound an iteration's cost: none, or a full one
    (a cost is linear in the draft, so one of the two is the costlier)."""
    return (0, fit.draft_slots) if fit.draft_slots else (0,)


def worst_iteration_time(fit: Fit, budget: int, max_num_seqs: int) -> float:
    """The slowest iteration a full budget allows: a prefill chunk beside one decoding
    request, or beside ``max_num_seqs`` of them, each with no draft or a full one, whichever
    the fit says costs more (one request without a draft where a prompt token costs more
    than a decoding request: the chunk gets the rest of the budget)."""
    return max(
        fit.predict(
            decode_tokens=decodes,
            prefill_tokens=budget - decodes * (1 + drafts),
            prefill_reqs=1,
            draft_tokens=decodes * drafts,
        )
        for decodes in (1, max_num_seqs)
        for drafts in _draft_ends(fit)
    )


def _budget(fit: Fit, iteration_target: float, max_num_seqs: int, min_chunk_tokens: int) -> int:
    """The largest budget whose worst iteration (worst_iteration_time) keeps within the
    iteration target, rounded down to BUDGET_MULTIPLE tokens while that still leaves a
    prefill chunk of ``min_chunk_tokens`` beside one decoding request and its full draft
    (recommend checked that one fits)."""
    slots = 1 + fit.draft_slots
    prefill_token_time = fit.coefficients.get("prefill_tokens", 0.0)
    if prefill_token_time <= 0:  # no prefill cost fitted: a guess (_extrapolation_notes)
        return max_num_seqs * slots + 16 * min_chunk_tokens
    fixed_time = fit.predict(prefill_reqs=1)
    budget = min(  # d decodes of j drafts: fixed + d decodes + (budget - d (1 + j)) prompt tokens
        decodes * (1 + drafts)
        + (iteration_target - fixed_time - fit.decode_request_time(drafts) * decodes)
        / prefill_token_time
        for decodes in (1, max_num_seqs)
        for drafts in _draft_ends(fit)
    )
    budget = max(int(budget + 1e-6), slots + min_chunk_tokens)  # 431.99999... is 432 tokens
    rounded = budget // BUDGET_MULTIPLE * BUDGET_MULTIPLE
    return rounded if rounded >= slots + min_chunk_tokens else budget


def _extrapolation_notes(fit: Fit, max_num_seqs: int, budget: int) -> list[str]:
    notes = []
    if budget > fit.max_tokens_seen:
        notes.append(
            f"the recording has at most {plural(fit.max_tokens_seen, 'token')} per "
            "iteration: "
            f"{budget} is extrapolated, re-record at the new settings to confirm"
        )
    if budget < fit.min_prompt_tokens_seen:
        notes.append(
            f"the recording's iterations with prompts held at least "
            f"{plural(fit.min_prompt_tokens_seen, 'prompt token')}: {budget} is extrapolated "
            "below them, where the cost of carrying prompts at all and their tokens' cannot be "
            "told apart; lower the budget in steps and re-record to confirm"
        )
    if max_num_seqs > fit.max_decode_reqs_seen:  # as the actions say it (actions.py)
        notes.append(
            f"--max-num-seqs {max_num_seqs} is extrapolated (at most "
            f"{plural(fit.max_decode_reqs_seen, 'request')} decoded at once in the recording): "
            "re-record at the new settings to confirm"
        )
    target = fit.target_decode_context_tokens
    if target is not None and target > fit.max_decode_context_seen:
        notes.append(
            f"the recording's decoding requests held at most "
            f"{fit.max_decode_context_seen:.0f} KV tokens each (an iteration's mean): "
            f"--decode-context {target} is extrapolated"
        )
    if "prefill_tokens" not in fit.coefficients:
        notes.append(f"{NO_PREFILL_TOKEN_COST}: the budget is a guess")
    return notes


def _iteration_text(fit: Fit, itl_target: float) -> str:
    """`` (iterations of X ms)`` after an ITL target where drafts make the two differ."""
    if fit.drafts is None:
        return ""
    return f" (iterations of {fit.iteration_target(itl_target) * 1000:.1f} ms)"


def _draft_text(fit: Fit) -> str:
    """`` with a K-token draft`` where the recording has drafts."""
    return f" with a {fit.draft_slots}-token draft" if fit.drafts else ""


def _per_token_text(fit: Fit, iteration_time: float) -> str:
    """`` (X ms per output token)`` after an iteration time where drafts make them differ."""
    if fit.drafts is None:
        return ""
    return f" ({iteration_time / fit.output_tokens_per_decode * 1000:.1f} ms per output token)"


@dataclass
class DraftPayoff:
    """By the fit, a decode-only iteration of ``num_decode_reqs`` decoding requests (the
    recording's mean): a request's seconds per output token with the recording's mean draft
    behind each request, and without drafts (the module doc)."""

    num_decode_reqs: float
    token_time_with_drafts: float
    token_time_without_drafts: float
    saving_error: float | None = None  # one standard error of ``saving``; None: not known

    @property
    def saving(self) -> float:
        """The share of time per output token drafts save (below 0: what they add)."""
        return 1 - self.token_time_with_drafts / self.token_time_without_drafts


def draft_payoff(tl: EngineTimeline, fit: Fit) -> DraftPayoff | None:
    """Whether drafts pay, by the fit; None without drafts or without a draft-token cost."""
    if fit.drafts is None or "draft_tokens" not in fit.coefficients:
        return None
    decode_reqs = tl.col("num_decode_reqs")
    num_decode_reqs = float(decode_reqs[decode_reqs > 0].mean())
    with_drafts = fit.design_row(decode_tokens=num_decode_reqs) / fit.output_tokens_per_decode
    without_drafts = fit.design_row(decode_tokens=num_decode_reqs, draft_tokens=0)
    token_time_with, token_time_without = with_drafts @ fit.weights, without_drafts @ fit.weights
    error = None
    if fit.covariance is not None:
        # saving = 1 - with / without: its gradient in the coefficients, then its variance
        gradient = (token_time_with * without_drafts - token_time_without * with_drafts) / (
            token_time_without**2
        )
        error = float(np.sqrt(max(gradient @ fit.covariance @ gradient, 0.0)))
    return DraftPayoff(num_decode_reqs, float(token_time_with), float(token_time_without), error)


def _payoff_line(payoff: DraftPayoff | None) -> str:
    """Whether drafts pay, as tune says it."""
    if payoff is None:
        return (
            "  whether drafts pay is not known: no cost per draft token could be fitted "
            "(draft tokens did not vary apart from the decoding requests, each drafting "
            "alike, or their cost came out below 0)"
        )
    ms = 1000
    saving = payoff.saving
    verdict = f"save {saving:.0%}" if saving >= 0 else f"add {-saving:.0%}"
    if payoff.saving_error is not None:
        verdict += (
            f" (± {ERROR_SIGMAS * payoff.saving_error:.0%} at {ERROR_SIGMAS} standard errors)"
        )
    line = (
        f"  drafts {verdict} of the time per output token, by the fit of their draft tokens' "
        "cost (what speculation costs every step, drafted or not, is not in the records): "
        f"at the recording's "
        f"mean of {payoff.num_decode_reqs:.1f} decoding requests, each gets an output token "
        f"every {payoff.token_time_with_drafts * ms:.1f} ms with their drafts, every "
        f"{payoff.token_time_without_drafts * ms:.1f} ms without"
    )
    if saving < 0:
        line += "; fewer draft tokens or none (--speculative-config) would decode faster"
    return line


def _draft_lines(fit: Fit, payoff: DraftPayoff | None) -> list[str]:
    """The speculative decoding figures the limits use, and whether drafts pay; none
    without drafts."""
    drafts = fit.drafts
    if drafts is None:
        return []
    accepted = drafts.output_tokens_per_decode - 1
    tokens = drafts.output_tokens_per_decode
    return [
        f"  speculative decoding: per decoding request and iteration "
        f"{drafts.draft_tokens_per_decode:.2f} draft tokens, {accepted:.2f} accepted "
        f"({100 * drafts.acceptance_rate:.1f}% of draft tokens), drafts of up to "
        f"{plural(fit.draft_slots, 'token')}",
        f"  limits give each decoding request 1 + {fit.draft_slots} budget tokens and hold "
        f"iteration time to the ITL target x {tokens:.2f} tokens per decoding request",
        _payoff_line(payoff),
    ]


# --------------------------------------------------------------------------------------------
# Command line


def fit_error_text(fit: Fit) -> str:
    """``mean |error| 65.5%, R^2 0.860``, as the report's fit line says it. A rough fit with
    an R^2 near 1 says why the two disagree: a few long iterations (a 7,000-token prompt)
    hold most of the variance, so R^2 is theirs, and the error is that of the many short."""
    text = f"mean |error| {100 * fit.mean_abs_error_ratio:.1f}%, R^2 {fit.r_squared:.3f}"
    if fit.mean_abs_error_ratio > ROUGH_FIT_ERROR and fit.r_squared >= 0.9:
        text += ", which the few longest iterations set: the many short ones are the error"
    return text


def _rough_fit_lines(fit: Fit) -> list[str]:
    if fit.mean_abs_error_ratio <= ROUGH_FIT_ERROR:
        return []
    return [
        f"  the fit is rough (mean |error| above {100 * ROUGH_FIT_ERROR:.0f}%): iteration time "
        "here depends on more than the batch, so the values below are guesses; fit a steadier "
        "stretch (--iterations) or a run without other load"
    ]


def format_report(
    tl: EngineTimeline,
    fit: Fit,
    rec: Recommendation,
    kv_seqs: int | None,
    kv_length: float | None,
    decode_context_refused: str | None = None,
) -> list[str]:
    ms, us = 1000, 1e6
    coefficient_text = ", ".join(
        f"{us * fit.coefficients[name]:.2f} us per {label}"
        for name, label in (
            ("prefill_tokens", "prefill token"),
            ("decode_tokens", "decode token"),
            ("prefill_reqs", "prefill request"),
            ("decode_kv_tokens", "decode KV token"),
            ("draft_tokens", "draft token"),
        )
        if name in fit.coefficients
    )
    if "prompt_steps" in fit.coefficients:
        coefficient_text += (
            f", {ms * fit.coefficients['prompt_steps']:.3f} ms per iteration carrying prompts"
        )
    formula = " + ".join([f"{fit.base_time * ms:.3f} ms", *filter(None, [coefficient_text])])
    lines = [
        f"Engine {tl.engine_index}: fit over {plural(fit.num_iterations, 'iteration')} "
        f"({plural(fit.num_outliers, 'outlier')} left out{_beyond_linear_text(fit)})",
        f"  iteration time = {formula}",
        f"  fit error: RMSE {fit.rmse_time * ms:.3f} ms, {fit_error_text(fit)}",
        *_rough_fit_lines(fit),
        *_draft_lines(fit, draft_payoff(tl, fit)),
    ]
    if fit.target_decode_context_tokens is not None:
        lines.append(
            f"  predictions put --decode-context {fit.target_decode_context_tokens} KV tokens "
            f"behind each decoding request (the recording's mean: "
            f"{fit.decode_context_tokens:.0f})"
        )
    elif "decode_kv_tokens" in fit.coefficients:
        lines.append(
            f"  predictions put the recording's mean decode context behind each decoding "
            f"request: {fit.decode_context_tokens:.0f} KV tokens"
        )
    if decode_context_refused is not None:
        lines.append(
            f"  --decode-context not honoured: {decode_context_refused}; the predictions and "
            "limits below are for the recorded contexts"
        )
    current_seqs = tl.facts.get("max_num_seqs")
    current_budget = tl.facts.get("max_num_batched_tokens")
    if current_seqs and current_budget:
        seqs = min(current_seqs, current_budget // (1 + fit.draft_slots))
        worst = worst_iteration_time(fit, current_budget, seqs)
        itl = "" if fit.drafts else " (ITL)"
        lines.append(
            f"  current: --max-num-seqs {current_seqs}, --max-num-batched-tokens "
            f"{current_budget} -> worst iteration{itl} {worst * ms:.1f} ms predicted"
            + _per_token_text(fit, worst)
        )
    if kv_seqs is not None and kv_length is not None:
        lines.append(
            f"  KV cache: {plural(tl.num_kv_blocks_total, 'block')}, room for "
            f"{plural(kv_seqs, 'request')} of the mean recorded length "
            f"({kv_length:.0f} tokens) at once"
        )
    if rec.decode_cost_unidentified is not None:
        lines.append(
            f"  the cost per decode token is not measured: {rec.decode_cost_unidentified}; "
            "--max-num-seqs and the decode figures below rest on it, a guess: tune a "
            f"recording whose requests decoding at once varied {DECODE_SPREAD}-fold or more "
            "(several concurrencies)"
        )
    lines += [
        f"Recommended for ITL <= {rec.itl_target * ms:.1f} ms"
        f"{_iteration_text(fit, rec.itl_target)}: --max-num-seqs {rec.max_num_seqs} "
        f"--max-num-batched-tokens {rec.max_num_batched_tokens} (--max-num-seqs limited by "
        f"{rec.limited_by})",
        f"  predicted: decode-only iteration {rec.decode_iteration_time * ms:.1f} ms at "
        f"{plural(rec.max_num_seqs, 'request')} -> {rec.generation_throughput:.0f} decode "
        "tokens/s; "
        f"worst mixed iteration {rec.worst_iteration_time * ms:.1f} ms"
        f"{_per_token_text(fit, rec.worst_iteration_time)}; prefill "
        f"{rec.prompt_throughput:.0f} tokens/s at a full budget",
    ]
    lines += [f"  note: {note}" for note in [*rec.notes, *tune_lines(tl)]]
    return lines


def _beyond_linear_text(fit: Fit) -> str:
    """What the fit line says of the iterations left out as beyond the linear range."""
    count = fit.num_beyond_linear
    if not count:
        return ""
    they = "it" if count == 1 else "they"
    return (
        f"; {plural(count, 'iteration')} beyond where iteration time is linear in the batch: "
        f"alone {they} held {DOMINANT_SHARE:.0%}+ of its variance, and the rest of the fit "
        f"misses {'it' if count == 1 else 'them'} by over {ROUGH_FIT_ERROR:.0%} (a long "
        "prompt's attention grows faster than its tokens)"
    )


def context_tokens(text: str) -> int:
    """``--decode-context``: a whole number of tokens, 0 or more."""
    try:
        tokens = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of tokens: {text!r}") from None
    if tokens < 0:
        raise argparse.ArgumentTypeError(f"a context is 0 tokens or more, not {tokens}")
    return tokens


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iterscope tune",
        description="Fit iteration time from a recording and recommend max_num_batched_tokens "
        "and max_num_seqs for an inter-token latency target.",
    )
    parser.add_argument("recordings", nargs="+", type=Path, help="JSONL recording file(s)")
    parser.add_argument(
        "--itl-target",
        type=latency,
        required=True,
        metavar="LATENCY",
        help="inter-token latency target, with its unit: 50ms, 0.05s, 50000us",
    )
    parser.add_argument(
        "--min-chunk",
        type=int,
        default=512,
        help="prefill tokens an iteration must still fit beside a full decode batch (default 512)",
    )
    parser.add_argument(
        "--decode-context",
        type=context_tokens,
        metavar="TOKENS",
        help="predict with this many KV tokens of context behind each decoding request "
        "(prompt and output so far) instead of the recording's mean; only where the fit has "
        "a decode-context cost (FPM engines whose context varied), else tune says it is not "
        "honoured",
    )
    parser.add_argument(
        "--iterations",
        type=iteration_range,
        metavar="FIRST-LAST",
        help="fit only the iterations numbered FIRST to LAST (as a finding's action quotes them)",
    )
    parser.add_argument("--engine", type=int, help="only this engine index")
    add_fpm_producer_argument(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    return parser


def iteration_range(text: str) -> tuple[int, int]:
    """``FIRST-LAST``: two iteration numbers, FIRST not above LAST."""
    first, dash, last = text.partition("-")
    if not (dash and first.isdigit() and last.isdigit() and int(first) <= int(last)):
        raise argparse.ArgumentTypeError(
            f"'{text}' is not FIRST-LAST, two iteration numbers with FIRST not above LAST "
            "(e.g. 1200-1450)"
        )
    return int(first), int(last)


def iterations_stretch(tl: EngineTimeline, first: int, last: int) -> tuple[EngineTimeline, int]:
    """The iterations numbered ``first`` to ``last`` of one run of the engine (numbers that
    only grow from one to the other), and how many such stretches the timeline holds: more
    than one where the engine restarted and numbered them again (the first is taken)."""
    numbers = tl.col("iteration")
    stretches = []
    for start in np.flatnonzero(numbers == first).tolist():
        ends = np.flatnonzero(numbers[start:] == last)
        stop = start + int(ends[0]) + 1 if ends.size else start
        if ends.size and (np.diff(numbers[start:stop]) > 0).all():
            stretches.append((start, stop))
    if not stretches:
        raise ValueError(f"no iterations numbered {first} to {last} in one run")
    return tl.stretch(*stretches[0]), len(stretches)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.min_chunk < 0:
        print("iterscope tune: --min-chunk must be >= 0", file=sys.stderr)
        return 2
    try:
        all_timelines, _, num_bad = read_timelines(args.recordings, args.fpm_producer)
    except (OSError, ValueError) as error:  # missing, a folder, unreadable, not a recording
        print(f"iterscope tune: {error}", file=sys.stderr)
        return 2
    timelines = all_timelines
    if args.engine is not None:
        timelines = {k: v for k, v in timelines.items() if k == args.engine}
    results, status = [], 0
    for tl in timelines.values():
        try:
            if args.iterations:
                tl, num_stretches = iterations_stretch(tl, *args.iterations)
                if num_stretches > 1:
                    print(
                        f"iterscope tune: engine {tl.engine_index}: iterations "
                        f"{'-'.join(map(str, args.iterations))} come {num_stretches} times "
                        "(the engine restarted): the first are fitted",
                        file=sys.stderr,
                    )
            fit, refused = at_decode_context(fit_iteration_time(tl), args.decode_context)
            kv_seqs, kv_length = kv_max_seqs(tl)
            rec = recommend(fit, args.itl_target, args.min_chunk, kv_seqs)
        except ValueError as error:
            print(f"iterscope tune: engine {tl.engine_index}: {error}", file=sys.stderr)
            results.append({"engine_index": tl.engine_index, "error": str(error)})
            status = 1
            continue
        result = {
            "engine_index": tl.engine_index,
            "fit": fit.to_json(),
            "recommendation": asdict(rec),
            "fpm_notes": tune_lines(tl),
            "decode_context_refused": refused,
        }
        if fit.drafts is not None:
            payoff = draft_payoff(tl, fit)
            result["spec_decode"] = {
                **fit.drafts.to_json(),
                "iteration_time_target": fit.iteration_target(args.itl_target),
                "payoff": asdict(payoff) if payoff else None,
            }
        results.append(result)
        if not args.json:
            print("\n".join(format_report(tl, fit, rec, kv_seqs, kv_length, refused)))
    if not timelines:
        print(
            f"iterscope tune: {nothing_to_read(all_timelines, num_bad, args.engine)}",
            file=sys.stderr,
        )
        return 2  # input it cannot use, as an unreadable file (and timeline, explain)
    if args.json:
        print(json.dumps({"engines": results}, indent=2))
    return status
