"""`iterscope serve`: an OpenAI-compatible HTTP frontend in front of the engine-core process.

    client --HTTP--> this process (FastAPI + uvicorn) --lossless ZMQ lanes--> engine core
                                                       (EngineCoreClient spawns it)
    engine core --telemetry lane--> sidecar (started here unless --no-sidecar)

Endpoints: /metrics, /v1/completions and /v1/chat/completions (streaming SSE or not), /v1/models,
/health. Errors use OpenAI's body shape: 400 for bad parameters, prompts that can never fit
and messages the chat template refuses, 404 for an unknown model name, 503 once the engine is
dead. Output text comes from engine/entrypoints/detokenizer.py: decoded incrementally, and cut
at the first ``stop`` string, which also aborts the engine request.

Every generation runs under a disconnect watcher: when the HTTP client goes away, the engine
request is aborted at once, so its KV blocks are freed in the next iteration (the abort's
finish milestone shows it in the telemetry records). A valid W3C ``traceparent`` header is
handed to the engine request, so the sidecar's request span joins the caller's trace.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import logging
import os
import re
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError, TemplateSyntaxError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.config import MAX_BLOCK_SIZE, EngineConfig
from engine.core_client import (
    DEFAULT_STALL_AFTER_S,
    EngineBusyError,
    EngineCoreClient,
    EngineDeadError,
)
from engine.entrypoints import api_metrics, arg_types
from engine.entrypoints.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.entrypoints.fanout import choice_params, choice_request_id, interleave
from engine.entrypoints.http_guard import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    HttpLimits,
    RequestGuard,
    header_timeout_protocol,
)
from engine.entrypoints.openai_protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
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
from engine.request import FinishReason
from engine.scheduler import RequestRejectedError
from telemetry.lane.publisher import DEFAULT_QUEUE_CAPACITY, DEFAULT_SNDHWM
from telemetry.lane.record import MAX_ENGINE_INDEX
from telemetry.sidecar.sinks.prometheus import DEFAULT_METRICS_PORT

logger = logging.getLogger("iterscope.serve")

DEFAULT_MODEL = "smollm2"  # the embedded SmolLM2-135M GGUF
TINY_MODEL = "tiny-llama"  # a 2-layer random-weight model with a byte tokenizer (tests, smoke)
API_KEY_ENV = "ITERSCOPE_API_KEY"
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 128 << 10  # glibc's own starting value
TRACEPARENT = re.compile(r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")


# Model and tokenizer ------------------------------------------------------------------------


def load_tiny_model(name: str, dtype: str, device: str) -> Any:
    """EngineCoreClient's load_model for TINY_MODEL (module level, so it pickles for spawn)."""
    from engine.model.loader import build_tiny_model

    return build_tiny_model(dtype=dtype, device=device)


def load_tokenizer(model: str) -> Any:
    """The model's tokenizer alone, without its weights (the frontend never runs the model)."""
    from engine.model.paths import TINY_VOCAB_SIZE, resolve_model_path
    from engine.model.tokenizer import ByteTokenizer, build_gguf_tokenizer, load_hf_tokenizer

    if model == TINY_MODEL:
        return ByteTokenizer(TINY_VOCAB_SIZE)
    path = resolve_model_path(model)
    if path.is_file() and path.suffix == ".gguf":
        from engine.model.gguf_file import gguf_tokenizer_fields, open_gguf

        return build_gguf_tokenizer(gguf_tokenizer_fields(open_gguf(path)))
    return load_hf_tokenizer(path)


def start_engine(config: EngineConfig, cpu_threads: int | None = None) -> EngineCoreClient:
    """Spawn the engine-core process. ``cpu_threads`` sets OMP_NUM_THREADS, which the spawned
    process inherits and torch reads when it starts (None: torch's default, one per core)."""
    if cpu_threads is not None:
        if cpu_threads < 1:
            raise ValueError(f"--cpu-threads must be at least 1, got {cpu_threads}")
        os.environ["OMP_NUM_THREADS"] = str(cpu_threads)
    load_model = load_tiny_model if config.model == TINY_MODEL else None
    return EngineCoreClient(config, load_model=load_model)


def check_text(text: str, param: str) -> None:
    """JSON can carry a lone UTF-16 surrogate (\\ud800), which is no character: a client
    error, before a tokenizer fails on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequest(f"{param} is not valid Unicode: a lone surrogate at character "
                             f"{error.start}", param) from None


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


@dataclass
class WholeChoice:
    """One choice of a whole (not streamed) response, gathered from its deltas."""

    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None


# The frontend --------------------------------------------------------------------------------


class Frontend:
    """Request handling shared by both endpoints: prompt checks, generation, abort."""

    def __init__(self, client: EngineCoreClient, tokenizer: Any, model_name: str,
                 stall_after_s: float = DEFAULT_STALL_AFTER_S,
                 request_timeout_s: float | None = None) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.vocab_size = int(tokenizer.vocab_size)
        self.stall_after_s = stall_after_s
        self.request_timeout_s = request_timeout_s

    def check_model(self, requested: str | None) -> None:
        if requested not in (None, "", self.model_name):
            raise LookupError(f"the model {requested!r} does not exist; this server serves "
                              f"{self.model_name!r}")

    def prompt_ids(self, prompt: str | list[int]) -> list[int]:
        """Token ids of the prompt. Called off the event loop (tokenizing a large prompt
        takes seconds, and must cost only its own request that time)."""
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            return self.tokenizer.encode(prompt)
        bad = [token_id for token_id in prompt if not 0 <= token_id < self.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary "
                                 f"(0..{self.vocab_size - 1})", "prompt")
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
        self, http_request: Any, request_id: str, prompt_ids: list[int], params: Any, n: int,
        traceparent: str, stop_strings: list[str],
    ) -> AsyncIterator[TextDelta]:
        """The deltas of n choices, each an engine request of its own (entrypoints/fanout.py)."""
        if n == 1:
            return self.generate(http_request, request_id, prompt_ids, params, traceparent,
                                 stop_strings)
        return interleave([
            self.generate(http_request, choice_request_id(request_id, index), prompt_ids,
                          choice_params(params, index), traceparent, stop_strings, index)
            for index in range(n)])

    async def generate(
        self, http_request: Any, request_id: str, prompt_ids: list[int], params: Any,
        traceparent: str, stop_strings: list[str], index: int = 0,
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
                yield TextDelta(text, len(output.new_token_ids), finish_reason, index,
                                output.logprobs)
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
                    f"{timeout_s:g} s; it was aborted") from None

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
            raise EngineDeadError(f"the engine process is gone (exit code "
                                  f"{self.client.process.exitcode})")


def sse(body: dict[str, Any] | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


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


async def completion_events(frontend: Frontend, body: CompletionRequest, request_id: str,
                            outputs: AsyncIterator, num_prompt_tokens: int) -> AsyncIterator[str]:
    num_output_tokens = 0
    logprobs = LogprobsFormatter(frontend.token_text, chat=False)
    try:
        async for delta in outputs:
            num_output_tokens += delta.num_new_tokens
            choice = completion_choice(delta.index, delta.text, delta.finish_reason,
                                       logprobs(delta.index, delta.logprobs))
            yield sse(completion_body(request_id, frontend.model_name, [choice], None, True))
    except EngineDeadError as error:
        yield sse(error_body(str(error), "service_unavailable", 503))
        return
    except RequestTimeoutError as error:
        yield sse(error_body(str(error), "timeout", 504))
        return
    if body.include_usage:
        counts = usage(num_prompt_tokens, num_output_tokens)
        yield sse(completion_body(request_id, frontend.model_name, [], counts, True))
    yield sse("[DONE]")


async def chat_events(frontend: Frontend, body: ChatCompletionRequest, request_id: str,
                      outputs: AsyncIterator, num_prompt_tokens: int) -> AsyncIterator[str]:
    name = frontend.model_name
    num_output_tokens = 0
    logprobs = LogprobsFormatter(frontend.token_text, chat=True)
    for index in range(body.n):
        role = {"role": "assistant", "content": ""}
        yield sse(chat_chunk(request_id, name, [chat_chunk_choice(index, role, None)]))
    try:
        async for delta in outputs:
            num_output_tokens += delta.num_new_tokens
            choice = chat_chunk_choice(delta.index, {"content": delta.text}, delta.finish_reason,
                                       logprobs(delta.index, delta.logprobs))
            yield sse(chat_chunk(request_id, name, [choice]))
    except EngineDeadError as error:
        yield sse(error_body(str(error), "service_unavailable", 503))
        return
    except RequestTimeoutError as error:
        yield sse(error_body(str(error), "timeout", 504))
        return
    if body.include_usage:
        yield sse(chat_chunk(request_id, name, [], usage(num_prompt_tokens, num_output_tokens)))
    yield sse("[DONE]")


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


def build_app(frontend: Frontend, limits: HttpLimits | None = None,
              sidecar_metrics_url: api_metrics.SidecarUrl = None) -> FastAPI:
    """The FastAPI application; every error leaves as an OpenAI-style error body. GET /metrics
    serves the sidecar's series (read from ``sidecar_metrics_url``) and the HTTP series, which
    count the guard's refusals too (its middleware is the outer one)."""
    app = FastAPI(title="iterscope", docs_url=None, redoc_url=None)
    app.add_middleware(RequestGuard, limits=limits or HttpLimits())
    api_metrics.attach(app, sidecar_metrics_url)

    def error(status: int, message: str, error_type: str, param: str | None = None):
        return JSONResponse(error_body(message, error_type, status, param), status_code=status)

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
        problems = [f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}"
                    for e in exc.errors()]
        return error(400, "; ".join(problems), "invalid_request_error")

    async def run(http_request: Request, body: Any, prompt_ids: list[int], default_max: int,
                  events: Any, whole_body: Any, make_choice: Any):
        request_id = f"{'cmpl' if isinstance(body, CompletionRequest) else 'chatcmpl'}-" \
                     f"{uuid.uuid4().hex}"
        requested = (body.requested_max_tokens if isinstance(body, ChatCompletionRequest)
                     else body.max_tokens)
        try:
            max_tokens = frontend.max_tokens(requested, len(prompt_ids), default_max)
            params = body.sampling_params(max_tokens)
            outputs = frontend.generate_choices(http_request, request_id, prompt_ids, params,
                                                body.n, traceparent_of(http_request),
                                                body.stop_strings)
            if body.stream:
                outputs = await first_and_rest(outputs)
                stream = events(frontend, body, request_id, outputs, len(prompt_ids))
                return StreamingResponse(stream, media_type="text/event-stream")
            whole = await collect(outputs, body.n)
        except (InvalidRequest, RequestRejectedError, ValueError) as exc:
            return error(400, str(exc), "invalid_request_error", getattr(exc, "param", None))
        except EngineDeadError as exc:
            return error(503, f"the engine is not running: {exc}", "service_unavailable")
        except EngineBusyError as exc:
            return error(503, str(exc), "service_unavailable")
        except RequestTimeoutError as exc:
            return error(504, str(exc), "timeout")
        counts = usage(len(prompt_ids), sum(choice.num_tokens for choice in whole))
        logprobs = LogprobsFormatter(frontend.token_text, isinstance(body, ChatCompletionRequest))
        choices = [make_choice(index, "".join(choice.pieces), choice.finish_reason,
                               logprobs(index, choice.logprobs))
                   for index, choice in enumerate(whole)]
        return JSONResponse(whole_body(request_id, frontend.model_name, choices, counts))

    def checked(body: Any) -> JSONResponse | None:
        try:
            frontend.check_model(body.model)
            body.check_supported()
        except LookupError as exc:
            return error(404, str(exc), "not_found_error", "model")
        except InvalidRequest as exc:
            return error(400, str(exc), "invalid_request_error", exc.param)
        return None

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http_request: Request):
        if (refusal := checked(body)) is not None:
            return refusal
        try:
            prompt_ids = await asyncio.to_thread(frontend.prompt_ids, body.single_prompt())
        except InvalidRequest as exc:
            return error(400, str(exc), "invalid_request_error", exc.param)
        return await run(http_request, body, prompt_ids, DEFAULT_COMPLETION_MAX_TOKENS,
                         completion_events, completion_body, completion_choice)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http_request: Request):
        if (refusal := checked(body)) is not None:
            return refusal
        try:
            prompt_ids = await asyncio.to_thread(frontend.chat_prompt_ids,
                                                 body.template_messages())
        except InvalidRequest as exc:
            return error(400, str(exc), "invalid_request_error", exc.param)
        except TemplateSyntaxError as exc:
            return error(500, f"the model's chat template does not compile: {exc}",
                         "server_error")
        default_max = frontend.client.ready.max_model_len
        return await run(http_request, body, prompt_ids, default_max, chat_events, chat_body,
                         chat_choice)

    @app.get("/v1/models")
    async def models():
        ready = frontend.client.ready
        card = {"id": frontend.model_name, "object": "model", "created": int(time.time()),
                "owned_by": "iterscope", "max_model_len": ready.max_model_len,
                "vocab_size": frontend.vocab_size}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        """200 while the engine works or idles; 503 once it is dead, or stalled: requests in
        flight and nothing heard from it for --engine-stall-timeout."""
        client = frontend.client
        state = client.engine_state(frontend.stall_after_s)
        body = {"status": "ok" if state in ("idle", "running") else state,
                "engine": state, "engine_pid": client.ready.pid,
                "num_requests_in_flight": client.num_in_flight}
        if state == "dead":
            body["error"] = "the engine is not running"
        elif state == "stalled":
            body["error"] = (f"the engine has produced nothing for "
                             f"{time.monotonic() - client.last_message_s:.0f} s with "
                             f"{client.num_in_flight} requests in flight")
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    return app


# Command line --------------------------------------------------------------------------------


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine-core options shared by `serve` and `bench --in-process`; each help names its
    default and each type's error names the form it expects (engine/entrypoints/arg_types.py)."""
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=DEFAULT_MODEL,
                       help=f"HF directory, .gguf file, smollm2 or {TINY_MODEL} (default "
                       f"{DEFAULT_MODEL}); `serve` also takes it as its first argument")
    group.add_argument("--dtype", default="auto", type=arg_types.dtype,
                       help="auto, float32, bfloat16 or float16 (default auto: bfloat16 where "
                       "the CPU or GPU computes it natively, else float32 on CPU and float16 "
                       "on older GPUs; start-up says which)")
    group.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                       help="where the model runs (default %(default)s)")
    group.add_argument("--max-model-len", type=arg_types.int_in_range(1), default=None,
                       metavar="N", help="longest prompt + output in tokens (default: the "
                       "model's own limit)")
    group.add_argument("--max-num-seqs", type=arg_types.int_in_range(1), default=32,
                       metavar="N", help="most requests running at once (default %(default)s)")
    group.add_argument("--max-num-batched-tokens", type=arg_types.int_in_range(1),
                       default=2048, metavar="N",
                       help="most tokens in one iteration (default %(default)s)")
    group.add_argument("--block-size", type=arg_types.power_of_two(MAX_BLOCK_SIZE), default=16,
                       metavar="N", help="tokens per KV cache block (default %(default)s)")
    group.add_argument("--kv-cache-memory", type=arg_types.memory_size, default=None,
                       metavar="SIZE", help="KV cache budget, e.g. 512MiB or 4GiB (default: "
                       "512MiB on CPU, --gpu-memory-utilization of the card on CUDA)")
    group.add_argument("--gpu-memory-utilization", type=arg_types.fraction, default=0.9,
                       metavar="FRACTION", help="share of the GPU's memory for weights, "
                       "activations and KV cache on CUDA (default %(default)s)")
    group.add_argument("--no-prefix-caching", action="store_true",
                       help="turn the prefix cache off (default on)")
    group.add_argument("--engine-index", type=arg_types.int_in_range(0, MAX_ENGINE_INDEX),
                       default=0, metavar="N", help="this engine's index in its telemetry "
                       "(the `engine` label; default %(default)s)")
    group.add_argument("--telemetry-curve-keys-dir", default=None, metavar="DIR",
                       help="CURVE keys for a tcp telemetry lane to a sidecar on another host "
                       "(python -m telemetry.lane.curve; docs/deploy.md; default none: ipc lane)")
    group.add_argument("--telemetry-curve-engine-name", default="engine", metavar="NAME",
                       help="which engine key pair in that directory (default %(default)s)")
    group.add_argument("--telemetry-sndhwm", type=arg_types.int_in_range(1),
                       default=DEFAULT_SNDHWM, metavar="N",
                       help="telemetry frames ZMQ may hold for a slow sidecar before dropping "
                       "(default %(default)s)")
    group.add_argument("--telemetry-queue-capacity", type=arg_types.int_in_range(1),
                       default=DEFAULT_QUEUE_CAPACITY, metavar="N",
                       help="records the engine queues for its telemetry sender thread before "
                       "dropping (default %(default)s)")
    group.add_argument("--nvtx-markers", action="store_true",
                       help="one NVTX range per iteration in the engine process, to pair with "
                       "the sidecar's --nvtx ranges in Nsight Systems (docs/profiling.md; "
                       "default off)")
    group.add_argument("--cpu-threads", type=arg_types.int_in_range(1), default=None,
                       metavar="N", help="torch threads of the engine process on CPU "
                       "(default: one per core; 1 is faster when the frontend, sidecar and a "
                       "load generator share a small machine)")


def engine_config(args: argparse.Namespace, telemetry_address: str | None) -> EngineConfig:
    return EngineConfig(
        model=args.model, served_model_name=getattr(args, "served_model_name", None),
        dtype=args.dtype, device=args.device, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enable_prefix_caching=not args.no_prefix_caching, engine_index=args.engine_index,
        telemetry_address=telemetry_address,
        telemetry_curve_keys_dir=args.telemetry_curve_keys_dir,
        telemetry_curve_engine_name=args.telemetry_curve_engine_name,
        nvtx_markers=args.nvtx_markers,
        telemetry_sndhwm=args.telemetry_sndhwm,
        telemetry_queue_capacity=args.telemetry_queue_capacity,
    )


def build_parser() -> argparse.ArgumentParser:
    from telemetry.sidecar import process as sidecar_process

    parser = argparse.ArgumentParser(prog="iterscope serve", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default %(default)s)")
    parser.add_argument("--port", type=arg_types.port, default=8000,
                        help="listen port, 0 picks a free one (default %(default)s)")
    parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL",
                        help="the model, as with --model (as `vllm serve MODEL`)")
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="the model name clients use, and the model_name label of every "
                        "telemetry series (default: the model)")
    parser.add_argument("--access-log", action="store_true",
                        help="log every HTTP request (default off)")
    parser.add_argument("--max-request-body", type=arg_types.memory_size, default="4MiB",
                        metavar="SIZE", help="larger request bodies get 413 unread "
                        "(default %(default)s)")
    parser.add_argument("--request-body-timeout", type=arg_types.positive_float,
                        default=DEFAULT_BODY_TIMEOUT_S, metavar="SECONDS",
                        help="a request body must arrive within this long, else 408 "
                        "(default %(default)s)")
    parser.add_argument("--request-header-timeout", type=arg_types.positive_float,
                        default=DEFAULT_HEADER_TIMEOUT_S, metavar="SECONDS",
                        help="a connection whose request headers take longer is closed "
                        "(default %(default)s)")
    parser.add_argument("--request-timeout", type=arg_types.positive_float, default=None,
                        metavar="SECONDS", help="a request still generating after this long "
                        "is aborted and answered 504 (default: no limit)")
    parser.add_argument("--engine-stall-timeout", type=arg_types.positive_float,
                        default=DEFAULT_STALL_AFTER_S, metavar="SECONDS",
                        help="/health says stalled (503) when requests are in flight and the "
                        "engine has sent nothing for this long (default %(default)s)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV), metavar="KEY",
                        help="/v1/ requests need 'Authorization: Bearer KEY' (default: "
                        f"${API_KEY_ENV} if set, else no key; prefer the variable, since "
                        "command lines are visible to other users)")
    add_engine_arguments(parser)
    sidecar_process.add_arguments(parser)
    api_metrics.add_arguments(parser)
    group = parser.add_argument_group("sidecar shortcuts (passed to the sidecar started here)")
    group.add_argument("--metrics-port", type=arg_types.port, default=None, metavar="PORT",
                       help="the sidecar's /metrics port, 0 picks a free one (default "
                       f"{DEFAULT_METRICS_PORT})")
    group.add_argument("--record", default=None, metavar="PATH",
                       help="the sidecar records every telemetry message to this JSONL file "
                       "(default: no recording)")
    group.add_argument("--vllm-compatible-names", action="store_true",
                       help="the sidecar's /metrics also has vLLM's series names "
                       "(vllm:num_requests_running, ...) for vLLM's dashboards (default off)")
    return parser


def resolve_model_argument(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`serve MODEL` and `serve --model MODEL` are the same; both at once must agree."""
    positional = args.model_positional
    if positional is None:
        return
    if args.model not in (DEFAULT_MODEL, positional):
        parser.error(f"the model is given twice: {positional!r} and --model {args.model!r}")
    args.model = positional


def sidecar_arguments(args: argparse.Namespace) -> list[str]:
    extra = list(args.sidecar_arg)
    if args.metrics_port is not None:
        extra.append(f"--metrics-port={args.metrics_port}")
    if args.record is not None:
        extra.append(f"--record={args.record}")
    if args.vllm_compatible_names:
        extra.append("--vllm-compatible-names")
    return extra


def listening_socket(host: str, port: int) -> socket.socket:
    """Bound and listening before uvicorn starts, so port 0 can be reported and connections
    made before uvicorn accepts simply wait in the backlog."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def keep_large_blocks_mapped() -> bool:
    """Make glibc give every block of MMAP_THRESHOLD_BYTES or more its own mapping, returned
    to the system when freed; True if this C library took the setting.

    glibc raises its mmap threshold to the size of the largest mapped block freed (up to
    32 MiB). After one multi-megabyte prompt (its body, its text, its token-id list), later
    ones are carved from the heaps of the threads that tokenize them, and those pages are
    kept: the frontend stayed ~50 MiB above its resting size for good. A fixed threshold
    turns that adjustment off. Only this process: the engine is spawned afresh."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no C library symbol of that name: not glibc
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from telemetry.sidecar import process as sidecar_process

    parser = build_parser()
    args = parser.parse_args(argv)
    resolve_model_argument(parser, args)
    args.sidecar_arg = sidecar_arguments(args)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(name)s] "
                        "%(message)s", datefmt="%m-%d %H:%M:%S")
    # uvicorn re-raises SIGTERM once it has shut down: make that unwind through `finally`.
    signal.signal(signal.SIGTERM, _interrupt)
    keep_large_blocks_mapped()
    sidecar = client = None
    try:
        sidecar = sidecar_process.start_from_args(args)
        sidecar_metrics_url = api_metrics.sidecar_metrics_url(args, sidecar)
        config = engine_config(args, sidecar_process.telemetry_address(args, sidecar))
        tokenizer = load_tokenizer(args.model)
        client = start_engine(config, args.cpu_threads)
        frontend = Frontend(client, tokenizer, args.served_model_name or args.model,
                            args.engine_stall_timeout, args.request_timeout)
        sock = listening_socket(args.host, args.port)
        limits = HttpLimits(args.max_request_body, args.request_body_timeout, args.api_key)
        uv_config = uvicorn.Config(build_app(frontend, limits, sidecar_metrics_url),
                                   log_level="warning",
                                   http=header_timeout_protocol(args.request_header_timeout),
                                   access_log=args.access_log, lifespan="off")
        print(f"iterscope serve: {frontend.model_name} on http://{args.host}:"
              f"{sock.getsockname()[1]}/v1", flush=True)
        uvicorn.Server(uv_config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"iterscope serve: {exc}", file=sys.stderr)
        return 1
    finally:
        if client is not None:
            client.shutdown()
        if sidecar is not None:
            sidecar.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
