"""Where `iterscope bench` sends its requests, and what it measures of each.

A backend's ``send`` turns one BenchRequest into a RequestResult: TTFT (send -> first token),
the gaps between consecutive streamed tokens (ITL) and e2e (send -> last token), with the
token counts. HttpBackend streams /v1/completions of an OpenAI-compatible server (counts from
its usage report); InProcessBackend talks to the engine-core process directly.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from engine.request import SamplingParams


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds of time.perf_counter()."""

    success: bool = False
    error: str = ""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ttft_time: float = 0.0
    itl_times: list[float] = field(default_factory=list)
    e2e_time: float = 0.0


MODELS_TIMEOUT_S = 30.0  # for /v1/models only: a request's own time is what is measured


def first_model(response: Any) -> dict[str, Any] | None:
    """The first model card of an OpenAI /v1/models answer; None if it is not one."""
    if response.status_code != 200:
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    models = body.get("data") if isinstance(body, dict) else None
    if not (isinstance(models, list) and models and isinstance(models[0], dict)):
        return None
    return models[0] if "id" in models[0] else None


def describe(response: Any, limit: int = 80) -> str:
    """An answer in one line: status, content type and the start of the body."""
    kind = response.headers.get("content-type", "no content-type")
    return f"HTTP {response.status_code} ({kind}): {response.text[:limit]!r}"


async def read_stream(response: Any, result: RequestResult, clock: TokenClock) -> str:
    """Read a streamed completion into ``result``; the error in one line, or "" if none."""
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = _event(line)
        if chunk is None:
            return f"expected server-sent events of JSON objects, got {line[:80]!r}"
        if "error" in chunk:
            error = chunk["error"]
            return str(error.get("message", error) if isinstance(error, dict) else error)
        if chunk.get("choices"):
            clock.note_token(result)
        if chunk.get("usage"):
            result.num_prompt_tokens = chunk["usage"]["prompt_tokens"]
            result.num_output_tokens = chunk["usage"]["completion_tokens"]
    return ""


def _event(line: str) -> dict[str, Any] | None:
    try:
        chunk = json.loads(line[len("data: ") :])
    except ValueError:
        return None
    return chunk if isinstance(chunk, dict) else None


class HttpBackend:
    """Streams /v1/completions of an OpenAI-compatible server (token-id prompts)."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None) -> None:
        """``api_key``: sent as ``Authorization: Bearer KEY`` (a server started with one)."""
        import httpx

        self.base_url = base_url.rstrip("/")
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.http = httpx.AsyncClient(
            timeout=None, limits=httpx.Limits(max_connections=None), headers=headers
        )

    async def model_card(self) -> dict[str, Any]:
        """The first model /v1/models lists; a RuntimeError in one line, naming the URL, when
        the server cannot be reached or does not answer like an OpenAI server."""
        import httpx

        url = f"{self.base_url}/v1/models"
        try:
            response = await self.http.get(url, timeout=MODELS_TIMEOUT_S)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"cannot read {url}: {type(exc).__name__}: {exc}") from None
        if response.status_code == 401:
            raise RuntimeError(f"{url} answered 401: the server wants an API key; give --api-key")
        card = first_model(response)
        if card is None:
            raise RuntimeError(
                f"{url} does not answer like an OpenAI server: expected HTTP 200 with JSON "
                f'{{"data": [{{"id": ...}}]}}, got {describe(response)}'
            )
        return card

    async def send(self, request: BenchRequest) -> RequestResult:
        payload = {
            "model": self.model,
            "prompt": request.prompt_token_ids,
            "max_tokens": request.max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        result = RequestResult(num_prompt_tokens=len(request.prompt_token_ids))
        clock = TokenClock()
        url = f"{self.base_url}/v1/completions"
        try:
            async with self.http.stream("POST", url, json=payload) as response:
                if response.status_code != 200:
                    await response.aread()
                    result.error = f"{url} answered {describe(response, limit=300)}"
                    return result
                result.error = await read_stream(response, result, clock)
        except Exception as exc:  # a benchmark reports failures, it does not stop on them
            result.error = f"{type(exc).__name__}: {exc}"
        return result if result.error else clock.finish(result)

    async def close(self) -> None:
        await self.http.aclose()


class InProcessBackend:
    """Sends straight to the engine-core process through EngineCoreClient (no HTTP)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def send(self, request: BenchRequest) -> RequestResult:
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        result = RequestResult(num_prompt_tokens=len(request.prompt_token_ids))
        clock = TokenClock()
        try:
            async for output in self.client.add_request(request.prompt_token_ids, params):
                if output.new_token_ids:
                    result.num_output_tokens += len(output.new_token_ids)
                    clock.note_token(result)
        except Exception as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        return clock.finish(result)

    async def close(self) -> None:
        pass


class TokenClock:
    """When a request was sent and when its latest output arrived: TTFT, ITLs, end to end."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()

    def note_token(self, result: RequestResult) -> None:
        """Output arrived now: the first sets TTFT, each later one adds an inter-token time."""
        now = time.perf_counter()
        if not result.ttft_time:
            result.ttft_time = now - self.start
        else:
            result.itl_times.append(now - self.last)
        self.last = now

    def finish(self, result: RequestResult) -> RequestResult:
        result.e2e_time = self.last - self.start
        result.success = result.num_output_tokens > 0
        if not result.success and not result.error:
            result.error = "no output tokens in the answer"
        return result
