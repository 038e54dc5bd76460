"""Every sentence explain prints must be true of the recording: for each episode template, a
run where its claim would be false, checking the claim is not made (and a run where it is
true, checking it is, so the test can fail both ways)."""

import re

import numpy as np
import pytest

from telemetry.analysis.episodes import (
    Thresholds,
    detect_episodes,
    detect_kv_saturation,
    detect_long_prefill,
    detect_preemption_storms,
)
from telemetry.analysis.episodes.latency import decode_baselines
from telemetry.analysis.explain import main
from telemetry.analysis.findings import build_findings
from telemetry.analysis.timeline import NS_PER_S, build_timelines
from telemetry.analysis.tune import main as tune_main
from telemetry.analysis.words import plural
from telemetry.lane.record import UNKNOWN_WAITING_REASONS, IterationRecord

from . import synthetic
from .synthetic import Cost, Simulator, arrivals


def timeline_of(messages):
    return build_timelines(messages)[0]


def of_kind(episodes, kind):
    return [e for e in episodes if e.kind == kind]


def all_text(episodes) -> str:
    return "\n".join(f"{e.title} {e.evidence} {e.explanation} {e.setting}" for e in episodes)


def closed_loop(
    num_blocks: int, concurrency: int, num_prompt: int, num_output: int, max_num_seqs: int = 64
) -> Simulator:
    sim = Simulator(
        num_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=2048,
        cost=synthetic.STORY_COST,
    )
    sim.add_closed_loop(
        num_requests=40, concurrency=concurrency, num_prompt=num_prompt, num_output=num_output
    )
    return sim.run(10)


@pytest.fixture(scope="module")
def story1():
    return synthetic.story1_kv_cliff()


# ---- KV cache saturated


def test_saturation_says_every_block_was_in_use_only_at_100_percent():
    # Requests of 8 blocks (120 + 8 tokens of 16) in a 100-block cache: 12 fit, 96 blocks.
    nearly = detect_kv_saturation(timeline_of(closed_loop(100, 13, 120, 8).messages), Thresholds())
    (saturation,) = nearly
    assert 0.95 <= saturation.numbers["peak_usage"] < 1.0
    assert "Every KV block was in use" not in saturation.explanation
    assert "nearly full (peak 96.0%)" in saturation.explanation
    # 10 blocks each (150 + 10 tokens): 10 fit exactly, the cache is full.
    (full,) = detect_kv_saturation(
        timeline_of(closed_loop(100, 14, 150, 10).messages), Thresholds()
    )
    assert full.numbers["peak_usage"] == 1.0
    assert full.explanation.startswith("Every KV block was in use")


def test_saturation_blames_kv_for_waiting_only_when_the_source_says_why():
    timeline = timeline_of(closed_loop(100, 14, 150, 10).messages)
    (known,) = detect_kv_saturation(timeline, Thresholds())
    assert "could not be admitted" in known.explanation
    timeline.columns["unknown"] = np.full(timeline.num_iterations, UNKNOWN_WAITING_REASONS)
    (unknown,) = detect_kv_saturation(timeline, Thresholds())
    assert "could not be admitted" not in unknown.explanation
    assert "for KV capacity" not in unknown.evidence
    assert "does not say whether for KV capacity" in unknown.explanation


# ---- KV cache cliff


def test_cliff_claims_iterating_on_only_when_iterations_followed(story1):
    (cliff,) = of_kind(detect_episodes(timeline_of(story1.messages)), "kv_cliff")
    assert "it kept iterating" in cliff.explanation
    cut = [
        m
        for m in story1.messages
        if (m.start_ns + m.elapsed_ns if isinstance(m, IterationRecord) else m.ts_ns)
        <= cliff.end_ns
    ]
    (cut_cliff,) = of_kind(detect_episodes(timeline_of(cut)), "kv_cliff")
    assert cut_cliff.numbers["num_iterations_after"] == 0
    assert "kept iterating" not in cut_cliff.explanation
    assert "No iteration followed" in cut_cliff.explanation


def test_requests_finishing_together_are_no_cliff_and_nothing_claims_preemption():
    """Waves of 10 requests fill the cache and finish together: usage falls from 100% to
    nearly nothing, yet no running request became waiting and none was preempted."""
    sim = closed_loop(100, 10, 150, 10)
    timeline = timeline_of(sim.messages)
    usage = timeline.kv_usage
    assert usage.max() == 1.0 and (np.diff(usage) <= -0.5).any()  # the fall is there
    episodes = detect_episodes(timeline)
    assert not of_kind(episodes, "kv_cliff") and not of_kind(episodes, "preemption_storm")
    text = all_text(episodes)
    assert "were preempted" not in text and "The scheduler preempted" not in text


# ---- Preemption storm


def test_preemption_storm_needs_three_preemptions_within_a_second():
    timeline = timeline_of(synthetic.healthy().messages)
    starts = timeline.col("start_ns")
    spread = np.searchsorted(starts, starts[0] + np.arange(1, 9) * int(1.5 * NS_PER_S))
    timeline.columns["num_preemptions"] = np.zeros(timeline.num_iterations, dtype=np.int64)
    timeline.columns["num_preemptions"][spread] = 1
    assert detect_preemption_storms(timeline, Thresholds()) == []  # 8 preemptions, 1.5 s apart
    close = np.searchsorted(starts, starts[0] + int(20 * NS_PER_S)) + np.arange(3)
    timeline.columns["num_preemptions"][close] = 1
    (storm,) = detect_preemption_storms(timeline, Thresholds())
    assert storm.numbers["num_preemptions"] == 3 and storm.evidence.startswith("3 preemptions")


# ---- Requests waiting


def test_waiting_at_the_sequence_limit_says_kv_had_room_only_when_it_had():
    queued = of_kind(detect_episodes(timeline_of(synthetic.story3_bursty(4).messages)), "waiting")
    assert "KV had room" in queued[0].setting
    # 4 requests of 19 blocks (200 + 100 tokens) at the limit of 4 fill 76 of 80 blocks.
    sim = Simulator(
        num_blocks=80, max_num_seqs=4, max_num_batched_tokens=2048, cost=synthetic.STORY_COST
    )
    sim.add_requests(arrivals(6, 20, seed=3), num_prompt=200, num_output=100)
    (wait,) = of_kind(detect_episodes(timeline_of(sim.run(22).messages)), "waiting")
    assert wait.numbers["reason"] == "waiting_seq_limit" and wait.numbers["peak_usage"] >= 0.9
    assert "KV had room" not in wait.setting and "KV was nearly full too" in wait.setting


# ---- Stalls


def test_requests_queued_while_iterations_progress_are_no_stall():
    episodes = detect_episodes(timeline_of(synthetic.story3_bursty(4).messages))
    assert of_kind(episodes, "waiting")  # long waiting, iterations progress all along
    assert not of_kind(episodes, "stall")
    assert "stalled" not in all_text(episodes) and "spinning" not in all_text(episodes)


def test_a_stall_between_iterations_is_not_said_to_be_inside_one():
    (stall,) = of_kind(detect_episodes(timeline_of(synthetic.stalled().messages)), "stall")
    assert not stall.numbers["inside_iteration"]
    assert "between iterations" in stall.explanation
    assert "inside" not in stall.explanation and "hung" not in stall.explanation


def test_a_frozen_stall_claims_only_what_heartbeats_show():
    """A frozen last_iteration cannot tell a hung step from a very long one: the text says no
    iteration finished and the process was alive, never that it hung."""
    (stall,) = of_kind(detect_episodes(timeline_of(synthetic.stalled().messages)), "stall")
    numbers = stall.numbers
    assert numbers["max_waiting_reqs"] == 0 and numbers["max_running_reqs"] > 1
    assert stall.explanation.startswith(
        f"No iteration finished for {numbers['stall_time_s']:.2f} s while up to "
        f"{numbers['max_running_reqs']} requests ran; heartbeats continued, so the process was "
        "alive: a forward pass or the loop was stuck or very slow"
    )
    assert not re.search(r"\bhung\b|\bhang|0 requests waited|time out", stall.explanation)


# ---- Counts and their nouns

SINGULAR_AS_PLURAL = re.compile(
    r"(?<![\d.])1 (?:[a-z-]+ )?(?:iterations|requests|preemptions|heartbeats|messages|blocks|"
    r"tokens|episodes|findings|times|files|engines|lines|outliers)\b"
)


def test_plural_agrees_with_the_count():
    assert [plural(n, "iteration") for n in (0, 1, 2)] == [
        "0 iterations",
        "1 iteration",
        "2 iterations",
    ]
    assert plural(1, "request-s", "request-s") == "1 request-s"


def test_every_printed_count_agrees_with_its_noun(tmp_path, capsys, monkeypatch):
    """One of everything (an iteration, a preemption, a request, a finding, a file...): the
    text says each in the singular, and writes no "(s)". The first screen made short enough
    to leave one of the cliff's three findings unnamed."""
    monkeypatch.setattr("telemetry.analysis.explain_report.MAX_FINDING_LINES", 7)
    path = synthetic.write_records(
        synthetic.scripted(synthetic.SCRIPTED_CLIFF), tmp_path / "cliff.jsonl"
    )
    stalled = synthetic.stalled().write(tmp_path / "stalled.jsonl")
    texts = []
    for argv in ([str(path), "--all"], [str(stalled), "--all"]):
        assert main(argv) == 0
        texts.append(capsys.readouterr().out)
    assert tune_main([str(stalled), "--itl-target", "50ms"]) == 0
    texts.append(capsys.readouterr().out)
    text = "\n".join(texts)
    assert "1 iteration " in text and "1 running request " in text and "1 more finding" in text
    assert "(s)" not in text
    assert not SINGULAR_AS_PLURAL.findall(text), SINGULAR_AS_PLURAL.findall(text)


# ---- Telemetry gaps and silences


def test_a_frozen_process_is_not_called_a_restart():
    messages = [
        m
        for m in synthetic.healthy().messages
        if not synthetic.NS * 1010
        <= getattr(m, "ts_ns", getattr(m, "start_ns", 0))
        < synthetic.NS * 1014
    ]
    for seq, message in enumerate(messages, 1):  # nothing lost: the process sent nothing
        message.msg_seq = seq
    (gap,) = of_kind(detect_episodes(timeline_of(messages)), "telemetry_gap")
    assert not gap.numbers["restarted"] and gap.title == "Engine down"
    assert "restart" not in gap.explanation and "frozen" in gap.explanation
    assert "lost" not in gap.title


# ---- KV blocks leaking


def test_a_leak_that_stopped_growing_is_not_said_to_climb():
    sim = Simulator(
        num_blocks=400, max_num_seqs=32, max_num_batched_tokens=1024, cost=synthetic.STORY_COST
    )
    sim.leak_blocks_per_finish = 6
    sim.add_requests([0.5], num_prompt=64, num_output=10)
    sim.run(2)  # one finished request left 6 blocks behind
    sim.leak_blocks_per_finish = 0
    sim.add_requests(arrivals(3, 15, start_s=3), num_prompt=64, num_output=30)
    (leak,) = of_kind(detect_episodes(timeline_of(sim.run(20).messages)), "kv_leak")
    assert leak.numbers["excess_blocks_last"] <= leak.numbers["excess_blocks_first"]
    assert " grew " not in leak.evidence and "climbs" not in leak.explanation
    # the excess is a lower bound that dips while requests run: never "fell" under "leaking"
    # (QA: the opening WARNING said "fell 8 -> 6", later "grew 8 -> 82")
    assert " fell " not in leak.evidence and "(a lower bound, lower while requests run)" in (
        leak.evidence
    )
    (growing,) = of_kind(detect_episodes(timeline_of(synthetic.story2_leak().messages)), "kv_leak")
    assert " grew " in growing.evidence and "climbs" in growing.explanation


# ---- Long prefill chunks


def test_a_slow_iteration_its_chunk_does_not_explain_is_no_long_prefill():
    timeline = timeline_of(synthetic.story3_bursty(64).messages)
    assert detect_long_prefill(timeline, Thresholds()) == []
    elapsed = timeline.col("elapsed_ns").copy()
    ctx, gen = timeline.col("num_prefill_tokens"), timeline.col("num_decode_reqs")
    baseline = np.median(elapsed[(ctx == 0) & (gen > 0)])
    row = int(np.flatnonzero((ctx > 0) & (ctx <= 256) & (gen > 0))[0])
    elapsed[row] = 10 * baseline  # a hiccup: 10x slower beside a small chunk
    timeline.columns["elapsed_ns"] = elapsed
    timeline.columns["end_ns"] = timeline.col("start_ns") + elapsed
    assert detect_long_prefill(timeline, Thresholds()) == []


def test_a_long_prompt_now_and_then_is_no_finding_and_frequent_ones_are():
    """Three 2,000-token prompts in 22 s beside ~75 decoding steps a second: each stretches
    an iteration 9x, but they are under 1% of the decoding steps (the p99 inter-token latency
    is not theirs), so nothing is said (on vLLM's CPU build such a prompt every 30 s of healthy
    load had opened a finding each time). The same prompts in bursts are over 1%: a finding,
    whose evidence says the share."""
    rare = timeline_of(synthetic.long_prompts([5.0, 12.0, 16.0]).messages)
    assert detect_long_prefill(rare, Thresholds()) == []
    judged_alone = detect_long_prefill(rare, Thresholds(long_prefill_min_share=0.0))
    assert len(judged_alone) == 3
    assert all(0 < e.numbers["max_stretched_share"] < 0.01 for e in judged_alone)
    frequent = timeline_of(synthetic.long_prompts(synthetic.long_prompt_bursts()).messages)
    episodes = detect_long_prefill(frequent, Thresholds())
    assert len(episodes) == 3
    for episode in episodes:
        share = episode.numbers["max_stretched_share"]
        assert share >= 0.01
        assert f"stretched iterations held up to {100 * share:.1f}% of the decoding" in (
            episode.evidence
        )


def test_a_pause_of_a_second_is_a_finding_however_rare():
    """One 25,000-token prompt in a single chunk beside decoding requests: a 1.26 s pause in
    every stream, one iteration among thousands, is a finding by its length alone."""
    cost = Cost(base_time=0.010, context_token_time=50e-6, generation_token_time=0.5e-3)
    sim = Simulator(num_blocks=4000, max_num_seqs=64, max_num_batched_tokens=32768, cost=cost)
    sim.add_requests(arrivals(2, 40), num_prompt=32, num_output=150)
    sim.add_requests([30.0], num_prompt=25_000, num_output=10)
    (episode,) = detect_long_prefill(timeline_of(sim.run(42).messages), Thresholds())
    assert episode.numbers["max_elapsed_s"] - episode.numbers["baseline_s"] >= 1.0
    assert episode.numbers["max_stretched_share"] is None
    assert episode.evidence.endswith("; a pause of 1 s or more in every decoding stream")
    shorter = Thresholds(long_prefill_min_pause=2.0)  # under 1% of the steps: no finding
    assert detect_long_prefill(timeline_of(sim.messages), shorter) == []


def decode_rows(num: int, elapsed_s: float, requests: int) -> list:
    return [synthetic.Row(elapsed_s, running=requests, waiting=0, blocks_used=40,
                          gen_reqs=requests)] * num  # fmt: skip


def mixed_row(elapsed_s: float, requests: int, tokens: int = 64):
    return synthetic.Row(elapsed_s, running=requests + 1, waiting=0, blocks_used=40,
                         gen_reqs=requests, ctx_tokens=tokens)  # fmt: skip


def test_a_chunk_beside_a_batch_bigger_than_before_is_judged_against_as_many_requests():
    """4 requests decoding in 10 ms for 30 s, then 32 in 80 ms: a 100 ms iteration that
    carries a 64-token chunk beside the 32 is 1.25x what 32 took, not 10x the 4's median (a
    real vLLM batch of 34 was "14x its baseline" of 16-27 requests, its cost tripled)."""
    rows = decode_rows(3000, 0.010, 4) + decode_rows(20, 0.080, 32) + [mixed_row(0.100, 32)]
    timeline = timeline_of(synthetic.scripted(rows, num_blocks=4000))
    assert detect_long_prefill(timeline, Thresholds(long_prefill_min_share=0.0)) == []
    (baseline_ns,) = decode_baselines(timeline, np.array([len(rows) - 1]), Thresholds())
    assert baseline_ns == pytest.approx(0.080 * NS_PER_S)


def test_a_chunk_slowed_from_outside_costs_only_what_the_chunk_accounts_for():
    """Every 20th iteration carries a 64-token chunk that adds 30 ms beside 4 decoding
    requests (10 ms alone); one of them took 800 ms while the host was busy: the long
    prefill's cost counts 30 ms of it, what such a chunk took, not 790 ms (on a loaded host a
    211-token chunk took 815 ms where such chunks took 200-230 ms, all charged to the chunk)."""
    rows = []
    for number in range(3000):
        rows += [mixed_row(0.040, 4)] if number % 20 == 10 else decode_rows(1, 0.010, 4)
    rows += decode_rows(10, 0.010, 4) + [mixed_row(0.800, 4)] + decode_rows(50, 0.010, 4)
    timeline = timeline_of(synthetic.scripted(rows, num_blocks=4000))
    (finding,) = build_findings(timeline, detect_episodes(timeline), Thresholds())
    assert finding.kind == "long_prefill"
    num_mixed = int((timeline.col("num_prefill_tokens") > 0).sum())
    assert finding.cost == pytest.approx(num_mixed * 4 * 0.030, rel=0.05)
    assert "took up to 800.0 ms" in finding.worst.evidence  # what it took, said as it was


def test_long_prefill_setting_quotes_no_made_up_latency_target():
    cost = Cost(base_time=0.010, context_token_time=50e-6, generation_token_time=0.5e-3)
    sim = Simulator(num_blocks=2000, max_num_seqs=64, max_num_batched_tokens=2048, cost=cost)
    sim.add_requests(arrivals(2, 20), num_prompt=32, num_output=150)
    sim.add_requests(synthetic.long_prompt_bursts((5.0,)), num_prompt=2000, num_output=10)
    (episode,) = detect_long_prefill(timeline_of(sim.run(12).messages), Thresholds())
    assert "--itl-target" in episode.setting
    assert not re.search(r"--itl-target \d", episode.setting), episode.setting


# ---- the summary


def test_the_summary_quotes_queue_time_and_ttft_only_when_first_tokens_were_recorded():
    from telemetry.analysis.summary import format_summary, summarize

    rows = [synthetic.Row(0.010, running=2, waiting=1, blocks_used=10, gen_reqs=2)] * 20
    untimed = summarize(timeline_of(synthetic.scripted(rows)))
    text = "\n".join(format_summary(untimed)) + untimed.verdict
    assert untimed.num_timed_reqs == 0
    assert "no first token recorded, so no queue time or TTFT" in text
    assert "queue time p50" not in text and "median queue time" not in text

    timed = summarize(timeline_of(synthetic.story1_kv_cliff().messages))
    text = "\n".join(format_summary(timed))
    assert timed.num_timed_reqs > 0
    assert f"({plural(timed.num_timed_reqs, 'request')})" in text and "queue time p50" in text


def test_actions_quote_a_current_value_only_when_the_engine_reported_one(tmp_path, capsys):
    """Records without heartbeats carry no limits: the action names the flag and no '(now ?)'."""
    recording = synthetic.write_records(
        synthetic.scripted(synthetic.SCRIPTED_CLIFF), tmp_path / "untold.jsonl"
    )
    main([str(recording), "--all"])
    text = capsys.readouterr().out
    assert "--max-num-batched-tokens" in text
    assert "(now ?" not in text and "(now None" not in text
