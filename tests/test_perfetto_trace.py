"""`iterscope timeline`: recordings drawn as Perfetto traces, read back with perfetto's protos."""

import random
import re
from itertools import pairwise

import msgspec
import pytest
from scenarios.synthetic import SCENARIOS, write_records

from telemetry.analysis.actions import finding_action
from telemetry.analysis.episodes import Thresholds, detect_episodes
from telemetry.analysis.explain import main as explain_main
from telemetry.analysis.findings import build_findings
from telemetry.analysis.perfetto_trace import BATCH_KINDS, drawn_ends
from telemetry.analysis.request_phases import assign_lanes, request_phases
from telemetry.analysis.timeline import read_timelines
from telemetry.analysis.timeline_command import main
from telemetry.analysis.track_names import KV_USAGE, RUNNING, WAITING, counter_name
from telemetry.lane.record import (
    EVENT_FINISHED,
    EVENT_FIRST_TOKEN,
    UNKNOWN_PREFILL_REQS,
    UNKNOWN_WAITING_REASONS,
    RequestMilestone,
    SpecDecodeCounts,
    heartbeat,
    iteration_record,
)
from tests.helpers.perfetto_reader import read_trace

STORIES = ["story1 KV cliff", "stall", "preemption storm", "token budget", "KV capacity"]


def convert(recording, tmp_path, *extra):
    out = tmp_path / "run.pftrace"
    assert main([str(recording), "-o", str(out), *extra]) == 0
    return read_trace(out)


def assert_no_overlap(slices):
    """Slices of one depth (in begin order) follow one another; a nested one lies inside the
    slice it is nested in."""
    last_at_depth = {}
    for current in slices:
        assert current.start_ns <= current.end_ns, current
        if current.depth:
            parent = last_at_depth[current.depth - 1]
            assert parent.start_ns <= current.start_ns <= current.end_ns <= parent.end_ns
        before = last_at_depth.get(current.depth)
        assert before is None or before.end_ns <= current.start_ns, (before, current)
        last_at_depth[current.depth] = current


@pytest.mark.parametrize("story", STORIES)
def test_every_iteration_counter_sample_request_and_finding_is_in_the_trace_at_its_time(
    story, tmp_path
):
    recording = SCENARIOS[story][0]().write(tmp_path / "rec.jsonl")
    trace = convert(recording, tmp_path)
    tl = read_timelines([recording])[0][0]

    ((process_uuid, process),) = trace.processes().items()
    assert process.process.process_name.startswith("engine 0: ")
    assert f"{tl.num_kv_blocks_total} KV blocks" in process.process.process_name

    iterations = trace.slices[trace.track_named("iterations", process_uuid)]
    assert [s.start_ns for s in iterations] == tl.col("start_ns").tolist()
    assert [s.end_ns for s in iterations] == drawn_ends(tl).tolist()
    assert [s.args["iteration"] for s in iterations] == tl.col("iteration").tolist()
    kinds = (tl.col("num_prefill_tokens") > 0) + 2 * (tl.col("num_decode_reqs") > 0)
    assert [s.name for s in iterations] == [BATCH_KINDS[k] for k in kinds]
    decode = tl.col("num_decode_reqs").tolist()
    assert [s.args.get("num_decode_reqs", 0) for s in iterations] == decode

    ends = tl.col("end_ns").tolist()
    expected = {
        KV_USAGE: (100 * tl.kv_usage).tolist(),
        "KV blocks used": tl.col("num_kv_blocks_used").tolist(),
        RUNNING: tl.col("num_running_reqs").tolist(),
        WAITING: tl.col("num_waiting_reqs").tolist(),
        "waiting: KV capacity": tl.col("num_waiting_kv_reqs").tolist(),
        "waiting: --max-num-batched-tokens": tl.col("num_waiting_budget_reqs").tolist(),
        "iteration time": tl.col("elapsed_ns").tolist(),
    }
    for what, values in expected.items():
        samples = trace.counters[trace.track_named(counter_name(0, what), process_uuid)]
        assert [ts for ts, _ in samples] == drawn_ends(tl).tolist()
        assert [v for _, v in samples] == pytest.approx(values), what
    assert len(ends) == tl.num_iterations

    milestones = {m.request_id: m for r in tl.records for m in r.milestones}
    lanes = trace.children(process_uuid, "requests ")
    requests = {
        s.name.removeprefix("request "): s
        for lane in lanes
        for s in trace.slices[lane]
        if s.depth == 0
    }
    assert requests.keys() == milestones.keys()
    for request_id, drawn in requests.items():
        milestone = milestones[request_id]
        assert drawn.start_ns == milestone.arrival_ns
        if milestone.event & EVENT_FINISHED:
            assert drawn.end_ns == milestone.finished_ns
            assert drawn.args["num_output_tokens"] == milestone.num_output_tokens
        if milestone.first_token_ns:
            ttft_ms = (milestone.first_token_ns - milestone.arrival_ns) / 1e6
            assert drawn.args["ttft_ms"] == pytest.approx(ttft_ms)

    th = Thresholds()
    findings = build_findings(tl, detect_episodes(tl, th), th)
    drawn = sorted(
        (s.start_ns, s.name, s.args["action"])
        for lane in trace.children(process_uuid, "findings ")
        for s in trace.slices[lane]
    )
    assert drawn == sorted(
        (e.start_ns, f"finding {f.kind}", finding_action(tl, f, th))
        for f in findings
        for e in f.episodes
    )
    assert findings, "the story shows no finding: the check above proves nothing"

    for uuid, times in trace.timestamps.items():
        assert times == sorted(times), trace.tracks[uuid].name
    for slices in trace.slices.values():
        assert_no_overlap(slices)


def test_the_story_s_finding_is_on_the_findings_track(tmp_path):
    """A stall draws a "finding stall" slice over the frozen loop's time, with the action."""
    trace = convert(SCENARIOS["stall"][0]().write(tmp_path / "rec.jsonl"), tmp_path)
    (process_uuid,) = trace.processes()
    names = {
        s.name: s for lane in trace.children(process_uuid, "findings ") for s in trace.slices[lane]
    }
    assert "finding stall" in names
    stall = names["finding stall"]
    assert stall.end_ns - stall.start_ns >= 5e9
    assert stall.args["action"]


def test_a_cut_recording_converts_up_to_the_cut(tmp_path):
    recording = SCENARIOS["story1 KV cliff"][0]().write(tmp_path / "rec.jsonl")
    whole = recording.read_bytes()
    cut = whole[: len(whole) * 3 // 5]
    assert not cut.endswith(b"\n")  # a partial last line, as a kill -9 leaves
    recording.write_bytes(cut)
    num_complete = cut.count(b"\n")
    decoder = msgspec.json.Decoder()
    tags = [decoder.decode(line)[0] for line in cut.splitlines()[:num_complete]]
    trace = convert(recording, tmp_path)
    (process_uuid,) = trace.processes()
    iterations = trace.slices[trace.track_named("iterations", process_uuid)]
    assert len(iterations) == sum(1 for tag in tags if tag == 17)
    assert len(iterations) > 100


def decoding(i: int, **fields):
    """Engine 0's iteration ``i + 1``, 10 ms after the one before and 9 ms long, two requests
    decoding a token each; ``fields`` set more, or other, counts."""
    counts = dict(num_decode_reqs=2, num_decode_tokens=2, num_running_reqs=2)
    return iteration_record(
        0, i + 1, i + 1, start_ns=10**9 + i * 10**7, elapsed_ns=9 * 10**6, **{**counts, **fields}
    )


def test_unknown_counts_are_named_never_drawn_as_zero(tmp_path):
    """A vLLM server reports no waiting reasons and no prefill request count: no counter track
    for the reasons, and the iteration says which counts it lacks."""
    unknown = UNKNOWN_PREFILL_REQS | UNKNOWN_WAITING_REASONS
    records = [
        decoding(
            i, num_waiting_reqs=3, num_kv_blocks_used=4, num_kv_blocks_free=60, unknown=unknown
        )
        for i in range(5)
    ]
    trace = convert(write_records(records, tmp_path / "rec.jsonl"), tmp_path)
    names = {d.name for d in trace.tracks.values()}
    assert counter_name(0, WAITING) in names
    assert not any("waiting: " in name for name in names)
    (process_uuid,) = trace.processes()
    iteration = trace.slices[trace.track_named("iterations", process_uuid)][0]
    assert iteration.args["unknown"] == "num_prefill_reqs, waiting reasons"
    assert iteration.args["num_waiting_reqs"] == 3
    assert "num_prefill_reqs" not in iteration.args


def test_an_iteration_that_scored_drafts_says_so_and_its_batch_counts_them(tmp_path):
    """Its slice's args have the draft and accepted tokens; the batch-tokens counter holds
    what the iteration computed: one token per decoding request and the draft tokens."""
    records = [
        decoding(
            i,
            num_decode_tokens=2 + i,  # each its own token, and the i accepted
            spec_decode=SpecDecodeCounts(2, 6, i) if i else None,
        )
        for i in range(3)
    ]
    trace = convert(write_records(records, tmp_path / "rec.jsonl"), tmp_path)
    (process_uuid,) = trace.processes()
    iterations = trace.slices[trace.track_named("iterations", process_uuid)]
    assert [s.args.get("num_draft_tokens") for s in iterations] == [None, 6, 6]
    assert [s.args.get("num_accepted_tokens") for s in iterations] == [None, 1, 2]
    batch = trace.counters[trace.track_named(counter_name(0, "batch tokens"), process_uuid)]
    assert [value for _, value in batch] == [2, 8, 8]


def test_an_iteration_reported_past_the_next_one_s_start_is_drawn_up_to_it(tmp_path):
    records = [
        iteration_record(0, 1, 1, start_ns=10**9, elapsed_ns=3 * 10**7, num_decode_reqs=1),
        iteration_record(0, 2, 2, start_ns=10**9 + 10**7, elapsed_ns=10**7, num_decode_reqs=1),
    ]
    trace = convert(write_records(records, tmp_path / "rec.jsonl"), tmp_path)
    (process_uuid,) = trace.processes()
    first, second = trace.slices[trace.track_named("iterations", process_uuid)]
    assert first.end_ns == second.start_ns
    assert first.args["elapsed_ms"] == pytest.approx(30.0)
    assert "elapsed_ms" not in second.args


def milestone(request_id, event, **fields):
    times = dict(arrival_ns=0, first_scheduled_ns=0, first_token_ns=0, finished_ns=0)
    counts = dict(
        num_prompt_tokens=8,
        num_cached_tokens=0,
        num_output_tokens=1,
        num_preemptions=0,
        finish_reason=-1,
    )
    return RequestMilestone(request_id, event, **{**times, **counts, **fields})


def test_a_preempted_request_s_recomputed_prefill_nests_in_its_decode():
    m = milestone(
        "r",
        EVENT_FINISHED,
        arrival_ns=100,
        first_scheduled_ns=200,
        first_token_ns=400,
        finished_ns=1000,
        finish_reason=0,
        num_preemptions=1,
        preempted_ns=[500],
        prefill_chunks=[(200, 300, 4), (300, 402, 4), (600, 700, 12)],
    )
    request = request_phases(m, recording_end_ns=5000)
    assert (request.queued_start_ns, request.queued_end_ns) == (100, 200)
    assert request.prefills == [
        (200, 300, 0, 4),
        (300, 402, 1, 4),  # stamped 2 ns after the first token: decode follows it
    ]
    assert (request.decode_start_ns, request.end_ns) == (402, 1000)
    assert request.recomputed == [(600, 700, 2, 12)]


def test_a_request_the_recording_does_not_see_finish_ends_where_the_recording_ends():
    m = milestone(
        "r", EVENT_FIRST_TOKEN, arrival_ns=100, first_scheduled_ns=150, first_token_ns=300
    )
    request = request_phases(m, recording_end_ns=900)
    assert (request.end_ns, request.finished) == (900, False)
    assert request.finish_reason.startswith("unfinished")
    assert (request.decode_start_ns, request.recomputed) == (300, [])


def test_phases_follow_one_another_inside_the_request_whatever_the_milestone_says():
    """Times stamped by different calls may disagree (a chunk before the arrival, one ending
    after the finish, chunks overlapping): every phase is clamped, none dropped."""
    rng = random.Random(5)
    for _ in range(500):
        arrival_ns = rng.randint(0, 1000)
        chunks, start_ns = [], arrival_ns + rng.randint(-100, 200)
        for _ in range(rng.randint(0, 4)):
            chunks.append((start_ns, start_ns + rng.randint(-20, 300), rng.randint(1, 99)))
            start_ns += rng.randint(-50, 400)
        finished = rng.random() < 0.7
        m = milestone(
            "r",
            EVENT_FINISHED if finished else EVENT_FIRST_TOKEN,
            arrival_ns=arrival_ns,
            first_scheduled_ns=rng.choice([0, arrival_ns + rng.randint(-50, 300)]),
            first_token_ns=rng.choice([0, arrival_ns + rng.randint(-100, 600)]),
            finished_ns=arrival_ns + rng.randint(-200, 2000) if finished else 0,
            prefill_chunks=chunks,
        )
        request = request_phases(m, recording_end_ns=rng.randint(0, 3000))
        times = [request.queued_start_ns, request.queued_end_ns]
        times += [t for chunk in request.prefills for t in chunk[:2]]
        if request.decode_start_ns is not None:
            times += [request.decode_start_ns]
            times += [t for chunk in request.recomputed for t in chunk[:2]]
        else:
            assert not request.recomputed
        assert times == sorted(times), m
        assert min(arrival_ns, request.end_ns) == times[0] and times[-1] <= request.end_ns, m
        drawn = request.prefills + request.recomputed
        assert sorted(chunk[2:] for chunk in drawn) == [(i, c[2]) for i, c in enumerate(chunks)]


def test_lanes_never_hold_two_overlapping_requests_and_are_as_few_as_the_most_at_once():
    rng = random.Random(3)
    for _ in range(200):
        spans = []
        for _ in range(rng.randint(0, 40)):
            start = rng.randint(0, 100)
            spans.append((start, start + rng.randint(1, 30)))
        lanes = assign_lanes(spans)
        for lane in set(lanes):
            mine = sorted(s for s, n in zip(spans, lanes, strict=True) if n == lane)
            assert all(a[1] <= b[0] for a, b in pairwise(mine))
        points = sorted({t for s in spans for t in s})
        most = max((sum(1 for a, b in spans if a <= t < b) for t in points), default=0)
        assert len(set(lanes)) == most, spans


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "no such recording file"), (b"garbage\n{]\n", "no telemetry message")],
)
def test_bad_input_fails_with_a_reason_and_leaves_the_output_untouched(
    content, message, tmp_path, capsys
):
    recording = tmp_path / "rec.jsonl"
    if content is not None:
        recording.write_bytes(content)
    out = tmp_path / "run.pftrace"
    out.write_bytes(b"an earlier trace")
    assert main([str(recording), "-o", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert out.read_bytes() == b"an earlier trace"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["run.pftrace"] + (["rec.jsonl"] if content else [])
    )


def test_a_folder_given_as_the_recording_is_said_to_be_one(tmp_path, capsys):
    """timeline and explain say a folder is one, naming the recordings in it (they said: no
    such recording file); exit 2 as for a missing file."""
    for name in ("b.jsonl", "a.jsonl", "c.jsonl.gz", "d.jsonl", "notes.txt"):
        (tmp_path / name).write_text("")
    commands = {
        "timeline": lambda path: main([path, "-o", str(tmp_path / "t.pftrace")]),
        "explain": lambda path: explain_main([path]),
    }
    for name, command in commands.items():
        assert command(str(tmp_path)) == 2, name
        err = capsys.readouterr().err
        assert (
            f"{name}: {tmp_path} is a folder, not a recording: give a .jsonl file in it "
            "(a.jsonl, b.jsonl, c.jsonl.gz, ...)"
        ) in err
        empty = tmp_path / "empty"
        empty.mkdir(exist_ok=True)
        assert command(str(empty)) == 2, name
        assert f"{empty} is a folder, not a recording (and holds no .jsonl file)" in (
            capsys.readouterr().err
        )


@pytest.mark.parametrize("story", ["KV capacity", "healthy"])
def test_the_summary_counts_findings_as_explain_does(story, tmp_path, capsys):
    """The trace draws a slice per episode; the summary says the findings and their episodes
    in explain's count (it said "19 findings" where explain said "4 findings from 19
    episodes")."""
    recording = SCENARIOS[story][0]().write(tmp_path / "rec.jsonl")
    explain_main([str(recording)])
    said = re.search(r"(\d+ findings?) from (\d+ episodes?)", capsys.readouterr().out)
    assert main([str(recording), "-o", str(tmp_path / "run.pftrace")]) == 0
    out = capsys.readouterr().out
    if said is None:  # explain found no problem
        assert "MB): 1 engine, " in out and ", 0 findings\n" in out and "episode" not in out
        return
    findings, episodes = said.groups()
    assert findings != episodes.replace("episode", "finding")  # the check tells them apart
    assert f", {findings} ({episodes})\n" in out


def test_the_output_may_not_be_a_recording(tmp_path, capsys):
    recording = SCENARIOS["healthy"][0]().write(tmp_path / "rec.jsonl")
    before = recording.read_bytes()
    assert main([str(recording), "-o", str(recording)]) == 2
    assert "is one of the recordings" in capsys.readouterr().err
    assert recording.read_bytes() == before


def test_several_engines_are_several_processes(tmp_path):
    records = [
        iteration_record(e, 2, 1, start_ns=10**9, elapsed_ns=10**7, num_decode_reqs=1)
        for e in (0, 3)
    ]
    beats = [
        heartbeat(
            e,
            1,
            10**9 - 1,
            1,
            model_name=f"model-{e}",
            device_name="CPU",
            block_size=16,
            num_kv_blocks_total=64,
        )
        for e in (0, 3)
    ]
    path = tmp_path / "rec.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(m) + b"\n" for m in [*beats, *records]))
    trace = convert(path, tmp_path)
    names = sorted(d.process.process_name for d in trace.processes().values())
    assert names == [
        "engine 0: model-0 on CPU, 64 KV blocks x 16 tokens",
        "engine 3: model-3 on CPU, 64 KV blocks x 16 tokens",
    ]
    assert len({d.process.pid for d in trace.processes().values()}) == 2
    for process_uuid in trace.processes():
        assert len(trace.slices[trace.track_named("iterations", process_uuid)]) == 1


@pytest.mark.parametrize("story", ["token budget", "preemption storm"])
def test_each_first_token_has_an_arrow_from_its_iteration_to_its_decode(story, tmp_path):
    """The optional flow: from the iteration that produced a request's first token (the last
    to start at or before it) to the request's decode slice, one arrow per request."""
    recording = SCENARIOS[story][0]().write(tmp_path / "rec.jsonl")
    trace = convert(recording, tmp_path)
    tl = read_timelines([recording])[0][0]
    (process_uuid,) = trace.processes()
    iterations_uuid = trace.track_named("iterations", process_uuid)
    starts = tl.col("start_ns")
    milestones = {m.request_id: m for r in tl.records for m in r.milestones}
    expected = {
        request_id: int(starts[starts <= m.first_token_ns][-1])
        for request_id, m in milestones.items()
        if m.first_token_ns and m.first_token_ns >= starts[0]
    }
    assert expected, "no first token: the check below proves nothing"
    arrows = {}
    for (tail_track, tail), (head_track, head) in trace.flows.values():
        assert (tail_track, head.name) == (iterations_uuid, "decode")
        request = next(
            s
            for s in trace.slices[head_track]
            if s.depth == 0 and s.start_ns <= head.start_ns <= s.end_ns
        )
        arrows[request.name.removeprefix("request ")] = tail.start_ns
    assert arrows == expected
