"""`iterscope sidecar` plumbing and the sidecar subprocess helper used by engine commands."""

import argparse
import os
import signal
import socket
import subprocess
import sys
import textwrap
from contextlib import nullcontext

import pytest

from telemetry.sidecar import cli as sidecar_cli
from telemetry.sidecar import process as sidecar_process
from telemetry.sidecar.ingest import Ingest
from telemetry.sidecar.process import start_sidecar
from telemetry.sidecar.sink import Sink
from tests.helpers.fake_engine import start_engine, stop_engine
from tests.helpers.processes import wait_for_log
from tests.helpers.wait import wait_until


def test_missing_sink_modules_are_skipped_but_broken_ones_are_not(tmp_path, monkeypatch):
    (tmp_path / "broken_sink.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = sidecar_cli.load_sink_modules(
        ("telemetry.sidecar.sinks.log", "telemetry.sidecar.sinks.nope")
    )
    assert [m.__name__ for m in modules] == ["telemetry.sidecar.sinks.log"]
    with pytest.raises(ModuleNotFoundError):
        sidecar_cli.load_sink_modules(("broken_sink",))


def test_sinks_are_built_from_their_modules_and_attached_by_ingest(tmp_path):
    class Peer(Sink):
        def attach(self, health, sinks):
            self.health, self.peers = health, sinks

    peer = Peer()
    fake = argparse.Namespace(add_arguments=lambda parser: None, build=lambda args: peer)
    sink_modules = ("telemetry.sidecar.sinks.log", "telemetry.sidecar.sinks.jsonl")
    modules = [*sidecar_cli.load_sink_modules(sink_modules), fake]
    args = sidecar_cli.build_parser(modules).parse_args(
        ["--record", str(tmp_path / "r.jsonl"), "--log-interval", "2"]
    )
    sinks = sidecar_cli.build_sinks(modules, args)
    assert [type(s).__name__ for s in sinks] == ["LogSink", "JsonlSink", "Peer"]
    assert sinks[0].interval_ns == 2_000_000_000
    ingest = Ingest(sinks)
    assert peer.peers == sinks and peer.health is ingest.health
    sinks[1].close()
    args = sidecar_cli.build_parser(modules).parse_args(["--no-log"])
    assert sidecar_cli.build_sinks(modules, args) == [peer]


def test_remote_bind_needs_to_be_asked_for(capsys):
    assert sidecar_cli.main(["--address", "tcp://0.0.0.0:5999", "--no-metrics"]) == 2
    assert "--allow-remote" in capsys.readouterr().err
    assert sidecar_cli.main(["--address", "udp://x", "--no-metrics"]) == 2


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--address", "tcp://0.0.0.0:5999"], "--allow-remote"),
        (["--fpm", "foo"], "an --fpm endpoint must be ipc://PATH or tcp://HOST:PORT, got 'foo'"),
        (["--fpm", "ipc:///tmp/x", "--fpm-dp-ranks", "2"], "needs tcp://HOST:PORT endpoints"),
    ],
)
def test_bad_addresses_are_refused_before_anything_starts(
    arguments, said, tmp_path, caplog, capsys
):
    """No metrics server started, no recording file made, for a sidecar that cannot run."""
    record = tmp_path / "run.jsonl"
    with caplog.at_level("INFO"):
        code = sidecar_cli.main([*arguments, "--metrics-port", "0", "--record", str(record)])
    assert code == 2
    assert said in capsys.readouterr().err
    assert not record.exists()
    assert not [r for r in caplog.records if "Prometheus metrics on" in r.getMessage()]


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--dead-after", "0"], "argument --dead-after: '0' is not a duration above 0"),
        (["--record-max-files", "0"], "argument --record-max-files: expected a whole number >= 1"),
        (["--fpm-port", "70000"], "argument --fpm-port: expected a port number 1-65535, got"),
        (["--rcvhwm", "0"], "argument --rcvhwm: expected a whole number >= 1, got '0'"),
        (
            ["--dead-after", "60", "--evict-after", "30"],
            "--evict-after (30 s) must be at least --dead-after (60 s)",
        ),
    ],
)
def test_bad_values_are_refused_in_the_flags_words_before_anything_starts(
    arguments, said, tmp_path, caplog, capsys
):
    record = tmp_path / "run.jsonl"
    with (
        caplog.at_level("INFO"),
        pytest.raises(SystemExit) if "argument" in said else nullcontext(),
    ):
        code = sidecar_cli.main([*arguments, "--metrics-port", "0", "--record", str(record)])
        assert code == 2
    assert said in capsys.readouterr().err
    assert not record.exists()
    assert not [r for r in caplog.records if "Prometheus metrics on" in r.getMessage()]


def test_a_metrics_port_in_use_is_said_with_its_flags(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert (
            sidecar_cli.main(["--metrics-port", str(port), "--address", "tcp://127.0.0.1:0"]) == 2
        )
    said = capsys.readouterr().err
    assert f"cannot serve /metrics on 127.0.0.1:{port} (--metrics-host, --metrics-port): " in said


def test_engine_options_start_a_sidecar_by_default():
    parser = argparse.ArgumentParser()
    sidecar_process.add_arguments(parser)
    args = parser.parse_args(["--no-sidecar"])
    assert sidecar_process.start_from_args(args) is None
    assert sidecar_process.telemetry_address(args, None) is None
    args = parser.parse_args(["--telemetry-address", "ipc:///tmp/elsewhere.sock"])
    assert sidecar_process.start_from_args(args) is None
    assert sidecar_process.telemetry_address(args, None) == "ipc:///tmp/elsewhere.sock"


@pytest.mark.live
def test_two_sidecars_side_by_side_get_their_own_lanes(tmp_path):
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    handles = [open(path, "wb") for path in logs]
    sidecars = [
        start_sidecar(["--no-metrics", "--log-iterations"], stderr=handle) for handle in handles
    ]
    for handle in handles:
        handle.close()
    try:
        assert sidecars[0].address != sidecars[1].address
        engine = start_engine(sidecars[1].address, tmp_path / "engine.json", "--duration", "30")
        wait_for_log(logs[1], r"Iteration\(1\): ", engine, timeout_s=30)
        stop_engine(engine, tmp_path / "engine.json")
    finally:
        statuses = [sidecar.stop() for sidecar in sidecars]
    assert statuses == [0, 0]
    assert not any(os.path.exists(sidecar.run_dir) for sidecar in sidecars)
    assert "Iteration(" not in logs[0].read_text()
    assert "Iteration(1): 0 context requests" in logs[1].read_text()


@pytest.mark.live
def test_sidecar_stops_when_the_process_that_started_it_dies(tmp_path):
    script = textwrap.dedent("""
        import sys, time
        from telemetry.sidecar.process import start_sidecar
        sidecar = start_sidecar(["--no-metrics"], stderr=open(sys.argv[1], "wb"))
        print(sidecar.pid, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "s.log")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": "."},
    )
    try:
        sidecar_pid = int(parent.stdout.readline())
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        # Reaped by init; a zombie still has /proc/PID until then, so read its state.
        wait_until(
            lambda: " Z" in _proc_state(sidecar_pid),
            15,
            "the orphaned sidecar to exit",
            interval_s=0.1,
        )
        assert "sidecar stopped" in (tmp_path / "s.log").read_text()
    finally:
        parent.kill()


def _proc_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as file:
            return " " + file.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return " Z"


def test_the_lane_directory_is_made_private_and_a_foreign_one_is_refused(tmp_path, monkeypatch):
    fresh = tmp_path / "fresh"
    sidecar_cli.check_private_directory(str(fresh))
    assert fresh.stat().st_mode & 0o777 == 0o700
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(ValueError, match="writable by others"):
        sidecar_cli.check_private_directory(str(open_to_all))
    link = tmp_path / "link"
    link.symlink_to(fresh)
    with pytest.raises(ValueError, match="not a directory"):
        sidecar_cli.check_private_directory(str(link))
    someone_else = os.getuid() + 1
    monkeypatch.setattr(sidecar_cli.os, "getuid", lambda: someone_else)
    with pytest.raises(ValueError, match=f"belongs to uid {os.stat(fresh).st_uid}, not to you"):
        sidecar_cli.check_private_directory(str(fresh))


@pytest.mark.live
def test_a_sidecar_refuses_to_bind_in_a_directory_others_can_write(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "telemetry.sidecar.cli",
            "--address",
            f"ipc://{shared}/telemetry.sock",
            "--bind",
            "--no-metrics",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "writable by others (mode 777)" in result.stderr
    assert not (shared / "telemetry.sock").exists()
