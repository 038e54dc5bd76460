"""JSONL recording (wire fields, rotation, crash repair) and replay through the same sinks."""

import logging
import os
import random
import socket
import subprocess
import sys

import msgspec
import pytest

from telemetry.analysis.explain import read_timelines
from telemetry.lane.record import Heartbeat, IterationRecord, Message, RequestMilestone, heartbeat
from telemetry.lane.recording import read_recording, recording_files
from telemetry.sidecar.ingest import Ingest
from telemetry.sidecar.replay import replay
from telemetry.sidecar.sinks.jsonl import JsonlSink
from telemetry.sidecar.sinks.log import LogSink
from tests.helpers.lane import synthetic_record
from tests.helpers.sink_feed import send

SECOND = 1_000_000_000
OFFSET_NS = 1_700_000_000 * SECOND


def run_messages(num_engines=2, seconds=25, seed=1):
    """Two engines iterating every 50 ms with heartbeats every second; a few messages lost."""
    rng = random.Random(seed)
    messages = []
    for engine_index in range(num_engines):
        seq = 0
        for step in range(seconds * 20):
            t_ns = SECOND + step * SECOND // 20 + engine_index * 7_000_000
            if step % 20 == 0:
                seq += 1
                messages.append(
                    heartbeat(
                        engine_index,
                        seq,
                        t_ns,
                        t_ns + OFFSET_NS,
                        last_iteration=step,
                        num_waiting_reqs=1,
                        num_running_reqs=4,
                        device_name="CPU",
                    )
                )
            seq += 1
            message = synthetic_record(engine_index, step + 1, t_ns, 40_000_000)
            message.msg_seq = seq
            message.num_prefill_tokens = rng.randrange(0, 300)
            message.num_prefix_query_tokens = message.num_prefill_tokens
            message.num_prefix_hit_tokens = message.num_prefill_tokens // 2
            if step % 97 == 5:
                message.milestones = [
                    RequestMilestone(
                        request_id=f"r{step}",
                        event=3,
                        arrival_ns=t_ns - 5,
                        first_scheduled_ns=t_ns,
                        first_token_ns=t_ns + 1,
                        finished_ns=t_ns + 2,
                        num_prompt_tokens=9,
                        num_cached_tokens=0,
                        num_output_tokens=1,
                        num_preemptions=0,
                        finish_reason=1,
                        traceparent="00-abc-def-01",
                        prefill_chunks=[(t_ns, t_ns + 1, 9)],
                    )
                ]
            if rng.random() > 0.01:  # ~1% lost on the lane
                messages.append(message)
    messages.sort(key=lambda m: m.ts_ns if isinstance(m, Heartbeat) else m.start_ns)
    return messages


class Lines(list):
    def __call__(self, level, text):
        self.append((level, text))


def live(messages, path, **jsonl_kwargs):
    """What a live sidecar does with these messages: log lines, a recording, its Ingest. Its
    clock is record time, so its recording holds no notes: they carry the sidecar's wall time
    (tests/test_recording_notes.py)."""
    lines = Lines()
    jsonl = JsonlSink(path, notes=False, **jsonl_kwargs)
    ingest = Ingest([LogSink(interval_s=5, emit=lines), jsonl])
    for message in messages:
        now_ns = message.ts_ns if isinstance(message, Heartbeat) else message.start_ns
        ingest.on_message(message, now_ns)
        if message.msg_seq % 7 == 0:
            ingest.tick(now_ns)
    ingest.close()
    return lines, ingest


def test_recording_holds_exactly_the_wire_messages(tmp_path):
    messages = run_messages()
    live(messages, tmp_path / "rec.jsonl")
    decoder = msgspec.json.Decoder(Message)
    with open(tmp_path / "rec.jsonl", "rb") as file:
        recorded = [decoder.decode(line) for line in file]
    assert recorded == messages
    assert any(isinstance(m, IterationRecord) and m.milestones for m in recorded)
    first_line = (tmp_path / "rec.jsonl").read_bytes().split(b"\n")[0]
    assert msgspec.json.decode(first_line)[0] == 18  # a tagged array: [tag, engine_index, seq..]


def test_replay_prints_the_lines_the_live_run_printed(tmp_path):
    messages = run_messages()
    live_lines, live_ingest = live(messages, tmp_path / "rec.jsonl")
    replayed = Lines()
    ingest = replay(tmp_path / "rec.jsonl", [LogSink(interval_s=5, emit=replayed)])
    throughput = [text for level, text in live_lines if "throughput" in text]
    assert len(throughput) >= 8 and any("2 Engines Aggregated" in t for t in throughput)
    assert [text for _, text in replayed if "throughput" in text] == throughput
    assert {i: e.view.num_dropped_total for i, e in ingest.engines.items()} == {
        i: e.view.num_dropped_total for i, e in live_ingest.engines.items()
    }
    assert sum(e.view.num_dropped_total for e in ingest.engines.values()) > 0


def test_replay_stamps_its_log_lines_with_the_times_the_live_run_printed_them(tmp_path, caplog):
    """Each line's time is its record time as wall time (the heartbeats' clock anchor), as
    the live sidecar's clock read it then, not the time of the replay."""
    messages = run_messages(seconds=12)
    live(messages, tmp_path / "rec.jsonl")
    with caplog.at_level(logging.INFO):
        replay(tmp_path / "rec.jsonl", [LogSink(interval_s=5)])
    stamps_ns = [int(r.created * 1e9) for r in caplog.records if "throughput" in r.getMessage()]
    assert len(stamps_ns) >= 2
    first_ns, last_ns = OFFSET_NS + SECOND, OFFSET_NS + 13 * SECOND
    assert all(first_ns <= stamp <= last_ns for stamp in stamps_ns), stamps_ns
    windows = sorted(set(stamps_ns))  # each engine's line and the sum, at each window's close
    assert windows[1] - windows[0] == pytest.approx(5 * SECOND, abs=SECOND // 10)
    assert not logging.getLogger().handlers[0].filters  # taken off after the replay


def test_a_freeze_longer_than_ten_seconds_is_dead_at_its_own_time_in_replay(tmp_path, caplog):
    """A whole-process freeze of 15 s with a request running: live said "dead" 2.5 s in; the
    replay crossed any gap over 10 s in one step and said it when the engine came back."""
    beats = [
        heartbeat(0, n + 1, (10 + n) * SECOND, (10 + n) * SECOND + OFFSET_NS, num_running_reqs=1)
        for n in range(5)
    ]
    beats += [
        heartbeat(0, n + 6, (29 + n) * SECOND, (29 + n) * SECOND + OFFSET_NS, num_running_reqs=1)
        for n in range(3)
    ]
    path = tmp_path / "frozen.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(m) + b"\n" for m in beats))
    with caplog.at_level(logging.INFO):
        replay(path, [LogSink(interval_s=5)])
    (dead,) = [r for r in caplog.records if "-> dead" in r.getMessage()]
    said_ns = int(dead.created * 1e9) - OFFSET_NS
    # the last heartbeat at 14 s, dead 2.5 s later (at the next tick), as live
    assert 16 * SECOND + SECOND // 2 <= said_ns <= 16 * SECOND + SECOND * 7 // 10, said_ns


def test_replay_leaves_the_sinks_open_when_asked(tmp_path):
    """--serve-after-replay serves what was replayed: its sinks stay open until the caller
    closes them (they were closed at the replay's end, the /metrics server with them)."""
    live(run_messages(), tmp_path / "rec.jsonl")
    closed = []

    class Closes(LogSink):
        def close(self) -> None:
            closed.append(True)

    ingest = replay(tmp_path / "rec.jsonl", [Closes(emit=Lines())], close_sinks=False)
    assert closed == []
    ingest.close()
    assert closed == [True]
    replay(tmp_path / "rec.jsonl", [Closes(emit=Lines())])
    assert closed == [True, True]


def test_rotation_keeps_a_bounded_number_of_bounded_files(tmp_path):
    path = tmp_path / "rec.jsonl"
    messages = run_messages(num_engines=1, seconds=20)
    live(messages, path, max_bytes=10_000, max_files=3, flush_bytes=4096)
    files = recording_files(path)
    assert [f.name for f in files] == ["rec.jsonl.2", "rec.jsonl.1", "rec.jsonl"]
    assert all(f.stat().st_size <= 10_000 + 4096 for f in files)
    seqs = [m.msg_seq for m in read_recording(path)]
    assert seqs == sorted(seqs) and seqs[-1] == messages[-1].msg_seq  # the newest are kept
    assert len(seqs) < len(messages)  # the oldest were rotated away


def test_a_partial_last_line_is_cut_and_the_last_seqs_are_known(tmp_path):
    path = tmp_path / "rec.jsonl"
    messages = run_messages(seconds=3)
    live(messages, path)
    complete = path.read_bytes()
    with open(path, "ab") as file:  # a sidecar killed in the middle of a write
        file.write(b"[17,0,99999,3,")
    sink = JsonlSink(path)
    assert path.read_bytes() == complete
    last = {}
    for message in messages:
        last[message.engine_index] = message.msg_seq
    assert sink.known_last_seqs() == last
    sink.close()


def test_undecodable_lines_are_counted_not_fatal(tmp_path):
    path = tmp_path / "rec.jsonl"
    path.write_bytes(
        b'not json\n[33,0,1,2]\n[17,0,"x"]\n[18,0,1,2,3,0,0,0]\n'
        + b"[17,"
        + b"[" * 3000
        + b"0"
        + b"]" * 3001
        + b"\n"
    )  # nested too deep
    ingest = replay(path, [])
    assert ingest.health.num_undecodable == {
        "malformed": 3,
        "truncated": 0,
        "oversized": 0,
        "version": 1,
    }
    assert ingest.health.num_messages == 1


def test_explain_counts_bad_lines_as_replay_does(tmp_path):
    """One reader: a message out of range (seq 0) is as unreadable to explain as to replay."""
    path = tmp_path / "rec.jsonl"
    good = run_messages(num_engines=1, seconds=1)[:3]
    implausible = msgspec.structs.replace(good[0], msg_seq=0)
    encoder = msgspec.json.Encoder()
    path.write_bytes(
        b"".join(encoder.encode(m) + b"\n" for m in [*good, implausible])
        + b"not json\n[33,0,1,2]\n[17,0,5"
    )
    ingest = replay(path, [])
    num_bad_replayed = sum(ingest.health.num_undecodable.values())
    _, num_messages, num_bad_explained = read_timelines([path])
    assert num_bad_replayed == num_bad_explained == 4
    assert num_messages == ingest.health.num_messages == len(good)


def test_a_value_beyond_64_bits_is_an_unreadable_line_not_a_crash(tmp_path):
    """The analysis holds counts and times in signed 64-bit columns: a corrupt line with a
    larger one is counted unreadable by explain and replay alike (both crashed on it)."""
    path = tmp_path / "rec.jsonl"
    good = run_messages(num_engines=1, seconds=1)[:3]
    huge = msgspec.structs.replace(good[1], msg_seq=99, start_ns=2**63 + 5)
    encoder = msgspec.json.Encoder()
    path.write_bytes(b"".join(encoder.encode(m) + b"\n" for m in [*good, huge]))
    ingest = replay(path, [])
    _, num_messages, num_bad = read_timelines([path])
    assert num_bad == ingest.health.num_undecodable["malformed"] == 1
    assert num_messages == ingest.health.num_messages == len(good)


def test_a_gzipped_recording_reads_as_the_plain_one(tmp_path):
    """logrotate compresses rotated recordings: explain and replay read them gunzipped (explain
    took one for a Dynamo FPM trace, which are gzip too, and found no line of that kind)."""
    import gzip

    plain = tmp_path / "rec.jsonl"
    encoder = msgspec.json.Encoder()
    plain.write_bytes(b"".join(encoder.encode(m) + b"\n" for m in run_messages(1, seconds=2)))
    packed = tmp_path / "rec.jsonl.1.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert list(read_recording(packed)) == list(read_recording(plain))
    assert read_timelines([packed])[1:] == read_timelines([plain])[1:]
    assert replay(packed, []).health.num_messages == replay(plain, []).health.num_messages


def test_jsonl_sink_rejects_nonsense_limits(tmp_path):
    with pytest.raises(ValueError, match="max_files"):
        JsonlSink(tmp_path / "r.jsonl", max_files=0)


@pytest.mark.live
def test_cli_replay_prints_the_same_lines(tmp_path):
    messages = run_messages(seconds=12)
    live_lines, _ = live(messages, tmp_path / "rec.jsonl")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "telemetry.sidecar.cli",
            "--replay",
            str(tmp_path / "rec.jsonl"),
            "--log-interval",
            "5",
            "--no-metrics",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": "."},
    )
    assert result.returncode == 0, result.stderr
    printed = [
        line.split("] ", 1)[1] for line in result.stderr.splitlines() if "throughput" in line
    ]
    expected = [
        text for level, text in live_lines if level == logging.INFO and "throughput" in text
    ]
    assert printed == expected and len(expected) >= 4


@pytest.mark.live
def test_cli_replay_leaves_metrics_off_so_it_never_collides_with_a_live_sidecar(tmp_path):
    messages = run_messages(seconds=3)
    live(messages, tmp_path / "rec.jsonl")
    with socket.socket() as busy:  # a live sidecar's /metrics port
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "telemetry.sidecar.cli",
                "--replay",
                str(tmp_path / "rec.jsonl"),
                "--metrics-port",
                str(busy.getsockname()[1]),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": "."},
        )
    assert result.returncode == 0, result.stderr
    assert "replayed" in result.stderr


class FlakyDisk:
    """os.write for the JSONL sink: writes part of the data, then fails while ``full``."""

    def __init__(self) -> None:
        self.full = False
        self.cut_next_write = False
        self.real_write = os.write  # monkeypatching jsonl.os.write replaces os.write itself

    def write(self, fd: int, data) -> int:
        if self.full:
            raise OSError(28, "No space left on device")
        if self.cut_next_write:  # the disk fills up in the middle of this write
            self.cut_next_write, self.full = False, True
            return self.real_write(fd, bytes(data[: len(data) // 2 + 3]))
        return self.real_write(fd, data)


def test_a_full_disk_never_writes_a_line_twice_and_holds_a_bounded_backlog(tmp_path, monkeypatch):
    from telemetry.sidecar.sinks import jsonl

    disk = FlakyDisk()
    monkeypatch.setattr(jsonl.os, "write", disk.write)
    monkeypatch.setattr(jsonl, "MAX_UNWRITTEN_BYTES", 4096)
    path = tmp_path / "rec.jsonl"
    sink = JsonlSink(path, flush_bytes=1 << 30)  # flushed by hand below
    messages = run_messages(num_engines=1, seconds=20)
    first, second, third = messages[:40], messages[40:120], messages[120:]
    for message in first:
        send(sink, message)
    disk.cut_next_write = True
    with pytest.raises(OSError):
        sink.flush()  # half of it reaches the file, ending inside a line
    disk.full = False
    for message in second:
        send(sink, message)
    sink.flush()  # the rest of `first`, then `second`: nothing twice
    assert list(read_recording(path)) == first + second
    disk.full = True
    for message in third:  # the disk stays full: the backlog stays bounded
        send(sink, message)
        try:
            sink.flush()
        except OSError:
            pass
    assert len(sink._buffer) <= 4096 + 1024 and sink.num_lines_lost > 0
    disk.full = False
    sink.close()
    recorded = list(read_recording(path))  # every line whole; the lost ones missing
    assert recorded[: len(first + second)] == first + second
    assert len(recorded) + sink.num_lines_lost == len(messages)


def test_recordings_and_their_rotations_are_readable_by_their_owner_only(tmp_path):
    path = tmp_path / "rec.jsonl"
    live(run_messages(seconds=3), path, max_bytes=2_000, max_files=3)
    files = sorted(tmp_path.glob("rec.jsonl*"))
    assert len(files) > 1  # rotated at least once
    assert {oct(file.stat().st_mode & 0o777) for file in files} == {oct(0o600)}


def test_a_disk_full_at_close_says_how_many_lines_were_lost(tmp_path, monkeypatch, caplog):
    """Through the sidecar's Ingest: every failed write is one line (an OSError needs no
    traceback), and the close, however many failures came before, says what it lost."""
    from telemetry.sidecar.sinks import jsonl

    disk = FlakyDisk()
    monkeypatch.setattr(jsonl.os, "write", disk.write)
    path = tmp_path / "rec.jsonl"
    ingest = Ingest([JsonlSink(path)], live_findings=False)
    disk.full = True
    messages = run_messages(num_engines=1, seconds=3)
    with caplog.at_level(logging.ERROR, logger="iterscope.sidecar"):
        for second in range(12):  # a flush fails at every tick
            ingest.on_message(messages[second], second * 10**9)
            ingest.tick(second * 10**9 + 1)
        ingest.close()
    errors = [record for record in caplog.records if record.levelno == logging.ERROR]
    assert [r.exc_info for r in errors if r.exc_info] == []  # no tracebacks
    assert (
        errors[0]
        .getMessage()
        .startswith(
            "the jsonl sink failed: [Errno 28] No space left on device (1 sink failures so far)"
        )
    )
    assert errors[-1].getMessage() == (
        f"closing the jsonl sink failed: [Errno 28] the recording {path} could not be written "
        "at close (No space left on device): 13 buffered lines lost"
    )
    assert ingest.sinks[0].num_lines_lost == 13  # 12 messages, the sidecar's closing note
