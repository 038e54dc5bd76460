"""CURVE on the telemetry lane: engines publish over loopback tcp to a PULL socket set up by
telemetry.lane.curve; only engines holding listed keys get through."""

import logging
import stat
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from telemetry.lane import curve
from telemetry.lane.publisher import ZmqPublisher
from telemetry.lane.record import IterationRecord, iteration_record, make_decoder
from tests.helpers.lane import RecordingSink
from tests.helpers.net import free_port
from tests.helpers.wait import wait_until

DEADLINE_S = 15.0
HANDSHAKE_FAILED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def record(engine_index: int) -> IterationRecord:
    return iteration_record(
        engine_index,
        0,
        1,
        start_ns=time.monotonic_ns(),
        elapsed_ns=1_000_000,
        num_decode_reqs=1,
        num_decode_tokens=1,
        num_running_reqs=1,
        num_kv_blocks_used=1,
        num_kv_blocks_free=9,
        num_kv_tokens=16,
    )


@pytest.fixture
def keys_dir(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    curve.generate_keys(path, ["engine-a", "engine-b"])
    return path


@pytest.fixture
def intruder_keys_dir(tmp_path: Path, keys_dir: Path) -> Path:
    """Well-formed keys for an engine named engine-a that the sidecar never listed, plus the
    sidecar's real public key: everything an outsider could have."""
    path = tmp_path / "intruder"
    curve.generate_keys(path, ["engine-a"])
    (path / "server.key").write_bytes((keys_dir / "server.key").read_bytes())
    return path


@pytest.fixture
def wrong_server_keys_dir(tmp_path: Path, keys_dir: Path) -> Path:
    """engine-a's real secret key, but another sidecar's public key."""
    path = tmp_path / "other-sidecar"
    curve.generate_keys(path, [])
    (path / "engine-a.key_secret").write_bytes((keys_dir / "engine-a.key_secret").read_bytes())
    return path


class Server:
    """A CURVE PULL socket on loopback tcp with a monitor of its handshakes."""

    def __init__(self, keys_dir: Path) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PULL)
        self.socket.linger = 0
        curve.configure_server(self.socket, keys_dir)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.monitor = self.socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED_EVENTS
        )
        self.events: Counter = Counter()
        self.decoder = make_decoder()

    def drain(self, wait_s: float) -> list:
        """Frames received during ``wait_s`` (decoded); monitor events are tallied."""
        frames = []
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        end = time.monotonic() + wait_s
        while (left_s := end - time.monotonic()) > 0:
            for sock, _ in poller.poll(left_s * 1000):
                if sock is self.monitor:
                    self.events[recv_monitor_message(self.monitor)["event"]] += 1
                else:
                    frames.append(self.decoder.decode(self.socket.recv()))
        return frames

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=0)
        curve.stop_server_auth(self.context)
        self.context.term()


@pytest.fixture
def server(keys_dir: Path):
    server = Server(keys_dir)
    yield server
    server.close()


@pytest.fixture
def engines():
    """Start publishers, each in a context of its own as in separate processes; close all."""
    started = []

    def start(address: str, engine_index: int, **curve_args) -> ZmqPublisher:
        context = zmq.Context()
        publisher = ZmqPublisher(
            address, engine_index, heartbeat_interval_s=3600, context=context, **curve_args
        )
        started.append((publisher, context))
        return publisher

    yield start
    for publisher, context in started:
        publisher.close()
        context.term()


def num_handshakes_failed(events: Counter) -> int:
    """libzmq reports a refused peer as a protocol error or without detail, depending on when
    the mismatch is seen; either one counts."""
    return sum(n for event, n in events.items() if event & HANDSHAKE_FAILED_EVENTS)


def publish_until(server: Server, publishers: list, done) -> Counter:
    """Publish one record per engine every 20 ms until ``done(received, events)``."""
    received: Counter = Counter()

    def published_until_done() -> bool:
        if done(received, server.events):
            return True
        for publisher in publishers:
            publisher.publish(record(publisher.engine_index))
        for frame in server.drain(wait_s=0.02):  # the pause between rounds
            received[frame.engine_index] += 1
        return False

    wait_until(
        published_until_done,
        DEADLINE_S,
        lambda: f"done: received {dict(received)}, events {dict(server.events)}",
        interval_s=0,
    )
    return received


def test_two_engines_with_keys_get_through_and_one_without_keys_is_rejected(
    server, engines, keys_dir
):
    keys = str(keys_dir)
    engine_a = engines(server.address, 1, curve_keys_dir=keys, curve_engine_name="engine-a")
    engine_b = engines(server.address, 2, curve_keys_dir=keys, curve_engine_name="engine-b")
    plain = engines(server.address, 3)

    def done(received, events):
        return (
            received[1] >= 5
            and received[2] >= 5
            and events[zmq.EVENT_HANDSHAKE_SUCCEEDED] >= 2
            and num_handshakes_failed(events) >= 1
        )

    received = publish_until(server, [engine_a, engine_b, plain], done)
    assert received[3] == 0
    assert plain.num_sent_total == 0
    # the engine sees its lane as down, and counts it (once its sender stops waiting for the
    # connection, publisher.CONNECT_WAIT_MS)
    wait_until(lambda: plain.num_dropped_total > 0, 5, "the plain engine's drops")
    assert engine_a.num_sent_total >= received[1]


@pytest.mark.parametrize(
    "rejected_keys, expected_event",
    [
        ("intruder_keys_dir", zmq.EVENT_HANDSHAKE_FAILED_AUTH),
        ("wrong_server_keys_dir", None),  # any handshake failure
    ],
    ids=["unlisted-engine-key", "wrong-server-key"],
)
def test_engine_with_keys_the_sidecar_does_not_trust_is_rejected(
    server, engines, keys_dir, rejected_keys, expected_event, request
):
    rejected_dir = request.getfixturevalue(rejected_keys)
    trusted = engines(server.address, 1, curve_keys_dir=str(keys_dir), curve_engine_name="engine-b")
    rejected = engines(
        server.address, 2, curve_keys_dir=str(rejected_dir), curve_engine_name="engine-a"
    )

    def done(received, events):
        if expected_event is None:
            return received[1] >= 5 and num_handshakes_failed(events) >= 1
        return received[1] >= 5 and events[expected_event] >= 1

    received = publish_until(server, [trusted, rejected], done)
    assert received[2] == 0
    assert rejected.num_sent_total == 0


def test_generate_keys_layout_permissions_and_idempotence(tmp_path):
    keys = tmp_path / "keys"
    curve.generate_keys(keys, ["gpu-host-1"])
    server_key = (keys / "server.key").read_bytes()
    assert (keys / "server.key_secret").is_file()
    assert (keys / "clients" / "gpu-host-1.key").is_file()
    assert (keys / "gpu-host-1.key_secret").is_file()
    assert not (keys / "gpu-host-1.key").exists()
    for secret in keys.glob("*.key_secret"):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    curve.generate_keys(keys, ["gpu-host-1", "gpu-host-2"])
    assert (keys / "server.key").read_bytes() == server_key
    assert sorted(p.name for p in (keys / "clients").iterdir()) == [
        "gpu-host-1.key",
        "gpu-host-2.key",
    ]


@pytest.mark.parametrize("name", ["", "server", "../escape", "-dash", "a b"])
def test_invalid_engine_names_are_refused(tmp_path, name):
    with pytest.raises(ValueError, match="invalid engine name"):
        curve.generate_keys(tmp_path / "keys", [name])


def test_missing_files_give_errors_that_say_what_to_do(tmp_path):
    keys = tmp_path / "keys"
    curve.generate_keys(keys, [])
    context = zmq.Context()
    try:
        pull = context.socket(zmq.PULL)
        with pytest.raises(FileNotFoundError, match="no engine public keys"):
            curve.configure_server(pull, keys)
        pull.close(linger=0)
        with pytest.raises(FileNotFoundError, match="engine-x.key_secret not found"):
            ZmqPublisher(
                "tcp://127.0.0.1:1",
                0,
                context=context,
                curve_keys_dir=str(keys),
                curve_engine_name="engine-x",
            )
        curve.generate_keys(tmp_path / "engine-host", ["engine"])
        (tmp_path / "engine-host" / "server.key").unlink()
        with pytest.raises(FileNotFoundError, match="server.key not found"):
            curve.configure_client(context.socket(zmq.PUSH), tmp_path / "engine-host")
    finally:
        curve.stop_server_auth(context)
        context.destroy(linger=0)


def test_one_context_refuses_a_second_keys_directory(tmp_path):
    curve.generate_keys(tmp_path / "one", ["e"])
    curve.generate_keys(tmp_path / "two", ["e"])
    context = zmq.Context()
    try:
        curve.configure_server(context.socket(zmq.PULL), tmp_path / "one")
        curve.configure_server(context.socket(zmq.PULL), tmp_path / "one")  # same dir: fine
        with pytest.raises(ValueError, match="one keys directory per context"):
            curve.configure_server(context.socket(zmq.PULL), tmp_path / "two")
    finally:
        curve.stop_server_auth(context)
        context.destroy(linger=0)


def test_command_line_creates_keys(tmp_path, capsys):
    assert curve.main([str(tmp_path / "k"), "--engines", "a", "b"]) == 0
    assert (tmp_path / "k" / "clients" / "b.key").is_file()
    assert "engine a:" in capsys.readouterr().out
    assert curve.main([str(tmp_path / "k"), "--engines", "server"]) == 2


def test_command_line_is_iterscope_curve_keys(capsys):
    with pytest.raises(SystemExit) as exit_info:
        curve.main(["--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: iterscope curve-keys ")
    with pytest.raises(SystemExit) as exit_info:
        curve.main([])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: iterscope curve-keys ")
    assert "iterscope curve-keys: error: the following arguments are required: keys_dir" in err


@pytest.mark.parametrize("keys_under_file", [False, True])
def test_command_line_refuses_a_file_for_the_keys_directory(tmp_path, capsys, keys_under_file):
    file = tmp_path / "empty.jsonl"
    file.write_text("")
    assert curve.main([str(file / "keys" if keys_under_file else file)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (
        f"iterscope curve-keys: {file} is a file, not a directory: KEYS_DIR must be a "
        "directory to create or extend\n"
    )
    assert list(tmp_path.iterdir()) == [file] and file.read_text() == ""


def test_command_line_checks_every_name_before_writing(tmp_path, capsys):
    assert curve.main([str(tmp_path / "keys"), "--engines", "fine", "server"]) == 2
    assert capsys.readouterr().err.startswith("iterscope curve-keys: invalid engine name")
    assert not (tmp_path / "keys").exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_command_line_says_which_path_it_cannot_create(capsys):
    assert curve.main(["/proc/keys_qa"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith("iterscope curve-keys: cannot create or write /proc/keys_qa: ")


def test_a_failed_write_leaves_no_partial_certificate(tmp_path, capsys, monkeypatch):
    create = zmq.auth.create_certificates

    def public_half_then_fail(directory, name):
        if not name.startswith("broken"):
            return create(directory, name)
        path = Path(directory) / f"{name}.key"
        path.write_text("half")
        raise OSError(28, "No space left on device", str(path.with_suffix(".key_secret")))

    monkeypatch.setattr(zmq.auth, "create_certificates", public_half_then_fail)
    keys = tmp_path / "keys"
    assert curve.main([str(keys), "--engines", "good", "broken"]) == 2  # a new directory
    assert capsys.readouterr().err == (
        f"iterscope curve-keys: cannot create or write {keys / 'broken.key_secret'}: "
        "No space left on device\n"
    )
    assert not keys.exists()
    curve.generate_keys(keys, ["good"])  # an existing directory keeps what it held
    before = sorted(p.relative_to(keys) for p in keys.rglob("*"))
    assert curve.main([str(keys), "--engines", "good", "broken-2"]) == 2
    assert sorted(p.relative_to(keys) for p in keys.rglob("*")) == before


def test_real_sidecar_with_keys_accepts_only_engines_with_keys(engines, keys_dir, caplog):
    """The engine without keys gets nothing through, and the sidecar says why (it was
    invisible on both sides: only the disconnect counter moved)."""
    from telemetry.sidecar.ingest import Ingest
    from telemetry.sidecar.lane_loop import LaneLoop

    sink = RecordingSink()
    context = zmq.Context()
    address = f"tcp://127.0.0.1:{free_port()}"
    ingest = Ingest([sink])
    sidecar = LaneLoop(address, ingest, context=context, curve_keys_dir=str(keys_dir))
    thread = threading.Thread(target=sidecar.run, daemon=True)
    thread.start()
    try:
        keys = str(keys_dir)
        engine_a = engines(address, 1, curve_keys_dir=keys, curve_engine_name="engine-a")
        engine_b = engines(address, 2, curve_keys_dir=keys, curve_engine_name="engine-b")
        plain = engines(address, 3)

        def engine_indexes() -> Counter:
            return Counter(engine_index for engine_index, _ in sink.of("iteration"))

        def published_until_both_through() -> bool:
            if engine_indexes()[1] >= 5 and engine_indexes()[2] >= 5:
                return True
            for publisher in (engine_a, engine_b, plain):
                publisher.publish(record(publisher.engine_index))
            return False

        wait_until(
            published_until_both_through,
            DEADLINE_S,
            lambda: f"5 records of engines 1 and 2: {dict(engine_indexes())}",
            interval_s=0.02,
        )
        assert engine_indexes()[3] == 0 and plain.num_sent_total == 0
        wait_until(lambda: plain.num_dropped_total > 0, DEADLINE_S, "the plain engine's drops")
        wait_until(
            lambda: ingest.health.num_lane_handshake_failures >= 1,
            DEADLINE_S,
            lambda: "a failed handshake counted",
        )
        said = [r.getMessage() for r in caplog.records if "the lane's handshake" in r.getMessage()]
        assert said[0].startswith(
            f"a sender to {address} failed the lane's handshake (failed handshakes of this "
            "kind so far: 1): no CURVE keys"
        )
    finally:
        sidecar.stop()
        thread.join(timeout=5)
        curve.stop_server_auth(context)
        context.term()


def test_a_sender_with_keys_the_sidecar_does_not_trust_is_said_so(
    engines, keys_dir, intruder_keys_dir, caplog
):
    from telemetry.sidecar.ingest import Ingest
    from telemetry.sidecar.lane_loop import LaneLoop

    context = zmq.Context()
    address = f"tcp://127.0.0.1:{free_port()}"
    ingest = Ingest([])
    sidecar = LaneLoop(address, ingest, context=context, curve_keys_dir=str(keys_dir))
    thread = threading.Thread(target=sidecar.run, daemon=True)
    thread.start()
    try:
        intruder = engines(
            address, 1, curve_keys_dir=str(intruder_keys_dir), curve_engine_name="engine-a"
        )

        def said_untrusted() -> bool:
            intruder.publish(record(1))
            return any("not among the engine keys" in r.getMessage() for r in caplog.records)

        wait_until(said_untrusted, DEADLINE_S, lambda: "the untrusted key said", interval_s=0.05)
        assert ingest.health.num_messages == 0
    finally:
        sidecar.stop()
        thread.join(timeout=5)
        curve.stop_server_auth(context)
        context.term()


def test_failed_handshakes_are_said_per_cause_so_a_second_sender_is_not_hidden(
    keys_dir, tmp_path, caplog
):
    """An engine without keys retries every 100 ms or so: its failures are said 3 times, then
    once a minute. An engine with an untrusted key that failed once after it went unsaid for
    that minute: each cause has its own count and its own minute."""
    from telemetry.sidecar.ingest import Ingest
    from telemetry.sidecar.lane_loop import HANDSHAKE_LINES_AT_ONCE, LaneLoop

    context = zmq.Context()
    ingest = Ingest([])
    sidecar = LaneLoop(
        f"ipc://{tmp_path}/lane.sock", ingest, context=context, curve_keys_dir=str(keys_dir)
    )
    try:
        with caplog.at_level(logging.WARNING):
            for _ in range(10):
                sidecar._say_handshake_failure(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
            sidecar._say_handshake_failure(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == HANDSHAKE_LINES_AT_ONCE + 1
        assert "of this kind so far: 1): its CURVE key is not among" in said[-1]
    finally:
        sidecar.stop()
        sidecar.run()  # returns at once, closing the socket
        curve.stop_server_auth(context)
        context.term()


def test_vllm_sources_take_their_curve_keys_from_the_environment(
    server, keys_dir, monkeypatch, caplog
):
    """A vLLM on another host than its sidecar: its sources' publisher (vllm_lane, the same
    for the scheduler source and the plugin) authenticates as the engine the environment
    names; keys that cannot be read turn telemetry off and say so, vLLM serving on."""
    from telemetry.sources import vllm_lane

    monkeypatch.setenv(vllm_lane.ADDRESS_ENV, server.address)
    monkeypatch.setenv(vllm_lane.CURVE_KEYS_ENV, str(keys_dir))
    monkeypatch.setenv(vllm_lane.CURVE_NAME_ENV, "engine-b")
    publisher = vllm_lane.start_publisher(5, {"source": "vllm-scheduler"}, "the scheduler source")
    assert publisher is not None
    try:
        received = publish_until(server, [publisher], lambda received, _: received[5] >= 3)
        assert received[5] >= 3
    finally:
        publisher.close()
    monkeypatch.setenv(vllm_lane.CURVE_NAME_ENV, "no-such-engine")
    assert vllm_lane.start_publisher(6, {}, "the scheduler source") is None
    assert "cannot publish to" in caplog.text and "no-such-engine.key_secret" in caplog.text
