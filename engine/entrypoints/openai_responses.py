"""OpenAI-compatible response bodies for /v1/completions and /v1/chat/completions.

Responses are plain dicts in the shapes the official `openai` client parses; streaming sends
the same objects as ``chat.completion.chunk`` / ``text_completion`` chunks, one SSE ``data:``
line each, then ``data: [DONE]``. error_body is OpenAI's error shape, answered by the routes
and the HTTP guard alike. The request bodies: engine/entrypoints/openai_protocol.py.
"""

from __future__ import annotations

import time
from typing import Any


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


def completion_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_body(
    request_id: str,
    model: str,
    choices: list[dict[str, Any]],
    usage_counts: dict[str, int] | None,
    chunk: bool = False,
) -> dict[str, Any]:
    """A text_completion object: a whole response, or one streamed chunk (no choices makes
    the usage-only last chunk)."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage_counts is not None or not chunk:
        body["usage"] = usage_counts
    return body


def chat_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict | None = None
) -> dict[str, Any]:
    """A choice of a whole chat.completion response."""
    message = {"role": "assistant", "content": text}
    return {
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_body(
    request_id: str,
    model: str,
    choices: list[dict[str, Any]],
    usage_counts: dict[str, int] | None,
) -> dict[str, Any]:
    """A whole chat.completion response."""
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "usage": usage_counts,
        "choices": choices,
    }


def chat_chunk_choice(
    index: int, delta: dict[str, str], finish_reason: str | None, logprobs: dict | None = None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk(
    request_id: str,
    model: str,
    choices: list[dict[str, Any]],
    usage_counts: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One chat.completion.chunk; no choices makes the usage-only last chunk."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage_counts is not None:
        body["usage"] = usage_counts
    return body


def error_body(message: str, error_type: str, code: int, param: str | None = None) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
