"""The sidecar's notes in its recording (telemetry.lane.recording.SidecarNote): an engine's
death, and the recording's close, which `explain` reads to say how a recording that ends
mid-work ends."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import msgspec
import pytest
from scenarios import synthetic

from engine.config import EngineConfig
from engine.core_client import EngineCoreClient
from engine.request import SamplingParams
from telemetry.analysis.episodes import Thresholds, detect_episodes
from telemetry.analysis.explain_report import format_engine
from telemetry.analysis.findings import build_findings
from telemetry.analysis.timeline import build_timelines, read_timelines
from telemetry.lane.recording import SidecarNote, read_recording
from telemetry.sidecar.engine_view import EngineStatus
from telemetry.sidecar.ingest import Ingest
from telemetry.sidecar.lane_loop import LaneLoop
from telemetry.sidecar.replay import replay
from telemetry.sidecar.sinks.jsonl import JsonlSink, read_last_seqs
from tests.helpers.fake_runner import PacedRunner, load_fake_model
from tests.helpers.findings import assert_replay_agrees_with_explain

NS = 1_000_000_000


def ending(timeline) -> list[str]:
    lines = format_engine(timeline, detect_episodes(timeline), Thresholds())
    return [line for line in lines if line.startswith("  It ends")]


def cut_mid_work():
    """The first half of a bursty run's messages (requests running at the cut), its last
    message's wall time and the timelines' notes to add to."""
    messages = synthetic.story3_bursty(64).messages
    messages = messages[: len(messages) // 2]
    timeline = build_timelines(messages)[0]
    last_ns = max(int(timeline.col("end_ns")[-1]), timeline.heartbeats[-1].ts_ns)
    return messages, timeline.to_wall_ns(last_ns)


def test_the_death_the_sidecar_saw_is_how_the_recording_ends():
    messages, last_wall_ns = cut_mid_work()
    dead = SidecarNote(0, last_wall_ns + int(2.6 * NS), "dead")
    closed = SidecarNote(0, last_wall_ns + 60 * NS, "dead", closing=True)
    (end,) = ending(build_timelines([*messages, dead, closed])[0])
    assert re.match(
        r"  It ends with the engine's death: the live sidecar called it dead at "
        r"\d\d:\d\d:\d\d\.\d{3}, 2\.6 s after its last message \(with \d+ requests running "
        r"and 0 waiting\), and heard nothing more of it before it closed the recording at "
        r"\d\d:\d\d:\d\d\.\d{3}: the process died or its lane broke",
        end,
    ), end


def test_the_death_the_sidecar_saw_is_an_engine_down_finding_live_and_in_explain(tmp_path):
    """The silence from the last message to the recording's close, costed as any silence
    (its requests in flight x its length), where explain had said "No problem found" of a
    killed engine and only the live sidecar had said "Engine down"; a replay, which reads the
    notes' time as record time, finds the same."""
    messages, last_wall_ns = cut_mid_work()
    dead = SidecarNote(0, last_wall_ns + int(2.6 * NS), "dead")
    closed = SidecarNote(0, last_wall_ns + 20 * NS, "dead", closing=True)
    timeline = build_timelines([*messages, dead, closed])[0]
    last = timeline.last_message()
    in_flight = last.num_running_reqs + last.num_waiting_reqs
    findings = build_findings(timeline, detect_episodes(timeline), Thresholds())
    assert findings[0].title == "Engine down"
    (episode,) = findings[0].episodes
    assert episode.numbers["silent_time_s"] == pytest.approx(20, abs=0.01)
    assert findings[0].cost == pytest.approx(20 * in_flight, rel=0.01)
    assert "until it closed the recording: the live sidecar found it dead" in episode.evidence
    path = tmp_path / "rec.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(m) + b"\n" for m in [*messages, dead, closed]))
    live = assert_replay_agrees_with_explain(path)
    assert "dead" in [finding.kind for finding in live]
    without_notes = build_timelines(messages)[0]
    assert not [e for e in detect_episodes(without_notes) if e.title == "Engine down"]
    # a sidecar quicker to call it dead (--dead-after 1), closed 2 s after the last message:
    # no silence longer than explain's dead_after (2.5 s), as a replay finds none
    quick = [
        SidecarNote(0, last_wall_ns + NS, "dead"),
        SidecarNote(0, last_wall_ns + 2 * NS, "dead", True),
    ]
    short = build_timelines([*messages, *quick])[0]
    assert not [e for e in detect_episodes(short) if e.title == "Engine down"]
    assert ending(short)[0].startswith("  It ends with the engine's death: ")


def test_a_death_noted_before_late_records_leaves_the_replay_s_clock_to_the_messages():
    """tests/data/vllm_0.33_scheduler_stopped_late_records.jsonl.gz: vLLM 0.33 through the
    scheduler source (the suite's KV stack), its engine core stopped with two records queued
    in its publisher: the sidecar noted it dead, then the two records came, with times before
    the note's, then a heartbeat. A replay that moved its clock to the note judged those
    records late and found no silence, where explain (and the live sidecar) found one; only
    the notes after the last message move it, at the end."""
    path = Path(__file__).parent / "data" / "vllm_0.33_scheduler_stopped_late_records.jsonl.gz"
    (timeline,) = read_timelines([path])[0].values()
    assert [note.status for note in timeline.notes] == ["dead"]
    assert timeline.death_at_end() is None  # heard again after it
    live = assert_replay_agrees_with_explain(path)
    assert "dead" in [finding.kind for finding in live]


def test_a_recording_the_sidecar_stopped_says_the_engine_was_working():
    messages, last_wall_ns = cut_mid_work()
    closed = SidecarNote(0, last_wall_ns + NS // 10, "running", closing=True)
    (end,) = ending(build_timelines([*messages, closed])[0])
    assert re.match(
        r"  It ends mid-work, with \d+ requests running and 0 waiting: the sidecar stopped "
        r"recording at \d\d:\d\d:\d\d\.\d{3} while the engine was running \(not dead\)\.$",
        end,
    ), end


def test_a_death_the_engine_came_back_from_is_not_how_it_ends():
    """A dead note before the last message (the engine was heard again) says nothing of the
    end: without a note after it, the recording cannot tell a death from a stop."""
    messages, last_wall_ns = cut_mid_work()
    earlier = SidecarNote(0, last_wall_ns - 5 * NS, "dead")
    (end,) = ending(build_timelines([*messages, earlier])[0])
    assert end.endswith(
        "or the engine died there (the sidecar's log says 'Engine down' if it did)."
    )


def test_the_sink_notes_a_death_and_every_engine_at_its_close_and_a_replay_s_none(tmp_path):
    path = tmp_path / "rec.jsonl"
    sink = JsonlSink(path)
    sink.on_status(0, EngineStatus.RUNNING, 1)
    sink.on_status(3, EngineStatus.RUNNING, 1)
    sink.on_status(3, EngineStatus.DEAD, 2)
    sink.on_status(5, EngineStatus.IDLE, 2)
    sink.on_engine_removed(5, 10)
    sink.close()
    assert list(read_recording(path)) == []  # messages only, unless asked for notes
    notes = [(n.engine_index, n.status, n.closing) for n in read_recording(path, notes=True)]
    assert notes == [(3, "dead", False), (0, "running", True), (3, "dead", True)]
    assert EngineStatus.DEAD.value == "dead"  # what explain reads (recording.DEAD)
    assert read_last_seqs(path) == {}  # a note's third element is no seq
    replaying = JsonlSink(tmp_path / "replayed.jsonl", notes=False)
    replaying.on_status(0, EngineStatus.DEAD, 2)
    replaying.close()
    assert (tmp_path / "replayed.jsonl").read_bytes() == b""


def test_notes_are_no_messages_to_readers_or_a_replay(tmp_path):
    messages, last_wall_ns = cut_mid_work()
    path = tmp_path / "rec.jsonl"
    lines = [*messages, SidecarNote(0, last_wall_ns + 3 * NS, "dead")]
    path.write_bytes(b"".join(msgspec.json.encode(line) + b"\n" for line in lines))
    timelines, num_messages, num_bad = read_timelines([path])
    assert (num_messages, num_bad) == (len(messages), 0)
    assert [note.status for note in timelines[0].notes] == ["dead"]
    ingest = replay(path, [])
    assert sum(ingest.health.num_undecodable.values()) == 0
    assert ingest.health.num_messages == len(messages)


@pytest.mark.live
def test_an_engine_killed_mid_work_ends_its_recording_with_its_death(tmp_path):
    """A real engine process, killed (SIGKILL) with requests running, beside a real sidecar
    recording it: explain had said the recording stopped or the engine died; the sidecar saw
    which, and its recording now says it."""
    address, path = f"ipc://{tmp_path}/lane.sock", tmp_path / "rec.jsonl"
    ingest = Ingest([JsonlSink(path)], dead_after_s=1.0)
    sidecar = LaneLoop(address, ingest)
    thread = threading.Thread(target=sidecar.run)
    thread.start()
    config = EngineConfig(
        model="fake",
        kv_cache_memory_bytes=64 * 16 * 256,
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        telemetry_address=address,
    )
    client = EngineCoreClient(config, load_fake_model, PacedRunner, 60)
    try:
        greedy = SamplingParams(max_tokens=240, temperature=0, ignore_eos=True)
        streams = [client.add_request([1, 2, index], greedy) for index in range(2)]
        streams[0].get(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # until the sidecar heard of both running
            engine = ingest.engines.get(0)
            if engine is not None and engine.view.num_running_reqs == 2:
                break
            time.sleep(0.01)
        os.kill(client.process.pid, signal.SIGKILL)
        while time.monotonic() < deadline + 10:
            engine = ingest.engines.get(0)
            if engine is not None and engine.view.status is EngineStatus.DEAD:
                break
            time.sleep(0.05)
        time.sleep(2.0)  # silent for over explain's dead_after (2.5 s) before the close
    finally:
        sidecar.stop()
        thread.join()
        ingest.close()
        client.shutdown()
    (timeline,) = read_timelines([path])[0].values()
    (end,) = ending(timeline)
    assert end.startswith("  It ends with the engine's death: the live sidecar called it dead")
    assert "(with 2 requests running and 0 waiting)" in end, end
    assert [e.title for e in detect_episodes(timeline)] == ["Engine down"]
    (live,) = assert_replay_agrees_with_explain(path)
    assert live.kind == "dead"
