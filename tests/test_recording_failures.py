"""A JSONL recording whose writes fail part way (a file size limit, a full disk) keeps whole
lines only, and records everything held back once writes succeed again
(telemetry/sidecar/sinks/jsonl.py; docs/runbooks/IterscopeRecordingFailing.md)."""

import errno
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from telemetry.lane.record import Heartbeat
from telemetry.lane.recording import read_recording
from telemetry.sidecar.ingest import Ingest
from telemetry.sidecar.sinks import jsonl
from telemetry.sidecar.sinks.jsonl import JsonlSink
from tests.helpers.sink_feed import send
from tests.test_jsonl_replay import run_messages


class SizeLimitedDisk:
    """os.write for the JSONL sink under a file size limit: the write that crosses it writes
    up to the limit (ending inside a line) and returns short; the next raises EFBIG, as
    write(2) does under RLIMIT_FSIZE with SIGXFSZ ignored."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.real_write = os.write  # monkeypatching jsonl.os.write replaces os.write itself

    def write(self, fd: int, data) -> int:
        room = self.limit - os.fstat(fd).st_size
        if room <= 0:
            raise OSError(errno.EFBIG, "File too large")
        return self.real_write(fd, bytes(data[:room]))


def undecodable(path) -> list[str]:
    return [line for line in read_recording(path) if isinstance(line, str)]


def test_a_write_cut_by_a_size_limit_leaves_whole_lines_and_resumes(tmp_path, monkeypatch):
    disk = SizeLimitedDisk(limit=5_000)
    monkeypatch.setattr(jsonl.os, "write", disk.write)
    path = tmp_path / "rec.jsonl"
    sink = JsonlSink(path, flush_bytes=1 << 30)  # flushed by hand below
    messages = run_messages(num_engines=1, seconds=10)
    first, second = messages[:60], messages[60:]
    send(sink, *first)
    with pytest.raises(OSError) as failure:
        sink.flush()  # the limit cuts this write inside a line
    assert failure.value.errno == errno.EFBIG
    recorded = list(read_recording(path))
    assert path.read_bytes().endswith(b"\n") and undecodable(path) == []
    assert 0 < len(recorded) < len(first) and recorded == first[: len(recorded)]
    with pytest.raises(OSError):
        sink.flush()  # still over the limit: the file is cut back again, still whole
    assert list(read_recording(path)) == recorded
    disk.limit = 1 << 30  # the limit lifted: what was held is written, nothing twice
    send(sink, *second)
    sink.flush()
    assert list(read_recording(path)) == messages
    sink.close()


def test_a_failed_tick_through_the_sidecar_leaves_a_readable_recording(tmp_path, monkeypatch):
    """As the tester ran it: Ingest flushes at each tick, counts the failures, and the file
    reads back whole after every one of them."""
    disk = SizeLimitedDisk(limit=3_000)
    monkeypatch.setattr(jsonl.os, "write", disk.write)
    path = tmp_path / "rec.jsonl"
    sink = JsonlSink(path)
    ingest = Ingest([sink], live_findings=False)
    messages = run_messages(num_engines=1, seconds=5)
    for number, message in enumerate(messages):
        now_ns = message.ts_ns if isinstance(message, Heartbeat) else message.start_ns
        ingest.on_message(message, now_ns)
        if number % 10 == 9:
            ingest.tick(now_ns)
            assert undecodable(path) == []
    assert sink.num_errors > 0
    disk.limit = 1 << 30
    ingest.close()
    assert list(read_recording(path)) == messages


def test_a_failed_truncate_is_logged_and_the_line_completed_later(tmp_path, monkeypatch, caplog):
    """Where even cutting the partial line off fails, the log says the recording ends inside
    a line, and the next write that succeeds completes it: still nothing twice."""
    disk = SizeLimitedDisk(limit=5_000)
    monkeypatch.setattr(jsonl.os, "write", disk.write)

    def failing_truncate(fd: int, length: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(jsonl.os, "ftruncate", failing_truncate)
    path = tmp_path / "rec.jsonl"
    sink = JsonlSink(path, flush_bytes=1 << 30)
    messages = run_messages(num_engines=1, seconds=10)
    send(sink, *messages[:60])
    with caplog.at_level(logging.ERROR, logger="iterscope.sidecar"), pytest.raises(OSError):
        sink.flush()
    assert [r.getMessage() for r in caplog.records] == [
        f"the recording {path} ends inside a line: cutting off a partial write failed "
        "([Errno 5] Input/output error); the next write that succeeds completes the line"
    ]
    disk.limit = 1 << 30
    send(sink, *messages[60:])
    sink.close()
    assert list(read_recording(path)) == messages


@pytest.mark.live  # starts a Python process: RLIMIT_FSIZE must not bound pytest's own files
def test_a_real_file_size_limit_leaves_whole_lines(tmp_path):
    """The tester's `ulimit -f`: a real RLIMIT_FSIZE (Python ignores SIGXFSZ, so write(2)
    returns short, then fails with EFBIG); the file ends at a whole line below the limit,
    and everything is written once the limit is raised."""
    path = tmp_path / "rec.jsonl"
    script = textwrap.dedent(
        f"""
        import errno, resource
        from telemetry.sidecar.sinks.jsonl import JsonlSink
        from tests.helpers.sink_feed import send
        from tests.test_jsonl_replay import run_messages

        sink = JsonlSink({str(path)!r}, flush_bytes=1 << 30)
        send(sink, *run_messages(num_engines=1, seconds=10))
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, hard))
        try:
            sink.flush()
        except OSError as error:
            assert error.errno == errno.EFBIG, error
        else:
            raise AssertionError("the limit did not stop the write")
        with open({str(path) + ".limited"!r}, "wb") as copy:
            copy.write(open({str(path)!r}, "rb").read())
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        sink.close()
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": "."},
    )
    assert result.returncode == 0, result.stderr
    limited = tmp_path / "rec.jsonl.limited"
    assert 0 < limited.stat().st_size < 10_000
    assert limited.read_bytes().endswith(b"\n") and undecodable(limited) == []
    assert list(read_recording(path)) == run_messages(num_engines=1, seconds=10)
