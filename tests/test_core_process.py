"""The engine core across the process boundary: submit, stream, abort, reject, shut down, die.

The engine process runs the real core on the fake runner (spawned, so it imports only what
the engine needs); outputs are checked against the single-request reference.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import signal
import time

import pytest

from engine import core_client, core_messages
from engine.config import EngineConfig
from engine.core_client import EngineBusyError, EngineCoreClient, EngineDeadError
from engine.request import SamplingParams
from engine.request_stream import RequestStream
from engine.scheduler import RequestRejectedError
from tests.helpers.fake_runner import (
    FailingRunner,
    FakeRunner,
    PacedRunner,
    load_fake_model,
    reference_output,
)
from tests.helpers.faults import stalling

pytestmark = pytest.mark.live

MAX_MODEL_LEN = 256


def make_config(**settings) -> EngineConfig:
    defaults = dict(
        model="fake",
        kv_cache_memory_bytes=64 * 16 * 256,  # 64 blocks of 16 tokens at 256 B per token
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=4,
        max_num_batched_tokens=64,
    )
    return EngineConfig(**{**defaults, **settings})


def start_client(runner_class=FakeRunner, **settings) -> EngineCoreClient:
    return EngineCoreClient(make_config(**settings), load_fake_model, runner_class, 60)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def client():
    client = start_client(test_count_log_records=True)
    yield client
    client.shutdown()


def collect(stream) -> tuple[list[int], str | None]:
    tokens: list[int] = []
    reason = None
    for output in stream:
        tokens += output.new_token_ids
        reason = output.finish_reason
    return tokens, reason


def test_ready_reports_the_kv_plan_the_allocator_and_the_kernels(client):
    """The CPU engine runs on tcmalloc, which the client preloads into the process it spawns
    (`make test` installs libtcmalloc-minimal4); the line comes from the engine's own map.
    Then the runner's CPU kernels (a fake's: none)."""
    *lines, allocator, kernels = client.ready.startup_lines
    assert lines == [
        make_config().dtype_choice()[1],
        "Available KV cache memory: 0.00 GiB (0.2 MiB)",
        "KV cache size: 1,024 tokens",
        "Maximum concurrency for 256 tokens per request: 4.00x",
    ]
    assert allocator.startswith("memory allocator: tcmalloc (/"), allocator
    assert kernels == "CPU kernels: none (a fake runner)"
    assert "libtcmalloc" not in os.environ.get("LD_PRELOAD", "")  # this process: as it was
    assert client.ready.num_kv_blocks == 64 and client.ready.pid == client.process.pid


def test_submit_and_stream_from_threads(client):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], list(range(1, 40))]
    streams = [client.add_request(prompt, greedy(10)) for prompt in prompts]
    for prompt, stream in zip(prompts, streams, strict=True):
        tokens, reason = collect(stream)
        assert tokens == reference_output(prompt, 10, MAX_MODEL_LEN, ignore_eos=True)
        assert reason == "length"


def test_submit_and_stream_from_asyncio(client):
    prompts = [[3, 1], [1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 9, 9]]

    async def run_one(prompt):
        stream = client.add_request(
            prompt, greedy(8), traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01"
        )
        tokens = []
        async for output in stream:
            tokens += output.new_token_ids
        return tokens

    async def run_all():
        return await asyncio.gather(*(run_one(prompt) for prompt in prompts))

    results = asyncio.run(run_all())
    for prompt, tokens in zip(prompts, results, strict=True):
        assert tokens == reference_output(prompt, 8, MAX_MODEL_LEN, ignore_eos=True)


@pytest.fixture(scope="module")
def paced_client():
    """A paced runner (5 ms a step), so an abort lands while the request runs: the fake
    model alone made 200 tokens before the abort arrived on a fast machine (and 250 in CI)."""
    client = start_client(runner_class=PacedRunner)
    yield client
    client.shutdown()


def test_abort_ends_the_stream(paced_client):
    client = paced_client
    stream = client.add_request([1, 2, 3], greedy(200), request_id="to-abort")
    first = stream.get(timeout=10)
    assert not first.finished
    client.abort("to-abort")
    tokens, reason = collect(stream)
    assert reason == "abort"
    assert len(tokens) < 199
    # The id is free again once the stream ended.
    assert collect(client.add_request([1, 2, 3], greedy(2), request_id="to-abort"))[1] == "length"


def test_impossible_request_is_rejected_by_the_client(client):
    with pytest.raises(RequestRejectedError, match="exceeds max_model_len"):
        client.add_request([1] * 250, greedy(10))


def test_impossible_request_is_rejected_by_the_engine(client, monkeypatch):
    monkeypatch.setattr(core_client, "check_request_fits", lambda *args: None)
    stream = client.add_request([1] * 250, greedy(10))
    with pytest.raises(RequestRejectedError, match="exceeds max_model_len"):
        stream.get(timeout=10)


def test_a_value_of_a_wrong_type_is_rejected_at_submission(client):
    with pytest.raises(RequestRejectedError, match="Expected `int | null`, got `str`"):
        client.add_request([1, 2, 3], SamplingParams(max_tokens=4, seed="7"))
    with pytest.raises(RequestRejectedError, match="Expected `int`, got `float`"):
        client.add_request([1, 2.5, 3], greedy(4))
    with pytest.raises(ValueError, match="is not a valid FinishReason"):
        client.abort("anything", finish_reason=99)
    assert collect(client.add_request([1, 2, 3], greedy(3)))[1] == "length"


def test_frames_the_engine_cannot_read_never_end_it(paced_client):
    """A foreign sender's bad frames: a request the engine can name is rejected, the rest is
    dropped, an unknown abort reason is a plain abort; requests in flight carry on."""
    client = paced_client
    running = client.add_request([1, 2, 3], greedy(250))
    assert not running.get(timeout=10).finished
    bad_request = core_messages.AddRequest("bad-seed", [1, 2, 3], SamplingParams(seed="7"))
    stream = RequestStream("bad-seed")
    with client._streams_lock:
        client._streams["bad-seed"] = stream
    client._send(bad_request)
    client._send_frame(b"\xc1 not msgpack")
    client._send_frame(b"\x92\xa3add" + b"\x91" * 3000 + b"\x00")  # nested too deep
    client._send(core_messages.AbortRequests([running.request_id], 99))
    with pytest.raises(RequestRejectedError, match="undecodable request"):
        stream.get(timeout=10)
    assert collect(running)[1] == "abort"
    assert client.is_alive
    assert collect(client.add_request([4, 5, 6], greedy(3)))[1] == "length"


def test_engine_process_imports_no_exporters_and_logs_nothing_per_iteration(client):
    collect(client.add_request(list(range(1, 30)), greedy(20)))
    reply = client.probe()
    assert reply.iteration > 20
    assert "prometheus_client" not in reply.top_level_modules
    assert "opentelemetry" not in reply.top_level_modules
    assert "engine" in reply.top_level_modules  # the probe really lists the modules
    assert reply.num_log_records == 0


def test_graceful_shutdown_aborts_what_is_left():
    client = start_client(runner_class=PacedRunner)
    stream = client.add_request([1, 2, 3], greedy(240))
    stream.get(timeout=10)
    client.shutdown()
    assert collect(stream)[1] == "abort"
    assert client.process.exitcode == 0
    with pytest.raises(EngineDeadError, match="shut down"):
        client.add_request([1, 2], greedy(2))


def test_ctrl_c_to_the_process_group_leaves_shutdown_to_the_client():
    """A terminal's Ctrl-C signals every process of the group; the engine must not die of it
    (with a KeyboardInterrupt traceback) before its client shuts it down in order."""
    client = start_client()
    try:
        stream = client.add_request([1, 2, 3], greedy(40))
        first = stream.get(timeout=10).new_token_ids
        os.kill(client.process.pid, signal.SIGINT)
        time.sleep(0.5)
        assert client.process.is_alive()
        tokens, reason = collect(stream)
        assert first + tokens == reference_output([1, 2, 3], 40, MAX_MODEL_LEN, ignore_eos=True)
        assert reason == "length"
    finally:
        client.shutdown()
    assert client.process.exitcode == 0


def test_engine_death_wakes_every_waiter_and_is_logged(caplog):
    """The server lives on answering 503: its log says the engine died, how, and what to do."""
    client = start_client(runner_class=PacedRunner)
    try:
        streams = [client.add_request([1, 2, index], greedy(240)) for index in range(3)]
        streams[0].get(timeout=10)
        os.kill(client.process.pid, signal.SIGKILL)
        for stream in streams:
            with pytest.raises(EngineDeadError, match="died .*killed by SIGKILL"):
                while True:
                    stream.get(timeout=5)  # queue.Empty here would mean nobody told us
        assert not client.is_alive
        (logged,) = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert logged.getMessage().startswith(
            f"the engine process died (pid {client.process.pid}, killed by SIGKILL); "
            "3 requests in flight end with an error"
        )
        assert logged.getMessage().endswith("/health says dead: restart the server")
        with pytest.raises(EngineDeadError):
            client.add_request([1, 2], greedy(2))
    finally:
        client.shutdown()


def test_sending_to_a_just_killed_engine_is_refused_instead_of_hanging():
    """Before the reader thread notices the death, a send must not block on the dead lane:
    once its queue is full (at once here: a PUSH socket without a peer takes nothing), a
    request is refused with EngineBusyError."""
    client = start_client()
    try:
        os.kill(client.process.pid, signal.SIGKILL)
        client.process.join(5)
        # As if nobody had noticed yet: the reader thread (stopped here) and the liveness
        # check, so sends go on until the lane's queue is full.
        client._closing.set()
        client._dead_error = None
        client.process.is_alive = lambda: True
        with pytest.raises(EngineBusyError, match="not taking requests"):
            for index in range(10_000):  # more than the lane's queue holds
                client.add_request([1, 2, index % 100], greedy(2))
        client.abort("a")  # a control message is kept for later, not a hang either
        assert client._input_channel.num_pending == 1
        client.process.is_alive = lambda: False
        with pytest.raises(EngineDeadError, match="died"):
            client.add_request([1, 2, 3], greedy(2))
    finally:
        client.shutdown()


def test_a_failure_in_the_loop_reaches_every_waiter_with_its_cause():
    client = EngineCoreClient(make_config(), load_fake_model, FailingRunner, 60)
    try:
        stream = client.add_request([1, 2, 3], greedy(4))
        with pytest.raises(EngineDeadError, match="injected runner failure"):
            stream.get(timeout=10)
    finally:
        client.shutdown()


def test_startup_failure_reaches_the_client():
    with pytest.raises(RuntimeError, match="estimated maximum model length is 64"):
        start_client(kv_cache_memory_bytes=64 * 256, max_model_len=128)


def test_engine_process_publishes_records_and_heartbeats(tmp_path):
    import zmq

    from telemetry.lane.record import Heartbeat, IterationRecord, make_decoder

    context = zmq.Context()
    sink = context.socket(zmq.PULL)
    address = f"ipc://{tmp_path}/telemetry"
    sink.bind(address)
    client = start_client(telemetry_address=address, engine_index=3)
    try:
        collect(client.add_request([1, 2, 3], greedy(5), request_id="traced"))
        decoder = make_decoder()
        records, heartbeats = [], []
        while len(records) < 5 or not heartbeats:
            assert sink.poll(5000), "no telemetry from the engine process"
            message = decoder.decode(sink.recv())
            (records if isinstance(message, IterationRecord) else heartbeats).append(message)
    finally:
        client.shutdown()
        sink.close(linger=0)
        context.term()
    assert all(record.engine_index == 3 for record in records)
    assert sum(record.num_decode_tokens for record in records) == 4
    finished = [m for record in records for m in record.milestones if m.request_id == "traced"]
    assert finished[-1].num_output_tokens == 5
    heartbeat = heartbeats[0]
    assert isinstance(heartbeat, Heartbeat)
    assert (heartbeat.model_name, heartbeat.device_name) == ("fake", "CPU")
    assert (heartbeat.block_size, heartbeat.num_kv_blocks_total) == (16, 64)
    assert (heartbeat.max_num_seqs, heartbeat.max_num_batched_tokens) == (4, 64)
    assert heartbeat.pid == client.ready.pid


def states_until_finished(client, stream, stall_after_s: float = 0.5) -> set[str]:
    """The engine states the client reads (stalled after ``stall_after_s``) every 0.1 s
    until ``stream`` finishes (30 s at most)."""
    states = set()
    deadline = time.monotonic() + 30
    while not stream.finished and time.monotonic() < deadline:
        states.add(client.engine_status(stall_after_s))
        with contextlib.suppress(queue.Empty):
            stream.get(timeout=0.1)
    return states


def test_an_iteration_bigger_than_any_before_is_given_its_time_before_stalled():
    """An engine's first iteration (or a prompt longer than all before) may take long: a
    7,000-token prompt took 24-45 s on 2 CPU cores, and /health said "stalled" (503, a
    readiness probe takes the pod out) while the sidecar rightly said running. The engine
    says such an iteration is starting and the time it may take (the sidecar's rule); the
    client waits that long (a small iteration that hangs is stalled as before: the test
    after)."""
    client = start_client(stalling(FakeRunner, at_call=1, seconds=2.0))
    try:
        stream = client.add_request([1, 2, 3], greedy(4))
        states = states_until_finished(client, stream)
        assert stream.finished and "running" in states and "stalled" not in states, states
    finally:
        client.shutdown()


def test_engine_state_tells_stalled_from_running_and_idle():
    """An iteration that hangs with a request in flight reads as stalled once no message has
    come for the threshold, and the engine is running again when outputs resume."""
    client = start_client(stalling(FakeRunner, at_call=3, seconds=3.0))
    try:
        assert client.engine_status(0.5) == "idle"
        stream = client.add_request([1, 2, 3], greedy(10))
        states = states_until_finished(client, stream)
        assert stream.finished and {"running", "stalled"} <= states
        assert client.engine_status(0.5) == "idle"
    finally:
        client.shutdown()
    assert client.engine_status() == "dead"
