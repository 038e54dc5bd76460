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
import socket
import time

import httpx
import pytest
from test_serve import KV_CACHE_MEMORY, ServerProcess, tiny_server

from engine.entrypoints.serve import TINY_MODEL

NUM_QUEUED = 1000


@pytest.fixture
def server(tmp_path):
    with tiny_server(tmp_path, "--no-sidecar", "--engine-stall-timeout", "2") as server:
        yield server


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


def read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    """Everything the server sends until it closes the connection (fails after timeout_s)."""
    sock.settimeout(timeout_s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.fixture
def quick_timeouts_server(tmp_path):
    with tiny_server(tmp_path, "--no-sidecar", "--request-header-timeout", "1",
                     "--request-body-timeout", "1") as server:
        yield server


def test_slow_headers_and_slow_bodies_lose_their_connection(quick_timeouts_server):
    host, port = quick_timeouts_server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as silent:
        assert read_until_closed(silent, 30) == b""  # connected, sent nothing: closed
    with socket.create_connection((host, int(port))) as slow_headers:
        slow_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert read_until_closed(slow_headers, 30) == b""
    with socket.create_connection((host, int(port))) as slow_body:
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
        answer = read_until_closed(slow_body, 30)
        assert answer.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 1 s" in answer
    health = httpx.get(f"{quick_timeouts_server.base_url}/health", timeout=10)
    assert health.status_code == 200  # a prompt client after all that is served


def test_a_killed_frontend_leaves_no_engine_directory_behind(tmp_path):
    server = ServerProcess(tmp_path, "--model", TINY_MODEL, "--kv-cache-memory",
                           KV_CACHE_MEMORY, "--no-sidecar")
    try:
        engine_pid = httpx.get(f"{server.base_url}/health").json()["engine_pid"]
        lanes = [link for link in os.listdir(f"/proc/{engine_pid}/fd")
                 if "iterscope-engine-" in os.readlink(f"/proc/{engine_pid}/fd/{link}")]
        engine_dirs = {os.path.dirname(os.readlink(f"/proc/{engine_pid}/fd/{link}"))
                       for link in lanes}
        server.process.kill()
        server.process.wait()
        deadline = time.monotonic() + 30
        while os.path.exists(f"/proc/{engine_pid}") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not os.path.exists(f"/proc/{engine_pid}"), "the engine outlived its client"
    finally:
        server.stop()
    assert all(not os.path.exists(directory) for directory in engine_dirs)


def test_a_request_past_its_timeout_is_aborted_with_504(tmp_path):
    with tiny_server(tmp_path, "--no-sidecar", "--request-timeout", "2") as server:
        engine_pid = httpx.get(f"{server.base_url}/health").json()["engine_pid"]
        body = {"model": TINY_MODEL, "prompt": "hello", "max_tokens": 4}
        os.kill(engine_pid, signal.SIGSTOP)
        try:
            whole = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
            streamed = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                                  json={**body, "stream": True})
        finally:
            os.kill(engine_pid, signal.SIGCONT)
        assert whole.status_code == 504
        assert "--request-timeout 2 s" in whole.json()["error"]["message"]
        # Nothing came before the timeout, so the stream had not started: a 504 too (a stream
        # already under way ends with an error event instead).
        assert streamed.status_code == 504
        assert asyncio.run(health_until(server.base_url, "ok", 30))[-1]["engine"] == "idle"
        ok = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert ok.status_code == 200  # in time once the engine runs
