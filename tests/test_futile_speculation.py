"""Speculative decoding that gains nothing (telemetry/analysis/episodes/drafts.py): explain
finds it where the decoding iterations of the 30 s before an iteration accepted fewer tokens
than 1% of their decoding request-steps while speculative decoding was on (a draft scored, or
the heartbeats' num_speculative_tokens), says so with an unknown cost and the action, and
stays silent at 1% or more, on too few iterations in the window, without speculative decoding
and after a restart without it. That the live sidecar opens the same finding in time and ranks
it first is tests/test_live_findings.py's, over the scenario "speculation that gains nothing";
here, also on a real vLLM's recording."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from scenarios.synthetic import SCENARIOS, drafting, futile_speculation

from telemetry.analysis.episodes import (
    Thresholds,
    detect_costly_drafts,
    detect_episodes,
    detect_futile_speculation,
)
from telemetry.analysis.explain import main
from telemetry.analysis.findings import build_findings
from telemetry.analysis.live_findings import FindingEvent
from telemetry.analysis.timeline import NS_PER_S, build_timelines, read_timelines
from telemetry.analysis.tune import draft_payoff, fit_iteration_time
from telemetry.lane.record import Heartbeat, SpecDecodeCounts, heartbeat, iteration_record
from telemetry.sidecar.sinks.finding_log import finding_line
from tests.helpers.findings import assert_replay_agrees_with_explain
from tests.helpers.findings import explained as explained_rows

KIND = "futile_speculation"
STEP_NS = 10_000_000  # scripted iterations: one every 10 ms, each 8 ms long


def scripted(
    num_iterations: int,
    num_decoding: int = 2,
    accepted: int = 0,
    draft_every: int = 0,
    said_until_s: float | None = None,
    step_ns: int = STEP_NS,
) -> list:
    """Iterations of ``num_decoding`` decoding requests each, ``accepted`` draft tokens
    accepted in every one (a draft scored with them), and a heartbeat a second; every
    ``draft_every``-th iteration one draft of 3 tokens scored (0: none but those); heartbeats
    say num_speculative_tokens 3 until ``said_until_s`` (None: always), 0 from then on."""
    messages: list = []
    for number in range(1, num_iterations + 1):
        drafted = accepted or (draft_every and number % draft_every == 0)
        spec = SpecDecodeCounts(1, 3, accepted, [accepted, 0, 0]) if drafted else None
        messages.append(
            iteration_record(
                0,
                number,
                number,
                start_ns=number * step_ns,
                elapsed_ns=8_000_000,
                num_decode_reqs=num_decoding,
                num_decode_tokens=num_decoding + accepted,
                num_running_reqs=num_decoding,
                spec_decode=spec,
            )
        )
    for second in range(num_iterations * step_ns // NS_PER_S + 1):
        said = said_until_s is None or second < said_until_s
        messages.append(
            heartbeat(
                0,
                0,
                second * NS_PER_S,
                second * NS_PER_S,
                num_running_reqs=num_decoding,
                num_speculative_tokens=3 if said else 0,
            )
        )
    return messages


def futile(messages: list, thresholds: Thresholds | None = None) -> list:
    timeline = build_timelines(messages)[0]
    return detect_futile_speculation(timeline, thresholds or Thresholds())


@pytest.fixture(scope="module")
def scenario():
    make, truth = SCENARIOS["speculation that gains nothing"]
    assert truth == KIND
    return make()


def test_explain_finds_speculation_that_gains_nothing(scenario):
    timeline = build_timelines(scenario.messages)[0]
    findings = build_findings(timeline, detect_episodes(timeline), Thresholds())
    assert [finding.kind for finding in findings] == [KIND]
    (episode,) = findings[0].episodes
    first = int(timeline.col("start_ns").searchsorted(episode.start_ns))
    last = int(timeline.col("start_ns").searchsorted(episode.end_ns))
    numbers = episode.numbers
    # the numbers are the episode's own iterations'
    assert numbers["num_draft_tokens"] == timeline.col("num_draft_tokens")[first:last].sum() > 0
    assert numbers["num_decode_steps"] == timeline.col("num_decode_reqs")[first:last].sum()
    assert numbers["num_accepted_tokens"] == 0 == numbers["saved_share"]
    assert numbers["num_speculative_tokens"] == 3
    # judged from the 100th decoding iteration on: the window needs that many
    decoding_before = (timeline.col("num_decode_reqs")[:first] > 0).sum()
    assert decoding_before == Thresholds().futile_speculation_min_iterations - 1
    assert findings[0].cost == 0 and findings[0].cost_label == "unknown"
    assert "drafts of up to 3 tokens" in episode.evidence
    assert "0 accepted (0.00% of the request-steps)" in episode.evidence
    assert "not in the records" in episode.evidence
    assert episode.setting.startswith(
        "Leave out --speculative-config (num_speculative_tokens now 3)"
    )


def test_explain_prints_it_with_its_cost_unknown(scenario, tmp_path, capsys):
    path = scenario.write(tmp_path / "futile.jsonl")
    assert main([str(path)]) == 0
    text = capsys.readouterr().out
    assert "1. Speculative decoding gains nothing: 1 time" in text
    assert ", speculating 3 tokens ahead" in text  # the heartbeats' fact, in the header
    assert main([str(path), "--json"]) == 0
    (engine,) = json.loads(capsys.readouterr().out)["engines"]
    (finding,) = engine["findings"]
    assert finding["kind"] == KIND and finding["cost_label"] == "unknown"
    assert "--speculative-config" in finding["action"]


def test_the_heartbeats_say_speculation_is_on_where_no_draft_was_proposed():
    """A proposer that never finds a draft (an n-gram on text that never repeats) still runs
    every step: the heartbeats' num_speculative_tokens says speculation is on. A sender that
    does not say it (an older one) and scored no draft shows nothing to judge."""
    sim = futile_speculation(drafting_share=0.0)
    timeline = build_timelines(sim.messages)[0]
    assert not timeline.col("num_drafts").any()
    (episode,) = detect_futile_speculation(timeline, Thresholds())
    assert episode.numbers["num_draft_tokens"] == 0
    assert "0 draft tokens proposed" in episode.evidence
    unsaid = [
        msgspec.structs.replace(m, num_speculative_tokens=0) if type(m) is Heartbeat else m
        for m in sim.messages
    ]
    assert futile(unsaid) == []


@pytest.mark.parametrize(("num_decoding", "found"), [(101, True), (99, False)])
def test_the_line_is_one_accepted_token_per_100_request_steps(num_decoding, found):
    """One token accepted in every iteration: of 101 decoding requests, 0.99% of the
    request-steps (found); of 99, 1.01% (not)."""
    episodes = futile(scripted(300, num_decoding=num_decoding, accepted=1))
    assert bool(episodes) == found
    if found:
        (episode,) = episodes
        assert episode.numbers["accepted_share"] == pytest.approx(1 / 101)
        assert episode.numbers["saved_share"] == pytest.approx(1 / 102)


def test_it_takes_100_decoding_iterations_within_the_window():
    """Judged from the 100th decoding iteration on; iterations 400 ms apart put only 75 in
    any 30 s window: never judged, however long the run."""
    (episode,) = futile(scripted(300))
    assert episode.start_ns == 100 * STEP_NS
    assert futile(scripted(99)) == []
    assert futile(scripted(500, step_ns=400_000_000)) == []


def test_without_speculative_decoding_or_after_a_restart_without_it_nothing_is_said():
    """No draft and no heartbeat saying so: nothing. Heartbeats that stop saying it (the
    engine restarted without --speculative-config) end the episode at the first heartbeat
    that does not, as no draft was scored in the window."""
    assert futile(scripted(3000, said_until_s=0)) == []
    (episode,) = futile(scripted(3000, said_until_s=20))
    assert episode.end_ns < 20 * NS_PER_S <= episode.end_ns + STEP_NS
    # drafts scored in the window say it too, heartbeats or not
    (episode,) = futile(scripted(3000, draft_every=50, said_until_s=0))
    assert episode.numbers["num_speculative_tokens"] == 3  # the longest draft recorded


def test_speculation_that_pays_or_costs_is_not_futile():
    """Where drafts are accepted (paying or not), this kind is silent; costly drafts are the
    other kind's (tests/test_costly_drafts.py)."""
    for name in ("drafts that pay", "drafts that cost"):
        make, _ = SCENARIOS[name]
        assert futile(make().messages) == []


def test_drafts_that_cost_and_gain_nothing_are_this_kind_not_costly_drafts():
    """The drafts of "drafts that cost" (a draft token costs what a request's own token does),
    none accepted: the fit says they add more than 10%, but the finding is this kind's, one
    finding for one cause (its action is the same: leave drafts out)."""
    sim = drafting(1e-3, accept_one_in=10**9).run(33)
    timeline = build_timelines(sim.messages)[0]
    payoff = draft_payoff(timeline, fit_iteration_time(timeline))
    assert -payoff.saving - 2 * payoff.saving_error > 0.1
    assert detect_costly_drafts(timeline, Thresholds()) == []
    assert [f.kind for f in build_findings(timeline, detect_episodes(timeline), Thresholds())] == [
        KIND
    ]


def test_on_a_real_vllm_the_live_sidecar_and_explain_both_say_it():
    """tests/data/vllm_futile_speculation.jsonl: vLLM 0.32 (CPU build, the scheduler source)
    speculating by n-gram drafts of up to 3 tokens matched on 2 (bench/drafts_payoff_vllm.py
    --spec-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
    "prompt_lookup_min": 2}'): 175 draft tokens proposed for 2,304 output tokens, 12
    accepted (0.5% of the decoding request-steps); the same load without drafts was 1.45x
    faster per output token there, which tune's fit saw as +1% (the draft tokens alone). The
    replayed sidecar opens explain's findings, this one at the same iteration."""
    path = Path(__file__).parent / "data" / "vllm_futile_speculation.jsonl"
    (timeline,) = read_timelines([path])[0].values()
    assert timeline.facts["num_speculative_tokens"] == 3
    live = assert_replay_agrees_with_explain(path)
    (finding,) = [finding for finding in live if finding.kind == KIND]
    ((_, iteration, _),) = [row for row in explained_rows(timeline) if row[0] == KIND]
    assert finding.iteration == iteration and finding.cost_label == "unknown"
    assert "Leave out --speculative-config (num_speculative_tokens now 3)" in finding.action
    # its log lines say the cost cannot be measured, not that it is 0
    for what in ("opened", "closed"):
        _, line = finding_line(FindingEvent(what, finding))
        assert "cost not measurable" in line and "request-s unknown" not in line, line
