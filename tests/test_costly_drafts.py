"""Speculative decoding's drafts that cost more than they save (telemetry/analysis/episodes/
drafts.py): explain finds them from tune's payoff over the 30 s before each 10 s step, costs
them and says what to change; it says them where the load made them cost, not where it made
them pay; it stays silent where drafts pay, where the fit cannot tell (its error too wide, no
cost of a decode token to price a draft token against) and on too few drafting iterations.
That the live sidecar opens the same findings, in time, and ranks them first is
tests/test_live_findings.py's, over the scenarios "drafts that cost", "drafts that pay" and
"drafts that stop paying"."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
from scenarios.synthetic import DRAFTS_CHANGE_S, SCENARIOS, Cost, Simulator, arrivals

from telemetry.analysis.episodes import Thresholds, detect_costly_drafts, detect_episodes
from telemetry.analysis.explain import main
from telemetry.analysis.findings import build_findings
from telemetry.analysis.timeline import NS_PER_S, EngineTimeline, build_timelines, read_timelines
from telemetry.analysis.tune import DraftPayoff, draft_payoff, fit_iteration_time
from telemetry.lane.record import SpecDecodeCounts, iteration_record

STEP_NS, WINDOW_NS = 10 * NS_PER_S, 30 * NS_PER_S  # Thresholds' defaults


@pytest.fixture(scope="module")
def costly():
    """The scenario's recording: drafts of 3 tokens that cost what a request's own token
    does, one request in four accepting any (12% of draft tokens)."""
    make, truth = SCENARIOS["drafts that cost"]
    assert truth == "costly_drafts"
    return make()


def window_timeline(timeline: EngineTimeline, step_start_ns: int) -> EngineTimeline:
    """The records that started in the 30 s before a step, as a timeline of their own."""
    records = [
        r for r in timeline.records if step_start_ns - WINDOW_NS <= r.start_ns < step_start_ns
    ]
    return EngineTimeline(timeline.engine_index, records, timeline.heartbeats)


def window_payoff(timeline: EngineTimeline, step_start_ns: int) -> DraftPayoff | None:
    """tune's payoff over the 30 s before a step; None without drafts there."""
    window = window_timeline(timeline, step_start_ns)
    if not window.col("num_drafts").any():
        return None
    return draft_payoff(window, fit_iteration_time(window))


def row_steps(timeline: EngineTimeline) -> np.ndarray:
    return timeline.col("start_ns") // STEP_NS


def test_explain_finds_drafts_that_cost_more_than_they_save(costly):
    """Each step's drafting iterations are judged on the 30 s before it: the first step that
    drafts has no drafts behind it and is not judged; the others are, the episode's figures
    are its latest step's, and each of its decode tokens came later by its own step's."""
    timeline = build_timelines(costly.messages)[0]
    findings = build_findings(timeline, detect_episodes(timeline), Thresholds())
    assert findings[0].kind == "costly_drafts"
    (episode,) = findings[0].episodes
    steps, drafting = row_steps(timeline), timeline.col("num_drafts") > 0
    first_step = steps[drafting][0]
    assert episode.start_ns == timeline.col("start_ns")[drafting & (steps > first_step)][0]
    payoffs = {
        step: window_payoff(timeline, step * STEP_NS) for step in set(steps[drafting].tolist())
    }
    assert payoffs[first_step] is None
    numbers, last_step = episode.numbers, steps[drafting][-1]
    payoff = payoffs[last_step]
    assert numbers["num_judgments"] == len(payoffs) - 1 >= 2
    assert numbers["added_share"] == pytest.approx(-payoff.saving) and -payoff.saving > 0.25
    assert numbers["added_share_error"] == pytest.approx(payoff.saving_error)
    assert payoff.saving_error < 0.01
    rows = np.flatnonzero(
        (timeline.col("start_ns") >= episode.start_ns) & (timeline.col("end_ns") <= episode.end_ns)
    )
    added_s = [
        payoffs[step].token_time_with_drafts - payoffs[step].token_time_without_drafts
        for step in steps[rows].tolist()
    ]
    cost = float((timeline.col("num_decode_tokens")[rows] * added_s).sum())
    assert findings[0].cost == pytest.approx(cost, rel=0.01)
    assert findings[0].cost_label == "slowed"
    shares = sorted(-payoffs[step].saving for step in payoffs if step != first_step)
    assert f"{len(shares)} times, drafts adding {shares[0]:.0%} to {shares[-1]:.0%}" in (
        episode.evidence
    )
    assert f"drafts add {-payoff.saving:.0%} (± " in episode.evidence
    accepted = timeline.col("num_accepted_tokens")[rows].sum()
    draft_tokens = timeline.col("num_draft_tokens")[rows].sum()
    assert numbers["acceptance_rate"] == pytest.approx(accepted / draft_tokens)
    assert f"({100 * accepted / draft_tokens:.1f}% of draft tokens)" in episode.evidence
    assert episode.setting.startswith("Turn speculative decoding off (leave out ")
    assert "num_speculative_tokens (drafts of up to 3 tokens now)" in episode.setting


@pytest.mark.parametrize(
    ("name", "before", "after"), [("drafts that stop paying", 1, 8), (None, 8, 1)]
)
def test_drafts_are_said_to_cost_where_their_load_made_them_cost(name, before, after):
    """Drafts accepted one request in ``before``, then in ``after`` from DRAFTS_CHANGE_S: the
    episode holds only iterations after the change where drafts came to cost, only before
    it where they stopped, give or take the window and step a verdict lags by. Where they
    stopped paying, a fit over the whole recording would have said they cost from the start."""
    from scenarios.synthetic import drafts_that_change

    sim = SCENARIOS[name][0]() if name else drafts_that_change(before, after)
    timeline = build_timelines(sim.messages)[0]
    change_ns, lag_ns = sim.at(DRAFTS_CHANGE_S), STEP_NS + WINDOW_NS
    (episode,) = detect_costly_drafts(timeline, Thresholds())
    if before < after:  # stopped paying
        assert change_ns < episode.start_ns <= change_ns + lag_ns
        assert episode.end_ns == timeline.col("end_ns")[-1]
        whole = draft_payoff(timeline, fit_iteration_time(timeline))
        assert -whole.saving - 2 * whole.saving_error > 0.1  # said from the start
    else:
        assert episode.start_ns < change_ns < episode.end_ns <= change_ns + lag_ns


def test_explain_prints_the_finding_and_its_action(costly, tmp_path, capsys):
    path = costly.write(tmp_path / "costly.jsonl")
    assert main([str(path)]) == 0
    text = capsys.readouterr().out
    assert "1. Speculative decoding's drafts cost more than they save: 1 time" in text
    assert "request-s slowed" in text
    assert main([str(path), "--json"]) == 0
    (engine,) = json.loads(capsys.readouterr().out)["engines"]
    assert engine["findings"][0]["kind"] == "costly_drafts"
    assert "--speculative-config" in engine["findings"][0]["action"]


def test_drafts_that_pay_are_no_finding():
    make, truth = SCENARIOS["drafts that pay"]
    timeline = build_timelines(make().messages)[0]
    assert truth is None
    assert draft_payoff(timeline, fit_iteration_time(timeline)).saving > 0.3
    assert detect_costly_drafts(timeline, Thresholds()) == []


def test_a_fit_too_uncertain_to_tell_says_nothing():
    """All but every third decoding request drafting: draft tokens move almost with decoding
    requests, so the fit can hardly price them apart. Its point estimate says drafts add
    more than 10%, its error leaves room for less: not said."""
    sim = Simulator(
        num_blocks=800,
        max_num_seqs=32,
        max_num_batched_tokens=1024,
        cost=Cost(base_time=0.020, generation_token_time=1e-3, draft_token_time=1e-3),
        num_spec_tokens=3,
        accept_one_in=4,
    )
    sim.add_requests(arrivals(6, 30, seed=5), num_prompt=96, num_output=60)
    timeline = build_timelines(sim.run(33).messages)[0]
    payoff = draft_payoff(timeline, fit_iteration_time(timeline))
    assert -payoff.saving > 0.1 and -payoff.saving - 2 * payoff.saving_error < 0.1
    assert detect_costly_drafts(timeline, Thresholds()) == []


def test_too_few_drafting_iterations_say_nothing(costly):
    """A step is judged on at least costly_drafts_min_iterations drafting iterations in the
    window before it: at the most any window has, found; one more, none."""
    timeline = build_timelines(costly.messages)[0]
    starts, drafting = timeline.col("start_ns"), timeline.col("num_drafts") > 0
    most = max(
        int(drafting[(starts >= step * STEP_NS - WINDOW_NS) & (starts < step * STEP_NS)].sum())
        for step in set(row_steps(timeline)[drafting].tolist())
    )
    assert detect_costly_drafts(timeline, Thresholds(costly_drafts_min_iterations=most))
    assert not detect_costly_drafts(timeline, Thresholds(costly_drafts_min_iterations=most + 1))


def drafting_records(decode_reqs_of) -> list:
    """60 s of 10 iterations a second: ``decode_reqs_of(number)`` decoding requests, up to 4
    of them drafting 3 tokens each, one accepted; an iteration takes 14 ms, plus 3 ms per
    draft token, whatever the number of decoding requests: drafts add to the time per output
    token about half at 4 decoding requests, four fifths at 7 or 8."""
    rng = random.Random(1)
    records = []
    for number in range(1, 601):
        drafting, decode_reqs = rng.randint(0, 4), decode_reqs_of(number)
        records.append(
            iteration_record(
                0,
                number,
                number,
                start_ns=number * 100_000_000,
                elapsed_ns=int((0.014 + 3 * drafting * 3e-3) * 1e9),
                num_decode_reqs=decode_reqs,
                num_decode_tokens=decode_reqs + drafting,
                num_running_reqs=decode_reqs,
                spec_decode=SpecDecodeCounts(drafting, 3 * drafting, drafting, [drafting, 0, 0])
                if drafting
                else None,
            )
        )
    return records


def test_where_decode_tokens_were_never_priced_drafts_are_not_judged():
    """Always 4 decoding requests: their cost is the base's, and no fit can say what a decode
    token costs; whether drafts pay would compare a draft token with nothing: not said,
    though the fit says drafts add about half."""
    timeline = build_timelines(drafting_records(lambda number: 4))[0]
    fit = fit_iteration_time(timeline)
    assert "decode_tokens" not in fit.coefficients and "draft_tokens" in fit.coefficients
    assert -draft_payoff(timeline, fit).saving > 0.4
    assert detect_costly_drafts(timeline, Thresholds()) == []


def test_a_decode_token_that_costs_next_to_nothing_is_priced_so():
    """7 or 8 decoding requests, each costing nothing beside the base: the fits price a decode
    token at about 0 (left out where it comes out below 0, which the first version took for
    a decode token never priced, and said nothing for those steps: 46 findings in an hour of
    one load, on and off). Every step after the first is judged, one finding."""
    timeline = build_timelines(drafting_records(lambda number: 7 + number % 2))[0]
    (episode,) = detect_costly_drafts(timeline, Thresholds())
    steps = row_steps(timeline)
    assert episode.start_ns == timeline.col("start_ns")[steps > steps[0]][0]
    assert episode.numbers["num_judgments"] == len(set(steps.tolist())) - 1
    assert 0.7 < episode.numbers["added_share"] < 0.9
    unpriced = [
        step
        for step in set(steps.tolist()) - {steps[0]}
        if "decode_tokens"
        not in fit_iteration_time(window_timeline(timeline, step * STEP_NS)).coefficients
    ]
    assert unpriced  # the case this test is about


def test_on_a_real_vllm_the_finding_is_first_and_says_what_tune_says():
    """tests/data/vllm_costly_drafts.jsonl: vLLM 0.32 drafting by ngram, about 2% of draft
    tokens accepted (bench/drafts_payoff_vllm.py, which measured the same load 2.46x faster
    per output token without drafts)."""
    path = Path(__file__).parent / "data" / "vllm_costly_drafts.jsonl"
    (timeline,) = read_timelines([path])[0].values()
    findings = build_findings(timeline, detect_episodes(timeline), Thresholds())
    assert [finding.kind for finding in findings][:1] == ["costly_drafts"]
    (episode,) = findings[0].episodes
    drafting = timeline.col("num_drafts") > 0
    payoff = window_payoff(timeline, row_steps(timeline)[drafting][-1] * STEP_NS)
    assert episode.numbers["added_share"] == pytest.approx(-payoff.saving)
    assert -payoff.saving - 2 * payoff.saving_error >= 0.1
    assert "drafts of up to 5 tokens now" in episode.setting
