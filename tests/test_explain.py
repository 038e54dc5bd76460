"""`iterscope explain` on synthetic recordings shaped like the user stories (tests/scenarios)."""

import io
import json
import logging
import re
import threading
from itertools import pairwise

import msgspec
import pytest
from scenarios import synthetic
from scenarios.synthetic import Simulator, arrivals, long_prompt_bursts, long_prompts

from telemetry.analysis.episodes import (
    INFO,
    PROBLEM,
    Thresholds,
    detect_episodes,
    detect_kv_saturation,
    detect_telemetry_gaps,
)
from telemetry.analysis.explain import main, read_timelines
from telemetry.analysis.explain_report import format_engine
from telemetry.analysis.summary import format_summary, summarize
from telemetry.analysis.timeline import NS_PER_S, build_timelines
from telemetry.analysis.timeline_command import main as timeline_main
from telemetry.lane.record import IterationRecord, SpecDecodeCounts, heartbeat, iteration_record
from telemetry.lane.recording import RecordingReader, message_time_ns
from telemetry.sidecar import explain_command
from telemetry.sidecar.follow import follow
from telemetry.sidecar.replay import replay
from telemetry.sidecar.sinks.log import LogSink
from tests.helpers.findings import explained, replayed
from tests.helpers.lane import synthetic_record
from tests.helpers.wait import wait_until


def episodes_of(sim: Simulator, engine_index: int = 0):
    timeline = build_timelines(sim.messages)[engine_index]
    return timeline, detect_episodes(timeline)


def problems(episodes):
    return [e for e in episodes if e.severity != INFO]


def only(episodes, kind):
    found = [e for e in episodes if e.kind == kind]
    assert found, f"no {kind} episode in {[e.kind for e in episodes]}"
    return found


@pytest.fixture(scope="module")
def story1():
    return synthetic.story1_kv_cliff()


@pytest.fixture(scope="module")
def story2():
    return synthetic.story2_leak()


@pytest.fixture(scope="module")
def stalled():
    return synthetic.stalled()


def test_healthy_run_has_no_episode():
    for seed in (0, 1, 2):
        _, episodes = episodes_of(synthetic.healthy(seed))
        assert episodes == [], [(e.kind, e.evidence) for e in episodes]


def test_story1_kv_cliff_without_preemption(story1):
    timeline, episodes = episodes_of(story1)
    (cliff,) = only(episodes, "kv_cliff")
    assert cliff.numbers["usage_before"] >= 0.9
    assert cliff.numbers["usage_before"] - cliff.numbers["usage_after"] >= 0.5
    assert cliff.numbers["running_before"] == 18
    assert cliff.numbers["num_preemptions"] == 0
    assert cliff.numbers["num_iterations_after"] > 0  # the engine kept iterating
    assert "no preemption was counted" in cliff.explanation
    # Nothing invents a stall or a leak: the loop kept going and blocks were returned.
    assert not [e for e in episodes if e.kind in ("stall", "kv_leak", "telemetry_gap")]


def test_a_cliff_found_soon_after_says_what_followed_only_as_far_as_it_was_seen(story1):
    """Live, the sidecar finds a cliff within a second: its evidence must not claim 5 s."""
    timeline, episodes = episodes_of(story1)
    (cliff,) = only(episodes, "kv_cliff")
    assert re.search(r"; \d+ iterations ran in the next 5 s \(", cliff.evidence)
    cut_ns = cliff.end_ns + NS_PER_S // 2
    early = build_timelines([m for m in story1.messages if message_time_ns(m) <= cut_ns])[0]
    (cliff,) = only(detect_episodes(early), "kv_cliff")
    assert "the next 5 s" not in cliff.evidence + cliff.explanation
    assert re.search(
        r"(\d+ iterations ran|no iteration ran) in the (4\d\d\.\d ms|500\.0 ms) recorded since",
        cliff.evidence,
    ), cliff.evidence


def test_kv_cliff_by_preemption_is_explained_as_preemption():
    sim = Simulator(
        num_blocks=300, max_num_seqs=64, max_num_batched_tokens=2048, cost=synthetic.STORY_COST
    )
    sim.add_closed_loop(num_requests=40, concurrency=12, num_prompt=300, num_output=200)
    sim.run(20)
    _, episodes = episodes_of(sim)
    storms = only(episodes, "preemption_storm")
    assert sum(e.numbers["num_preemptions"] for e in storms) >= 3
    assert not [e for e in episodes if e.kind in ("stall", "kv_leak")]


def test_story2_leak_seen_with_usage_climbing(story2):
    _, episodes = episodes_of(story2)
    (leak,) = only(episodes, "kv_leak")
    assert leak.numbers["excess_blocks_last"] > 10 * max(leak.numbers["excess_blocks_first"], 1)
    assert leak.numbers["nothing_running"]
    assert leak.numbers["usage_last"] > 0.9
    # Consequences are named too: requests end up waiting for KV capacity.
    waits = only(episodes, "waiting")
    assert waits[-1].numbers["reason"] == "waiting_kv"
    assert not [e for e in episodes if e.kind == "kv_cliff"]


def test_stall_from_frozen_heartbeats(stalled):
    _, episodes = episodes_of(stalled)
    (stall,) = only(episodes, "stall")
    assert 7.5 <= stall.numbers["stall_time_s"] <= 9
    assert not stall.ongoing
    assert not stall.numbers["inside_iteration"]
    assert not [e for e in episodes if e.kind in ("idle", "kv_leak", "telemetry_gap")]


def test_work_after_an_idle_spell_is_waited_for_from_its_coming_as_live(tmp_path):
    """A real vLLM's recording (through the scheduler source): iteration 403 ends, 3 s idle
    (heartbeats say nothing waits or runs), then 2 requests and a 2.7 s step with the process
    frozen 2.6 s inside it. Explain had called 5.8 s from 403's end a stall; the live sidecar
    starts waiting for progress when the work comes (it had none before), so it saw only the
    silence ("Engine down"), as explain now does."""
    messages, seq, now_ns = [], 0, 100 * NS_PER_S

    def beat(ts_ns: int, running: int, iteration: int) -> None:
        nonlocal seq
        seq += 1
        messages.append(
            heartbeat(
                0,
                seq,
                ts_ns,
                ts_ns,
                last_iteration=iteration,
                pid=3,
                num_running_reqs=running,
                num_kv_blocks_total=1000,
            )
        )

    def record(iteration: int, start_ns: int, elapsed_ns: int, running: int) -> None:
        nonlocal seq
        seq += 1
        decoding = synthetic_record(0, iteration, start_ns, elapsed_ns, running, 0)
        messages.append(msgspec.structs.replace(decoding, msg_seq=seq))

    beat(now_ns, 1, 0)
    for iteration in range(1, 404):  # decoding, 40 ms a step
        record(iteration, now_ns, 40_000_000, 1 if iteration < 403 else 0)
        now_ns += 40_000_000
        if iteration % 25 == 0:
            beat(now_ns, 1 if iteration < 403 else 0, iteration)
    for second in range(1, 4):  # idle
        beat(now_ns + second * NS_PER_S - NS_PER_S // 10, 0, 403)
    work_ns = now_ns + 3 * NS_PER_S
    beat(work_ns + 20_000_000, 2, 403)  # the work came, then the process froze 2.6 s
    beat(work_ns + 2_670_000_000, 2, 403)
    record(404, work_ns, 2_680_000_000, 2)
    now_ns = work_ns + 2_680_000_000
    for iteration in range(405, 450):
        record(iteration, now_ns, 40_000_000, 2)
        now_ns += 40_000_000
    beat(now_ns, 2, 449)
    path = tmp_path / "rec.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(m) + b"\n" for m in messages))
    (timeline,) = read_timelines([path])[0].values()
    kinds = [e.title for e in detect_episodes(timeline) if e.kind in ("stall", "telemetry_gap")]
    assert kinds == ["Engine down"]
    live = [f.kind for f in replayed(path) if f.kind in ("stall", "dead")]
    assert live == ["dead"]


def test_stall_threshold_is_a_setting(stalled):
    timeline = build_timelines(stalled.messages)[0]
    assert not only(detect_episodes(timeline), "stall")[0].ongoing
    assert not [
        e for e in detect_episodes(timeline, Thresholds(stall_after=10)) if e.kind == "stall"
    ]


def test_stall_at_the_end_is_ongoing():
    sim = Simulator(cost=synthetic.STORY_COST)
    sim.add_requests(arrivals(4, 10), num_prompt=64, num_output=200)
    sim.add_stall(at_s=5.0, duration_s=100)
    sim.run(12)
    _, episodes = episodes_of(sim)
    (stall,) = only(episodes, "stall")
    assert stall.ongoing and stall.numbers["stall_time_s"] >= 6


def test_spinning_loop_is_a_stall():
    """A request larger than the whole KV cache can never be admitted: the loop keeps
    iterating (heartbeats see last_iteration move) but schedules nothing."""
    sim = Simulator(
        num_blocks=20, max_num_seqs=8, max_num_batched_tokens=512, cost=synthetic.STORY_COST
    )
    sim.add_requests(arrivals(4, 1), num_prompt=32, num_output=10)
    sim.add_requests([2.0], num_prompt=400, num_output=10)  # 25 blocks of 16 > 20
    sim.run(5)
    timeline, episodes = episodes_of(sim)
    records = [m for m in sim.messages if isinstance(m, IterationRecord)]
    spinning = [r for r in records if r.num_prefill_reqs + r.num_decode_reqs == 0]
    assert len(spinning) >= 10 and records[-len(spinning) :] == spinning  # all at the end
    (stall,) = only(episodes, "stall")
    assert stall.title == "Engine spinning: iterations schedule nothing"
    assert stall.numbers == {"num_iterations": len(spinning)}
    assert stall.start_ns == spinning[0].start_ns
    assert stall.end_ns == spinning[-1].start_ns + spinning[-1].elapsed_ns
    assert "up to 1 waited and 0 ran" in stall.evidence
    assert "waiting by reason at the end: KV capacity 1;" in stall.evidence
    fewer = Thresholds(spin_min_iterations=len(spinning) + 1)
    assert not [e for e in detect_episodes(timeline, fewer) if e.kind == "stall"]


def saturating(concurrency: int) -> Simulator:
    """Requests of 10 blocks each (150 + 10 tokens of 16) in a 100-block cache, kept at
    ``concurrency`` in flight: 10 fit at once, the rest wait for KV capacity."""
    sim = Simulator(
        num_blocks=100, max_num_seqs=64, max_num_batched_tokens=2048, cost=synthetic.STORY_COST
    )
    sim.add_closed_loop(num_requests=40, concurrency=concurrency, num_prompt=150, num_output=10)
    return sim.run(10)


def test_kv_saturation_with_requests_waiting_for_kv():
    sim = saturating(concurrency=14)
    timeline = build_timelines(sim.messages)[0]
    records = [m for m in sim.messages if isinstance(m, IterationRecord)]
    (saturation,) = detect_kv_saturation(timeline, Thresholds())
    # Every iteration but the last (after it all had finished): each wave's finish empties the
    # cache for one iteration only, which does not split the episode.
    assert saturation.numbers == {
        "peak_usage": 1.0,
        "num_iterations": len(records) - 1,
        "num_preemptions": 0,
        "max_waiting_kv_reqs": 4,
    }
    assert saturation.severity == PROBLEM
    assert saturation.start_ns == records[0].start_ns
    assert saturation.end_ns == records[-2].start_ns + records[-2].elapsed_ns
    assert "peak 100.0% of 100 blocks" in saturation.evidence
    assert "could not be admitted" in saturation.explanation
    # No preemption in the records: the text must not claim any.
    assert "were preempted" not in saturation.explanation
    assert "no running request was preempted" in saturation.explanation
    longer = Thresholds(kv_saturated_min_iterations=len(records))
    assert detect_kv_saturation(timeline, longer) == []


def test_kv_saturation_with_preemptions_says_how_many(story2):
    (saturation,) = detect_kv_saturation(build_timelines(story2.messages)[0], Thresholds())
    num_preemptions = saturation.numbers["num_preemptions"]
    assert num_preemptions > 0
    assert f"{num_preemptions} running requests that needed a new block were preempted" in (
        saturation.explanation
    )
    assert "no running request was preempted" not in saturation.explanation


def test_kv_saturation_where_everything_fits_is_information():
    timeline = build_timelines(saturating(concurrency=10).messages)[0]
    (saturation,) = detect_kv_saturation(timeline, Thresholds())
    assert saturation.severity == INFO
    assert saturation.numbers["max_waiting_kv_reqs"] == 0
    assert saturation.numbers["num_preemptions"] == 0
    assert "still fit" in saturation.explanation


def test_idle_is_information_not_a_problem():
    sim = Simulator(cost=synthetic.STORY_COST)
    sim.add_requests(arrivals(4, 5), num_prompt=64, num_output=20)
    sim.add_requests(arrivals(4, 5, start_s=20, seed=1), num_prompt=64, num_output=20)
    sim.run(27)
    _, episodes = episodes_of(sim)
    idle = only(episodes, "idle")
    assert idle[0].numbers["idle_time_s"] >= 10
    assert problems(episodes) == []


def test_story3_batched_versus_queued():
    batched = summarize(build_timelines(synthetic.story3_bursty(64).messages)[0])
    queued_timeline = build_timelines(synthetic.story3_bursty(4).messages)[0]
    queued = summarize(queued_timeline)
    assert batched.mean_batch_reqs > 10 and batched.waiting_share < 0.05
    assert batched.verdict.startswith("Batched") and "not queued" in batched.verdict
    assert queued.max_running_reqs == 4 and queued.waiting_share > 0.5
    assert "and queued" in queued.verdict and "mostly for --max-num-seqs" in queued.verdict
    assert queued.waiting_reason_shares["max_num_seqs"] == 1.0  # the JSON key, unchanged
    (wait,) = only(detect_episodes(queued_timeline), "waiting")
    assert wait.numbers["reason"] == "waiting_seq_limit"
    assert "Raise --max-num-seqs (now 4)" in wait.setting


def test_the_summary_says_how_many_finished_requests_were_aborted():
    """4 of 8 clients gave up while queued (vLLM's scheduler source): "8 finished" read as
    8 served; the summary says 4 of them were aborted."""
    sim = Simulator(cost=synthetic.STORY_COST)
    sim.add_requests(arrivals(2, 4), num_prompt=32, num_output=10)
    sim.run(10)
    finishes = [
        m for message in sim.messages for m in getattr(message, "milestones", ()) if m.finished_ns
    ]
    for milestone in finishes[:4]:
        milestone.finish_reason = 2  # abort
    summary = summarize(build_timelines(sim.messages)[0])
    assert (summary.num_finished_reqs, summary.num_aborted_reqs) == (len(finishes), 4)
    assert (
        f"requests: {len(finishes)} finished (4 of them aborted: their clients gave up, or the "
        "engine stopped); " in "\n".join(format_summary(summary))
    )


def test_lost_messages_make_a_telemetry_gap():
    sim = Simulator(cost=synthetic.STORY_COST)
    sim.add_requests(arrivals(6, 20), num_prompt=64, num_output=40)
    sim.add_message_loss(5.0, 6.0, by_engine=True)
    sim.add_message_loss(12.0, 12.3, by_engine=False)
    sim.run(22)
    num_lost = sim.msg_seq - len(sim.messages)
    _, episodes = episodes_of(sim)
    gaps = only(episodes, "telemetry_gap")
    assert len(gaps) == 2
    assert sum(g.numbers["num_lost"] for g in gaps) == num_lost
    assert gaps[0].numbers["num_dropped_by_engine"] == gaps[0].numbers["num_lost"]
    assert gaps[1].numbers["num_dropped_by_engine"] == 0


def test_a_recording_ending_with_requests_cut_off_says_whether_the_engine_was_told_to_stop(
    tmp_path, capsys
):
    """A closing heartbeat with requests in flight: told to stop (vLLM's SIGTERM), a
    shutdown cut them off, as the sidecar's "closed" line says; not told (a failed loop), it
    is no shutdown, and the live sidecar called it dead."""
    said = {}
    for told in (True, False):
        sim = Simulator(cost=synthetic.STORY_COST)
        sim.add_requests([0.5] * 3, num_prompt=32, num_output=4000)
        path = sim.run(5).close(stop_requested=told).write(tmp_path / f"{told}.jsonl")
        assert main([str(path)]) == 0
        said[told] = capsys.readouterr().out
    assert (
        "with 3 requests running and 0 waiting: it was told to stop, and the shutdown cut "
        in (said[True])
    )
    assert "with 3 requests running and 0 waiting, not told to stop: its loop failed" in said[False]


def test_restarted_engine_is_a_silence_not_a_loss():
    first = Simulator(cost=synthetic.STORY_COST).run(10)
    second = Simulator(cost=synthetic.STORY_COST, start_s=1015.0)
    second.add_requests(arrivals(2, 3), num_prompt=32, num_output=10)
    second.run(5)
    timeline = build_timelines(first.messages + second.messages)[0]
    (gap,) = only(detect_episodes(timeline), "telemetry_gap")
    assert gap.numbers["restarted"] and gap.numbers["silent_time_s"] >= 4


def test_an_engine_that_closed_its_lane_and_restarted_is_no_silence_live_or_in_explain(
    tmp_path, capsys
):
    """A clean shutdown (a closing heartbeat, nothing in flight) and a start 5 s later: no
    silence, no "Engine down", in explain and in the sidecar's replay alike; a recording that
    ends with one says the engine shut down there."""
    first = Simulator(cost=synthetic.STORY_COST)
    first.add_requests(arrivals(2, 3), num_prompt=32, num_output=10)
    first.run(10).close()
    second = Simulator(cost=synthetic.STORY_COST, start_s=1015.0).run(5)
    path = tmp_path / "restarted.jsonl"
    path.write_bytes(
        first.write(tmp_path / "a").read_bytes() + second.write(tmp_path / "b").read_bytes()
    )
    (timeline,) = read_timelines([path])[0].values()
    assert "telemetry_gap" not in {e.kind for e in detect_episodes(timeline)}
    assert explained(timeline) == [] and replayed(path) == []
    assert main([str(first.write(tmp_path / "closed.jsonl"))]) == 0
    assert "It ends as the engine closed its telemetry lane at " in capsys.readouterr().out


def test_holes_reordering_silences_and_restarts_in_one_stream():
    """Messages by seq and time: 3 lost (a hole), two that came out of order (none lost), a
    3.7 s silence with seq continuous (a silence), 4 s with one message lost (a hole, not a
    silence), then the engine restarted (seq 1 after 20) 5 s later (a silence, restarted)."""
    at_s = [
        *[(seq, 1.0 + 0.1 * (seq - 1)) for seq in range(1, 11)],
        (14, 2.0),
        (16, 2.1),
        (15, 2.2),
        (17, 2.3),
        (18, 6.0),
        (20, 10.0),
        (1, 15.0),
        (2, 15.1),
    ]
    records = [
        iteration_record(0, seq, number, start_ns=int(t * NS_PER_S), elapsed_ns=50_000_000)
        for number, (seq, t) in enumerate(at_s, start=1)
    ]
    beat = heartbeat(0, 3, int(15.2 * NS_PER_S), int(15.2 * NS_PER_S))
    gaps = detect_telemetry_gaps(build_timelines([*records, beat])[0], Thresholds())
    holes = [(round(g.start_ns / NS_PER_S, 2), g.numbers["num_lost"]) for g in gaps[:2]]
    assert holes == [(1.95, 3), (6.05, 1)]
    silences = [
        (round(g.start_ns / NS_PER_S, 2), round(g.end_ns / NS_PER_S, 2), g.numbers["restarted"])
        for g in gaps[2:]
    ]
    assert silences == [(2.35, 6.05, False), (10.05, 15.05, True)]


def test_dead_after_sets_how_long_a_silence_is_as_the_sidecars_flag_does(tmp_path, capsys):
    """The restart's 5 s without a message is a silence at the default (2.5 s, the sidecar's
    default --dead-after) and none at --dead-after 10s; explain and timeline refuse a value
    that is not a duration above 0, saying so."""
    first = Simulator(cost=synthetic.STORY_COST).run(10)
    second = Simulator(cost=synthetic.STORY_COST, start_s=1015.0).run(5)
    path = tmp_path / "restarted.jsonl"
    path.write_bytes(
        first.write(tmp_path / "a").read_bytes() + second.write(tmp_path / "b").read_bytes()
    )

    def silences(*flags: str) -> list:
        assert main([str(path), "--json", *flags]) == 0
        (engine,) = json.loads(capsys.readouterr().out)["engines"]
        return [e for e in engine["episodes"] if "silent_time_s" in e["numbers"]]

    assert len(silences()) == 1 and silences("--dead-after", "4s")
    assert silences("--dead-after", "10s") == []
    for bad in ("0", "-1s", "soon"):
        output = ["-o", str(tmp_path / "t.pftrace")]
        for command, argv in ((main, [str(path)]), (timeline_main, [str(path), *output])):
            with pytest.raises(SystemExit) as exit_info:
                command([*argv, f"--dead-after={bad}"])
            assert exit_info.value.code == 2
            error = capsys.readouterr().err
            assert f"argument --dead-after: '{bad}' is not a duration above 0 (e.g. 2.5s" in error


def test_long_prefill_chunks_stretch_decode():
    sim = long_prompts(long_prompt_bursts((5.0, 12.0)))
    _, episodes = episodes_of(sim)
    long_prefills = only(episodes, "long_prefill")
    assert len(long_prefills) == 2
    assert long_prefills[0].numbers["max_elapsed_s"] > 3 * long_prefills[0].numbers["baseline_s"]
    assert "Lower --max-num-batched-tokens (now 2048)" in long_prefills[0].setting


def test_engines_are_told_apart():
    leaky = synthetic.story2_leak()
    leaky.engine_index = 1
    for message in leaky.messages:
        message.engine_index = 1
    timelines = build_timelines(synthetic.healthy().messages + leaky.messages)
    assert sorted(timelines) == [0, 1]
    assert detect_episodes(timelines[0]) == []
    only(detect_episodes(timelines[1]), "kv_leak")


def test_rotated_files_in_any_order_and_a_cut_line(story2, tmp_path):
    whole = story2.write(tmp_path / "whole.jsonl")
    lines = whole.read_bytes().splitlines(keepends=True)
    third = len(lines) // 3
    parts = [lines[:third], lines[third : 2 * third], lines[2 * third :]]
    paths = []  # the JSONL sink's rotation: rec.jsonl.2 (oldest), rec.jsonl.1, rec.jsonl
    for number, part in enumerate(parts):
        path = tmp_path / ("rec.jsonl" if number == 2 else f"rec.jsonl.{2 - number}")
        path.write_bytes(b"".join(part) + (b"[17, 0, 5" if number == 2 else b""))
        paths.append(path)
    whole_episodes = detect_episodes(read_timelines([whole])[0][0])
    for given in ([paths[-1]], list(reversed(paths)), paths + paths):
        split_timelines, num_messages, num_bad = read_timelines(given)
        assert num_bad == 1 and num_messages == len(lines)
        assert [(e.kind, e.start_ns) for e in detect_episodes(split_timelines[0])] == [
            (e.kind, e.start_ns) for e in whole_episodes
        ]


def test_cli_text_json_and_plot(story1, tmp_path, capsys):
    path = story1.write(tmp_path / "story1.jsonl")
    plot = tmp_path / "story1.png"
    assert main([str(path), "--plot", str(plot)]) == 0
    text = capsys.readouterr().out
    assert "KV cache cliff: running requests became waiting" in text
    assert "preemptions counted: 0" in text and "batched or queued?" in text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    assert main([str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (engine,) = report["engines"]
    cliff = next(e for e in engine["episodes"] if e["kind"] == "kv_cliff")
    assert cliff["start_wall_ns"] - cliff["start_ns"] == story1.wall_offset_ns
    assert engine["summary"]["num_finished_reqs"] == 60
    # the keys scripts read, kept from before the code's words became prefill/decode
    assert engine["summary"]["num_context_tokens"] > 0
    assert "num_generation_tokens" in engine["summary"]


def test_cli_errors(tmp_path, capsys):
    assert main([str(tmp_path / "missing.jsonl")]) == 2
    assert "no such recording file" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("not json\n")
    assert main([str(empty)]) == 2
    assert "its line is not one" in capsys.readouterr().err


def test_nothing_to_read_says_why_in_every_command(story1, tmp_path, capsys):
    """explain, tune and timeline say alike why a recording gave them nothing, and exit
    alike: 2, as for a file they cannot read."""
    from telemetry.analysis import timeline_command, tune

    garbage, empty = tmp_path / "garbage.jsonl", tmp_path / "empty.jsonl"
    garbage.write_text("not json\n{]\n")
    empty.write_text("")
    recording = story1.write(tmp_path / "rec.jsonl")
    commands = {
        "explain": lambda *args: main(list(args)),
        "tune": lambda *args: tune.main([*args, "--itl-target", "50ms"]),
        "timeline": lambda *args: timeline_command.main([*args, "-o", str(tmp_path / "t.pftrace")]),
    }
    cases = [
        ([str(garbage)], "none of its 2 lines is one"),
        ([str(empty)], "no telemetry message found in the recording: it is empty"),
        (
            [str(recording), "--engine", "7"],
            "no message of engine 7 in the recording (it has engine 0)",
        ),
    ]
    for name, command in commands.items():
        for args, said in cases:
            assert command(*args) == 2, (name, args)
            assert said in capsys.readouterr().err, (name, args)


def test_follow_prints_the_stall_as_the_recording_grows(stalled, tmp_path):
    """The sidecar's lines, as it said them live: the stall when it opens, mid-recording,
    and when it closes once the rest has come."""
    encoder = msgspec.json.Encoder()
    lines = [encoder.encode(m) + b"\n" for m in stalled.messages]
    path = tmp_path / "live.jsonl"
    cut = next(
        i for i, m in enumerate(stalled.messages) if getattr(m, "ts_ns", 0) >= stalled.at(17.0)
    )  # mid-stall: frozen for 6 s+, past the 5 s threshold
    path.write_bytes(b"".join(lines[:cut]))
    out = io.StringIO()
    reads = []

    def grow():
        wait_until(lambda: "Engine stalled since" in out.getvalue(), 10, "the stall said")
        reads.append(out.getvalue())
        with open(path, "ab") as f:
            f.write(b"".join(lines[cut:]))

    writer = threading.Thread(target=grow)
    writer.start()
    follow([path], Thresholds(), interval_s=0.05, max_time_s=1.5, out=out)
    writer.join()
    text = out.getvalue()
    assert "ended after" not in reads[0].split("Engine stalled since", 1)[1], reads[0]
    assert "INFO Engine 000: Engine stalled: ended after" in text, text
    assert text.index("Engine stalled since") < text.index("Engine stalled: ended after")


def test_follow_says_what_the_sidecar_said_live(tmp_path):
    """Three long prefills 4-7 s apart: the sidecar's log says the first as it opens and
    closes, the repeats in one line (finding_log.py); follow prints exactly the lines a
    replay through the sidecar prints, then explain's summary with all three."""
    sim = long_prompts(long_prompt_bursts())
    path = sim.write(tmp_path / "rec.jsonl")
    out = io.StringIO()
    follow([path], Thresholds(), 0.05, max_time_s=0.3, out=out)
    text = out.getvalue()
    said = []
    replay(path, [LogSink(emit=lambda level, line: said.append((level, line)))])
    levels = {"INFO": logging.INFO, "WARNING": logging.WARNING}
    printed = [line.partition(" ") for line in text.splitlines()]
    printed = [(levels[level], line) for level, _, line in printed if level in levels]
    assert printed == [(level, line) for level, line in said if level >= logging.INFO]
    assert text.count(" Engine 000: Long prefill chunks stretch decode latency since") == 1
    assert "Long prefill chunks stretch decode latency again: 2 more times" in text, text
    assert "Long prefill chunks stretch decode latency: 3 times" in text  # the summary


def test_follow_reads_files_rotated_while_following(story2, tmp_path):
    """The sidecar appends, then rotates (rec.jsonl -> rec.jsonl.1 -> rec.jsonl.2, a new
    rec.jsonl): every message is read once, the tail written just before a rename included."""
    encoder = msgspec.json.Encoder()
    lines = [encoder.encode(m) + b"\n" for m in story2.messages]
    cuts = [
        0,
        len(lines) // 5,
        2 * len(lines) // 5,
        3 * len(lines) // 5,
        4 * len(lines) // 5,
        len(lines),
    ]
    parts = [b"".join(lines[a:b]) for a, b in pairwise(cuts)]
    path = tmp_path / "rec.jsonl"
    path.write_bytes(parts[0])
    reader = RecordingReader([path])
    read = reader.read_new()
    with open(path, "ab") as f:
        f.write(parts[1])
    path.rename(tmp_path / "rec.jsonl.1")
    path.write_bytes(parts[2])
    read += reader.read_new()
    with open(path, "ab") as f:
        f.write(parts[3])
    (tmp_path / "rec.jsonl.1").rename(tmp_path / "rec.jsonl.2")
    path.rename(tmp_path / "rec.jsonl.1")
    path.write_bytes(parts[4])
    read += reader.read_new()
    assert reader.read_new() == []
    assert read == story2.messages and reader.num_bad_lines == 0


def test_follow_reads_nothing_twice_when_a_rotation_lands_between_listing_and_opening(
    story2, tmp_path, monkeypatch
):
    from telemetry.lane import recording

    encoder = msgspec.json.Encoder()
    lines = [encoder.encode(m) + b"\n" for m in story2.messages]
    half = len(lines) // 2
    path = tmp_path / "rec.jsonl"
    path.write_bytes(b"".join(lines[:half]))
    reader = RecordingReader([path])
    read = reader.read_new()
    path.rename(tmp_path / "rec.jsonl.1")  # the rotation, after the reader listed the files
    path.write_bytes(b"".join(lines[half:]))
    listing = recording.with_rotated_files
    monkeypatch.setattr(recording, "with_rotated_files", lambda paths: [path])  # stale list
    read += reader.read_new()
    monkeypatch.setattr(recording, "with_rotated_files", listing)
    read += reader.read_new()  # rec.jsonl.1 is listed again: its place was kept
    assert read == story2.messages


def test_follow_keeps_a_bounded_window(story2, tmp_path):
    path = story2.write(tmp_path / "story2.jsonl")
    out = io.StringIO()
    follow([path], Thresholds(), interval_s=0.05, max_time_s=0.3, out=out, window_messages=300)
    (newest,) = build_timelines(story2.messages[-300:]).values()
    summary = "\n".join(format_engine(newest, detect_episodes(newest), Thresholds()))
    assert out.getvalue().endswith(summary + "\n")
    assert newest.num_iterations < 300 < len(story2.messages)


def test_follow_reads_what_its_last_interval_added(story2, tmp_path, monkeypatch):
    """Lines written while follow sleeps its last interval are in the summary it ends with."""
    from telemetry.sidecar import follow as follow_module

    path = tmp_path / "story2.jsonl"
    story2.write(path)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:100]))

    def sleep_and_grow(seconds: float) -> None:
        with open(path, "ab") as f:  # the writer goes on while follow sleeps
            f.write(b"".join(lines[100:]))

    monkeypatch.setattr(follow_module.time, "sleep", sleep_and_grow)
    out = io.StringIO()
    follow([path], Thresholds(), interval_s=3600, max_time_s=0.0001, out=out)
    (whole,) = build_timelines(story2.messages).values()
    summary = "\n".join(format_engine(whole, detect_episodes(whole), Thresholds()))
    assert out.getvalue().endswith(summary + "\n")


def test_reached_through_the_iterscope_command(story2, tmp_path, capsys):
    from engine.entrypoints.cli import main as iterscope

    path = story2.write(tmp_path / "story2.jsonl")
    assert iterscope(["explain", str(path), "--engine", "0"]) == 0
    assert "KV blocks leaking" in capsys.readouterr().out
    assert iterscope(["explain", str(path), "--engine", "7"]) == 2


def test_wrapped_lines_never_split_a_flag():
    from telemetry.analysis.explain_report import _wrapped

    text = "Raise " + " ".join(["--gpu-memory-utilization"] * 12)
    lines = _wrapped("do", text)
    assert len(lines) > 2
    assert all(
        word.startswith("--") or word in ("do", "Raise") for line in lines for word in line.split()
    )


def recording_of(path, pid: int, first_ms: int, restart_pid: int = 0):
    """A recording of engine 0: a heartbeat of process ``pid``, 20 decode iterations; with
    ``restart_pid``, a heartbeat of that process and 20 more (the engine restarted)."""
    from telemetry.lane.record import heartbeat, iteration_record

    ms = 1_000_000
    lines = []
    for number, process in enumerate(p for p in (pid, restart_pid) if p):
        start = first_ms + 1_000 * number
        lines.append(heartbeat(0, 40 * number + 1, start * ms, start * ms, pid=process))
        lines += [
            iteration_record(0, 40 * number + 2 + i, i + 1, start_ns=(start + 10 * i) * ms,
                             elapsed_ns=8 * ms, num_decode_reqs=2, num_decode_tokens=2,
                             num_running_reqs=2)
            for i in range(20)
        ]  # fmt: skip
    path.write_bytes(b"".join(msgspec.json.encode(message) + b"\n" for message in lines))
    return path


def test_two_engines_that_share_an_index_are_refused_not_drawn_as_one(tmp_path, capsys):
    """Two runs' recordings (engine 0 each, other processes) would interleave two engines'
    iterations on one timeline: refused with both files named. One engine's recording
    continued in a second file, or restarted within one, is one engine."""
    first = recording_of(tmp_path / "vllm.jsonl", pid=100, first_ms=0)
    second = recording_of(tmp_path / "ours.jsonl", pid=200, first_ms=500_000)
    assert main([str(first), str(second)]) == 2
    error = capsys.readouterr().err
    assert f"engine 0 of {first} (pid 100) and engine 0 of {second} (pid 200)" in error
    continued = recording_of(tmp_path / "day2.jsonl", pid=100, first_ms=1_000)
    assert len(read_timelines([first, continued])[0]) == 1
    restarted = recording_of(tmp_path / "restart.jsonl", pid=300, first_ms=0, restart_pid=301)
    assert len(read_timelines([restarted])[0]) == 1


def test_the_header_says_a_device_no_heartbeat_named_is_not_reported():
    """An engine whose heartbeats name no device (a source that does not know it) reads "not
    reported by the source", never "on ?"; one that names it, "on CPU"."""
    from telemetry.analysis.explain_report import engine_header
    from telemetry.lane.record import Heartbeat

    sim = synthetic.story3_bursty(2)
    assert engine_header(build_timelines(sim.messages)[0]).startswith("Engine 0, model sim on CPU,")
    unnamed = [
        msgspec.structs.replace(m, device_name="") if isinstance(m, Heartbeat) else m
        for m in sim.messages
    ]
    header = engine_header(build_timelines(unnamed)[0])
    assert header.startswith("Engine 0, model sim, device not reported by the source, "), header
    versioned = [
        msgspec.structs.replace(m, source="vllm-scheduler", engine_version="vllm 0.33.0")
        if isinstance(m, Heartbeat)
        else m
        for m in sim.messages
    ]
    header = engine_header(build_timelines(versioned)[0])
    assert header.endswith(", vllm 0.33.0 (vllm-scheduler)"), header


def drafting_records() -> list:
    """12 iterations of 6 decoding requests, 4 of them drafting 3 tokens each (2 found no
    draft); 8 iterations accept 4, 3 and 3 tokens at the draft's positions 1, 2 and 3 (10
    in all), the other 4 none. Over the recording: 48 drafts, 144 draft tokens, 80 accepted
    (55.6%), 32, 24 and 24 at each position (0.667, 0.500, 0.500 per draft), a mean
    acceptance length of 1 + 80 / 48 = 2.67 per draft, and 1 + 80 / 72 = 2.11 tokens per
    decoding request and iteration; each iteration computes 6 + 12 = 18 tokens."""
    records = []
    for number in range(1, 13):
        per_pos = [4, 3, 3] if number <= 8 else [0, 0, 0]
        records.append(
            iteration_record(
                0,
                number,
                number,
                start_ns=number * 20_000_000,
                elapsed_ns=10_000_000,
                num_decode_reqs=6,
                num_decode_tokens=6 + sum(per_pos),
                num_running_reqs=6,
                spec_decode=SpecDecodeCounts(4, 12, sum(per_pos), per_pos),
            )
        )
    return records


def test_the_summary_says_how_speculative_decoding_went():
    summary = summarize(build_timelines(drafting_records())[0])
    lines = format_summary(summary)
    assert (
        "speculative decoding: 144 draft tokens in 48 drafts, 80 accepted (55.6%), mean "
        "acceptance length 2.67; per position 0.667, 0.500, 0.500; decoding requests got "
        "2.11 tokens per iteration on average"
    ) in lines
    # the batch counts the tokens computed (drafts included), the decode tokens those produced
    assert summary.mean_batch_tokens == 18.0
    assert summary.num_decode_tokens == 6 * 12 + 80
    data = summary.to_dict()["spec_decode"]
    assert data["num_accepted_tokens_per_pos"] == [32, 24, 24]
    assert data["mean_acceptance_length"] == pytest.approx(1 + 80 / 48)


def test_without_drafts_the_summary_says_nothing_of_them():
    summary = summarize(build_timelines(synthetic.story3_bursty(64).messages)[0])
    assert not any("speculative" in line for line in format_summary(summary))
    assert "spec_decode" not in summary.to_dict()


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--plot", "{tmp}/no-such-folder/p.png"], "there is no folder"),
        (["--plot", "{tmp}/copy.jsonl"], "expected a file name ending .png, .svg, .pdf"),
        (["--plot", "{tmp}/no-extension"], "expected a file name ending .png, .svg, .pdf"),
        (["--follow", "--interval", "0"], "argument --interval: '0' is not a duration above 0"),
        (["--follow", "--max-time", "0s"], "argument --max-time: '0s' is not a duration above 0"),
    ],
)
def test_bad_flags_are_refused_before_reading_anything(flags, said, story2, tmp_path, capsys):
    """A plot that could not be written was a traceback after the whole analysis; an
    --interval of 0 made --follow spin."""
    path = story2.write(tmp_path / "story2.jsonl")
    with pytest.raises(SystemExit) as exit_:
        explain_command.main([str(path), *(flag.format(tmp=tmp_path) for flag in flags)])
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["story2.jsonl"]


def test_token_rates_say_their_span_where_the_recording_is_longer():
    """The rates are over the iterations (first start to last end); a recording whose
    heartbeats go on for minutes after the last iteration gives a longer span on the line
    above, which the rates were not divided by."""
    records = [
        iteration_record(
            0,
            n,
            n,
            start_ns=n * 100_000_000,
            elapsed_ns=50_000_000,
            num_prefill_reqs=1,
            num_prefill_tokens=10,
            num_running_reqs=1,
        )
        for n in range(1, 101)
    ]  # 10 tokens every 0.1 s: 100 tokens/s over 9.95 s
    beats = [heartbeat(0, 101, 60 * NS_PER_S, 1_700_000_000 * NS_PER_S)]
    lines = format_summary(summarize(build_timelines([*records, *beats])[0]))
    tokens = next(line for line in lines if line.startswith("tokens:"))
    assert tokens == (
        "tokens: 1000 prefill (100.5 tokens/s), 0 decode (0.0 tokens/s) over the 9.9 s from "
        "the first iteration to the last"
    )
    lines = format_summary(summarize(build_timelines(records)[0]))
    assert next(line for line in lines if line.startswith("tokens:")).endswith("(0.0 tokens/s)")


def test_a_saturation_ended_by_a_preemption_counts_it_as_the_cliff_after_it_does():
    """The iteration that brings usage below 95% is the saturation's too: where it preempted
    (as the cliff counts), the saturation said "0 preemptions ... none was preempted"."""
    rows = [synthetic.Row(0.010, running=2, waiting=0, blocks_used=100, gen_reqs=2)] * 12
    rows += [synthetic.Row(0.010, running=1, waiting=1, blocks_used=50, gen_reqs=1, preemptions=1)]
    rows += [synthetic.Row(0.010, running=1, waiting=1, blocks_used=50, gen_reqs=1)] * 5
    episodes = detect_episodes(build_timelines(synthetic.scripted(rows))[0])
    (cliff,) = only(episodes, "kv_cliff")
    (saturation,) = only(episodes, "kv_saturation")
    assert cliff.numbers["num_preemptions"] == saturation.numbers["num_preemptions"] == 1
    assert "none was preempted" not in saturation.explanation
    assert "1 running request that needed a new block was preempted" in saturation.explanation


def test_each_episode_of_all_has_the_action_its_live_finding_gave(tmp_path, capsys):
    """`--all` printed the detector's generic setting under each episode ("Raise
    --max-num-seqs: KV had room") beside the finding's action ("Keep --max-num-seqs at 7"):
    each episode's change line is now its own action, the worst one's the finding's."""
    from telemetry.analysis.actions import episode_action, finding_action
    from telemetry.analysis.findings import build_findings

    make, _ = synthetic.SCENARIOS["story3 sequence limit"]
    path = make().write(tmp_path / "recording.jsonl")
    (timeline,) = read_timelines([path])[0].values()
    episodes = detect_episodes(timeline)
    assert main([str(path), "--all"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for episode in episodes:
        assert "change " + " ".join(episode_action(timeline, episode, Thresholds()).split()) in text
    (finding,) = build_findings(timeline, episodes, Thresholds())
    assert finding_action(timeline, finding, Thresholds()) == episode_action(
        timeline, finding.worst, Thresholds()
    )


def test_batch_composition_is_by_decoding_requests_not_tokens_produced():
    """A vLLM source counts a prompt's first token as produced (num_decode_tokens 1) in a
    step that decoded no request: that step is prefill-only, not mixed."""
    records = [
        iteration_record(
            0,
            1,
            1,
            start_ns=0,
            elapsed_ns=10,
            num_prefill_reqs=1,
            num_prefill_tokens=7000,
            num_decode_tokens=1,
            num_running_reqs=1,
        ),
        iteration_record(
            0,
            2,
            2,
            start_ns=20,
            elapsed_ns=10,
            num_decode_reqs=1,
            num_decode_tokens=1,
            num_running_reqs=1,
        ),
    ]
    summary = summarize(build_timelines(records)[0])
    shares = (summary.decode_only_share, summary.prefill_only_share, summary.mixed_share)
    assert shares == (0.5, 0.5, 0.0)


def test_json_findings_name_the_kind_the_live_sidecar_and_alerts_use(tmp_path, capsys):
    """explain's kinds are its episodes' (a silence is a telemetry_gap, waiting is waiting):
    `live_kind` is the one /metrics, the alerts and the live findings use, to join them."""
    path = synthetic.write_records(
        synthetic.scripted(synthetic.SCRIPTED_CLIFF), tmp_path / "cliff.jsonl"
    )
    assert main([str(path), "--json"]) == 0
    (engine,) = json.loads(capsys.readouterr().out)["engines"]
    kinds = {finding["kind"]: finding["live_kind"] for finding in engine["findings"]}
    assert kinds == {
        "telemetry_gap": "dead",
        "kv_cliff": "kv_cliff",
        "long_prefill": "long_prefill",
    }
