"""`iterscope serve` when its engine stops taking work: the frontend keeps answering.

A SIGSTOPped engine process with a thousand requests waiting on it: /health answers
throughout and turns to "stalled" (503) once nothing has come from the engine for
--engine-stall-timeout; when the engine continues, every request completes (or was refused
with 503 while the lane was full) and /health is 200 again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from test_serve import KV_CACHE_MEMORY, ServerProcess

from engine.serve import TINY_MODEL

NUM_QUEUED = 1000


@pytest.fixture
def server(tmp_path):
    server = ServerProcess(tmp_path, "--model", TINY_MODEL, "--kv-cache-memory",
                           KV_CACHE_MEMORY, "--cpu-threads", "1", "--no-sidecar",
                           "--engine-stall-timeout", "2")
    yield server
    server.stop()


async def health_until(base_url: str, status: str, timeout_s: float) -> list[dict]:
    """GET /health until its status is ``status``; every body seen. Each answer must come
    within 10 s (a frozen frontend fails here rather than hanging the test)."""
    bodies = []
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() < deadline:
            response = await client.get(f"{base_url}/health")
            bodies.append(response.json())
            if bodies[-1]["status"] == status:
                assert response.status_code == (200 if status == "ok" else 503)
                return bodies
            await asyncio.sleep(0.2)
    raise AssertionError(f"/health never said {status!r}: {bodies[-3:]}")


async def stop_queue_and_continue(base_url: str, engine_pid: int) -> tuple[list, list, list]:
    limits = httpx.Limits(max_connections=NUM_QUEUED + 10)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        os.kill(engine_pid, signal.SIGSTOP)
        try:
            body = {"model": TINY_MODEL, "prompt": "hello", "max_tokens": 4}
            requests = [asyncio.ensure_future(client.post(f"{base_url}/v1/completions",
                                                          json=body))
                        for _ in range(NUM_QUEUED)]
            stalled = await health_until(base_url, "stalled", 60)
        finally:
            os.kill(engine_pid, signal.SIGCONT)
        responses = await asyncio.gather(*requests)
    recovered = await health_until(base_url, "ok", 60)
    return stalled, responses, recovered


def test_a_stopped_engine_reads_as_stalled_and_requests_complete_when_it_continues(server):
    engine_pid = httpx.get(f"{server.base_url}/health").json()["engine_pid"]
    stalled, responses, recovered = asyncio.run(
        stop_queue_and_continue(server.base_url, engine_pid))
    assert stalled[-1]["engine"] == "stalled" and "produced nothing" in stalled[-1]["error"]
    assert stalled[-1]["num_requests_in_flight"] > 0
    statuses = [response.status_code for response in responses]
    assert set(statuses) <= {200, 503} and statuses.count(200) > 0
    refused = [response.json()["error"]["message"] for response in responses
               if response.status_code == 503]
    assert all("not taking requests" in message for message in refused)
    assert recovered[-1]["engine"] in ("idle", "running")
