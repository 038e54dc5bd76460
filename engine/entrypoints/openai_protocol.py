"""OpenAI-compatible request bodies for /v1/completions and /v1/chat/completions.

Requests are pydantic models (FastAPI validates them); fields we cannot honour, known or
not, are rejected with a clear message instead of being silently ignored. Besides OpenAI's
fields, the sampling extensions of vLLM's server, with its bounds: ``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos`` and ``stop_token_ids``. ``stop``
strings (one, or a list of up to 4, none empty) are applied by the frontend to the
detokenized text. ``n`` > 1 asks for that many choices (not with greedy sampling, as in
vLLM). The response bodies: engine/entrypoints/openai_responses.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from engine.entrypoints.detokenizer import check_stop_strings
from engine.logprobs import MAX_LOGPROBS
from engine.request import SAMPLING_EPS, SamplingParams

DEFAULT_COMPLETION_MAX_TOKENS = 16  # what OpenAI's /v1/completions uses when max_tokens is unset
INT64_MAX = 2**63 - 1
MAX_N = 16384  # the most choices one request may ask for (vLLM's VLLM_MAX_N_SEQUENCES default)
# Fields of the OpenAI API we do not model but that change nothing about the output.
HARMLESS_EXTRA_FIELDS = frozenset({"metadata", "store", "service_tier", "parallel_tool_calls"})


class InvalidRequest(ValueError):
    """A request the server understands but will not serve (answered with HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share."""

    # Unknown fields are refused in check_supported. strict: a value of another JSON type is
    # a 400 naming the field, never coerced (max_tokens: true is not 1, "5" is not 5).
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1, le=INT64_MAX)  # 0 or -1: off
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-INT64_MAX - 1, le=INT64_MAX)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, allow_inf_nan=False)
    user: str | None = None

    @field_validator(
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "n",
        "stream",
        "stop_token_ids",
        "ignore_eos",
        "min_tokens",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        mode="before",
    )
    @classmethod
    def _null_means_default(cls, value: Any, info: ValidationInfo) -> Any:
        """The OpenAI API lets clients send null for an optional field: its default."""
        if value is None:
            return cls.model_fields[info.field_name].get_default(call_default_factory=True)
        return value

    def check_supported(self) -> None:
        """Reject what the engine does not implement, naming the parameter."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise InvalidRequest(
                "stream_options.continuous_usage_stats is not supported", "stream_options"
            )
        if self.n > 1 and self.temperature < SAMPLING_EPS:
            raise InvalidRequest(f"n must be 1 when using greedy sampling, got {self.n}", "n")
        try:
            check_stop_strings(self.stop)
        except ValueError as exc:
            raise InvalidRequest(str(exc), "stop") from None
        for name, value in (self.model_extra or {}).items():
            if name in HARMLESS_EXTRA_FIELDS or value in (None, False, 0, "", [], {}):
                continue
            if name == "response_format" and value == {"type": "text"}:
                continue
            raise InvalidRequest(f"{name} is not supported", name)

    @property
    def num_logprobs(self) -> int | None:
        """How many alternatives to report per token; None: no logprobs."""
        return None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        if self.min_tokens > max_tokens:
            raise InvalidRequest(
                f"min_tokens ({self.min_tokens}) must not exceed the maximum "
                f"number of tokens ({max_tokens})",
                "min_tokens",
            )
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_k=max(self.top_k, 0),
            top_p=self.top_p,
            min_p=self.min_p,
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            logprobs=self.num_logprobs,
        )

    @property
    def stop_strings(self) -> list[str]:
        """The validated ``stop`` field as a list (check_supported has run)."""
        return check_stop_strings(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


def check_num_logprobs(value: int, param: str) -> None:
    if not 0 <= value <= MAX_LOGPROBS:
        raise InvalidRequest(f"{param} must be in [0, {MAX_LOGPROBS}], got {value}", param)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None  # the sampled token and this many most likely ones

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise InvalidRequest("echo is not supported", "echo")
        if self.logprobs is not None:
            check_num_logprobs(self.logprobs, "logprobs")

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

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
    model_config = ConfigDict(extra="allow", strict=True)  # refused in text() unless empty

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
                raise InvalidRequest(
                    f"content part type {part.get('type')!r} is not supported (text only)",
                    "messages",
                )
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int = 0  # with logprobs: this many most likely tokens per token

    @field_validator("logprobs", "top_logprobs", mode="before")
    @classmethod
    def _null_is_off(cls, value: Any, info: ValidationInfo) -> Any:
        return cls.model_fields[info.field_name].get_default() if value is None else value

    def check_supported(self) -> None:
        super().check_supported()
        check_num_logprobs(self.top_logprobs, "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs set to true", "top_logprobs")

    @property
    def num_logprobs(self) -> int | None:
        return self.top_logprobs if self.logprobs else None

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": message.role, "content": message.text()} for message in self.messages]

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, OpenAI's current name, else the older max_tokens."""
        return self.max_completion_tokens or self.max_tokens
