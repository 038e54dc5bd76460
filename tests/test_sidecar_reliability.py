"""The issue's reliability tests, with the synthetic engine (tests/helpers/fake_engine.py) as
a process of its own: a killed and restarted sidecar (by hand, and by the supervision of the
engine commands), a stopped sidecar, a killed engine."""

import argparse
import ast
import logging
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time

import pytest

from telemetry.lane.record import Heartbeat, IterationRecord
from telemetry.sidecar.engine_view import EngineStatus
from telemetry.sidecar.ingest import Ingest
from telemetry.sidecar.lane_loop import LaneLoop
from telemetry.sidecar.process import start_from_args, start_sidecar
from telemetry.sidecar.replay import read_recording
from tests.helpers.fake_engine import start_engine, stop_engine
from tests.helpers.lane import RecordingSink
from tests.helpers.net import free_port
from tests.helpers.processes import rss_bytes, wait_for_log
from tests.helpers.prom import scrape, total
from tests.helpers.wait import wait_until

pytestmark = pytest.mark.live

MIB = 1 << 20


def start_cli_sidecar(address, log_path, *extra):
    log = open(log_path, "ab")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "telemetry.sidecar.cli",
            "--address",
            address,
            "--no-metrics",
            "--log-interval",
            "1",
            *extra,
        ],
        stderr=log,
        env={**os.environ, "PYTHONPATH": "."},
    )
    log.close()
    wait_for_log(log_path, "sidecar bound", process, timeout_s=30)
    return process


def reported_dropped(log_text):
    """The per-engine dropped totals of the sidecar's final line."""
    match = re.search(r"sidecar stopped: .* dropped per engine (\{.*\})", log_text)
    assert match, log_text
    return ast.literal_eval(match.group(1))


def test_killed_and_restarted_sidecar_reports_the_exact_gap(tmp_path):
    address = f"ipc://{tmp_path}/lane.sock"
    recording = tmp_path / "rec.jsonl"
    first = start_cli_sidecar(address, tmp_path / "a.log", "--record", str(recording))
    engine = start_engine(address, tmp_path / "engine.json", "--iteration-time", "0.002")
    second = None
    try:
        time.sleep(1.5)
        first.send_signal(signal.SIGKILL)
        first.wait()
        written_by_first = recording.read_bytes()
        num_first_lines = written_by_first.count(b"\n")
        time.sleep(1.0)  # the engine iterates on; its sends fail and are counted
        second = start_cli_sidecar(address, tmp_path / "b.log", "--record", str(recording))
        time.sleep(1.5)
        report = stop_engine(engine, tmp_path / "engine.json")
        time.sleep(0.5)
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=20) == 0
    finally:
        for process in (engine, first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    messages = list(read_recording(recording))
    seen_by_first = messages[:num_first_lines]
    seen_by_second = messages[num_first_lines:]
    last_seq_first = max(m.msg_seq for m in seen_by_first)
    seqs_second = [m.msg_seq for m in seen_by_second]
    real_gap = max(seqs_second) - last_seq_first - len(set(seqs_second))
    assert real_gap > 0
    assert reported_dropped((tmp_path / "b.log").read_text()) == {0: real_gap}
    # The engine's first message to the new sidecar was a heartbeat (the publisher sends one
    # first after failed sends): no record was rejected before the sidecar met the engine.
    assert isinstance(seen_by_second[0], Heartbeat)
    assert "unknown_engine" not in (tmp_path / "b.log").read_text()
    # The engine never waited for a sidecar: no pause between iterations, and it carried on
    # through the gap.
    starts = [start_ns for start_ns, _, _ in report["samples"]]
    assert max(b - a for a, b in zip(starts, starts[1:], strict=False)) < 0.5e9
    first_iterations = [m.iteration for m in seen_by_first if isinstance(m, IterationRecord)]
    second_iterations = [m.iteration for m in seen_by_second if isinstance(m, IterationRecord)]
    assert min(second_iterations) > max(first_iterations) + 50  # ~1 s at 2 ms per iteration
    assert report["num_iterations"] >= max(second_iterations)


def test_stopped_sidecar_costs_the_engine_nothing_and_memory_stays_bounded(tmp_path):
    log_path = tmp_path / "sidecar.log"
    with open(log_path, "wb") as log:
        sidecar = start_sidecar(["--rcvhwm", "100", "--no-metrics"], stderr=log)
    engine = start_engine(
        sidecar.address, tmp_path / "engine.json", "--iteration-time", "0.0005", "--sndhwm", "100"
    )
    try:
        time.sleep(1.5)
        sidecar_rss_before = rss_bytes(sidecar.pid)
        stopped_ns = time.monotonic_ns()
        os.kill(sidecar.pid, signal.SIGSTOP)
        time.sleep(3)
        sidecar_rss_stopped = rss_bytes(sidecar.pid)
        resumed_ns = time.monotonic_ns()
        os.kill(sidecar.pid, signal.SIGCONT)
        time.sleep(1.5)
        report = stop_engine(engine, tmp_path / "engine.json")
        time.sleep(0.5)
    finally:
        os.kill(sidecar.pid, signal.SIGCONT)
        engine.kill()
        status = sidecar.stop()
    assert status == 0
    assert report["num_dropped_total"] > 0  # the queue did fill up while the sidecar slept
    samples = report["samples"]
    before = [s for s in samples if s[0] < stopped_ns]
    during = [s for s in samples if stopped_ns + 0.2e9 < s[0] < resumed_ns]
    before = before[len(before) // 3 :]  # past start-up
    rate_before = len(before) / ((before[-1][0] - before[0][0]) / 1e9)
    rate_during = len(during) / ((during[-1][0] - during[0][0]) / 1e9)
    assert rate_during > 0.5 * rate_before
    # A blocking send would take the whole 3 s; a non-blocking one microseconds.
    assert max(publish_ns for _, _, publish_ns in during) < 50e6
    assert statistics.median(p for _, _, p in during) < 1e6
    assert report["max_rss_bytes"] < 200 * MIB
    assert sidecar_rss_stopped - sidecar_rss_before < 64 * MIB
    # Nothing was lost in transit: every gap the sidecar saw is a send the engine counted.
    assert reported_dropped(log_path.read_text()) == {0: report["num_dropped_total"]}


def test_killed_engine_is_reported_dead_within_3_s(tmp_path):
    address = f"ipc://{tmp_path}/lane.sock"
    statuses = []

    class StatusSink(RecordingSink):
        def on_status(self, engine_index, status, now_ns):
            statuses.append((status, time.monotonic_ns()))

    sidecar = LaneLoop(address, Ingest([StatusSink()]))
    thread = threading.Thread(target=sidecar.run)
    thread.start()
    engine = start_engine(address, tmp_path / "engine.json")
    try:
        wait_until(
            lambda: EngineStatus.RUNNING in [s for s, _ in statuses],
            30,
            lambda: f"the engine to run: {statuses}",
        )
        engine.send_signal(signal.SIGKILL)
        killed_ns = time.monotonic_ns()
        engine.wait()
        wait_until(
            lambda: statuses[-1][0] is EngineStatus.DEAD,
            10,
            lambda: f"the killed engine to be dead: {statuses}",
        )
    finally:
        engine.kill()
        sidecar.stop()
        thread.join(timeout=10)
    assert statuses[-1][1] - killed_ns <= 3e9
    assert [s for s, _ in statuses].count(EngineStatus.DEAD) == 1


def scrape_dropped(port: int) -> tuple[float, float]:
    """(records dropped of engine 0, sidecar start time) from a sidecar's /metrics."""
    samples = scrape(port)
    return (
        total(samples, "iterscope_records_dropped_total", engine="0"),
        total(samples, "iterscope_sidecar_start_time_seconds", engine=""),
    )


def test_a_killed_sidecar_of_the_engine_commands_is_restarted_and_the_gap_counted(tmp_path, caplog):
    """The sidecar `serve` starts (start_from_args) is killed: it is logged, restarted on the
    same lane and port, and the new one reports exactly the messages its recording misses."""
    recording = tmp_path / "rec.jsonl"
    port = free_port()
    args = argparse.Namespace(
        no_sidecar=False,
        telemetry_address=None,
        sidecar_arg=["--record", str(recording), "--metrics-port", str(port), "--no-log"],
    )
    sidecar = start_from_args(args)
    engine = start_engine(sidecar.address, tmp_path / "engine.json", "--iteration-time", "0.002")
    try:
        time.sleep(1.5)
        _, first_start_time = scrape_dropped(port)
        first_pid = sidecar.pid
        with caplog.at_level(logging.WARNING, logger="iterscope.telemetry"):
            os.kill(first_pid, signal.SIGKILL)
            num_first_lines = recording.read_bytes().count(b"\n")  # final: it is dead
            wait_until(lambda: sidecar.num_restarts > 0, 30, "the sidecar to be restarted")
        time.sleep(1.5)
        stop_engine(engine, tmp_path / "engine.json")
        time.sleep(0.5)
        dropped, second_start_time = scrape_dropped(port)
    finally:
        engine.kill()
        status = sidecar.stop()
    assert status == 0 and sidecar.pid != first_pid
    assert second_start_time > first_start_time
    assert any(f"sidecar (pid {first_pid}) exited" in r.getMessage() for r in caplog.records)
    messages = list(read_recording(recording))
    last_seq_first = max(m.msg_seq for m in messages[:num_first_lines])
    seqs_second = {m.msg_seq for m in messages[num_first_lines:]}
    real_gap = max(seqs_second) - last_seq_first - len(seqs_second)
    assert real_gap > 0
    assert dropped == real_gap


def test_a_sidecar_that_fails_to_restart_says_each_failure_and_the_attempts(monkeypatch, caplog):
    """The port it needs is taken for a while: each failed start is logged with its cause,
    not as the first sidecar exiting again, and the restart that works says after how many
    attempts (it repeated the dead sidecar's pid and status at each try)."""
    from telemetry.sidecar import process as process_module

    class Exited:
        pid, returncode = 4242, -9

        def poll(self):
            return self.returncode

    class Running(Exited):
        pid = 4343

        def poll(self):
            return None

    outcomes = []

    def launch(self, ready_timeout_s=30.0):
        if outcomes:
            raise outcomes.pop(0)
        return Running()

    monkeypatch.setattr(process_module, "WATCH_INTERVAL_S", 0.01)
    monkeypatch.setattr(process_module, "RESTART_BACKOFF_MAX_S", 0.01)
    monkeypatch.setattr(process_module.SidecarProcess, "_launch", launch)
    sidecar = process_module.SidecarProcess(["true"], "ipc:///nowhere", "/nonexistent", {})
    sidecar.process = Exited()  # it died
    outcomes[:] = [RuntimeError("the sidecar exited (status 2) before listening"), OSError("busy")]
    with caplog.at_level(logging.INFO, logger="iterscope.telemetry"):
        sidecar.supervise()
        wait_until(lambda: sidecar.num_restarts == 1, 10, "the restart that works")
        sidecar._stopping.set()
        sidecar._watcher.join(5)
    said = [r.getMessage() for r in caplog.records]
    assert sum("(pid 4242) exited with status -9" in line for line in said) == 1
    assert [line for line in said if line.startswith("restarting the sidecar failed")] == [
        "restarting the sidecar failed: the sidecar exited (status 2) before listening",
        "restarting the sidecar failed: busy",
    ]
    assert (
        said[-1]
        == "the sidecar runs again (pid 4343, restart 1, after 3 attempts) on ipc:///nowhere"
    )
