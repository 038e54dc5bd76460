"""The FastAPI application of `iterscope serve`: its routes and how errors leave.

Endpoints: /metrics, /v1/completions and /v1/chat/completions (streaming SSE or not), /v1/models,
/health. Both generation endpoints take one request path (``answer``); what differs between
them is data (engine/entrypoints/endpoints.py). Errors use OpenAI's body shape: 400 for bad
parameters, prompts that can never fit and messages the chat template refuses, 404 for an
unknown model name, 503 once the engine is dead or busy, 504 past --request-timeout. A valid
W3C ``traceparent`` header is handed to the engine request, so the sidecar's request span
joins the caller's trace.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateSyntaxError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.core_client import EngineBusyError, EngineDeadError
from engine.entrypoints import api_metrics
from engine.entrypoints.endpoints import (
    CHAT,
    COMPLETIONS,
    Endpoint,
    collect,
    stream_events,
    whole_body,
)
from engine.entrypoints.frontend import Frontend, RequestTimeoutError
from engine.entrypoints.http_guard import HttpLimits, RequestGuard
from engine.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
)
from engine.entrypoints.openai_responses import error_body
from engine.scheduler import RequestRejectedError

logger = logging.getLogger("iterscope.serve")

TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


def build_app(
    frontend: Frontend,
    limits: HttpLimits | None = None,
    sidecar_metrics_url: api_metrics.SidecarUrl = None,
) -> FastAPI:
    """The FastAPI application; every error leaves as an OpenAI-style error body. GET /metrics
    serves the sidecar's series (read from ``sidecar_metrics_url``) and the HTTP series, which
    count the guard's refusals too (its middleware is the outer one)."""
    app = FastAPI(title="iterscope", docs_url=None, redoc_url=None)
    app.add_middleware(RequestGuard, limits=limits or HttpLimits())
    api_metrics.attach(app, sidecar_metrics_url)
    add_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http_request: Request):
        return await answer(frontend, COMPLETIONS, body, http_request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http_request: Request):
        return await answer(frontend, CHAT, body, http_request)

    @app.get("/v1/models")
    async def models():
        return models_body(frontend)

    @app.get("/health")
    async def health():
        return health_response(frontend)

    return app


def error(status: int, message: str, error_type: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, error_type, status, param), status_code=status)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        """404 for an unknown path, 405 for a wrong method: OpenAI's shape too."""
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error(exc.status_code, str(exc.detail), error_type)

    @app.exception_handler(Exception)
    async def on_unexpected_error(request: Request, exc: Exception):
        logger.exception("unexpected error answering %s %s", request.method, request.url.path)
        return error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return error(400, "; ".join(map(problem_text, exc.errors())), "invalid_request_error")


def problem_text(problem: dict) -> str:
    """One of a request's validation problems: the field and what is wrong with it; a body
    that is no JSON at all, with the parser's reason and where it stopped."""
    if problem.get("type") == "json_invalid":
        reason = problem.get("ctx", {}).get("error", "")
        return f"the request body is not valid JSON: {reason} (at character {problem['loc'][-1]})"
    return f"{'.'.join(str(p) for p in problem['loc'][1:]) or 'body'}: {problem['msg']}"


async def answer(
    frontend: Frontend, endpoint: Endpoint, body: Any, http_request: Request
) -> Response:
    """The one request path of both generation endpoints: check, build the prompt, generate."""
    try:
        frontend.check_model(body.model)
        body.check_supported()
    except LookupError as exc:
        return error(404, str(exc), "not_found_error", "model")
    except InvalidRequest as exc:
        return error(400, str(exc), "invalid_request_error", exc.param)
    try:
        prompt_ids = await asyncio.to_thread(endpoint.prompt_ids, frontend, body)
    except InvalidRequest as exc:
        return error(400, str(exc), "invalid_request_error", exc.param)
    except TemplateSyntaxError as exc:
        return error(500, f"the model's chat template does not compile: {exc}", "server_error")
    return await generate(frontend, endpoint, body, http_request, prompt_ids)


async def generate(
    frontend: Frontend, endpoint: Endpoint, body: Any, http_request: Request, prompt_ids: list[int]
) -> Response:
    """A streamed response once the first delta is out (so errors before it are statuses),
    or the whole response once every choice has finished."""
    request_id = f"{endpoint.id_prefix}-{uuid.uuid4().hex}"
    try:
        max_tokens = frontend.max_tokens(
            endpoint.requested_max_tokens(body),
            len(prompt_ids),
            endpoint.default_max_tokens(frontend),
        )
        params = body.sampling_params(max_tokens)
        outputs = frontend.generate_choices(
            http_request,
            request_id,
            prompt_ids,
            params,
            body.n,
            traceparent_of(http_request),
            body.stop_strings,
        )
        if body.stream:
            outputs = await first_and_rest(outputs)
            events = stream_events(frontend, endpoint, body, request_id, outputs, len(prompt_ids))
            return StreamingResponse(events, media_type="text/event-stream")
        whole = await collect(outputs, body.n)
    except (InvalidRequest, RequestRejectedError, ValueError) as exc:
        return error(400, str(exc), "invalid_request_error", getattr(exc, "param", None))
    except EngineDeadError as exc:
        return error(503, f"the engine is not running: {exc}", "service_unavailable")
    except EngineBusyError as exc:
        return error(503, str(exc), "service_unavailable")
    except RequestTimeoutError as exc:
        return error(504, str(exc), "timeout")
    return JSONResponse(whole_body(frontend, endpoint, request_id, whole, len(prompt_ids)))


def traceparent_of(http_request: Any) -> str:
    """The W3C traceparent header if well formed, else "" (a malformed one is ignored)."""
    value = http_request.headers.get("traceparent", "").strip().lower()
    return value if TRACEPARENT.match(value) else ""


async def first_and_rest(generator: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """Await the first item now (so errors become HTTP statuses), yield everything later."""
    first = await generator.__anext__()

    async def chained() -> AsyncIterator[Any]:
        yield first
        async for item in generator:
            yield item

    return chained()


def models_body(frontend: Frontend) -> dict[str, Any]:
    ready = frontend.client.ready
    card = {
        "id": frontend.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "iterscope",
        "max_model_len": ready.max_model_len,
        "vocab_size": frontend.vocab_size,
    }
    return {"object": "list", "data": [card]}


def health_response(frontend: Frontend) -> JSONResponse:
    """200 while the engine works or idles; 503 once it is dead, or stalled: requests in
    flight and, for --engine-stall-timeout, nothing heard from it, or no token for any of
    them while it still iterates (EngineCoreClient.engine_health)."""
    client = frontend.client
    state, error_text = client.engine_health(frontend.stall_after_s)
    body = {
        "status": "ok" if state in ("idle", "running") else state,
        "engine": state,
        "engine_pid": client.ready.pid,
        "num_requests_in_flight": client.num_in_flight,
    }
    if error_text:
        body["error"] = error_text
    return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)
