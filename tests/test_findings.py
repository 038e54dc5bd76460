"""Findings: episodes merged by kind, costed in request-seconds, ranked; their actions."""

import json
import re
from dataclasses import replace

import numpy as np
import pytest
from scenarios import synthetic
from scenarios.synthetic import Cost, Row, Simulator, arrivals, scripted

from telemetry.analysis.actions import episode_action, finding_action
from telemetry.analysis.episodes import Thresholds, detect_episodes
from telemetry.analysis.episodes.latency import decode_baselines
from telemetry.analysis.explain import main
from telemetry.analysis.explain_report import MAX_FINDING_LINES, format_engine, format_findings
from telemetry.analysis.findings import build_findings, cost_text, episode_cost
from telemetry.analysis.timeline import NS_PER_S, build_timelines
from telemetry.lane.record import EVENT_FIRST_TOKEN, Heartbeat, IterationRecord, heartbeat

# A long prompt now and then beside ~75 decoding steps a second (long_prefill_sim) stretches
# under 1% of them: no finding by default. The tests of what a long prefill's action, cost and
# merging say judge every stretched iteration, as if the prompts came often enough to count.
EVERY_STRETCH = Thresholds(long_prefill_min_share=0.0)


def findings_of(sim: Simulator, thresholds: Thresholds | None = None):
    thresholds = thresholds or Thresholds()
    timeline = build_timelines(sim.messages)[0]
    episodes = detect_episodes(timeline, thresholds)
    return timeline, build_findings(timeline, episodes, thresholds)


@pytest.mark.parametrize(
    ("story", "expected_top"),
    [
        (synthetic.story1_kv_cliff, {"kv_cliff"}),  # running became waiting, none preempted
        (synthetic.story2_leak, {"kv_leak", "stall"}),  # usage climbs: a leak (and its spin)
        (synthetic.stalled, {"stall"}),
        (lambda: synthetic.story3_bursty(4), {"waiting"}),  # queued by max_num_seqs
    ],
)
def test_story_top_finding_first(story, expected_top):
    _, findings = findings_of(story())
    assert findings[0].kind in expected_top, [(f.kind, f.cost) for f in findings]
    assert_ranked(findings)


def assert_ranked(findings):
    """Faults first; then by cost, every finding that cost something above those that did not."""
    faults = [f.is_fault for f in findings]
    assert faults == sorted(faults, reverse=True), [(f.kind, f.cost) for f in findings]
    for group in ([f for f in findings if f.is_fault], [f for f in findings if not f.is_fault]):
        costs = [f.cost for f in group]
        assert costs == sorted(costs, reverse=True), [(f.kind, f.cost) for f in findings]


CLIFF_ROWS = synthetic.SCRIPTED_CLIFF


def test_a_kv_cliff_costs_the_time_its_evicted_request_waited_and_recomputed(tmp_path, capsys):
    timeline = build_timelines(scripted(CLIFF_ROWS))[0]
    findings = build_findings(timeline, detect_episodes(timeline), Thresholds())
    assert [f.kind for f in findings] == ["telemetry_gap", "kv_cliff", "long_prefill"]
    silence, cliff, prefill = findings
    assert cliff.cost == pytest.approx(6 * 0.010 + 0.040)  # waited, then recomputed
    assert prefill.cost == pytest.approx(0.040 - 0.010)
    # The silence: the 2 requests in flight before it got nothing for its 4.01 s (it ranked
    # last, "cost not measurable", below 0.03 request-s; a 10 s freeze with 4 requests too)
    assert silence.cost == pytest.approx(2 * 4.01) and silence.cost_label == "halted"
    path = synthetic.write_records(scripted(CLIFF_ROWS), tmp_path / "cliff.jsonl")
    assert main([str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    headlines = [line for line in lines if re.match(r"  \d\. ", line)]
    assert headlines[0] == "  1. Engine down: 1 time, 4.01 s in all, 8.0 request-s halted"
    assert (
        headlines[1].startswith("  2. KV cache cliff")
        and "0.10 request-s delayed" in (headlines[1])
    )
    assert "0.03 request-s slowed" in headlines[2]


def test_an_episode_costs_its_own_iterations_not_the_next_one_back_to_back():
    """KV usage 96% for 10 iterations of 10 ms with 2 requests waiting, then 80% with the
    same 2 waiting: the saturation costs 10 x 2 x 10 ms; the next iteration, which starts as
    the episode's last one ends, is not inside it."""
    rows = [Row(0.010, running=4, waiting=2, blocks_used=96)] * 10
    rows += [Row(0.010, running=4, waiting=2, blocks_used=80)] * 3
    timeline = build_timelines(scripted(rows))[0]
    (saturated,) = [e for e in detect_episodes(timeline) if e.kind == "kv_saturation"]
    assert timeline.col("start_ns")[10] == saturated.end_ns  # back to back
    assert episode_cost(timeline, saturated, Thresholds()) == pytest.approx(10 * 2 * 0.010)


def test_a_fault_ranks_first_even_before_it_costs_requests():
    """Blocks held with nothing running cost no request time yet, but only a restart fixes it."""
    leaking = [Row(0.010, running=0, waiting=0, blocks_used=20)] * 3
    timeline = build_timelines(scripted(CLIFF_ROWS[:11] + leaking))[0]
    findings = build_findings(timeline, detect_episodes(timeline), Thresholds())
    assert [f.kind for f in findings] == ["kv_leak", "kv_cliff", "long_prefill"]
    assert findings[0].cost == 0 < findings[2].cost < findings[1].cost
    text = "\n".join(format_findings(timeline, findings, Thresholds()))
    assert "faults first, then costliest first:" in text


def test_cost_text_never_reads_as_zero_above_zero():
    assert [cost_text(c) for c in (0, 0.004, 0.0734, 0.5, 2.25)] == [
        "0",
        "< 0.01",
        "0.07",
        "0.50",
        "2.2",
    ]


def test_story3_batched_has_no_finding():
    assert findings_of(synthetic.story3_bursty(64))[1] == []


def test_story3_queued_action_raises_max_num_seqs():
    _, (finding,) = findings_of(synthetic.story3_bursty(4))
    assert finding.worst.numbers["reason"] == "waiting_seq_limit"
    timeline = build_timelines(synthetic.story3_bursty(4).messages)[0]
    action = finding_action(timeline, finding, Thresholds())
    value = int(action.split("--max-num-seqs ")[1].split()[0])
    assert value > 4 and "(now 4)" in action


def test_queued_action_on_a_flat_step_cost_raises_in_steps_not_to_the_extrapolation():
    """A GPU decode step costs about the same at batch 1 and 256 (it is launch-bound), so
    tune's fit allows hundreds of requests from a recording that never decoded more than 4:
    the action raises the limit to twice what was seen and says the rest is extrapolated.
    A light load first, then the burst: the action is drawn from the 30 s before it."""
    flat = Cost(base_time=0.010, context_token_time=2e-6, generation_token_time=1e-7)
    sim = Simulator(num_blocks=20000, max_num_seqs=4, max_num_batched_tokens=2048, cost=flat)
    sim.add_requests(arrivals(1, 10, seed=3), num_prompt=200, num_output=100)
    sim.add_requests(arrivals(60, 20, start_s=12, seed=3), num_prompt=200, num_output=100)
    sim.run(35)
    _, (finding,) = findings_of(sim)
    timeline = build_timelines(sim.messages)[0]
    action = finding_action(timeline, finding, Thresholds())
    assert action.startswith("Set --max-num-seqs 8 (now 4): ") and "extrapolated" in action
    allowed = int(action.split(" allows ")[1].split(",")[0])
    assert allowed > 8


def test_requests_held_back_by_the_engine_are_not_sent_to_an_admission_limit():
    """Requests a vLLM holds back (its prefill cadence, say) wait for no limit of KV,
    sequences or tokens: the action names what does hold them, not a limit to raise."""
    rows = [Row(0.010, running=2, waiting=3, blocks_used=20, gen_reqs=2)] * 300
    records = scripted(rows)
    for record in records:
        record.num_waiting_other_reqs, record.num_waiting_kv_reqs = record.num_waiting_kv_reqs, 0
    timeline = build_timelines(records)[0]
    (finding,) = build_findings(timeline, detect_episodes(timeline), Thresholds())
    assert finding.kind == "waiting" and finding.worst.numbers["reason"] == "waiting_other"
    action = finding_action(timeline, finding, Thresholds())
    assert action.startswith("Not an admission limit")
    assert "--prefill-schedule-interval" in action and "Raise" not in action
    # A vLLM that runs a prefill cadence says so in its heartbeats: the action names its value.
    start_ns = records[0].start_ns
    cadence = heartbeat(0, 1000, start_ns, start_ns, prefill_schedule_interval=8)
    timeline = build_timelines([cadence, *records])[0]
    (finding,) = build_findings(timeline, detect_episodes(timeline), Thresholds())
    action = finding_action(timeline, finding, Thresholds())
    assert action.startswith("Lower --prefill-schedule-interval (now 8), down to 1 to turn")
    assert "once every 8 steps" in action


def test_waiting_cost_matches_the_requests_queue_time():
    """Little's law: requests waiting x time = the sum of each request's time in the queue."""
    sim = synthetic.story3_bursty(4)
    _, (finding,) = findings_of(sim)
    queue_s = sum(
        (m.first_scheduled_ns - m.arrival_ns) / NS_PER_S
        for message in sim.messages
        if isinstance(message, IterationRecord)
        for m in message.milestones
        if m.event & EVENT_FIRST_TOKEN
    )
    last_end_ns = max(
        m.start_ns + m.elapsed_ns for m in sim.messages if isinstance(m, IterationRecord)
    )
    queue_s += sum((last_end_ns - r.arrival_ns) / NS_PER_S for r in sim.waiting)  # never ran
    assert finding.cost == pytest.approx(queue_s, rel=0.1)


def test_same_kind_episodes_merge_into_one_finding():
    sim = long_prefill_sim()
    timeline, (finding,) = findings_of(sim, EVERY_STRETCH)
    episodes = detect_episodes(timeline, EVERY_STRETCH)
    assert finding.kind == "long_prefill" and finding.count == len(episodes) == 3
    assert finding.total_time == pytest.approx(sum(e.duration_time for e in episodes))
    costs = [episode_cost(timeline, e, Thresholds()) for e in episodes]
    assert finding.cost == pytest.approx(sum(costs)) and min(costs) > 0
    assert finding.worst == episodes[costs.index(max(costs))]
    action = finding_action(timeline, finding, Thresholds())
    assert "--max-num-batched-tokens" in action and "(now 2048)" in action


def test_text_ranks_findings_in_at_most_15_lines_and_all_lists_episodes(tmp_path, capsys):
    path = synthetic.story2_leak().write(tmp_path / "story2.jsonl")
    assert main([str(path)]) == 0
    text = capsys.readouterr().out
    block = text.split("costliest first:\n")[1].split("\n\n")[0].splitlines()
    assert 1 + len(block) <= MAX_FINDING_LINES
    assert block[0].startswith("  1. KV blocks leaking")
    assert "Episodes (" not in text and "--all lists every episode" in text
    assert main([str(path), "--all"]) == 0
    assert "Episodes (" in capsys.readouterr().out


def test_json_findings(tmp_path, capsys):
    path = synthetic.stalled().write(tmp_path / "stalled.jsonl")
    assert main([str(path), "--json"]) == 0
    (engine,) = json.loads(capsys.readouterr().out)["engines"]
    top = engine["findings"][0]
    assert set(top) == {
        "kind",
        "live_kind",
        "title",
        "count",
        "total_time_s",
        "cost_request_s",
        "cost_label",
        "action",
        "worst",
    }
    assert top["kind"] == "stall" and top["worst"] in engine["episodes"]
    stall = top["worst"]["numbers"]
    expected = (
        (stall["max_waiting_reqs"] + stall["max_running_reqs"])
        * (top["worst"]["end_ns"] - top["worst"]["start_ns"])
        / NS_PER_S
    )
    assert top["cost_request_s"] == pytest.approx(expected)


def long_prefill_sim() -> Simulator:
    return synthetic.long_prompts([5.0, 12.0, 16.0])


def test_a_sequence_limit_above_the_requests_seen_is_said_to_be_extrapolated():
    """One request decoded beside the long prompts (two where a long prompt's own request
    decodes beside it): the limit tune sizes with the budget (15) is far above what the fit
    saw, as tune's note says; the action said it as a measured value (a warm-up's lone
    request gave "--max-num-seqs 3" live, then "Keep" 30 s later)."""
    cost = Cost(base_time=0.010, context_token_time=50e-6, generation_token_time=0.5e-3)
    sim = Simulator(num_blocks=2000, max_num_seqs=64, max_num_batched_tokens=2048, cost=cost)
    sim.add_requests([0.1], num_prompt=32, num_output=3000)
    sim.add_requests([5.0, 12.0, 16.0], num_prompt=2000, num_output=10)
    timeline, (finding,) = findings_of(sim.run(22), EVERY_STRETCH)
    action = finding_action(timeline, finding, Thresholds())
    assert "and --max-num-seqs 15 (now 64) together" in action, action
    assert action.endswith(
        "; --max-num-seqs 15 is extrapolated (at most 2 requests decoded at once there): "
        "re-record at the new settings to confirm."
    ), action


def test_long_prefill_action_gives_what_the_tune_command_it_quotes_prints(tmp_path, capsys):
    """The target is 3x the baseline the episode's first iteration was judged against (the
    median decode-only iteration of the 30 s before it), and tune, given the iterations the
    action quotes, prints its value."""
    from telemetry.analysis.tune import main as tune

    sim = long_prefill_sim()
    timeline, (finding,) = findings_of(sim, EVERY_STRETCH)
    action = finding_action(timeline, finding, Thresholds())
    first = int(timeline.col("start_ns").searchsorted(finding.worst.start_ns))
    (baseline_ns,) = decode_baselines(timeline, np.array([first]), Thresholds())
    command, own_target = quoted_commands(action)  # explain's target, then the operator's
    assert own_target == ["tune", PLACEHOLDERS["RECORDING"], "--itl-target", PLACEHOLDERS["T"]]
    assert command[:2] == ["tune", PLACEHOLDERS["RECORDING"]]
    target = command[command.index("--itl-target") + 1]
    assert target == f"{round(3 * baseline_ns / 1e6, 1):g}ms"
    since = timeline.col("start_ns") >= finding.worst.start_ns - 30 * NS_PER_S
    numbers = timeline.col("iteration")
    assert command[command.index("--iterations") + 1] == f"{numbers[since][0]}-{numbers[first]}"
    # tune holds the target only with fewer sequences than decoded at once here: the action
    # quotes its values and gives none (both set would queue the rest for the sequence limit)
    found = re.search(
        r"gives (\d+) only with --max-num-seqs (\d+) \(now 64\), fewer than the (\d+) requests",
        action,
    )
    value, seqs, decoded = (int(group) for group in found.groups())
    assert action.startswith("Lower --max-num-batched-tokens (now 2048) as far as")
    assert value < 2048 and seqs < decoded <= timeline.col("num_decode_reqs").max()
    assert tune([str(sim.write(tmp_path / "rec.jsonl")), *command[2:]]) == 0
    assert f"--max-num-seqs {seqs} --max-num-batched-tokens {value} " in capsys.readouterr().out


def test_a_budget_below_every_prompt_chunk_it_was_drawn_from_is_said_to_be_extrapolated(
    monkeypatch,
):
    """tune's note, in the action: lower it in steps and re-record."""
    from telemetry.analysis import actions
    from telemetry.analysis.tune import Recommendation

    timeline, (finding,) = findings_of(long_prefill_sim(), EVERY_STRETCH)
    rec = Recommendation(0.03, 64, 320, 0.01, 0.029, 554.0, 9000.0, "latency target", 16, 1900)
    monkeypatch.setattr(actions, "_tuned", lambda *_, **__: actions.Tuned(rec, "`tune ...`"))
    action = finding_action(timeline, finding, Thresholds())
    assert action.startswith("Set --max-num-batched-tokens 320 (now 2048), from `tune ...`")
    assert action.endswith(
        "; extrapolated (prompts came 1900+ tokens at a time): lower it in steps."
    )
    rec.min_prompt_tokens_seen = 32
    assert "extrapolated" not in finding_action(timeline, finding, Thresholds())


def test_where_carrying_prompts_at_all_exceeds_the_target_the_action_keeps_the_budget(
    tmp_path, capsys
):
    """A GPU-like engine: decode-only iterations of 2-3 ms, and every iteration that carries
    prompt tokens 15 ms more, whatever its chunk. Explain's latency target (3x the decode-only
    median) is under that cost, so no budget meets it: the action says so and keeps the
    budget (on an H200 it had said to set 320 tokens, where a 256-token chunk took 22 ms), and
    the tune command it quotes prints the same figures."""
    from telemetry.analysis.tune import main as tune

    cost = Cost(
        base_time=0.002,
        context_token_time=5e-6,
        generation_token_time=20e-6,
        prompt_step_time=0.015,
    )
    sim = Simulator(num_blocks=2000, max_num_seqs=64, max_num_batched_tokens=2048, cost=cost)
    sim.add_requests(arrivals(2, 20), num_prompt=32, num_output=150)
    sim.add_requests(arrivals(1, 20, seed=1), num_prompt=300, num_output=150)
    sim.add_requests([5.0, 12.0, 16.0], num_prompt=2000, num_output=10)
    timeline, findings = findings_of(sim.run(22), EVERY_STRETCH)
    (finding,) = [f for f in findings if f.kind == "long_prefill"]
    action = finding_action(timeline, finding, Thresholds())
    assert action.startswith("Keep --max-num-batched-tokens at 2048: by `iterscope tune")
    assert "A smaller budget would only make more such iterations" in action
    taken = re.search(
        r"\(([\d.]+) ms by the fit before its first prompt token, ([\d.]+) ms", action
    )
    assert float(taken[2]) == pytest.approx(15.0, rel=0.1) and float(taken[1]) > float(taken[2])
    assert float(taken[1]) * 1e-3 > 3 * float(np.median(timeline.col("elapsed_ns")) / NS_PER_S)
    (command,) = quoted_commands(action)
    assert tune([str(sim.write(tmp_path / "rec.jsonl")), *command[2:]]) == 1
    assert action.split(f"{command[-1]}`, ")[1].split(". A smaller")[0] in capsys.readouterr().err


def test_with_speculative_decoding_the_budget_holds_each_decoding_request_and_its_draft(
    tmp_path, capsys
):
    """Decoding requests that draft 3 tokens take 4 budget tokens each: on a CPU whose prompt
    tokens cost 0.6 ms, the budget that keeps explain's latency holds 8 of them and a 16-token
    chunk, so the action lowers --max-num-seqs with it (sized as if each took 1 token, 48
    tokens would seem to hold 32), no lower than the requests that decoded at once. The target
    quoted is per output token: the iteration time over the tokens a decoding request gets in
    one, both over the 30 s before the episode, which the tune command quoted prints the same
    values for. The action says the two together, as tune says them, and what the lower
    budget costs prompts."""
    from telemetry.analysis.tune import main as tune

    cost = Cost(
        base_time=0.010,
        context_token_time=600e-6,
        generation_token_time=1e-3,
        draft_token_time=0.2e-3,
    )
    sim = Simulator(
        num_blocks=2000, max_num_seqs=64, max_num_batched_tokens=2048, cost=cost, num_spec_tokens=3
    )
    sim.add_requests(arrivals(1, 20), num_prompt=32, num_output=150)
    sim.add_requests([5.0, 12.0, 16.0], num_prompt=2000, num_output=10)
    timeline, (finding,) = findings_of(sim.run(22), EVERY_STRETCH)
    action = finding_action(timeline, finding, Thresholds())
    assert "(now 64) together, from `iterscope tune" in action
    assert action.endswith(
        "so time to first token grows: keep both if it matters more than inter-token latency; "
        "--max-num-seqs 8 is extrapolated (at most 6 requests decoded at once there): "
        "re-record at the new settings to confirm."
    )
    assert re.search(r"prompts are then computed at \d+ tokens/s at most", action)
    budget, seqs = (
        int(re.search(rf"--{flag} (\d+) \(now", action).group(1))
        for flag in ("max-num-batched-tokens", "max-num-seqs")
    )
    (command,) = quoted_commands(action)
    min_chunk = int(command[command.index("--min-chunk") + 1])
    assert (budget, seqs, min_chunk) == (48, 8, 16)
    assert budget >= seqs * (1 + 3) + min_chunk
    assert seqs >= timeline.col("num_decode_reqs").max()
    first = int(timeline.col("start_ns").searchsorted(finding.worst.start_ns))
    (baseline_ns,) = decode_baselines(timeline, np.array([first]), Thresholds())
    rows = (timeline.col("start_ns") >= finding.worst.start_ns - 30 * NS_PER_S) & (
        timeline.col("start_ns") <= finding.worst.start_ns
    )
    decodes = timeline.col("num_decode_reqs")[rows].sum()
    tokens = 1 + timeline.col("num_accepted_tokens")[rows].sum() / decodes
    target = command[command.index("--itl-target") + 1]
    assert target == f"{round(3 * baseline_ns / 1e6 / tokens, 1):g}ms"
    assert f"over {tokens:.2f} tokens per decoding request and iteration" in action
    assert tune([str(sim.write(tmp_path / "rec.jsonl")), *command[2:]]) == 0
    assert f"--max-num-seqs {seqs} --max-num-batched-tokens {budget} " in capsys.readouterr().out


def test_a_budget_below_the_sequence_limit_comes_with_the_limit_and_its_ttft_cost(monkeypatch):
    """On a CPU whose prompts cost far more per token than decodes, tune can hold a latency
    target only with a budget of 16 tokens and 10 sequences; the engine refuses a budget below
    --max-num-seqs, so the action names both, and what it costs the time to first token."""
    from telemetry.analysis import actions
    from telemetry.analysis.tune import Recommendation

    sim = long_prefill_sim()  # --max-num-seqs 64, --max-num-batched-tokens 2048
    timeline, (finding,) = findings_of(sim, EVERY_STRETCH)
    tight = Recommendation(0.0677, 10, 16, 0.018, 0.064, 554.0, 272.0, "latency target", 10)
    tuned = actions.Tuned(tight, "`iterscope tune ...`")
    monkeypatch.setattr(actions, "_tuned", lambda *_, **__: tuned)
    action = finding_action(timeline, finding, Thresholds())
    assert action.startswith(
        "Set --max-num-batched-tokens 16 (now 2048) and --max-num-seqs 10 (now 64) together"
    )
    assert "272 tokens/s at most, so time to first token grows" in action


def test_a_budget_that_needs_fewer_requests_than_decoded_gives_no_value(monkeypatch):
    """Where tune holds the target only with fewer sequences than the engine decoded at once,
    setting both would queue the rest for the sequence limit (applied on a CPU: later
    arrivals waited 51 s for a first token): the action lowers the budget without a value."""
    from telemetry.analysis import actions
    from telemetry.analysis.tune import Recommendation

    sim = long_prefill_sim()
    timeline, (finding,) = findings_of(sim, EVERY_STRETCH)
    tight = Recommendation(0.0677, 2, 18, 0.018, 0.064, 554.0, 167.0, "latency target", 3)
    monkeypatch.setattr(actions, "_tuned", lambda *_, **__: actions.Tuned(tight, "`tune ...`"))
    action = finding_action(timeline, finding, Thresholds())
    assert action.startswith(
        "Lower --max-num-batched-tokens (now 2048) as far as your inter-token latency allows"
    )
    assert (
        "gives 18 only with --max-num-seqs 2 (now 64), fewer than the 3 requests that decoded"
        in action
    )
    assert "together" not in action and "Set " not in action


def test_a_budget_a_fit_can_only_guess_is_not_given_as_a_value(monkeypatch):
    """Without a cost per prefill token tune's budget is a guess: the long-prefill action
    names the flag and why no value is given, never a 'keep' or 'set' built on the guess."""
    from dataclasses import replace

    from telemetry.analysis import actions
    from telemetry.analysis.tune import NO_PREFILL_TOKEN_COST

    timeline, (finding,) = findings_of(long_prefill_sim(), EVERY_STRETCH)
    fitted = actions.fit_iteration_time(timeline)
    assert "prefill_tokens" in fitted.coefficients  # the simulated prompts cost per token
    tokenless = {k: v for k, v in fitted.coefficients.items() if k != "prefill_tokens"}
    monkeypatch.setattr(
        actions, "fit_iteration_time", lambda tl: replace(fitted, coefficients=tokenless)
    )
    action = finding_action(timeline, finding, Thresholds())
    assert action == (
        f"Lower --max-num-batched-tokens (now 2048); no value could be computed here: "
        f"{NO_PREFILL_TOKEN_COST}."
    )


PLACEHOLDERS = {
    "RECORDING": "rec.jsonl",
    "DTYPE": "float32",
    "LEN": "4096",
    "DIR": "model",
    "SIZE": "4GiB",
    "TOKENS": "512",
    "T": "50ms",
}
CONFIG_NAMES = re.compile(
    r"\b(max_num_seqs|max_num_batched_tokens|max_model_len|"
    r"kv_cache_memory|gpu_memory_utilization)\b"
)


def quoted_commands(text: str) -> list[list[str]]:
    """The `iterscope ...` commands quoted in a line, placeholders given sample values."""
    return [
        [PLACEHOLDERS.get(word, word) for word in command.split()[1:]]
        for command in re.findall(r"`(iterscope [^`]*)`", text)
    ]


def test_change_and_action_lines_name_real_flags_and_runnable_commands():
    import argparse

    from engine.entrypoints import kv_plan, serve_args
    from telemetry.analysis import explain, tune

    engine_flags = argparse.ArgumentParser()
    serve_args.add_engine_arguments(engine_flags)
    parsers = {
        "tune": tune.build_parser(),
        "kv-plan": kv_plan.build_parser(),
        "explain": explain.build_parser(),
    }
    lines = []
    for sim in (
        synthetic.story1_kv_cliff(),
        synthetic.story2_leak(),
        synthetic.stalled(),
        synthetic.story3_bursty(4),
        long_prefill_sim(),
    ):
        timeline, findings = findings_of(sim, EVERY_STRETCH)
        lines += [e.setting for e in detect_episodes(timeline, EVERY_STRETCH)]
        lines += [finding_action(timeline, f, Thresholds()) for f in findings]
    kinds_with_commands = 0
    for line in lines:
        assert not CONFIG_NAMES.search(line), line
        for command in quoted_commands(line):
            parsers[command[0]].parse_args(command[1:])  # exits (fails) on a wrong flag
            kinds_with_commands += 1
        outside = re.sub(r"`[^`]*`", "", line)
        for flag in re.findall(r"--[a-z][a-z-]*", outside):
            assert flag in engine_flags._option_string_actions, (flag, line)
    assert kinds_with_commands >= 5


def test_titles_header_and_summary_name_limits_by_their_flags():
    from telemetry.analysis.explain_report import engine_header
    from telemetry.analysis.summary import format_summary, summarize

    timeline, (finding,) = findings_of(synthetic.story3_bursty(4), EVERY_STRETCH)
    assert finding.title == "Requests waiting: --max-num-seqs"
    summary = summarize(timeline)
    assert "mostly for --max-num-seqs" in summary.verdict
    assert set(summary.waiting_reason_shares) == {  # the JSON keys, unchanged (+ other)
        "KV capacity",
        "max_num_seqs",
        "max_num_batched_tokens",
        "other",
    }
    texts = [engine_header(timeline), *format_summary(summary)]
    for sim in (
        synthetic.story1_kv_cliff(),
        synthetic.story2_leak(),
        synthetic.stalled(),
        long_prefill_sim(),
    ):
        timeline, findings = findings_of(sim, EVERY_STRETCH)
        texts += [f.title for f in findings] + [
            e.evidence for e in detect_episodes(timeline, EVERY_STRETCH)
        ]
        texts += [engine_header(timeline), *format_summary(summarize(timeline))]
    for text in texts:
        assert not CONFIG_NAMES.search(text), text
    assert "--max-num-batched-tokens 0.0%" in "\n".join(texts)


def test_kv_actions_before_any_request_finished_say_they_are_bounds():
    """No request finished before the cache filled: their length is known only as what they
    held, a lower bound, so the cache's size is "at least" what that gives (here 1.6x, where
    the requests' 300 tokens need 4x), and the sequence limit "or fewer"."""
    sim = Simulator(num_blocks=40, max_num_seqs=64, max_num_batched_tokens=2048)
    sim.add_requests([0.5] * 8, num_prompt=100, num_output=200)  # 2 of them fit, 8 at once
    sim.run(20)
    timeline, findings = findings_of(sim)
    kv = next(f for f in findings if f.kind == "kv_saturation")
    action = finding_action(timeline, kv, Thresholds())
    factor = float(re.search(r"to at least ([\d.]+)x the cache's size now", action).group(1))
    assert (
        1 < factor < 4
        and "none finished in the 30 s before it or during it; up to 8 wanted in at once" in action
    ), action
    limit = int(re.search(r"or set --max-num-seqs (\d+) or fewer\.$", action).group(1))
    # below the most that ran at once, which a limit at or above it would not change
    assert 2 <= limit < timeline.col("num_running_reqs").max(), action
    # Every request wanted in was running: fewer together, said to be a bound too (the
    # action as the live finding first says it, at the episode's first iteration, before any
    # request finished; explain, and the live finding as the episode grows, read the requests
    # that finish during it: test_kv_actions_are_sized_by_the_requests_that_fill_the_cache).
    sim = Simulator(num_blocks=40, max_num_seqs=64, max_num_batched_tokens=2048)
    sim.add_requests(arrivals(4, 10), num_prompt=100, num_output=200)
    sim.run(20)
    timeline, findings = findings_of(sim)
    kv = next(f for f in findings if f.kind in ("kv_saturation", "waiting"))
    action = episode_action(timeline, replace(kv.worst, end_ns=kv.worst.start_ns), Thresholds())
    assert action.startswith(
        "Set --max-num-seqs 3 or fewer: 4 requests running together took KV usage to 100.0% "
        "while still growing (none finished in the 30 s before it or during it); 3 would have "
        "held it near "
        "90% then; or raise --kv-cache-memory"
    ), action
    # Where the heartbeats say the longest length the engine allows, how many of that
    # length fit: the limit that holds them whatever they grow to (40 blocks of 16 tokens;
    # 300-token requests: "3 or fewer" applied still preempts once they grow past 213).
    for message in sim.messages:
        if isinstance(message, Heartbeat):
            message.max_model_len = 300
    timeline, findings = findings_of(sim)
    kv = next(f for f in findings if f.kind in ("kv_saturation", "waiting"))
    action = episode_action(timeline, replace(kv.worst, end_ns=kv.worst.start_ns), Thresholds())
    assert (
        "3 would have held it near 90% then (2 requests of the longest the engine allows, "
        "300 tokens, fit whatever they grow to); or raise" in action
    ), action


def test_kv_actions_are_sized_by_the_requests_that_fill_the_cache():
    """Two 31-token requests of a warm-up finished in the 30 s before the cache filled with
    300-token ones: the action sized the cache by the warm-up ("Set --max-num-seqs 4" where
    the cache held 1.8 of them, which changed nothing when applied). It reads the requests
    that run in the episode; at its opening, before any of them finished, what each running
    request held, more than the warm-up's, as a bound. (The live finding's action follows
    the episode: tests/test_live_findings.py.)"""
    sim = Simulator(num_blocks=34, max_num_seqs=32, max_num_batched_tokens=1024)
    sim.add_requests([0.5, 0.6], num_prompt=16, num_output=15)  # the warm-up
    sim.add_requests(arrivals(4, 30, start_s=5), num_prompt=100, num_output=200)
    sim.run(60)
    timeline, findings = findings_of(sim)
    (waiting,) = [f for f in findings if f.kind == "waiting"]
    action = finding_action(timeline, waiting, Thresholds())
    assert "(it holds 1 request of 300 tokens, 19 blocks each, the mean of those " in action
    assert action.endswith(", or set --max-num-seqs 1."), action
    opening = episode_action(
        timeline, replace(waiting.worst, end_ns=waiting.worst.start_ns), Thresholds()
    )
    assert opening.startswith("Raise --kv-cache-memory to at least "), opening
    assert "those that finished in the 30 s before it or during it were shorter, 31 " in opening


def test_kv_actions_name_what_sizes_the_cache_in_the_recorded_engines_words():
    """Ours: --kv-cache-memory. vLLM: its flag, and what overrides it where set (its CPU
    build's environment variable, a block count override). A light load first: the action
    is sized by the requests that finished in the 30 s before."""
    sim = Simulator(num_blocks=40, max_num_seqs=64, max_num_batched_tokens=2048)
    sim.add_requests([0.5, 3.0], num_prompt=100, num_output=200)
    sim.add_requests(arrivals(4, 10, start_s=6), num_prompt=100, num_output=200)
    sim.run(20)
    timeline, findings = findings_of(sim)
    kv = next(f for f in findings if f.kind in ("kv_saturation", "waiting"))
    ours = finding_action(timeline, kv, Thresholds())
    assert ours.startswith("Raise --kv-cache-memory to ") and "VLLM" not in ours, ours
    for message in sim.messages:  # the same run as vLLM's scheduler source reports it
        if type(message) is Heartbeat:
            message.source = "vllm-scheduler"
    vllm = finding_action(build_timelines(sim.messages)[0], kv, Thresholds())
    assert vllm.startswith(
        "Raise --kv-cache-memory-bytes (or VLLM_CPU_KVCACHE_SPACE where it is set, which "
        "overrides the flag on vLLM's CPU build; or --num-gpu-blocks-override where one is "
        "set) to "
    ), vllm


def cache_too_small() -> Simulator:
    """Requests of 450 tokens (29 blocks) in fours on a cache of 56 blocks."""
    sim = Simulator(num_blocks=56, max_num_seqs=8, max_num_batched_tokens=2048)
    sim.add_requests([0.5] * 4 + [8] * 4 + [16] * 4, num_prompt=300, num_output=150)
    return sim.run(40)


def waiting_action(sim: Simulator) -> str:
    timeline, findings = findings_of(sim)
    waiting = next(f for f in findings if f.kind == "waiting")
    return finding_action(timeline, waiting, Thresholds())


def test_the_cache_s_multiple_counts_the_blocks_the_requests_take():
    """4 requests of 450 tokens want 4 x 29 = 116 of the 56 blocks: 2.1x the cache (it said
    4.0x, the 4 wanted over the 1 that fits, a count rounded down), as `kv-plan` finds."""
    action = waiting_action(cache_too_small())
    assert action.startswith(
        "Raise --kv-cache-memory to 2.1x the cache's size now (it holds 1 request of 450 "
        "tokens, 29 blocks each, the mean of those that finished"
    ), action
    assert action.endswith("or set --max-num-seqs 1."), action


def test_kv_actions_during_a_leak_send_to_the_leak_not_to_fewer_requests():
    """396 of 400 blocks held by no request: fewer requests together (the KV findings said
    --max-num-seqs 2 and 3, from the usage a few requests took) cannot help."""
    timeline, findings = findings_of(synthetic.story2_leak())
    actions = {f.kind: finding_action(timeline, f, Thresholds()) for f in findings}
    assert actions["kv_leak"].startswith("Not a tuning setting: a block-accounting bug.")
    for kind in ("kv_saturation", "waiting"):
        assert re.match(
            r"Restart the engine to recover the \d+ blocks held by no running request "
            r"\(\d+\.\d% of the cache at its highest usage here: the KV leak finding\)",
            actions[kind],
        ), actions[kind]
        assert "--max-num-seqs" not in actions[kind]


def test_an_action_without_enough_iterations_before_it_points_to_tune_over_the_run(
    monkeypatch,
):
    """An episode early in a run has few iterations in the 30 s before it; the recording has
    more, and tune over it may give the value the action could not."""
    from telemetry.analysis import actions

    timeline, findings = findings_of(synthetic.story3_bursty(max_num_seqs=2))
    waiting = next(f for f in findings if f.kind == "waiting")
    early = timeline.stretch(0, 5)  # a basis of too few iterations
    monkeypatch.setattr(actions, "action_basis", lambda tl, episode: (early, ""))
    action = finding_action(timeline, waiting, Thresholds())
    assert "at least 10 are needed to fit iteration time, in the 30 s before it; " in action
    assert re.search(
        r"`iterscope tune RECORDING --itl-target [\d.]+ms` over more of the run may give one\.$",
        action,
    ), action


def test_an_action_without_a_decode_only_iteration_before_it_says_so_of_that_stretch(
    monkeypatch,
):
    """The summary beside it may count many decode-only iterations in the whole run: the
    action says it found none before the episode, and where tune may find one."""
    from telemetry.analysis import actions

    timeline, findings = findings_of(synthetic.story3_bursty(max_num_seqs=2))
    waiting = next(f for f in findings if f.kind == "waiting")
    prefills = np.flatnonzero(timeline.col("num_prefill_tokens") > 0)
    first_prefill = int(prefills[0])
    basis = timeline.stretch(first_prefill, first_prefill + 1)  # one iteration, prompts in it
    monkeypatch.setattr(actions, "action_basis", lambda tl, episode: (basis, ""))
    action = finding_action(timeline, waiting, Thresholds())
    assert action.endswith(
        "no value could be computed here: no decode-only iteration ran in the 30 s before the "
        "episode to set a latency target from; `iterscope tune RECORDING --itl-target TIME` "
        "over more of the run may give one."
    ), action


def test_a_storm_costs_until_its_requests_run_again_not_while_later_arrivals_wait():
    """3 preempted with nobody waiting before; 60 ms later all 3 are taken in again (they
    wait at the queue's front), while 3 requests that arrived meanwhile wait on for 200 ms:
    those are not the storm's (the cost counted them to the end: 0.81 request-s)."""
    rows = (
        [Row(0.010, running=10, waiting=0, blocks_used=90, gen_reqs=10)] * 3
        + [Row(0.010, running=7, waiting=3, blocks_used=96, gen_reqs=7, preemptions=3)]
        + [Row(0.010, running=7, waiting=3, blocks_used=96, gen_reqs=7)] * 5
        + [Row(0.010, running=10, waiting=3, blocks_used=99, gen_reqs=7, ctx_tokens=300)]
        + [Row(0.010, running=10, waiting=3, blocks_used=99, gen_reqs=10)] * 20
    )
    timeline = build_timelines(synthetic.scripted(rows))[0]
    findings = build_findings(timeline, detect_episodes(timeline), Thresholds())
    (storm,) = [f for f in findings if f.kind == "preemption_storm"]
    # waited 6 iterations of 10 ms each, then recomputed in the 10 ms iteration that took them
    assert storm.cost == pytest.approx(3 * 6 * 0.010 + 3 * 0.010)


def test_an_action_gives_no_value_from_a_rough_fit_and_tune_says_it_is_rough(capsys, tmp_path):
    """Iteration times that the batch does not explain (every other one 8x longer, as on a
    loaded host): the fit's mean error is far above ROUGH_FIT_ERROR, so the action gives no
    --max-num-seqs of it and says why; tune prints its values with a warning."""
    from telemetry.analysis.tune import ROUGH_FIT_ERROR
    from telemetry.analysis.tune import main as tune_main

    sim = synthetic.story3_bursty(max_num_seqs=2)
    for number, record in enumerate(m for m in sim.messages if isinstance(m, IterationRecord)):
        if number % 2:
            record.elapsed_ns *= 8
    timeline, findings = findings_of(sim)
    waiting = next(f for f in findings if f.kind == "waiting")
    action = finding_action(timeline, waiting, Thresholds())
    assert "no value could be computed here: the fit of iteration time over the 30 s before " in (
        action
    )
    assert "too rough to draw one from (mean |error| " in action
    error = float(action.split("mean |error| ")[1].split("%")[0]) / 100
    assert error > ROUGH_FIT_ERROR
    path = sim.write(tmp_path / "rough.jsonl")
    tune_main([str(path), "--itl-target", "1s"])
    assert "the fit is rough (mean |error| above 35%)" in capsys.readouterr().out


def test_two_processes_on_one_engine_index_are_no_lost_telemetry():
    """Their seqs interleave, so each one's messages are holes in the other's: the gap
    finding names the conflict and its fix, not a send high-water mark."""
    sim = synthetic.story3_bursty(64)
    other = synthetic.story3_bursty(64)
    for message in sim.messages:
        if isinstance(message, Heartbeat):
            message.pid = 111
    for message in other.messages:  # the second process started 10 s later
        if isinstance(message, Heartbeat):
            message.pid = 222
            message.ts_ns += 10 * NS_PER_S
        else:
            message.start_ns += 10 * NS_PER_S
    timeline = build_timelines([*sim.messages, *other.messages])[0]
    gaps = [e for e in detect_episodes(timeline) if e.kind == "telemetry_gap"]
    assert len(gaps) == 1
    assert gaps[0].title == "Telemetry mixed: two engine processes publish as one"
    assert "switch between pids 111 and 222" in gaps[0].evidence
    assert gaps[0].setting.startswith("Give each engine process its own --engine-index")


def test_the_cache_s_multiple_is_rounded_up_so_the_size_holds_them():
    """8 requests of 14 blocks in a 68-block cache want 112 blocks, 1.647x: the action says
    1.7x (1.6x, rounded down, left 3 blocks short, and the engine kept preempting)."""
    sim = Simulator(num_blocks=68, max_num_seqs=8, max_num_batched_tokens=2048)
    sim.add_requests([0.5] * 8 + [12] * 8 + [24] * 8, num_prompt=96, num_output=128)
    sim.run(60)
    timeline, findings = findings_of(sim)
    kv = next(f for f in findings if f.kind == "kv_saturation")
    action = finding_action(timeline, kv, Thresholds())
    assert action.startswith(
        "Raise --kv-cache-memory to 1.7x the cache's size now (it holds 4 requests of 224 "
        "tokens, 14 blocks each"
    ), action


def test_a_raised_budget_never_comes_with_fewer_requests_at_once(monkeypatch):
    """Prompts waiting for the token budget: tune's value at explain's latency target came
    with --max-num-seqs 1 (now 32), and applied, waiting grew 5x. The action raises the budget
    alone and says why it gives no value."""
    from types import SimpleNamespace

    from telemetry.analysis import actions

    timeline = build_timelines(synthetic.story3_bursty(4).messages)[0]
    timeline.facts["max_num_seqs"], timeline.facts["max_num_batched_tokens"] = 32, 64
    rec = SimpleNamespace(max_num_batched_tokens=65, max_num_seqs=1)
    tuned = actions.Tuned(rec, "`iterscope tune RECORDING --itl-target 449.2ms` (3x ...)")
    monkeypatch.setattr(actions, "_tuned", lambda *args, **kwargs: tuned)
    action = actions._budget_action(timeline, "", Thresholds(), lower=False)
    assert action.startswith(
        "Raise --max-num-batched-tokens (now 64) as far as your inter-token latency allows: "
    ), action
    assert "gives 65 only with --max-num-seqs 1 (now 32), fewer requests at once" in action
    assert "Set --max-num-seqs" not in action


def test_a_recording_that_ends_mid_work_says_so_with_or_without_findings():
    """An engine killed with 4 requests running left a recording explain called "No problem
    found"; a recording cannot tell that from one stopped mid-load, so it says both; and an
    engine killed after findings (a QA run: 6 findings, 2 requests running at the kill) said
    nothing of its end at all."""
    sim = synthetic.story3_bursty(64)
    cut = build_timelines(sim.messages[: len(sim.messages) // 2])[0]
    lines = format_engine(cut, [], Thresholds())
    assert lines[2].startswith("  No problem found: ")
    assert re.match(
        r"  It ends mid-work, with \d+ requests running and 0 waiting: the recording stopped ",
        lines[3],
    ), lines
    assert lines[3].endswith(
        "or the engine died there (the sidecar's log says 'Engine down' if it did)."
    )
    sim = synthetic.story1_kv_cliff()
    cut = build_timelines(sim.messages[: len(sim.messages) // 2])[0]
    episodes = detect_episodes(cut, Thresholds())
    assert build_findings(cut, episodes, Thresholds()), "findings expected"
    lines = format_engine(cut, episodes, Thresholds())
    assert any(line.startswith("  It ends mid-work, with ") for line in lines), lines
    idle = build_timelines(synthetic.kv_capacity().messages)[0]
    idle.records[-1].num_running_reqs = idle.records[-1].num_waiting_reqs = 0
    for beat in idle.heartbeats:
        beat.num_running_reqs = beat.num_waiting_reqs = 0
    assert not [line for line in format_engine(idle, [], Thresholds()) if "It ends" in line]


def test_kv_actions_quote_kv_plan_with_the_dtype_and_length_the_heartbeats_say():
    """Heartbeats that say the engine's dtype and max model length give the kv-plan command
    in a KV action those values, runnable as quoted but for the model and the memory; a
    sender that predates them leaves DTYPE and LEN to fill in, and says so."""
    from engine.entrypoints import kv_plan

    sim = cache_too_small()
    unsaid = waiting_action(sim)
    assert "--dtype DTYPE --max-model-len LEN --request-len 450`, with DTYPE and LEN" in unsaid
    for message in sim.messages:
        if isinstance(message, Heartbeat):
            message.dtype, message.max_model_len = "bfloat16", 2048
    action = waiting_action(sim)
    (command,) = quoted_commands(action)
    assert command == [
        "kv-plan",
        *("--model", PLACEHOLDERS["DIR"], "--memory", PLACEHOLDERS["SIZE"]),
        *("--dtype", "bfloat16", "--max-model-len", "2048", "--request-len", "450"),
    ]
    kv_plan.build_parser().parse_args(command[1:])
    assert "DTYPE" not in action and "LEN" not in action


@pytest.mark.parametrize(("block_size", "flag"), [(16, ""), (128, " --block-size 128")])
def test_the_kv_plan_quote_names_the_engine_s_block_size_where_kv_plan_s_default_differs(
    block_size, flag
):
    """vLLM's CPU build pages in blocks of 128: without the flag kv-plan planned in 16s and
    said 15.1x where 8.5x was true for 130-token requests."""
    from engine.entrypoints import kv_plan
    from telemetry.analysis.episodes.episode import KV_PLAN_BLOCK_SIZE, kv_plan_text

    assert kv_plan.build_parser().get_default("block_size") == KV_PLAN_BLOCK_SIZE
    beat = heartbeat(0, 1, 1, 1, block_size=block_size, dtype="bfloat16", max_model_len=2048)
    text = kv_plan_text(build_timelines([beat])[0], "130", "such requests a SIZE holds")
    assert text.startswith(
        "`iterscope kv-plan --model DIR --memory SIZE --dtype bfloat16 --max-model-len 2048 "
        f"--request-len 130{flag}` shows how many such requests a SIZE holds"
    )


def test_a_rough_fit_with_an_r_squared_near_1_says_why_they_disagree():
    """'too rough (mean |error| 73.3%, R^2 1.000)' read as a contradiction: the R^2 is the
    few longest iterations', the error the many short ones'."""
    from dataclasses import replace

    from telemetry.analysis.tune import fit_error_text, fit_iteration_time

    fit = fit_iteration_time(build_timelines(long_prefill_sim().messages)[0])
    rough = replace(fit, mean_abs_error_ratio=0.733, r_squared=0.9996)
    assert fit_error_text(rough) == (
        "mean |error| 73.3%, R^2 1.000, which the few longest iterations set: the many short "
        "ones are the error"
    )
    assert fit_error_text(replace(fit, mean_abs_error_ratio=0.733, r_squared=0.5)) == (
        "mean |error| 73.3%, R^2 0.500"
    )


def test_keeping_the_budget_of_requests_waiting_for_it_says_the_true_reason(monkeypatch):
    """Requests waited for a budget of 64 and tune allows 48 at explain's latency: "a
    latency target that loose does not call for a change" was said (the target is tighter,
    not looser); the reason is that a larger budget would break it."""
    from telemetry.analysis import actions
    from telemetry.analysis.tune import Recommendation

    make, _ = synthetic.SCENARIOS["token budget"]
    timeline, findings = findings_of(make())
    waiting = next(f for f in findings if f.kind == "waiting")
    current = timeline.facts["max_num_batched_tokens"]
    rec = Recommendation(0.05, 64, current - 16, 0.01, 0.05, 500.0, 900.0, "latency target", 4)
    monkeypatch.setattr(actions, "_tuned", lambda *_, **__: actions.Tuned(rec, "`tune ...`"))
    action = finding_action(timeline, waiting, Thresholds())
    assert action.startswith(
        f"Keep --max-num-batched-tokens at {current}: at the latency explain holds iterations "
        f"to, `tune ...` allows {current - 16}, no more than now, so a larger budget would "
        "break it"
    ), action
    assert "loose" not in action


def test_where_even_a_16_token_chunk_misses_the_target_the_budget_is_still_lowered():
    """On a CPU a prompt token costs 6 ms: no chunk, even of 16 tokens, keeps explain's
    latency beside a decoding request, yet smaller chunks shorten the pause (8,192 kept was
    advised; 128 cut the pause from 45 s to 1 s): lower it, and why no value. Only a fixed
    cost of carrying any prompt (a GPU's eager step) makes every budget miss alike: keep."""
    cost = Cost(base_time=0.010, context_token_time=6e-3, generation_token_time=0.5e-3)
    sim = Simulator(num_blocks=2000, max_num_seqs=64, max_num_batched_tokens=2048, cost=cost)
    sim.add_requests(arrivals(1, 20), num_prompt=16, num_output=150)
    sim.add_requests([5.0, 12.0, 16.0], num_prompt=2000, num_output=10)
    timeline, findings = findings_of(sim.run(22), EVERY_STRETCH)
    (finding,) = [f for f in findings if f.kind == "long_prefill"]
    action = finding_action(timeline, finding, Thresholds())
    assert action.startswith(
        "Lower --max-num-batched-tokens (now 2048); no value could be computed here: by "
        "`iterscope tune RECORDING"
    ), action
    assert "beside a 16-token prefill chunk" in action and "Keep" not in action
