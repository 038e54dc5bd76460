"""`iterscope serve` when its engine stops taking work: the frontend keeps answering.

A SIGSTOPped engine process with a thousand requests waiting on it: /health answers
throughout and turns to "stalled" (503) once nothing has come from the engine for
--engine-stall-timeout; when the engine continues, every request completes (or was refused
with 503 while the lane was full) and /health is 200 again. Multi-megabyte prompts leave the
frontend's memory where it was; --request-timeout wraps streams only when it is set.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import httpx
import pytest

from engine.entrypoints.frontend import Frontend, RequestTimeoutError
from engine.entrypoints.serve_args import TINY_MODEL
from tests.helpers.processes import rss_bytes
from tests.helpers.serve import (
    KV_CACHE_MEMORY,
    PLAIN_TEMPLATE,
    HangingClient,
    ScriptedClient,
    ServerProcess,
    TemplateTokenizer,
    tiny_server,
)
from tests.helpers.wait import wait_until

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
            requests = [
                asyncio.ensure_future(client.post(f"{base_url}/v1/completions", json=body))
                for _ in range(NUM_QUEUED)
            ]
            stalled = await health_until(base_url, "stalled", 60)
        finally:
            os.kill(engine_pid, signal.SIGCONT)
        responses = await asyncio.gather(*requests)
    recovered = await health_until(base_url, "ok", 60)
    return stalled, responses, recovered


@pytest.mark.live
def test_a_stopped_engine_reads_as_stalled_and_requests_complete_when_it_continues(server):
    engine_pid = httpx.get(f"{server.base_url}/health").json()["engine_pid"]
    stalled, responses, recovered = asyncio.run(
        stop_queue_and_continue(server.base_url, engine_pid)
    )
    assert stalled[-1]["engine"] == "stalled" and "produced nothing" in stalled[-1]["error"]
    assert stalled[-1]["num_requests_in_flight"] > 0
    statuses = [response.status_code for response in responses]
    assert set(statuses) <= {200, 503} and statuses.count(200) > 0
    refused = [
        response.json()["error"]["message"] for response in responses if response.status_code == 503
    ]
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
    with tiny_server(
        tmp_path, "--no-sidecar", "--request-header-timeout", "1", "--request-body-timeout", "1"
    ) as server:
        yield server


@pytest.mark.live
def test_slow_headers_and_slow_bodies_lose_their_connection(quick_timeouts_server):
    host, port = quick_timeouts_server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as silent:
        assert read_until_closed(silent, 30) == b""  # connected, sent nothing: closed
    with socket.create_connection((host, int(port))) as slow_headers:
        slow_headers.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert read_until_closed(slow_headers, 30) == b""
    with socket.create_connection((host, int(port))) as slow_body:
        slow_body.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
        )
        answer = read_until_closed(slow_body, 30)
        assert answer.startswith(b"HTTP/1.1 408 ") and b"did not arrive within 1 s" in answer
    health = httpx.get(f"{quick_timeouts_server.base_url}/health", timeout=10)
    assert health.status_code == 200  # a prompt client after all that is served


@pytest.mark.live
def test_a_killed_frontend_leaves_no_engine_directory_behind(tmp_path):
    server = ServerProcess(
        tmp_path, "--model", TINY_MODEL, "--kv-cache-memory", KV_CACHE_MEMORY, "--no-sidecar"
    )
    try:
        engine_pid = httpx.get(f"{server.base_url}/health").json()["engine_pid"]
        lanes = [
            link
            for link in os.listdir(f"/proc/{engine_pid}/fd")
            if "iterscope-engine-" in os.readlink(f"/proc/{engine_pid}/fd/{link}")
        ]
        engine_dirs = {
            os.path.dirname(os.readlink(f"/proc/{engine_pid}/fd/{link}")) for link in lanes
        }
        server.process.kill()
        server.process.wait()
        wait_until(
            lambda: not os.path.exists(f"/proc/{engine_pid}"),
            30,
            "the engine to exit (it outlived its client)",
            0.1,
        )
    finally:
        server.stop()
    assert all(not os.path.exists(directory) for directory in engine_dirs)


@pytest.mark.live
def test_a_request_past_its_timeout_is_aborted_with_504(tmp_path):
    with tiny_server(tmp_path, "--no-sidecar", "--request-timeout", "2") as server:
        engine_pid = httpx.get(f"{server.base_url}/health").json()["engine_pid"]
        body = {"model": TINY_MODEL, "prompt": "hello", "max_tokens": 4}
        os.kill(engine_pid, signal.SIGSTOP)
        try:
            whole = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
            streamed = httpx.post(
                f"{server.base_url}/v1/completions", timeout=60, json={**body, "stream": True}
            )
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


LARGE_PROMPT_BYTES = 3 << 20  # under the 4 MiB body limit, far over the tiny model's 1024
RSS_MARGIN_BYTES = 24 << 20  # without a fixed mmap threshold the frontend kept ~50 MiB more


def rss_settles_under(pid: int, limit_bytes: int, timeout_s: float) -> int:
    """The process's RSS once it is at most ``limit_bytes``, else the last seen after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (rss := rss_bytes(pid)) > limit_bytes and time.monotonic() < deadline:
        time.sleep(0.2)
    return rss


@pytest.mark.live
def test_memory_returns_to_its_baseline_after_large_prompts(tmp_path):
    with tiny_server(tmp_path, "--no-sidecar") as server:
        pid, url = server.process.pid, server.base_url
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        with httpx.Client(timeout=120) as http:
            for path, body in (
                ("completions", {"prompt": "hi", "max_tokens": 2}),
                ("chat/completions", chat),
            ):  # imports and caches warmed up
                assert http.post(f"{url}/v1/{path}", json=body).status_code == 200
            baseline = rss_bytes(pid)
            huge = "x" * LARGE_PROMPT_BYTES
            for _ in range(3):
                too_long = http.post(f"{url}/v1/completions", json={"prompt": huge})
                assert too_long.status_code == 400 and "max_model_len" in too_long.text
                chat_body = {"messages": [{"role": "user", "content": huge}], "stream": True}
                too_long = http.post(f"{url}/v1/chat/completions", json=chat_body)
                assert too_long.status_code == 400 and "max_model_len" in too_long.text
            long_prompt = {"prompt": "y" * 1000, "max_tokens": 4}  # fits 1024 tokens
            assert http.post(f"{url}/v1/completions", json=long_prompt).status_code == 200
        settled = rss_settles_under(pid, baseline + RSS_MARGIN_BYTES, timeout_s=15)
    assert settled <= baseline + RSS_MARGIN_BYTES, (
        f"RSS {settled >> 20} MiB after large prompts, baseline {baseline >> 20} MiB"
    )


def timed_frontend(client, request_timeout_s):
    return Frontend(
        client, TemplateTokenizer(PLAIN_TEMPLATE), TINY_MODEL, request_timeout_s=request_timeout_s
    )


async def outputs_through_timeout(client, request_timeout_s):
    """(whether the stream came back unwrapped, the token ids read through it)."""
    stream = client.add_request([1], None, "r-1", "")
    passed = timed_frontend(client, request_timeout_s)._within_timeout(stream)
    return passed is stream, [output.new_token_ids async for output in passed]


def test_without_a_request_timeout_streams_pass_through_unwrapped():
    steps = [[ord("a")], [ord("b")], [ord("c")]]
    unwrapped, token_ids = asyncio.run(outputs_through_timeout(ScriptedClient(steps), None))
    assert unwrapped and token_ids == steps
    unwrapped, token_ids = asyncio.run(outputs_through_timeout(ScriptedClient(steps), 30.0))
    assert not unwrapped and token_ids == steps


def test_with_a_request_timeout_a_stalled_stream_times_out():
    client = HangingClient([[ord("a")], [ord("b")]])
    with pytest.raises(RequestTimeoutError, match="--request-timeout 0.2 s"):
        asyncio.run(outputs_through_timeout(client, 0.2))
