"""What one HTTP request may cost the frontend before the application sees it.

An ASGI middleware in front of the FastAPI app:

- **Body size.** A body larger than ``max_body_bytes`` gets 413 without being parsed: when
  its Content-Length says so, else as soon as the bytes received pass the limit (chunked
  uploads). Before the answer, up to twice ``max_body_bytes`` of the body is read and thrown
  away (for at most DRAIN_TIMEOUT_S): the client is usually still uploading, and a connection
  closed with unread data is reset, which can destroy the 413 already sent before the client
  reads it. A larger body gets its answer without the wait. A prompt that could fit
  ``max_model_len`` is far smaller than the default, so only abuse meets it.
- **Body time.** The whole body must arrive within ``body_timeout_s`` of the request's
  headers, else 408: a client that promises 1,000 bytes and sends 10 no longer holds its
  connection (and the memory it was given) forever.
- **API key.** With ``api_key`` set, every ``/v1/`` path needs ``Authorization: Bearer KEY``
  (401 otherwise), as with vLLM's ``--api-key``; /health and /metrics stay open for probes
  and scrapers.

The body is read here, whole, then replayed to the application; after it, the app's
``receive`` reaches the client's again, so disconnects are still seen.

- **Header time.** uvicorn waits forever for a request's headers; HeaderTimeoutH11Protocol
  (its HTTP/1.1 protocol, passed as ``http=``) closes a connection whose request headers
  are not complete within ``header_timeout_s`` of its first byte, or of the connection
  itself (a client that connects and sends nothing).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine.entrypoints.openai_responses import error_body

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
DRAIN_TIMEOUT_S = 5.0  # how long the rest of a refused body is read before the 413

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class HttpLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    api_key: str | None = None


class _Refused(Exception):
    def __init__(self, status: int, message: str, error_type: str) -> None:
        super().__init__(message)
        self.status = status
        self.error_type = error_type


class RequestGuard:
    """ASGI middleware applying HttpLimits to every HTTP request."""

    def __init__(self, app: Callable, limits: HttpLimits) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self._check_api_key(scope)
            self._check_declared_length(scope)
            body = await asyncio.wait_for(self._read_body(receive), self.limits.body_timeout_s)
        except _Refused as refusal:
            if refusal.status == 413:
                await self._drain(scope, receive)
            await _send_error(send, refusal.status, str(refusal), refusal.error_type)
            return
        except TimeoutError:
            await _send_error(
                send,
                408,
                f"the request body did not arrive within {self.limits.body_timeout_s:g} s",
                "invalid_request_error",
            )
            return
        await self.app(scope, _replay(body, receive), send)

    def _check_api_key(self, scope: Scope) -> None:
        if self.limits.api_key is None or not scope["path"].startswith("/v1/"):
            return
        given = _header(scope, b"authorization")
        expected = f"Bearer {self.limits.api_key}".encode()
        if given is None or not hmac.compare_digest(given, expected):
            raise _Refused(
                401,
                "a valid API key is required: send the header 'Authorization: Bearer <key>'",
                "authentication_error",
            )

    def _check_declared_length(self, scope: Scope) -> None:
        declared = _header(scope, b"content-length")
        if declared is None:
            return
        try:
            length = int(declared)
        except ValueError:
            raise _Refused(
                400,
                f"Content-Length {declared.decode(errors='replace')!r} is not a number",
                "invalid_request_error",
            ) from None
        if length > self.limits.max_body_bytes:
            raise self._too_large(f"{length:,} bytes")

    async def _read_body(self, receive: Receive) -> bytes:
        chunks, num_bytes = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Refused(
                    400, "the client went away while sending the body", "invalid_request_error"
                )
            chunk = message.get("body", b"")
            num_bytes += len(chunk)
            if num_bytes > self.limits.max_body_bytes:
                raise self._too_large(f"more than {self.limits.max_body_bytes:,} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _drain(self, scope: Scope, receive: Receive) -> None:
        """Read and drop the rest of a refused body, up to twice ``max_body_bytes`` (none of
        it when its declared length is more), for up to DRAIN_TIMEOUT_S (the module
        docstring)."""
        max_drain_bytes = 2 * self.limits.max_body_bytes
        declared = _header(scope, b"content-length")
        if declared is not None and int(declared) > max_drain_bytes:
            return

        async def drain() -> None:
            num_bytes = 0
            while num_bytes <= max_drain_bytes:
                message = await receive()
                num_bytes += len(message.get("body", b""))
                if message["type"] == "http.disconnect" or not message.get("more_body"):
                    return

        try:
            await asyncio.wait_for(drain(), DRAIN_TIMEOUT_S)
        except TimeoutError:
            pass

    def _too_large(self, size: str) -> _Refused:
        return _Refused(
            413,
            f"the request body ({size}) is larger than the server's limit of "
            f"{self.limits.max_body_bytes:,} bytes (--max-request-body)",
            "invalid_request_error",
        )


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the buffered body once, then the client's own messages."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


async def _send_error(send: Send, status: int, message: str, error_type: str) -> None:
    """An OpenAI-style error; the connection is closed after it (the rest of a refused body
    is never read)."""
    payload = json.dumps(error_body(message, error_type, status)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"connection", b"close"),
        (b"content-length", str(len(payload)).encode()),
    ]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a deadline on each request's headers. Between
    requests a keep-alive connection is uvicorn's (its keep-alive timeout)."""

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._arm_header_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # headers of a request not complete yet
            self._arm_header_deadline()
        elif self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(
                self.header_timeout_s, self.transport.close
            )


def header_timeout_protocol(header_timeout_s: float) -> type[HeaderTimeoutH11Protocol]:
    """The protocol class for uvicorn.Config(http=...) with this header deadline."""
    return type(
        "HeaderTimeoutH11Protocol",
        (HeaderTimeoutH11Protocol,),
        {"header_timeout_s": header_timeout_s},
    )
