"""The two generation endpoints, /v1/completions and /v1/chat/completions, as data.

They share one request path (engine/entrypoints/routes.py); an Endpoint holds what differs:
how the prompt is built, where max_tokens comes from and its default, the id prefix, and
the shapes of the response, its streamed chunks and their choices (engine/entrypoints/
openai_responses.py). Below, how a request's TextDeltas become either the SSE events of a
streamed response or one whole response body.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.core_client import EngineDeadError
from engine.entrypoints.frontend import Frontend, RequestTimeoutError
from engine.entrypoints.openai_protocol import DEFAULT_COMPLETION_MAX_TOKENS
from engine.entrypoints.openai_responses import (
    chat_body,
    chat_choice,
    chat_chunk,
    chat_chunk_choice,
    completion_body,
    completion_choice,
    error_body,
    usage,
)
from engine.logprobs import LogprobsFormatter, TokenLogprobs

Choice = Callable[[int, str, str | None, dict | None], dict[str, Any]]  # index, text, ...
Body = Callable[[str, str, list[dict[str, Any]], dict[str, int] | None], dict[str, Any]]


@dataclass(frozen=True)
class Endpoint:
    """What one generation endpoint does its own way. ``prompt_ids`` runs off the event loop
    (tokenizing a large prompt takes seconds); ``chunk`` with no choices and the usage counts
    makes the usage-only last chunk."""

    id_prefix: str
    chat: bool  # the logprobs' shape (LogprobsFormatter)
    prompt_ids: Callable[[Frontend, Any], list[int]]
    requested_max_tokens: Callable[[Any], int | None]
    default_max_tokens: Callable[[Frontend], int]
    whole_body: Body
    whole_choice: Choice
    chunk: Callable[..., dict[str, Any]]  # (request_id, model, choices, usage_counts=None)
    chunk_choice: Choice
    opening_chunks: Callable[[str, str, int], list[dict[str, Any]]]  # before any text


def completion_chunk(
    request_id: str,
    model: str,
    choices: list[dict[str, Any]],
    usage_counts: dict[str, int] | None = None,
) -> dict[str, Any]:
    return completion_body(request_id, model, choices, usage_counts, chunk=True)


def chat_text_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict | None = None
) -> dict[str, Any]:
    return chat_chunk_choice(index, {"content": text}, finish_reason, logprobs)


def chat_role_chunks(request_id: str, model: str, n: int) -> list[dict[str, Any]]:
    """A streamed chat response first names the assistant's role, once per choice."""
    return [
        chat_chunk(
            request_id,
            model,
            [chat_chunk_choice(index, {"role": "assistant", "content": ""}, None)],
        )
        for index in range(n)
    ]


COMPLETIONS = Endpoint(
    id_prefix="cmpl",
    chat=False,
    prompt_ids=lambda frontend, body: frontend.prompt_ids(body.single_prompt()),
    requested_max_tokens=lambda body: body.max_tokens,
    default_max_tokens=lambda frontend: DEFAULT_COMPLETION_MAX_TOKENS,
    whole_body=completion_body,
    whole_choice=completion_choice,
    chunk=completion_chunk,
    chunk_choice=completion_choice,
    opening_chunks=lambda request_id, model, n: [],
)

CHAT = Endpoint(
    id_prefix="chatcmpl",
    chat=True,
    prompt_ids=lambda frontend, body: frontend.chat_prompt_ids(body.template_messages()),
    requested_max_tokens=lambda body: body.requested_max_tokens,
    default_max_tokens=lambda frontend: frontend.client.ready.max_model_len,
    whole_body=chat_body,
    whole_choice=chat_choice,
    chunk=chat_chunk,
    chunk_choice=chat_text_choice,
    opening_chunks=chat_role_chunks,
)


# Responses -----------------------------------------------------------------------------------


def sse(body: dict[str, Any] | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


async def stream_events(
    frontend: Frontend,
    endpoint: Endpoint,
    body: Any,
    request_id: str,
    outputs: AsyncIterator,
    num_prompt_tokens: int,
) -> AsyncIterator[str]:
    """The SSE events of a streamed response. An engine that dies or a request that times
    out after the first delta ends the stream with an error event (its 200 has gone
    out)."""
    name = frontend.model_name
    num_output_tokens = 0
    logprobs = LogprobsFormatter(frontend.token_text, chat=endpoint.chat)
    for chunk in endpoint.opening_chunks(request_id, name, body.n):
        yield sse(chunk)
    try:
        async for delta in outputs:
            num_output_tokens += delta.num_new_tokens
            choice = endpoint.chunk_choice(
                delta.index, delta.text, delta.finish_reason, logprobs(delta.index, delta.logprobs)
            )
            yield sse(endpoint.chunk(request_id, name, [choice]))
    except EngineDeadError as error:
        yield sse(error_body(str(error), "service_unavailable", 503))
        return
    except RequestTimeoutError as error:
        yield sse(error_body(str(error), "timeout", 504))
        return
    if body.include_usage:
        counts = usage(num_prompt_tokens, num_output_tokens)
        yield sse(endpoint.chunk(request_id, name, [], counts))
    yield sse("[DONE]")


@dataclass
class WholeChoice:
    """One choice of a whole (not streamed) response, gathered from its deltas."""

    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None


async def collect(outputs: AsyncIterator, n: int) -> list[WholeChoice]:
    """The n choices of a non-streamed request."""
    choices = [WholeChoice() for _ in range(n)]
    async for delta in outputs:
        choice = choices[delta.index]
        choice.pieces.append(delta.text)
        choice.num_tokens += delta.num_new_tokens
        choice.finish_reason = delta.finish_reason
        if delta.logprobs is not None:
            choice.logprobs = choice.logprobs or []
            choice.logprobs.extend(delta.logprobs)
    return choices


def whole_body(
    frontend: Frontend,
    endpoint: Endpoint,
    request_id: str,
    whole: list[WholeChoice],
    num_prompt_tokens: int,
) -> dict[str, Any]:
    """The body of a whole response from its collected choices."""
    counts = usage(num_prompt_tokens, sum(choice.num_tokens for choice in whole))
    logprobs = LogprobsFormatter(frontend.token_text, endpoint.chat)
    choices = [
        endpoint.whole_choice(
            index, "".join(choice.pieces), choice.finish_reason, logprobs(index, choice.logprobs)
        )
        for index, choice in enumerate(whole)
    ]
    return endpoint.whole_body(request_id, frontend.model_name, choices, counts)
