"""One concrete action per finding: the flag to change and the value to give it.

Values come from the recording itself: the token budget and sequence limit from `tune`'s fit
of iteration time (for a latency target of ``long_prefill_ratio`` times the median decode-only
iteration, the point where explain calls an iteration stretched), the KV size from how many
requests wanted in at once against how many of their length the cache holds (what `kv-plan`
computes from a model): the mean length of the requests that finished, weighted by how long
each ran (a long request holds its blocks longer, so the cache holds more of them), or where
none had, what each running one held, a lower bound (the action then says "at least"). Where
a value cannot be derived, the action says which command computes it and why it could not be
given here. A tune command an action quotes prints the value the action gives: the target is
quoted as it is parsed back.

A budget or sequence limit is drawn from the iterations that started within ACTION_HISTORY_S
before the episode, through its first (action_basis): the records the live sidecar holds when
the finding opens, which `explain` reads alike, so the two give one action. The tune command
quoted fits those iterations alone (``--iterations FIRST-LAST``). For a long prefill its
target is then 3x the very baseline the iteration was judged against. A KV size reads the
episode too (kv_action_basis): the requests that fill the cache are those that run in it, and
the 30 s before may hold only a warm-up's short ones (two 31-token requests sized a cache that
held 1.8 of the 300-token requests that filled it: "Set --max-num-seqs 4", which changed
nothing). The live finding's action follows its episode as it grows (live_findings), so it
ends as explain's for that episode; the alert reads the latest.

With speculative decoding tune's target is per output token and holds iterations to it times
the tokens a decoding request gets per iteration (telemetry/analysis/tune.py): the target
quoted is the iteration time explain holds to, divided by those tokens, so that tune holds
iterations to explain's latency, and its budget holds each decoding request's draft.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from telemetry.analysis.cli_time import parse_time
from telemetry.analysis.episodes import Episode, Thresholds
from telemetry.analysis.episodes.episode import (
    kv_memory_flag,
    kv_memory_text,
    kv_plan_hint,
    kv_plan_text,
    pct,
)
from telemetry.analysis.episodes.kv import leak_min_blocks, leaked_blocks
from telemetry.analysis.episodes.latency import decode_baselines, decode_only_rows
from telemetry.analysis.findings import Finding
from telemetry.analysis.spec_decode import draft_slots, output_tokens_per_decode, recorded_drafts
from telemetry.analysis.timeline import NS_PER_S, EngineTimeline
from telemetry.analysis.tune import (
    NO_PREFILL_TOKEN_COST,
    ROUGH_FIT_ERROR,
    UNTIMED_OR_UNSPLIT,
    PromptStepTooSlow,
    Recommendation,
    fit_error_text,
    fit_iteration_time,
    kv_max_seqs,
    recommend,
)
from telemetry.analysis.words import plural

KV_KINDS = ("kv_saturation", "kv_cliff", "preemption_storm")
KV_TARGET_USAGE = 0.9  # peak usage to plan for: headroom for requests that grow
MIN_CHUNK_TOKENS = (512, 256, 128, 64, 16)  # tune's --min-chunk: its default first
SEQS_STEP = 2  # an action raises --max-num-seqs at most this many times what was recorded
ACTION_HISTORY_S = 30.0  # the past a budget or sequence limit is drawn from (action_basis)
KV_HISTORY_TEXT = f"the {ACTION_HISTORY_S:g} s before it or during it"  # kv_action_basis


def _decode_baseline_s(tl: EngineTimeline, th: Thresholds) -> float | None:
    """What the detectors judged the last iteration of ``tl`` (an action basis: the episode's
    first) against, latency.decode_baselines: the median decode-only iteration of as many
    decode tokens before it; with too few of those, the median decode-only iteration."""
    decode_only = decode_only_rows(tl)
    if not decode_only.any():
        return None
    (baseline_ns,) = decode_baselines(tl, np.array([tl.num_iterations - 1]), th)
    if np.isnan(baseline_ns):
        baseline_ns = float(np.median(tl.col("elapsed_ns")[decode_only]))
    return baseline_ns / NS_PER_S


def itl_target_text(tl: EngineTimeline, th: Thresholds) -> str | None:
    """The latency explain holds iterations to (long_prefill_ratio x the median decode-only
    iteration of as many decoding requests: _decode_baseline_s) per output token (the
    iteration's, over the tokens a decoding request gets in one) as a --itl-target value,
    to 0.1 ms; None without a decode-only iteration."""
    baseline_s = _decode_baseline_s(tl, th)
    if baseline_s is None:
        return None
    target_ms = (
        th.long_prefill_ratio * baseline_s * 1000 / output_tokens_per_decode(recorded_drafts(tl))
    )
    return f"{max(round(target_ms, 1), 0.1):g}ms"


def kv_action_basis(tl: EngineTimeline, episode: Episode) -> EngineTimeline:
    """The iterations a KV size is drawn from: those that started within ACTION_HISTORY_S
    before the episode, through its last (the module's docstring)."""
    starts = tl.col("start_ns")
    first = int(starts.searchsorted(episode.start_ns - int(ACTION_HISTORY_S * NS_PER_S)))
    return tl.stretch(first, int(starts.searchsorted(episode.end_ns, side="right")))


def reads_whole_episode(episode: Episode) -> bool:
    """Whether the episode's action reads the episode itself (a KV size), not only what came
    before it: its live finding's action is then drawn again as the episode grows."""
    return episode.kind in KV_KINDS or (
        episode.kind == "waiting" and episode.numbers.get("reason") == "waiting_kv"
    )


def action_basis(tl: EngineTimeline, episode: Episode) -> tuple[EngineTimeline, str]:
    """The iterations a budget or sequence limit is drawn from: those that started within
    ACTION_HISTORY_S before the episode, through its first (the module's docstring), and the
    tune option that selects them."""
    starts, numbers = tl.col("start_ns"), tl.col("iteration")
    first = int(starts.searchsorted(episode.start_ns - int(ACTION_HISTORY_S * NS_PER_S)))
    stop = int(starts.searchsorted(episode.start_ns, side="right"))
    option = f" --iterations {numbers[first]}-{numbers[stop - 1]}" if stop > first else ""
    return tl.stretch(first, stop), option


@dataclass
class Tuned:
    """tune's recommendation for an action, with the tune command that prints it; or none,
    why not, and whether that is because no token budget meets the target at all: tune's
    verdict (PromptStepTooSlow), by its one rule for when the recording measured a fixed cost
    of carrying prompts near the chunk it is about; where it did not (PromptStepNotEstablished:
    prompt steps far bigger), no value, and why not is what tune says then, no impossibility."""

    rec: Recommendation | None
    text: str
    no_budget_meets_target: bool = False


def _tuned(tl: EngineTimeline, th: Thresholds, option: str, sizes_budget: bool = False) -> Tuned:
    """tune's recommendation at the latency explain holds iterations to, with the tune command
    that prints it (``option``: the iterations ``tl`` holds, action_basis); or none and why
    not. Where tune's default prefill chunk does not fit beside one decoding request within
    the target, smaller chunks are tried (MIN_CHUNK_TOKENS); where even the smallest does not,
    why not is what tune says then: that no budget meets the target where a fixed cost of
    carrying prompts exceeds it and the recording tells that cost apart (PromptStepTooSlow), or
    that this is not established and what would settle it where it does not
    (PromptStepNotEstablished, tune's rule: recommend raises one or the other).
    ``sizes_budget``: the token budget is what is asked, which a fit without a cost per
    prefill token only guesses: none then."""
    target = itl_target_text(tl, th)
    if target is None:
        return Tuned(
            None,
            f"no decode-only iteration ran in the {ACTION_HISTORY_S:g} s before the episode to "
            "set a latency target from; `iterscope tune RECORDING --itl-target TIME` over more "
            "of the run may give one",
        )
    try:
        fit = fit_iteration_time(tl)
    except ValueError as error:
        if not tl.known(UNTIMED_OR_UNSPLIT).all():  # the source gives no times: nowhere
            return Tuned(None, str(error))
        return Tuned(  # too few iterations before the episode: more of the run may do
            None,
            f"{error}, in the {ACTION_HISTORY_S:g} s before it; `iterscope tune RECORDING "
            f"--itl-target {target}` over more of the run may give one",
        )
    if fit.mean_abs_error_ratio > ROUGH_FIT_ERROR:
        return Tuned(
            None,
            f"the fit of iteration time over the {ACTION_HISTORY_S:g} s before the episode is "
            f"too rough to draw one from ({fit_error_text(fit)}); `iterscope tune RECORDING "
            f"--itl-target {target}` over a steadier stretch may give one",
        )
    if sizes_budget and "prefill_tokens" not in fit.coefficients:
        return Tuned(None, NO_PREFILL_TOKEN_COST)
    for min_chunk in MIN_CHUNK_TOKENS:
        try:
            rec = recommend(fit, parse_time(target), min_chunk, kv_max_seqs(tl)[0])
        except ValueError as error:
            why_not, fixed_cost = str(error), isinstance(error, PromptStepTooSlow)
            continue
        chunk = "" if min_chunk == MIN_CHUNK_TOKENS[0] else f" --min-chunk {min_chunk}"
        per_token = (
            f" over {fit.output_tokens_per_decode:.2f} tokens per decoding request and iteration"
            if fit.drafts
            else ""
        )
        return Tuned(
            rec,
            f"`iterscope tune RECORDING --itl-target {target}{chunk}{option}` "
            f"({th.long_prefill_ratio:g}x the median decode-only iteration of the "
            f"{ACTION_HISTORY_S:g} s before{per_token})",
        )
    command = f"`iterscope tune RECORDING --itl-target {target} --min-chunk {min_chunk}{option}`"
    # Only a prompt step's fixed cost makes every budget miss it alike; where a 16-token
    # chunk is too slow, smaller chunks still shorten the pause (keeping 8,192 tokens was
    # advised where 128 cut the pause from 45 s to 1 s). And only where the recording tells
    # that cost from the prompt tokens' (tune's PromptStepTooSlow): a fixed cost fitted to
    # prompts all of one size is extrapolated (PromptStepNotEstablished), and keeping the
    # budget would claim what tune does not (a vLLM whose prompts were all 479 tokens).
    return Tuned(None, f"by {command}, {why_not}", no_budget_meets_target=fixed_cost)


def _now(current: int | None) -> str:
    """`` (now N)`` after a flag when the engine reported the value it ran with, else nothing."""
    return f" (now {current})" if current else ""


def _budget_action(tl: EngineTimeline, option: str, th: Thresholds, lower: bool) -> str:
    tuned_for = _tuned(tl, th, option, sizes_budget=True)
    rec, tuned = tuned_for.rec, tuned_for.text
    current = tl.facts.get("max_num_batched_tokens")
    if lower and tuned_for.no_budget_meets_target:
        at = f" at {current}" if current else ""
        return (
            f"Keep --max-num-batched-tokens{at}: {tuned}. A smaller budget would only make more "
            "such iterations: the cost is the engine's for each iteration that carries prompts "
            "(on a GPU, typically those running outside its decode-only CUDA graphs)."
        )
    if rec is None:
        return (
            f"{'Lower' if lower else 'Raise'} --max-num-batched-tokens{_now(current)};"
            f" no value could be computed here: {tuned}."
        )
    value = rec.max_num_batched_tokens
    if current and lower and value >= current:
        return (
            f"Keep --max-num-batched-tokens at {current}: {tuned} suggests "
            f"{value}, so a latency target that loose does not call for a change."
        )
    if current and not lower and value <= current:  # prompts wait, but more would be slower
        return (
            f"Keep --max-num-batched-tokens at {current}: at the latency explain holds "
            f"iterations to, {tuned} allows {value}, no more than now, so a larger budget "
            "would break it; `iterscope tune RECORDING --itl-target T`, with T your own "
            "target, gives the budget for it."
        )
    seqs = tl.facts.get("max_num_seqs")
    if not lower and seqs and rec.max_num_seqs < seqs:
        # Prompts wait for the budget: fewer requests at once would queue them for the
        # sequence limit instead (applied, waiting grew 5x).
        return (
            f"Raise --max-num-batched-tokens{_now(current)} as far as your inter-token latency "
            f"allows: at the latency explain holds iterations to, {tuned} gives {value} only "
            f"with --max-num-seqs {rec.max_num_seqs}{_now(seqs)}, fewer requests at once, "
            "which would queue them for the sequence limit instead; `iterscope tune RECORDING "
            "--itl-target T`, with T your own target, gives the budget for it."
        )
    if lower and seqs and rec.max_num_seqs < min(seqs, rec.decode_reqs_seen):
        # The target is met only with fewer requests decoding than the engine ran at once:
        # the rest would queue for the sequence limit (applied, later arrivals waited 51 s).
        return (
            f"Lower --max-num-batched-tokens{_now(current)} as far as your inter-token "
            f"latency allows, so that prompts are split into chunks: at the latency explain "
            f"holds iterations to, {tuned} gives {value} only with --max-num-seqs "
            f"{rec.max_num_seqs}{_now(seqs)}, fewer than the "
            f"{plural(rec.decode_reqs_seen, 'request')} that decoded at once here, which "
            "would queue them for the sequence limit instead; `iterscope tune RECORDING "
            "--itl-target T`, with T your own target, gives the budget for it."
        )
    slots = 1 + draft_slots(recorded_drafts(tl))  # budget tokens per decoding request
    # A smaller budget computes prompts more slowly: said where the budget is lowered.
    ttft = (
        f"; prompts are then computed at {rec.prompt_throughput:.0f} tokens/s at most, so "
        "time to first token grows: keep {} if it matters more than inter-token latency"
    )
    # A budget below the sequence limit the engine refuses; one below its decoding requests'
    # drafts would leave some of them out of each iteration; and where tune's sequence limit
    # is below the engine's, it sized the two together (a full batch of decodes alone would
    # miss the target): said together, as tune prints them.
    if seqs and (value < seqs * slots or rec.max_num_seqs < seqs):
        return (
            f"Set --max-num-batched-tokens {value}{_now(current)} and --max-num-seqs "
            f"{rec.max_num_seqs}{_now(seqs)} together, from {tuned}"
            + ttft.format("both")
            + f"{_below_seen(rec)}{_seqs_beyond_seen(rec)}."
        )
    lowered = ttft.format("it") if current and value < current else ""
    return (
        f"Set --max-num-batched-tokens {value}{_now(current)}, from {tuned}{lowered}"
        f"{_below_seen(rec)}."
    )


def _below_seen(rec: Recommendation) -> str:
    """Where the budget is below every prompt-carrying iteration it was drawn from: said, with
    what to do (tune's note says the same)."""
    seen = rec.min_prompt_tokens_seen
    if rec.max_num_batched_tokens >= seen:
        return ""
    return f"; extrapolated (prompts came {seen}+ tokens at a time): lower it in steps"


def _seqs_beyond_seen(rec: Recommendation) -> str:
    """Where the sequence limit is above the most requests that decoded at once in the
    iterations it was drawn from: said, with what to do (tune's note says the same; a limit
    drawn from a warm-up's lone request was applied as it stood)."""
    if rec.max_num_seqs <= rec.decode_reqs_seen:
        return ""
    return (
        f"; --max-num-seqs {rec.max_num_seqs} is extrapolated (at most "
        f"{plural(rec.decode_reqs_seen, 'request')} decoded at once there): re-record at the "
        "new settings to confirm"
    )


def _seqs_action(tl: EngineTimeline, option: str, th: Thresholds) -> str:
    tuned_for = _tuned(tl, th, option)
    rec, tuned = tuned_for.rec, tuned_for.text
    current = tl.facts.get("max_num_seqs")
    if rec is None:
        return f"Raise --max-num-seqs{_now(current)}; no value could be computed here: {tuned}."
    if current and rec.max_num_seqs <= current:
        return (
            f"Keep --max-num-seqs at {current}: {tuned} allows "
            f"{rec.max_num_seqs} ({rec.limited_by}); send fewer concurrent requests or add an "
            "engine."
        )
    seen = max(rec.decode_reqs_seen, current or 0)
    if rec.max_num_seqs > SEQS_STEP * seen > 0:
        return (
            f"Set --max-num-seqs {SEQS_STEP * seen}{_now(current)}: {tuned} allows "
            f"{rec.max_num_seqs}, but those iterations never decoded more than "
            f"{plural(rec.decode_reqs_seen, 'request')} at once, so that is extrapolated; "
            "raise it in steps and re-record."
        )
    return f"Set --max-num-seqs {rec.max_num_seqs}{_now(current)}, from {tuned}."


@dataclass
class RequestLength:
    """KV tokens a request takes, and whether that is a lower bound (requests still growing)."""

    tokens: float
    what: str
    lower_bound: bool
    why_bound: str = ""  # why it is a bound: none finished, or those that did were shorter


def _request_length(tl: EngineTimeline) -> RequestLength | None:
    """The mean length of the requests that finished in ``tl``, weighted by how long each ran
    (kv_max_seqs); else, or where the running requests held more each at the highest usage
    (those that finished were shorter ones), a lower bound: the KV tokens each running request
    held then. None without a block size or any KV in use."""
    _, mean_length = kv_max_seqs(tl)
    finished = (
        f"the mean of those that finished in {KV_HISTORY_TEXT}, weighted by how long each ran"
    )
    held = _held_at_peak(tl)
    if mean_length is not None and (held is None or held <= mean_length):
        return RequestLength(mean_length, finished, False)
    if held is None:
        return None
    if mean_length is None:
        why = f"none finished in {KV_HISTORY_TEXT}"
    else:
        why = f"those that finished in {KV_HISTORY_TEXT} were shorter, {mean_length:.0f} tokens"
    what = f"what each running request held at the highest usage, {why}"
    return RequestLength(held, what, True, why)


def _held_at_peak(tl: EngineTimeline) -> float | None:
    """KV tokens each running request held at the highest usage; None if unknown."""
    block_size = int(tl.facts.get("block_size", 0))
    usage = tl.kv_usage
    if not block_size or not usage.size or usage.max() <= 0:
        return None
    peak = int(np.argmax(usage))
    running = int(tl.col("num_running_reqs")[peak])
    if running <= 0:
        return None
    return float(usage[peak]) * tl.num_kv_blocks_total * block_size / running


def _at_most(value: int, bound: bool) -> str:
    """A sequence limit, with `` or fewer`` where it is a bound (requests still growing)."""
    return f"{value} or fewer" if bound and value > 1 else str(value)


def _longest_fit_text(tl: EngineTimeline) -> str:
    """For requests still growing, whose length is only a lower bound: how many requests of
    the longest length the engine allows (its max_model_len, where its heartbeats say it)
    the cache holds, the limit that keeps them all whatever they grow to; "" if unknown."""
    max_model_len = int(tl.facts.get("max_model_len", 0))
    block_size = int(tl.facts.get("block_size", 0))
    if not max_model_len or not block_size or not tl.num_kv_blocks_total:
        return ""
    fit = tl.num_kv_blocks_total // math.ceil(max_model_len / block_size)
    return (
        f" ({plural(fit, 'request')} of the longest the engine allows, {max_model_len:,} "
        f"tokens, {'fits' if fit == 1 else 'fit'} whatever they grow to)"
    )


def _kv_action(tl: EngineTimeline, th: Thresholds) -> str:
    """From the iterations of ``tl`` (kv_action_basis): where blocks held by no request fill the
    cache, the leak; else how many requests wanted in at once against how many of their
    length the cache holds; or, where all fit, fewer together."""
    leak = _leak_text(tl, th)
    if leak:
        return leak
    wanted = tl.col("num_running_reqs") + tl.col("num_waiting_reqs")
    demand = int(wanted.max()) if wanted.size else 0
    length = _request_length(tl)
    if length is None or demand <= 0:
        return (
            f"Raise {kv_memory_text(tl)} or lower --max-num-seqs; no value could be computed "
            f"here (no block size or KV usage was recorded): {kv_plan_hint(tl)}."
        )
    blocks_each = math.ceil(length.tokens / int(tl.facts["block_size"]))
    fit = tl.num_kv_blocks_total // blocks_each  # 0: not one fits
    if 0 < demand <= fit:
        return _kv_peak_action(tl, length)
    at_least = "at least " if length.lower_bound else ""
    seqs = fit
    if length.lower_bound:  # a bound: below the most that ran at once, or it changes nothing
        seqs = min(fit, int(tl.col("num_running_reqs").max()) - 1)
    if not fit:
        fewer = ": fewer together cannot help, not one fits"
    elif seqs <= 0:
        fewer = ": fewer together cannot help, one ran at a time"
    else:
        fewer = f", or set --max-num-seqs {_at_most(seqs, length.lower_bound)}" + (
            _longest_fit_text(tl) if length.lower_bound else ""
        )
    # the blocks they take, paged; rounded up, so the size said holds them all
    factor = math.ceil(demand * blocks_each * 10 / tl.num_kv_blocks_total) / 10
    return (
        f"Raise {kv_memory_flag(tl)} to {at_least}{factor:.1f}x the cache's size now (it holds "
        f"{plural(fit, 'request')} of {length.tokens:.0f} tokens, "
        f"{plural(blocks_each, 'block')} each, {length.what}; up to {demand} wanted in at once; "
        f"{kv_plan_text(tl, f'{length.tokens:.0f}', 'such requests a SIZE holds')}){fewer}."
    )


def _leak_text(tl: EngineTimeline, th: Thresholds) -> str | None:
    """Where blocks held by no request (leaked_blocks, the leak finding's rule) are a leak
    at the iterations' highest usage, the action is the leak's: fewer requests or a larger
    cache only put off the day it fills again."""
    excess = leaked_blocks(tl)
    if not excess.size:
        return None
    peak = int(np.argmax(tl.kv_usage))
    if excess[peak] < leak_min_blocks(tl, th):
        return None
    return (
        f"Restart the engine to recover the {plural(int(excess[peak]), 'block')} held by no "
        f"running request ({pct(excess[peak] / tl.num_kv_blocks_total)} of the cache at its "
        "highest usage here: the KV leak finding) and report it with this recording; fewer "
        "requests together or a larger cache would only put off the day it fills again."
    )


def _kv_peak_action(tl: EngineTimeline, length: RequestLength) -> str:
    """Fewer requests together, so that their peak stays near KV_TARGET_USAGE; where
    ``length`` is a lower bound, those running were still growing (fewer still may be
    needed)."""
    growing = length.lower_bound
    usage = tl.kv_usage
    peak = int(np.argmax(usage))
    running = int(tl.col("num_running_reqs")[peak])
    value = max(1, int(running * KV_TARGET_USAGE / max(float(usage[peak]), 1e-9)))
    kv_plan = f"({kv_plan_text(tl, None, 'requests a size holds')})"
    took = f"{plural(running, 'request')} running together took KV usage to {pct(usage[peak])}"
    if value >= running:  # fewer requests cannot help: one alone fills the cache
        return f"Raise {kv_memory_text(tl)} {kv_plan}: {took}, fewer cannot run."
    near = f"near {100 * KV_TARGET_USAGE:.0f}%"
    if growing:
        return (
            f"Set --max-num-seqs {_at_most(value, growing)}: {took} while still growing "
            f"({length.why_bound}); {value} would have held it {near} "
            f"then{_longest_fit_text(tl)}; or raise {kv_memory_text(tl)} {kv_plan}."
        )
    return (
        f"Set --max-num-seqs {value}: {took}, and with {value} it stays {near}; or raise "
        f"{kv_memory_text(tl)} {kv_plan}."
    )


SLOWED_FIRST_TEXT = (
    "First find what else ran on the engine's host or device and keep it off its cores: the "
    "queue formed while decode iterations were slowed from outside the batch (the "
    "slowed-decode finding). If it forms again without that: "
)


def finding_action(tl: EngineTimeline, finding: Finding, th: Thresholds) -> str:
    """The one thing to change for this finding, naming the flag and, where known, the value;
    for a queue that formed while the engine was slowed from outside (related.py), freeing
    the engine first."""
    action = _finding_action(tl, finding, th)
    if not finding.worst.numbers.get("began_slowed"):
        return action
    return SLOWED_FIRST_TEXT + (action[0].lower() + action[1:] if action[1:2].islower() else action)


def _finding_action(tl: EngineTimeline, finding: Finding, th: Thresholds) -> str:
    kind, reason = finding.kind, finding.worst.numbers.get("reason")
    if kind == "long_prefill" or (kind == "waiting" and reason == "waiting_budget"):
        return _budget_action(*action_basis(tl, finding.worst), th, lower=kind == "long_prefill")
    if kind == "waiting" and reason == "waiting_seq_limit":
        return _seqs_action(*action_basis(tl, finding.worst), th)
    if reads_whole_episode(finding.worst):  # a KV size
        return _kv_action(kv_action_basis(tl, finding.worst), th)
    return finding.worst.setting


def episode_action(tl: EngineTimeline, episode: Episode, th: Thresholds) -> str:
    """One episode's action: what its live finding gives (live, each episode is a finding),
    and explain's for a finding whose worst episode it is."""
    return finding_action(tl, Finding(episode.kind, [episode], [0.0]), th)
