"""OpenAI-compatible request and response bodies for /v1/completions and /v1/chat/completions.

Requests are pydantic models (FastAPI validates them); fields we cannot honour, known or
not, are rejected with a clear message instead of being silently ignored. Extensions in the
manner of vLLM: ``top_k``, ``ignore_eos`` and ``stop_token_ids``. ``stop`` strings (one, or a
list of up to 4, none empty) are applied by the frontend to the detokenized text. Responses
are plain dicts in the shapes the official `openai` client parses; streaming sends the same
objects as ``chat.completion.chunk`` / ``text_completion`` chunks, one SSE ``data:`` line
each, then ``data: [DONE]``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from engine.detokenizer import check_stop_strings
from engine.request import SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # what OpenAI's /v1/completions uses when max_tokens is unset
INT64_MAX = 2**63 - 1
# Fields of the OpenAI API we do not model but that change nothing about the output.
HARMLESS_EXTRA_FIELDS = frozenset({"metadata", "store", "service_tier", "parallel_tool_calls"})


class InvalidRequest(ValueError):
    """A request the server understands but will not serve (answered with HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow")  # unknown fields are refused in check_supported

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=INT64_MAX)  # 0 or -1: off
    seed: int | None = Field(default=None, ge=-INT64_MAX - 1, le=INT64_MAX)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] = Field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    user: str | None = None

    @field_validator("temperature", "top_p", "top_k", "n", "stream", "stop_token_ids",
                     "ignore_eos", "presence_penalty", "frequency_penalty", mode="before")
    @classmethod
    def _null_means_default(cls, value: Any, info: ValidationInfo) -> Any:
        """The OpenAI API lets clients send null for an optional field: its default."""
        if value is None:
            return cls.model_fields[info.field_name].get_default(call_default_factory=True)
        return value

    def check_supported(self) -> None:
        """Reject what the engine does not implement, naming the parameter."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true",
                                 "stream_options")
        if self.n != 1:
            raise InvalidRequest("only n=1 is supported", "n")
        try:
            check_stop_strings(self.stop)
        except ValueError as exc:
            raise InvalidRequest(str(exc), "stop") from None
        if self.presence_penalty or self.frequency_penalty:
            raise InvalidRequest("presence and frequency penalties are not supported",
                                 "presence_penalty" if self.presence_penalty
                                 else "frequency_penalty")
        if self.logprobs not in (None, False, 0):
            raise InvalidRequest("logprobs are not supported", "logprobs")
        for name, value in (self.model_extra or {}).items():
            if name in HARMLESS_EXTRA_FIELDS or value in (None, False, 0, "", [], {}):
                continue
            if name == "response_format" and value == {"type": "text"}:
                continue
            raise InvalidRequest(f"{name} is not supported", name)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=max(self.top_k, 0),
            top_p=self.top_p,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
        )

    @property
    def stop_strings(self) -> list[str]:
        """The validated ``stop`` field as a list (check_supported has run)."""
        return check_stop_strings(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise InvalidRequest("echo is not supported", "echo")

    def single_prompt(self) -> str | list[int]:
        """The prompt as text or token ids; a batch of several prompts is refused."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequest("send one prompt per request (no prompt batches)", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise InvalidRequest("the prompt is empty", "prompt")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # refused in text() unless empty

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None  # a participant's name: the templates we serve do not use it

    def text(self) -> str:
        """The content as one string; list content may hold text parts only. Other fields
        (tool_calls, tool_call_id, ...) would be lost on the way to the template: refused."""
        for name, value in (self.model_extra or {}).items():
            if value not in (None, "", [], {}):
                raise InvalidRequest(f"messages: {name} is not supported", "messages")
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise InvalidRequest(f"content part type {part.get('type')!r} is not supported "
                                     "(text only)", "messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": message.role, "content": message.text()} for message in self.messages]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# Responses -----------------------------------------------------------------------------------


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
    }


def completion_body(
    request_id: str, model: str, text: str | None, finish_reason: str | None,
    usage_counts: dict[str, int] | None, chunk: bool = False,
) -> dict[str, Any]:
    """A text_completion object: a whole response, or one streamed chunk (text None makes the
    usage-only last chunk)."""
    choices = [] if text is None else [
        {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    ]
    body: dict[str, Any] = {
        "id": request_id, "object": "text_completion", "created": int(time.time()),
        "model": model, "choices": choices,
    }
    if usage_counts is not None or not chunk:
        body["usage"] = usage_counts
    return body


def chat_body(
    request_id: str, model: str, text: str, finish_reason: str | None,
    usage_counts: dict[str, int] | None,
) -> dict[str, Any]:
    """A whole chat.completion response."""
    message = {"role": "assistant", "content": text}
    return {
        "id": request_id, "object": "chat.completion", "created": int(time.time()),
        "model": model, "usage": usage_counts,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": finish_reason}],
    }


def chat_chunk(
    request_id: str, model: str, delta: dict[str, str] | None, finish_reason: str | None,
    usage_counts: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One chat.completion.chunk; delta None makes the usage-only last chunk."""
    choices = [] if delta is None else [
        {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    ]
    body: dict[str, Any] = {
        "id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
        "model": model, "choices": choices,
    }
    if usage_counts is not None:
        body["usage"] = usage_counts
    return body


def error_body(message: str, error_type: str, code: int, param: str | None = None) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
