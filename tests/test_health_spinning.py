"""/health on an engine that iterates but serves no one (QA: a KV-block leak left 4 requests
waiting forever; the engine kept beating, scheduling nothing, and /health said 200 "running"
for 80 s+), and the healthy engines that give no token for a while and must stay "running":
a long prompt prefilled in many iterations, a request that arrives after a long idle, a
request queued behind a long-running one."""

from __future__ import annotations

import contextlib
import json
import queue
import time
from types import SimpleNamespace

import pytest

from engine.config import EngineConfig
from engine.core_client import EngineCoreClient
from engine.entrypoints.routes import health_response
from engine.request import SamplingParams
from tests.helpers.fake_runner import FakeRunner, load_fake_model
from tests.helpers.faults import slowed

pytestmark = pytest.mark.live

STALL_AFTER_S = 2.0  # over the engine's progress beat (1 s), so beats alone never stall it


def load_leaky_model(name_or_dir: str, dtype: str, device: str):
    """The fake model, in an engine whose scheduler keeps every block of each finished request
    (run in the engine process: a leak in the block bookkeeping)."""
    from engine import scheduler

    finish = scheduler.Scheduler._finish

    def finish_and_leak(self, request, reason, now_ns):
        self.pool.acquire(list(request.block_ids))
        finish(self, request, reason, now_ns)

    scheduler.Scheduler._finish = finish_and_leak
    return load_fake_model(name_or_dir, dtype, device)


def start_client(load_model=load_fake_model, runner_class=FakeRunner, **settings):
    defaults = dict(
        model="fake",
        kv_cache_memory_bytes=64 * 16 * 256,  # 64 blocks of 16 tokens at 256 B per token
        max_model_len=256,
        max_num_seqs=4,
        max_num_batched_tokens=64,
    )
    config = EngineConfig(**{**defaults, **settings})
    return EngineCoreClient(config, load_model, runner_class, 60)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def drain(stream) -> None:
    with contextlib.suppress(queue.Empty):
        while not stream.finished:
            stream.get(timeout=0.05)


def states_until_finished(client, streams, timeout_s: float = 30) -> list[str]:
    """engine_status every 0.05 s until every stream has finished."""
    states = []
    deadline = time.monotonic() + timeout_s
    while not all(s.finished for s in streams) and time.monotonic() < deadline:
        states.append(client.engine_status(STALL_AFTER_S))
        for stream in streams:
            with contextlib.suppress(queue.Empty):
                stream.get(timeout=0.05 / len(streams))
    assert all(s.finished for s in streams), "the requests did not finish"
    return states


def test_an_engine_that_iterates_but_schedules_nothing_is_stalled():
    """All KV blocks leak with the first request; the next waits forever while the engine
    beats every second and answers aborts (clients giving up every 0.4 s): /health says
    stalled (503) once no request has had a token for the stall timeout, and says why."""
    client = start_client(
        load_leaky_model,
        kv_cache_memory_bytes=16 * 16 * 256,  # 16 blocks: the first request leaks 15
        max_num_batched_tokens=256,
    )
    try:
        first = client.add_request([n % 60 + 1 for n in range(200)], greedy(40))
        drain(first)
        assert first.finished
        waiting = client.add_request([7] * 60, greedy(4))
        added_s = time.monotonic()
        states, state = [], "running"
        while state != "stalled" and time.monotonic() - added_s < 20:
            giving_up = client.add_request([9] * 60, greedy(4))
            client.abort(giving_up.request_id)
            time.sleep(0.4)
            state = client.engine_status(STALL_AFTER_S)
            states.append(state)
        assert state == "stalled", states
        assert states[0] == "running"  # not stalled on arrival
        assert time.monotonic() - added_s >= STALL_AFTER_S
        assert time.monotonic() - client.last_message_s < STALL_AFTER_S  # it still beats
        response = health_response(SimpleNamespace(client=client, stall_after_s=STALL_AFTER_S))
        body = json.loads(response.body)
        assert response.status_code == 503, body
        assert (body["status"], body["engine"]) == ("stalled", "stalled")
        assert body["num_requests_in_flight"] == 1
        assert "has produced no output for" in body["error"], body
        assert "with 1 requests in flight, though it still iterates" in body["error"], body
        assert not waiting.finished
    finally:
        client.shutdown()


def test_a_long_prefill_after_a_long_idle_is_running():
    """A request arriving after an idle longer than the stall timeout is not stalled on
    arrival, and its prompt, prefilled in 4 iterations of 1 s each (no token for 4 s+, beyond
    the first, big one), keeps the engine running."""
    client = start_client(runner_class=slowed(FakeRunner, seconds=1.0))
    try:
        time.sleep(STALL_AFTER_S + 0.5)
        assert client.engine_status(STALL_AFTER_S) == "idle"
        stream = client.add_request([3] * 250, greedy(2))
        states = states_until_finished(client, [stream])
        assert set(states) == {"running"}, states
    finally:
        client.shutdown()


def test_a_request_queued_behind_a_long_running_one_is_running():
    """One request at a time: the second waits for the first (4 s+ of decoding, no token of
    its own), and the first's tokens keep the engine running."""
    client = start_client(runner_class=slowed(FakeRunner, seconds=0.1), max_num_seqs=1)
    try:
        running = client.add_request([1, 2, 3], greedy(40))
        queued = client.add_request([4, 5, 6], greedy(2))
        states = states_until_finished(client, [running, queued])
        assert set(states) == {"running"}, states
        assert client.engine_status(STALL_AFTER_S) == "idle"
    finally:
        client.shutdown()
