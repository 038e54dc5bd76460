"""Decode iterations slowed from outside the batch (telemetry/analysis/episodes/slow_decode.py)."""

from pathlib import Path

import msgspec
import numpy as np
import pytest
from scenarios import synthetic
from scenarios.synthetic import Cost, Row, Simulator, arrivals, scripted

from telemetry.analysis.clock import wall_seconds
from telemetry.analysis.episodes import Thresholds, detect_episodes, detect_slow_decode, slow_decode
from telemetry.analysis.findings import build_findings, episode_cost
from telemetry.analysis.timeline import NS_PER_S, build_timelines, read_timelines
from telemetry.lane.record import heartbeat
from tests.helpers.findings import assert_replay_agrees_with_explain, replayed


def timeline_of(messages):
    return build_timelines(messages)[0]


def decoding(num: int, elapsed_s: float = 0.010, gen_reqs: int = 4) -> list[Row]:
    return [Row(elapsed_s, running=gen_reqs, waiting=0, blocks_used=10, gen_reqs=gen_reqs)] * num


def test_another_job_on_the_cores_is_said_and_ranked_first():
    """Every third iteration 6x slower for 10 s, prompts or not: the finding, first, costed as
    the decoding requests' time beyond the baseline; no long prefill is blamed for it."""
    sim = synthetic.another_job()  # from 12 s to 22 s
    timeline = timeline_of(sim.messages)
    findings = build_findings(timeline, detect_episodes(timeline), Thresholds())
    assert [f.kind for f in findings] == ["slow_decode"]
    (episode,) = findings[0].episodes
    assert sim.at(12) <= episode.start_ns < sim.at(13) and sim.at(21) < episode.end_ns <= sim.at(23)
    assert episode.numbers["max_elapsed_s"] >= 3 * episode.numbers["baseline_s"]
    assert episode.numbers["max_stretched_share"] >= 0.01
    assert "no prompt" in episode.evidence and "Not a tuning setting" in episode.setting
    assert findings[0].cost == pytest.approx(episode_cost(timeline, episode, Thresholds()))
    assert findings[0].cost > 10


def test_a_batch_that_grows_is_not_a_slowed_decode():
    """Decode time grows with the batch (10 ms a token over a 20 ms base: 1 request takes 30
    ms, 32 take 340 ms): iterations of more tokens than any before are judged against those of
    the most tokens scaled up to theirs, never against the small batches' median."""
    cost = Cost(base_time=0.020, context_token_time=1e-6, generation_token_time=10e-3)
    sim = Simulator(num_blocks=2000, max_num_seqs=64, max_num_batched_tokens=2048, cost=cost)
    sim.add_requests([0.1 + 0.5 * i for i in range(32)], num_prompt=16, num_output=400)
    timeline = timeline_of(sim.run(60).messages)
    assert timeline.col("num_decode_reqs").max() == 32
    assert detect_slow_decode(timeline, Thresholds()) == []


def test_a_hiccup_now_and_then_is_nothing_and_a_second_long_pause_is_a_finding():
    """One decode-only iteration of 60 ms among 3,000 of 10 ms: under 1% of the decoding
    steps, a pause of 50 ms: nothing. One of 1.2 s: a pause anyone streaming sees."""
    hiccup = decoding(1500) + decoding(1, 0.060) + decoding(1500)
    assert detect_slow_decode(timeline_of(scripted(hiccup)), Thresholds()) == []
    pause = decoding(1500) + decoding(1, 1.2) + decoding(1500)
    (episode,) = detect_slow_decode(timeline_of(scripted(pause)), Thresholds())
    assert episode.numbers["max_stretched_share"] is None
    assert episode.evidence.endswith("; a pause of 1 s or more in every decoding stream")
    cost = episode_cost(timeline_of(scripted(pause)), episode, Thresholds())
    assert cost == pytest.approx(4 * (1.2 - 0.010), rel=0.01)  # 4 decoding requests


def test_an_iteration_as_long_as_the_stall_threshold_s_floor_is_the_stall_s():
    """A decode-only iteration of 2 s: a slowed decode under the stall rule's 5 s floor; with
    a fixed threshold of 1.5 s (explain --stall-after) it is the stall's, never both."""
    rows = decoding(1500) + decoding(1, 2.0) + decoding(1500)
    assert len(detect_slow_decode(timeline_of(scripted(rows)), Thresholds())) == 1
    assert detect_slow_decode(timeline_of(scripted(rows)), Thresholds(stall_after=1.5)) == []


def test_an_iteration_with_a_prompt_chunk_is_left_to_the_long_prefill_detector():
    """A slow mixed iteration is judged by its chunk (long_prefill.py), never as a slowed decode."""
    slow_mixed = [Row(1.5, running=4, waiting=0, blocks_used=10, gen_reqs=4, ctx_tokens=64)]
    rows = decoding(1500) + slow_mixed + decoding(1500)
    assert detect_slow_decode(timeline_of(scripted(rows)), Thresholds()) == []


def test_frequent_slowed_iterations_are_judged_on_the_past_only():
    """Every 20th iteration 8x slower from iteration 1,000 on (5% of the steps): found from
    the first ones whose 30 s before hold 1% of them, and a judgment never changes with the
    records after it (the live sidecar judges the same way). 5x (40 ms more) is under the
    50 ms a stream's reader would see: nothing."""
    rows = decoding(1000)
    for number in range(2000):
        rows += decoding(1, 0.080 if number % 20 == 0 else 0.010)
    whole = detect_slow_decode(timeline_of(scripted(rows)), Thresholds())
    assert whole and whole[0].numbers["max_stretched_share"] >= 0.01
    cut = detect_slow_decode(timeline_of(scripted(rows[:1600])), Thresholds())
    first_whole = [e for e in whole if e.start_ns <= cut[-1].end_ns]
    assert [e.start_ns for e in cut] == [e.start_ns for e in first_whole[: len(cut)]]
    assert np.isclose(cut[0].numbers["baseline_s"], whole[0].numbers["baseline_s"])
    small = decoding(1000)
    for number in range(2000):
        small += decoding(1, 0.050 if number % 20 == 0 else 0.010)
    assert detect_slow_decode(timeline_of(scripted(small)), Thresholds()) == []


def test_a_steady_slow_engine_is_not_slowed():
    """A CPU engine whose every decode takes 0.5 s: slow, not slowed (healthy_but_slow)."""
    timeline = timeline_of(synthetic.healthy_but_slow().messages)
    assert detect_slow_decode(timeline, Thresholds()) == []


@pytest.mark.parametrize("every", [1, 10])
def test_slowed_iterations_are_found_whether_all_or_few_are_slowed(every):
    """All iterations 6x slower for 10 s (requests pile up: the batch grows past anything
    seen before) or one in ten 4x: a slowed decode either way."""
    timeline = timeline_of(synthetic.another_job(every, 6.0 if every == 1 else 4.0).messages)
    assert detect_slow_decode(timeline, Thresholds())


def test_arrivals_alone_make_no_slowed_decode():
    """Healthy Poisson load of every scenario speed: nothing."""
    for make in (synthetic.healthy, synthetic.stalled, synthetic.story2_leak):
        assert detect_slow_decode(timeline_of(make().messages), Thresholds()) == [], make


def test_the_decoding_requests_time_is_the_cost():
    cost = Cost(base_time=0.010, context_token_time=50e-6, generation_token_time=0.5e-3)
    sim = Simulator(num_blocks=2000, max_num_seqs=64, max_num_batched_tokens=2048, cost=cost)
    sim.add_requests(arrivals(2, 20), num_prompt=32, num_output=150)
    sim.add_slowdown(from_s=8.0, to_s=12.0, factor=10.0, every=4)
    timeline = timeline_of(sim.run(22).messages)
    (finding,) = build_findings(timeline, detect_episodes(timeline), Thresholds())
    assert finding.kind == "slow_decode" and finding.cost_label == "slowed"


def test_a_slowdown_that_lasts_is_found_until_it_ends():
    """Every decode 7x slower for 2 minutes: found whole, judged against the iterations before it
    began (the slowed ones left out of the baseline: they had made up most of the 30 s before
    after 21 s, and the rest of the slowdown read as the engine's normal), and over once the
    engine runs as fast again."""
    rows = decoding(3000) + decoding(1800, 0.070) + decoding(3000)
    timeline = timeline_of(scripted(rows))
    (episode,) = detect_slow_decode(timeline, Thresholds())
    # whole: noticed once they are 1% of the 3,000 steps before, then from its start on
    assert episode.numbers["num_iterations"] == 1800
    assert episode.start_ns == timeline.col("start_ns")[3000]
    assert episode.end_ns == timeline.col("end_ns")[3000 + 1800 - 1]
    assert episode.numbers["baseline_s"] == pytest.approx(0.010)
    assert "in the 30 s before it (median" in episode.evidence  # the worst: its first
    assert episode_cost(timeline, episode, Thresholds()) == pytest.approx(4 * 0.060 * 1800)


def test_decodes_of_longer_contexts_are_not_slowed():
    """Decodes 7x slower while each request holds 10-fold the KV blocks (longer contexts to
    read): more work, not a slowdown (8 requests of 7,500-token contexts after short ones
    were "slowed from outside" for 22 s on a quiet machine)."""
    longer = [Row(0.070, running=4, waiting=0, blocks_used=100, gen_reqs=4)] * 1800
    timeline = timeline_of(scripted(decoding(3000) + longer + decoding(3000)))
    assert detect_slow_decode(timeline, Thresholds()) == []


def test_a_slowdown_that_grows_the_batch_is_judged_by_what_a_request_adds():
    """Decodes of 4-8 requests taking 20 ms + 1 ms a request, then every decode of 14
    requests (more than any before) 4x slower: judged against the past's time plus what a
    request added there (1 ms: fitted, identifiable), not 8 requests' time scaled in
    proportion to 14 (as if all 28 ms grew with the batch: 49 ms, so 136 ms was 2.8x, no
    finding). Beyond twice the requests of the iterations scaled up (8 here), proportion it
    is: a CPU's decode turns from reading weights to computing as the batch grows, so a fit
    on few requests understates what many add."""

    def decodes(num, requests, slowdown=1.0):
        return [Row(slowdown * (0.020 + 0.001 * requests), 8, 0, 10, gen_reqs=requests)] * num

    before = [row for _ in range(120) for n in (4, 5, 6, 7, 8) for row in decodes(5, n)]
    rows = before + decodes(1000, 14, slowdown=4.0) + before
    (episode,) = detect_slow_decode(timeline_of(scripted(rows)), Thresholds())
    assert episode.numbers["num_iterations"] > 1000 - 40
    assert episode.numbers["baseline_s"] == pytest.approx(0.034, rel=0.01)
    beyond = before + decodes(1000, 17, slowdown=4.0) + before  # 17 > 2 x 8
    assert detect_slow_decode(timeline_of(scripted(beyond)), Thresholds()) == []


def test_a_lasting_slowdown_where_the_source_reports_no_kv_is_found_until_it_ends():
    """No KV blocks reported (an FPM producer may not say them): the baseline is not grown by
    a KV figure the source never gave (the blocks per request read 1/requests, so a smaller
    batch had looked like longer contexts)."""
    before = [Row(0.010, running=8, waiting=0, blocks_used=0, gen_reqs=8)] * 3000
    during = [Row(0.070, running=2, waiting=0, blocks_used=0, gen_reqs=2)] * 1800
    timeline = timeline_of(scripted(before + during + before))
    (episode,) = detect_slow_decode(timeline, Thresholds())
    assert episode.end_ns == timeline.col("end_ns")[3000 + 1800 - 1]


def test_decodes_of_longer_contexts_are_not_slowed_in_kv_tokens_either():
    """The same where the source says KV tokens and no blocks (an FPM producer)."""
    before = [Row(0.010, running=4, waiting=0, blocks_used=0, gen_reqs=4)] * 3000
    during = [Row(0.070, running=4, waiting=0, blocks_used=0, gen_reqs=4)] * 1800
    records = scripted(before + during + before)
    for number, record in enumerate(records):
        record.num_kv_tokens = 4 * (5000 if 3000 <= number < 4800 else 500)
    assert detect_slow_decode(timeline_of(records), Thresholds()) == []


def test_a_burst_after_a_quiet_spell_is_not_a_slowed_decode():
    """1-2 requests decoding for 30 s (10 ms + 0.1 ms a request: reading the weights), then a
    burst of 64 (80 ms: computing now). The slope of the quiet spell would put 64 requests
    at 16 ms, so 80 ms would read 5x slowed; past twice the requests seen, time in proportion
    (320 ms) is all that is said."""
    quiet = [
        Row(0.010 + 0.0001 * n, running=n, waiting=0, blocks_used=10, gen_reqs=n)
        for _ in range(1500)
        for n in (1, 2)
    ]
    burst = [Row(0.080, running=64, waiting=0, blocks_used=10, gen_reqs=64)] * 500
    assert detect_slow_decode(timeline_of(scripted(quiet + burst)), Thresholds()) == []


def test_a_lasting_slowdown_with_longer_contexts_says_the_growth():
    """7x slower while each request holds 4x the KV blocks: time grows at most 4x with it, of
    which the off-pace bar allows 2x, so the baseline is 2x the time before: still slowed
    (3.5x), and the evidence says so. 1.5x the KV grows nothing (a real vLLM's decode moved 5%
    for that, and 1.5x baselines had broken a slowdown 9 times in 30 s)."""
    longer = [Row(0.070, running=4, waiting=0, blocks_used=40, gen_reqs=4)] * 1800
    longer[1000] = Row(0.075, running=4, waiting=0, blocks_used=40, gen_reqs=4)  # the worst
    timeline = timeline_of(scripted(decoding(3000) + longer + decoding(3000)))
    (episode,) = detect_slow_decode(timeline, Thresholds())
    assert episode.end_ns == timeline.col("end_ns")[3000 + 1800 - 1]
    assert episode.numbers["baseline_s"] == pytest.approx(0.020)
    assert "(iteration 4001, 4 decoding, no prompt)" in episode.evidence
    assert "took 10.0 ms in the 30 s before the slowdown began at iteration 3001" in (
        episode.evidence
    )
    assert ", 2.0x that for the 4.0x KV each decoding request holds now;" in episode.evidence
    somewhat = [Row(0.070, running=4, waiting=0, blocks_used=15, gen_reqs=4)] * 1800
    timeline = timeline_of(scripted(decoding(3000) + somewhat + decoding(3000)))
    (episode,) = detect_slow_decode(timeline, Thresholds())
    assert episode.numbers["baseline_s"] == pytest.approx(0.010)
    assert "KV each" not in episode.evidence


def test_one_iteration_of_a_slowdown_under_3x_does_not_end_it():
    """Every decode 7x slower for 170 s, one of them only 2.9x: the slowdown goes on, judged
    against the pace before it (in a real CPU hog, the iterations after a 2.93x one were
    judged on the slowed ones: 62 to 170 ms against 20, and 23 s of it went unfound)."""
    slowed = decoding(300, 0.280)
    rows = decoding(750, 0.040) + slowed + decoding(1, 0.116) + slowed + decoding(750, 0.040)
    timeline = timeline_of(scripted(rows))
    (episode,) = detect_slow_decode(timeline, Thresholds())
    assert episode.numbers["num_iterations"] == 601  # the 2.9x one too: off pace (2x)
    assert episode.start_ns == timeline.col("start_ns")[750]
    assert episode.end_ns == timeline.col("end_ns")[750 + 601 - 1]
    assert "600 of them took 3x their baseline or more, the other 1 2x or more" in (
        episode.evidence
    )
    cost = episode_cost(timeline, episode, Thresholds())
    assert cost == pytest.approx(4 * (0.240 * 600 + 0.076))


def with_heartbeats(records: list, path: Path) -> Path:
    """``records`` written as a recording, a heartbeat before them and every second (live
    admits an engine at its first heartbeat)."""
    messages, seq, next_beat_ns = [], 0, records[0].start_ns
    for record in records:
        while next_beat_ns <= record.start_ns + record.elapsed_ns:
            seq += 1
            last = record.iteration - 1
            messages.append(heartbeat(0, seq, next_beat_ns, next_beat_ns, last_iteration=last))
            next_beat_ns += NS_PER_S
        seq += 1
        messages.append(msgspec.structs.replace(record, msg_seq=seq))
    path.write_bytes(b"".join(msgspec.json.encode(m) + b"\n" for m in messages))
    return path


def test_a_slowdown_noticed_after_it_outlasted_the_window_s_lookback_is_found_live(tmp_path):
    """Decodes of 20 ms, then 50 ms (2.5x: off pace, not slowed) for 40 s, then 80 ms (4x)
    for 48 s: one slowdown, judged on the pace before it began, 40 s before its first
    noticed iteration. The live window had dropped that pace (nothing was noticed to keep it
    for) and found nothing; explain found 240 request-s."""
    rows = decoding(1500, 0.020) + decoding(800, 0.050) + decoding(600, 0.080)
    path = with_heartbeats(scripted(rows + decoding(1500, 0.020)), tmp_path / "rec.jsonl")
    (timeline,) = read_timelines([path])[0].values()
    (episode,) = detect_slow_decode(timeline, Thresholds())
    assert episode.numbers["num_iterations"] == 1400
    assert episode_cost(timeline, episode, Thresholds()) == pytest.approx(
        4 * (800 * 0.03 + 600 * 0.06)
    )
    (live,) = assert_replay_agrees_with_explain(path)
    assert live.kind == "slow_decode"


# Real recordings on a 2-core CPU (EPYC-AVX512-BF16), SmolLM2, 4 requests of 64-token prompts
# decoding 128 tokens at a time (a closed loop), written by the sidecar's --record.
DATA = Path(__file__).parent / "data"
# Two `python3 -c 'while True: pass'` beside the engine from 40 s into the load for 90 s:
# decode-only iterations of ~21 ms took 60 ms to 2.6 s meanwhile.
CPU_HOG = DATA / "iterscope_cpu_hog.jsonl.gz"
CPU_HOG_WALL_S = (1795954694.616, 1795954784.841)
# vLLM 0.32 (CPU build, bf16, the scheduler source) under the same load, four busy loops on
# its worker's core (`setsid taskset -c 0`) for 90 s: decode-only iterations of 28.6 ms took
# 91-108 ms (median of each 10 s), some of them under twice the pace before.
VLLM_CPU_HOG = DATA / "vllm_cpu_hog.jsonl.gz"
VLLM_CPU_HOG_WALL_S = (1795958259.650, 1795958349.654)
# No other load: short prompts for 45 s, then 8 requests of the same 7,500-token prompt
# (prefix-cached), whose decode-only iterations took 74-101 ms against 22 ms before.
LONG_CONTEXTS = DATA / "iterscope_long_contexts.jsonl.gz"


@pytest.mark.parametrize(
    ("recording", "hog_wall_s", "pace_s"),
    [(CPU_HOG, CPU_HOG_WALL_S, 0.021), (VLLM_CPU_HOG, VLLM_CPU_HOG_WALL_S, 0.0286)],
    ids=["iterscope", "vllm"],
)
def test_a_real_cpu_hog_is_found_for_as_long_as_it_ran_live_and_in_explain(
    recording, hog_wall_s, pace_s
):
    """Found over 85% of its 90 s, ranked first, each episode in it judged against the pace
    before it (its KV growth aside), and the live sidecar's replay finds the same. Before:
    an iteration of the hog under 3x (ours) or one under 2x 30 s in (vLLM's) ended the
    slowdown, and the rest was judged on the slowed pace: 23 s of ours, 60 s of vLLM's, went
    unfound."""
    (timeline,) = read_timelines([recording])[0].values()
    findings = build_findings(timeline, detect_episodes(timeline), Thresholds())
    assert findings[0].kind == "slow_decode"
    hog_from_s, hog_to_s = hog_wall_s
    covered_s = 0.0
    for episode in findings[0].episodes:
        start_s, end_s = (wall_seconds(timeline, ns) for ns in (episode.start_ns, episode.end_ns))
        covered_s += max(0.0, min(end_s, hog_to_s) - max(start_s, hog_from_s))
        if start_s >= hog_from_s:
            assert episode.numbers["baseline_s"] < 1.6 * pace_s, episode.evidence
    assert covered_s > 0.85 * (hog_to_s - hog_from_s)
    assert_replay_agrees_with_explain(recording)


def test_real_decodes_of_long_contexts_are_not_slowed_live_or_in_explain():
    (timeline,) = read_timelines([LONG_CONTEXTS])[0].values()
    assert detect_slow_decode(timeline, Thresholds()) == []
    assert [f for f in replayed(LONG_CONTEXTS) if f.kind == "slow_decode"] == []


@pytest.mark.parametrize("seed", range(6))
def test_iterations_skipped_as_surely_on_pace_change_no_judgment(seed, monkeypatch):
    """_PaceBefore skips drawing a baseline where none could put the iteration off pace: the
    episodes are those of drawing every one (random batches, contexts and slowdowns, one of
    them 6x for 3 stretches, so each stream has some)."""
    rng = np.random.default_rng(seed)
    rows = []
    for stretch in range(40):  # stretches of 100 iterations, some slowed 2-8x
        slowdown = rng.choice([1.0, 1.0, 1.0, rng.uniform(2.0, 8.0)])
        slowdown = 6.0 if 20 <= stretch < 23 else slowdown
        for _ in range(100):
            requests = int(rng.choice([1, 2, 4, 8, 16]))
            elapsed = (0.020 + 0.002 * requests) * rng.uniform(0.9, 1.3) * slowdown
            blocks = requests * int(rng.choice([2, 4, 8]))
            rows.append(Row(elapsed, requests, 0, blocks, gen_reqs=requests))
    timeline = timeline_of(scripted(rows, num_blocks=200))
    skipping = detect_slow_decode(timeline, Thresholds())
    assert skipping
    monkeypatch.setattr(slow_decode._PaceBefore, "_surely_on_pace", lambda self, at: False)
    assert detect_slow_decode(timeline, Thresholds()) == skipping


def test_one_iteration_on_pace_does_not_end_a_slowdown():
    """Every decode 3.5x slower for 2 minutes, every 30th of them only 1.5x (the busy loops
    yielding): one slowdown, judged on the pace before it throughout; it ends once the
    decode-only iterations are on pace for a second."""
    slowdown = []
    for number in range(750):
        slowdown += decoding(1, 0.060 if number % 30 == 29 else 0.140)
    rows = decoding(750, 0.040) + slowdown + decoding(750, 0.040)
    timeline = timeline_of(scripted(rows))
    (episode,) = detect_slow_decode(timeline, Thresholds())
    assert episode.numbers["num_iterations"] > 725 - 10
    assert episode.numbers["baseline_s"] == pytest.approx(0.040)
    assert not episode.ongoing
    (at_the_end,) = detect_slow_decode(timeline_of(scripted(rows[:-750])), Thresholds())
    assert at_the_end.ongoing  # explain says "(ongoing)"; live keeps its pace in the window
