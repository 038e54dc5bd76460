"""The Frontend: what both generation endpoints do with the engine, below HTTP.

It checks and tokenizes prompts, submits one engine request per choice (fan-out in
engine/entrypoints/fanout.py), and turns the engine's outputs into TextDeltas: decoded
incrementally and cut at the first ``stop`` string (engine/entrypoints/detokenizer.py).
Every generation runs under a disconnect watcher: when the HTTP client goes away, the engine
request is aborted at once, so its KV blocks are freed in the next iteration; so it is when
a stop string ends it, when the caller stops early, or when --request-timeout passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError

from engine.core_client import (
    DEFAULT_STALL_AFTER_S,
    EngineCoreClient,
    EngineDeadError,
    exit_text,
)
from engine.entrypoints.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.entrypoints.fanout import choice_params, choice_request_id, interleave
from engine.entrypoints.openai_protocol import InvalidRequest
from engine.logprobs import TokenLogprobs
from engine.request import FinishReason

logger = logging.getLogger("iterscope.serve")


def check_text(text: str, param: str) -> None:
    """JSON can carry a lone UTF-16 surrogate (\\ud800), which is no character: a client
    error, before a tokenizer fails on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequest(
            f"{param} is not valid Unicode: a lone surrogate at character {error.start}", param
        ) from None


class RequestTimeoutError(RuntimeError):
    """A request ran past --request-timeout (answered with HTTP 504)."""


@dataclass
class TextDelta:
    """What the frontend sends for one engine output: the new text (after detokenization and
    stop strings), the tokens it came from, the finish reason once finished, the choice it
    belongs to, and the tokens' logprobs if the request asked for them."""

    text: str
    num_new_tokens: int
    finish_reason: str | None
    index: int = 0
    logprobs: list[TokenLogprobs] | None = None


class Frontend:
    """Request handling shared by both endpoints: prompt checks, generation, abort."""

    def __init__(
        self,
        client: EngineCoreClient,
        tokenizer: Any,
        model_name: str,
        stall_after_s: float = DEFAULT_STALL_AFTER_S,
        request_timeout_s: float | None = None,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = int(tokenizer.vocab_size)
        self.stall_after_s = stall_after_s
        self.request_timeout_s = request_timeout_s

    def check_model(self, requested: str | None) -> None:
        if requested not in (None, "", self.model_name):
            raise LookupError(
                f"the model {requested!r} does not exist; this server serves {self.model_name!r}"
            )

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """Token ids of the prompt. Called off the event loop (tokenizing a large prompt
        takes seconds, and must cost only its own request that time)."""
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            return self.tokenizer.encode(prompt)
        bad = [token_id for token_id in prompt if not 0 <= token_id < self.vocab_size]
        if bad:
            raise InvalidRequest(
                f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", "prompt"
            )
        return list(prompt)

    def chat_prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt the model's chat template makes of the messages. A template that refuses
        them (its raise_exception, or a Jinja or type error on a role or shape it does not
        expect) is a client error: InvalidRequest with the template's message. A template that
        does not compile (TemplateSyntaxError) is the server's and passes through. Called
        off the event loop, as prompt_ids is."""
        for message in messages:
            check_text(message["content"], "messages")
        try:
            return self.tokenizer.apply_chat_template(messages)
        except TemplateSyntaxError:
            raise
        except ValueError as exc:  # raise_exception(), or a model without a chat template
            raise InvalidRequest(str(exc), "messages") from exc
        except (TemplateError, TypeError) as exc:
            raise InvalidRequest(f"chat template error: {exc}", "messages") from exc

    def max_tokens(self, requested: int | None, num_prompt_tokens: int, default: int) -> int:
        """The requested max_tokens, else `default` capped by what is left of max_model_len."""
        if requested is not None:
            return requested
        return max(1, min(default, self.client.ready.max_model_len - num_prompt_tokens))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def generate_choices(
        self,
        http_request: Any,
        request_id: str,
        prompt_ids: list[int],
        params: Any,
        n: int,
        traceparent: str,
        stop_strings: list[str],
    ) -> AsyncIterator[TextDelta]:
        """The deltas of n choices, each an engine request of its own (entrypoints/fanout.py)."""
        if n == 1:
            return self.generate(
                http_request, request_id, prompt_ids, params, traceparent, stop_strings
            )
        return interleave(
            [
                self.generate(
                    http_request,
                    choice_request_id(request_id, index),
                    prompt_ids,
                    choice_params(params, index),
                    traceparent,
                    stop_strings,
                    index,
                )
                for index in range(n)
            ]
        )

    async def generate(
        self,
        http_request: Any,
        request_id: str,
        prompt_ids: list[int],
        params: Any,
        traceparent: str,
        stop_strings: list[str],
        index: int = 0,
    ) -> AsyncIterator[TextDelta]:
        """A TextDelta per engine output. A stop string in the text ends the request there
        (finish reason "stop"); it is aborted in the engine, as it is when the HTTP client
        disconnects or the caller stops iterating early. As in vLLM, a stop string must end
        in the text of an output token after the first min_tokens."""
        self._raise_if_engine_died()
        stream = self.client.add_request(prompt_ids, params, request_id, traceparent)
        watcher = asyncio.ensure_future(self._abort_on_disconnect(http_request, stream))
        detokenizer = IncrementalDetokenizer(self.tokenizer)
        stops = StopStringMatcher(stop_strings)
        abort_reason = FinishReason.ABORT  # the telemetry's finish reason if we stop early
        num_tokens = 0
        try:
            async for output in self._within_timeout(stream):
                num_tokens += len(output.new_token_ids)
                token_ids = output.new_token_ids
                if output.finish_reason == "stop" and token_ids:
                    token_ids = token_ids[:-1]  # as in vLLM, EOS or a stop id is not in the text
                text = detokenizer.add(token_ids, output.finished)
                text = stops.add(text, output.finished, num_tokens > params.min_tokens)
                finish_reason = "stop" if stops.stopped else output.finish_reason
                if stops.stopped:
                    abort_reason = FinishReason.STOP
                yield TextDelta(
                    text, len(output.new_token_ids), finish_reason, index, output.logprobs
                )
                if stops.stopped:
                    return
        finally:
            watcher.cancel()
            if not stream.finished:
                self._abort(request_id, abort_reason)

    def _within_timeout(self, stream: Any) -> AsyncIterator[Any]:
        """The stream's outputs; RequestTimeoutError once --request-timeout has passed since
        the first was asked for (generate's cleanup then aborts the engine request). Without
        a timeout the stream itself: no generator layer to step through for every output."""
        if self.request_timeout_s is None:
            return stream
        return self._until_deadline(stream, self.request_timeout_s)

    @staticmethod
    async def _until_deadline(stream: Any, timeout_s: float) -> AsyncIterator[Any]:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not stream.finished:
            remaining_s = deadline - asyncio.get_running_loop().time()
            try:
                yield await asyncio.wait_for(stream.aget(), max(remaining_s, 0))
            except TimeoutError:
                raise RequestTimeoutError(
                    f"the request did not finish within --request-timeout "
                    f"{timeout_s:g} s; it was aborted"
                ) from None

    async def _abort_on_disconnect(self, http_request: Any, stream: Any) -> None:
        while (await http_request.receive())["type"] != "http.disconnect":
            pass
        if not stream.finished:
            logger.info("client went away: aborting %s", stream.request_id)
            self._abort(stream.request_id)

    def _abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> None:
        with contextlib.suppress(EngineDeadError):
            self._raise_if_engine_died()
            self.client.abort(request_id, reason)

    def _raise_if_engine_died(self) -> None:
        """The client notices a dead engine within ~0.1 s, and a send to a dead engine blocks
        (and with it this event loop): look at the process itself first."""
        if not self.client.is_alive:
            raise EngineDeadError(
                f"the engine process is gone ({exit_text(self.client.process.exitcode)})"
            )
