"""Speculative decoding's drafts that cost more than they save (telemetry/analysis/episodes/
drafts.py): explain finds them from tune's payoff, costs them and says what to change; it
stays silent where drafts pay, where the fit cannot tell (its error too wide, no cost of a
decode token to price a draft token against) and on too few drafting iterations. That the
live sidecar opens the same finding, in time, and ranks it first is
tests/test_live_findings.py's, over the scenarios "drafts that cost" and "drafts that pay"."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from scenarios.synthetic import SCENARIOS, Cost, Simulator, arrivals

from telemetry.analysis.episodes import Thresholds, detect_costly_drafts, detect_episodes
from telemetry.analysis.explain import main
from telemetry.analysis.findings import build_findings
from telemetry.analysis.timeline import build_timelines, read_timelines
from telemetry.analysis.tune import draft_payoff, fit_iteration_time
from telemetry.lane.record import SpecDecodeCounts, iteration_record


@pytest.fixture(scope="module")
def costly():
    """The scenario's recording: drafts of 3 tokens that cost what a request's own token
    does, one request in four accepting any (12% of draft tokens)."""
    make, truth = SCENARIOS["drafts that cost"]
    assert truth == "costly_drafts"
    return make()


def test_explain_finds_drafts_that_cost_more_than_they_save(costly):
    timeline = build_timelines(costly.messages)[0]
    findings = build_findings(timeline, detect_episodes(timeline))
    assert findings[0].kind == "costly_drafts"
    (episode,) = findings[0].episodes
    payoff = draft_payoff(timeline, fit_iteration_time(timeline))
    numbers = episode.numbers
    assert numbers["added_share"] == pytest.approx(-payoff.saving) and -payoff.saving > 0.25
    assert numbers["added_share_error"] == payoff.saving_error < 0.01
    # every decode token the drafting iterations produced came that much later
    added_s = payoff.token_time_with_drafts - payoff.token_time_without_drafts
    drafting = timeline.col("num_drafts") > 0
    first, last = drafting.nonzero()[0][[0, -1]]
    tokens = timeline.col("num_decode_tokens")[first : last + 1].sum()
    assert findings[0].cost == pytest.approx(tokens * added_s)
    assert findings[0].cost_label == "slowed"
    assert f"drafts add {-payoff.saving:.0%} (± " in episode.evidence
    assert "12.5% of draft tokens" in episode.evidence
    assert episode.setting.startswith("Turn speculative decoding off (leave out ")
    assert "num_speculative_tokens (drafts of up to 3 tokens now)" in episode.setting


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
    timeline = build_timelines(costly.messages)[0]
    num_drafting = int((timeline.col("num_drafts") > 0).sum())
    assert detect_costly_drafts(timeline, Thresholds(costly_drafts_min_iterations=num_drafting))
    assert not detect_costly_drafts(
        timeline, Thresholds(costly_drafts_min_iterations=num_drafting + 1)
    )


def test_without_a_cost_per_decode_token_a_draft_token_is_priced_against_nothing():
    """Always 4 decoding requests: their cost is the base's, so the fit has no decode-token
    cost, and whether drafts pay would compare a draft token with nothing: not said, though
    only one token of each draft of 3 was accepted."""
    rng = random.Random(1)
    records = []
    for number in range(1, 301):
        drafting = rng.randint(0, 4)
        elapsed_s = 0.010 + 4 * 1e-3 + 3 * drafting * 1e-3
        records.append(
            iteration_record(
                0,
                number,
                number,
                start_ns=number * 100_000_000,
                elapsed_ns=int(elapsed_s * 1e9),
                num_decode_reqs=4,
                num_decode_tokens=4 + drafting,
                num_running_reqs=4,
                spec_decode=SpecDecodeCounts(drafting, 3 * drafting, drafting, [drafting, 0, 0])
                if drafting
                else None,
            )
        )
    timeline = build_timelines(records)[0]
    fit = fit_iteration_time(timeline)
    assert "decode_tokens" not in fit.coefficients and "draft_tokens" in fit.coefficients
    assert detect_costly_drafts(timeline, Thresholds()) == []


def test_on_a_real_vllm_the_finding_is_first_and_says_what_tune_says():
    """tests/data/vllm_costly_drafts.jsonl: vLLM 0.32 drafting by ngram, about 2% of draft
    tokens accepted (bench/drafts_payoff_vllm.py, which measured the same load 2.46x faster
    per output token without drafts)."""
    path = Path(__file__).parent / "data" / "vllm_costly_drafts.jsonl"
    (timeline,) = read_timelines([path])[0].values()
    findings = build_findings(timeline, detect_episodes(timeline))
    assert [finding.kind for finding in findings][:1] == ["costly_drafts"]
    payoff = draft_payoff(timeline, fit_iteration_time(timeline))
    assert findings[0].worst.numbers["added_share"] == pytest.approx(-payoff.saving)
    assert -payoff.saving - 2 * payoff.saving_error >= 0.1
    assert "drafts of up to 5 tokens now" in findings[0].worst.setting
