"""RequestGuard: body size and time limits and the API key, before the application runs."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request

from engine.entrypoints.http_guard import HttpLimits, RequestGuard


def echo_app(limits: HttpLimits) -> FastAPI:
    """An app that reports the body it was given."""
    app = FastAPI()
    app.add_middleware(RequestGuard, limits=limits)

    @app.post("/v1/echo")
    async def echo(request: Request):
        return {"num_bytes": len(await request.body())}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


async def call(app: FastAPI, method: str, path: str, **kwargs) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.request(method, path, **kwargs)


def run(app: FastAPI, method: str, path: str, **kwargs) -> httpx.Response:
    return asyncio.run(call(app, method, path, **kwargs))


def test_a_body_within_the_limit_reaches_the_app_whole():
    response = run(
        echo_app(HttpLimits(max_body_bytes=1000)), "POST", "/v1/echo", content=b"x" * 1000
    )
    assert response.status_code == 200 and response.json() == {"num_bytes": 1000}


def test_a_declared_length_over_the_limit_gets_413_unread():
    response = run(
        echo_app(HttpLimits(max_body_bytes=1000)), "POST", "/v1/echo", content=b"x" * 1001
    )
    assert response.status_code == 413
    error = response.json()["error"]
    assert "1,001 bytes" in error["message"] and "1,000 bytes" in error["message"]
    assert "--max-request-body" in error["message"] and error["code"] == 413


def test_a_chunked_body_over_the_limit_gets_413():
    async def chunks():
        for _ in range(5):
            yield b"y" * 400

    response = run(echo_app(HttpLimits(max_body_bytes=1000)), "POST", "/v1/echo", content=chunks())
    assert response.status_code == 413
    assert "more than 1,000 bytes" in response.json()["error"]["message"]


def test_a_body_that_never_finishes_gets_408_after_the_timeout():
    async def stalled():
        yield b"{"
        await asyncio.sleep(5)
        yield b"}"

    response = run(echo_app(HttpLimits(body_timeout_s=0.2)), "POST", "/v1/echo", content=stalled())
    assert response.status_code == 408
    assert "0.2 s" in response.json()["error"]["message"]


def test_an_unreadable_content_length_is_a_400():
    app = RequestGuard(echo_app(HttpLimits()), HttpLimits())
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/echo",
        "headers": [(b"content-length", b"lots")],
    }
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 400 and b"'lots' is not a number" in sent[1]["body"]


def refused_while_uploading(num_chunks: int, declared: int | None) -> list[str]:
    """The order of what a guard with a 1,000-byte limit does with a body of ``num_chunks``
    chunks of 400 bytes: "read" per chunk it takes, "413" when it answers."""
    app = RequestGuard(echo_app(HttpLimits(max_body_bytes=1000)), HttpLimits(max_body_bytes=1000))
    events, chunks = [], iter(range(num_chunks))

    async def receive():
        index = next(chunks, None)
        if index is None:
            return {"type": "http.disconnect"}
        events.append("read")
        return {"type": "http.request", "body": b"y" * 400, "more_body": index < num_chunks - 1}

    async def send(message):
        if message["type"] == "http.response.start":
            events.append(str(message["status"]))

    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    scope = {"type": "http", "method": "POST", "path": "/v1/echo", "headers": headers}
    asyncio.run(app(scope, receive, send))
    return events


def test_a_refused_body_is_read_to_its_end_before_the_413_so_the_answer_is_not_reset():
    """Closing a connection with unread data resets it, and the reset can destroy the 413
    before the client, still uploading, reads it: up to twice the limit is read first."""
    assert refused_while_uploading(5, declared=2000) == ["read"] * 5 + ["413"]  # declared
    assert refused_while_uploading(5, declared=None) == ["read"] * 5 + ["413"]  # chunked
    # beyond twice the limit the guard does not wait for the rest
    assert refused_while_uploading(50, declared=20_000) == ["413"]
    assert refused_while_uploading(50, declared=None).count("read") < 50


@pytest.mark.parametrize(
    "header, status", [(None, 401), ("Bearer wrong", 401), ("secret", 401), ("Bearer secret", 200)]
)
def test_the_api_key_guards_v1_paths(header, status):
    headers = {} if header is None else {"Authorization": header}
    response = run(
        echo_app(HttpLimits(api_key="secret")), "POST", "/v1/echo", content=b"{}", headers=headers
    )
    assert response.status_code == status
    if status == 401:
        assert response.headers["www-authenticate"] == "Bearer"
        assert response.json()["error"]["type"] == "authentication_error"


def test_health_needs_no_api_key():
    response = run(echo_app(HttpLimits(api_key="secret")), "GET", "/health")
    assert response.status_code == 200
