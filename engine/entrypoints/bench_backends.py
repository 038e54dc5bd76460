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


class HttpBackend:
    """Streams /v1/completions of an OpenAI-compatible server (token-id prompts)."""

    def __init__(self, base_url: str, model: str | None = None) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self.model = model
        self.http = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None))

    async def model_card(self) -> dict[str, Any]:
        import httpx

        try:
            response = await self.http.get(f"{self.base_url}/v1/models")
            response.raise_for_status()
        except httpx.HTTPError as exc:
            raise RuntimeError(f"cannot read {self.base_url}/v1/models: {exc}") from exc
        return response.json()["data"][0]

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
        try:
            async with self.http.stream(
                "POST", f"{self.base_url}/v1/completions", json=payload
            ) as response:
                if response.status_code != 200:
                    result.error = (await response.aread()).decode(errors="replace")
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:
                        result.error = chunk["error"]["message"]
                        return result
                    if chunk.get("choices"):
                        clock.note_token(result)
                    if chunk.get("usage"):
                        result.num_prompt_tokens = chunk["usage"]["prompt_tokens"]
                        result.num_output_tokens = chunk["usage"]["completion_tokens"]
        except Exception as exc:  # a benchmark reports failures, it does not stop on them
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        return clock.finish(result)

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
        return result
