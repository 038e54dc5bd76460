"""`iterscope bench`: a load generator in the manner of `vllm bench serve`.

    random dataset (seeded)  ->  arrivals (Poisson at --request-rate, or all at once)
                             ->  concurrency limit (--max-concurrency, or a ramp for the demo)
                             ->  backend: the HTTP server (/v1/completions, streamed) or the
                                 engine-core process directly (--in-process)
                             ->  per-request TTFT, inter-token gaps, end-to-end latency
                             ->  summary table + JSON result file

Prompts are random token ids (so input lengths are exact) and requests set ignore_eos (so
output lengths are exact); sampling is greedy. Token counts come from the server's own usage
report, so they can be checked against the sidecar's counters for the same run.

Definitions: TTFT = send -> first token; ITL = gap between consecutive streamed tokens; TPOT
= (e2e - TTFT) / (output tokens - 1) per request; e2e = send -> last token.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from engine.request import SamplingParams

PERCENTILE_NAMES = (("mean", None), ("median", 50.0), ("p99", 99.0))


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


def random_dataset(
    num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0,
    range_ratio: float = 0.0,
) -> list[BenchRequest]:
    """Prompts of random token ids; lengths uniform in [len * (1 - r), len * (1 + r)]."""
    if num_prompts < 1 or input_len < 1 or output_len < 1:
        raise ValueError("num_prompts, input_len and output_len must be at least 1")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)

    def lengths(mean: int) -> np.ndarray:
        low = max(1, math.floor(mean * (1 - range_ratio)))
        high = math.ceil(mean * (1 + range_ratio))
        return rng.integers(low, high + 1, size=num_prompts)

    input_lens, output_lens = lengths(input_len), lengths(output_len)
    return [
        BenchRequest(rng.integers(0, vocab_size, size=int(n_in)).tolist(), int(n_out))
        for n_in, n_out in zip(input_lens, output_lens, strict=True)
    ]


# Backends --------------------------------------------------------------------------------------


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
            "model": self.model, "prompt": request.prompt_token_ids,
            "max_tokens": request.max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True},
        }
        result = RequestResult(num_prompt_tokens=len(request.prompt_token_ids))
        start = last = time.perf_counter()
        try:
            async with self.http.stream("POST", f"{self.base_url}/v1/completions",
                                        json=payload) as response:
                if response.status_code != 200:
                    result.error = (await response.aread()).decode(errors="replace")
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: "):])
                    now = time.perf_counter()
                    if "error" in chunk:
                        result.error = chunk["error"]["message"]
                        return result
                    if chunk.get("choices"):
                        _note_token(result, start, last, now)
                        last = now
                    if chunk.get("usage"):
                        result.num_prompt_tokens = chunk["usage"]["prompt_tokens"]
                        result.num_output_tokens = chunk["usage"]["completion_tokens"]
        except Exception as exc:  # a benchmark reports failures, it does not stop on them
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        result.e2e_time = last - start
        result.success = result.num_output_tokens > 0
        return result

    async def close(self) -> None:
        await self.http.aclose()


class InProcessBackend:
    """Sends straight to the engine-core process through EngineCoreClient (no HTTP)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def send(self, request: BenchRequest) -> RequestResult:
        params = SamplingParams(max_tokens=request.max_tokens, temperature=0.0, ignore_eos=True)
        result = RequestResult(num_prompt_tokens=len(request.prompt_token_ids))
        start = last = time.perf_counter()
        try:
            async for output in self.client.add_request(request.prompt_token_ids, params):
                now = time.perf_counter()
                if output.new_token_ids:
                    result.num_output_tokens += len(output.new_token_ids)
                    _note_token(result, start, last, now)
                    last = now
        except Exception as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result
        result.e2e_time = last - start
        result.success = result.num_output_tokens > 0
        return result

    async def close(self) -> None:
        pass


def _note_token(result: RequestResult, start: float, last: float, now: float) -> None:
    if not result.ttft_time:
        result.ttft_time = now - start
    else:
        result.itl_times.append(now - last)


# The run ---------------------------------------------------------------------------------------


class ConcurrencyLimit:
    """At most ``limit_at(elapsed seconds)`` requests in flight; the limit may change in time.

    Waiters are served first come, first served, as by vLLM's semaphore. Only the head of the
    queue polls (every 0.1 s, for a rising limit); the others sleep until it is their turn.
    """

    def __init__(self, limit_at: Callable[[float], int], start: float) -> None:
        self.limit_at = limit_at
        self.start = start
        self.num_in_flight = 0
        self._queue: collections.deque[asyncio.Event] = collections.deque()

    def _has_room(self) -> bool:
        return self.num_in_flight < self.limit_at(time.perf_counter() - self.start)

    async def acquire(self) -> None:
        turn = asyncio.Event()
        self._queue.append(turn)
        try:
            while not (self._queue[0] is turn and self._has_room()):
                timeout = 0.1 if self._queue[0] is turn else None
                turn.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(turn.wait(), timeout)
        finally:
            self._queue.remove(turn)
            self._wake_head()
        self.num_in_flight += 1

    def release(self) -> None:
        self.num_in_flight -= 1
        self._wake_head()

    def _wake_head(self) -> None:
        if self._queue:
            self._queue[0].set()


async def run_benchmark(
    backend: Any, requests: list[BenchRequest], request_rate: float = math.inf,
    concurrency_at: Callable[[float], int] | None = None, seed: int = 0,
    progress: bool = True, stop_sending_after: float | None = None,
) -> tuple[list[RequestResult], float]:
    """Send the requests; return their results (in send order) and the run's duration (s).

    ``stop_sending_after`` seconds: send nothing new after that (what was sent still ends).
    """
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    limit = ConcurrencyLimit(concurrency_at or (lambda _: math.inf), start)
    bar = tqdm(total=len(requests), disable=not progress, unit="req", file=sys.stderr)

    def too_late() -> bool:
        return stop_sending_after is not None and (
            time.perf_counter() - start > stop_sending_after)

    async def one(request: BenchRequest) -> RequestResult | None:
        """Arrives on schedule, then waits for a free slot (queued on the client side)."""
        await limit.acquire()
        try:
            if too_late():
                return None
            return await backend.send(request)
        finally:
            limit.release()
            bar.update(1)

    tasks = []
    for request in requests:  # arrivals on a fixed schedule, whatever is in flight
        if too_late():
            break
        tasks.append(asyncio.ensure_future(one(request)))
        if math.isfinite(request_rate):
            await asyncio.sleep(rng.exponential(1.0 / request_rate))
    results = [result for result in await asyncio.gather(*tasks) if result is not None]
    bar.close()
    return results, time.perf_counter() - start


# Summary ---------------------------------------------------------------------------------------


def _stats_ms(name: str, values: list[float]) -> dict[str, float]:
    array = np.asarray(values, dtype=float) * 1000.0 if values else np.zeros(1)
    return {
        f"{stat}_{name}_ms": float(array.mean() if q is None else np.percentile(array, q))
        for stat, q in PERCENTILE_NAMES
    }


def summarize(results: list[RequestResult], duration_time: float) -> dict[str, Any]:
    """The figures of the summary table (times in ms, throughputs per second)."""
    done = [r for r in results if r.success]
    num_input_tokens = sum(r.num_prompt_tokens for r in done)
    num_output_tokens = sum(r.num_output_tokens for r in done)
    tpots = [(r.e2e_time - r.ttft_time) / (r.num_output_tokens - 1)
             for r in done if r.num_output_tokens > 1]
    metrics: dict[str, Any] = {
        "duration_s": duration_time,
        "num_completed": len(done),
        "num_failed": len(results) - len(done),
        "total_input_tokens": num_input_tokens,
        "total_output_tokens": num_output_tokens,
        "request_throughput": len(done) / duration_time,
        "input_throughput": num_input_tokens / duration_time,
        "output_throughput": num_output_tokens / duration_time,
        "total_token_throughput": (num_input_tokens + num_output_tokens) / duration_time,
    }
    metrics.update(_stats_ms("ttft", [r.ttft_time for r in done]))
    metrics.update(_stats_ms("tpot", tpots))
    metrics.update(_stats_ms("itl", [gap for r in done for gap in r.itl_times]))
    metrics.update(_stats_ms("e2el", [r.e2e_time for r in done]))
    return metrics


def format_summary(metrics: dict[str, Any]) -> str:
    width = 50
    rows = [
        ("Successful requests:", metrics["num_completed"]),
        ("Failed requests:", metrics["num_failed"]),
        ("Benchmark duration (s):", f"{metrics['duration_s']:.2f}"),
        ("Total input tokens:", metrics["total_input_tokens"]),
        ("Total generated tokens:", metrics["total_output_tokens"]),
        ("Request throughput (req/s):", f"{metrics['request_throughput']:.2f}"),
        ("Input token throughput (tok/s):", f"{metrics['input_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{metrics['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{metrics['total_token_throughput']:.2f}"),
    ]
    lines = [" Benchmark result ".center(width, "=")]
    lines += [f"{label:<40}{value:>10}" for label, value in rows]
    for key, title in (("ttft", "Time to first token"), ("tpot", "Time per output token "
                       "(excl. 1st)"), ("itl", "Inter-token latency"), ("e2el", "End-to-end "
                       "latency")):
        lines.append(f" {title} ".center(width, "-"))
        for stat, _ in PERCENTILE_NAMES:
            label = f"{stat.capitalize()} {key.upper()} (ms):"
            lines.append(f"{label:<40}{metrics[f'{stat}_{key}_ms']:>10.2f}")
    lines.append("=" * width)
    return "\n".join(lines)


def result_json(metrics: dict[str, Any], settings: dict[str, Any],
                results: list[RequestResult]) -> dict[str, Any]:
    """What --result-file holds: settings, the summary figures and every request."""
    return {"settings": settings, **metrics, "requests": [asdict(r) for r in results]}


# Command line ----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from engine.entrypoints.serve_args import add_engine_arguments
    from telemetry.sidecar import process as sidecar_process

    parser = argparse.ArgumentParser(prog="iterscope bench", description=__doc__.split("\n")[0])
    target = parser.add_argument_group("target")
    target.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server to load (default %(default)s)")
    target.add_argument("--in-process", action="store_true",
                        help="no HTTP: start the engine-core process here (engine options "
                        "below) and send to it directly")
    load = parser.add_argument_group("load")
    load.add_argument("--num-prompts", type=int, default=100)
    load.add_argument("--random-input-len", type=int, default=128)
    load.add_argument("--random-output-len", type=int, default=64)
    load.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths vary uniformly by +- this share (default 0: exact)")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="requests per second, Poisson arrivals (default inf: all at once)")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="at most this many requests in flight (default: no limit)")
    load.add_argument("--vocab-size", type=int, default=None,
                      help="token ids are drawn below this (default: from /v1/models or the "
                      "model's tokenizer)")
    out = parser.add_argument_group("output")
    out.add_argument("--result-file", default=None, metavar="PATH", help="write a JSON result")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_engine_arguments(parser)
    sidecar_process.add_arguments(parser)
    return parser


def _check_args(args: argparse.Namespace) -> None:
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")


async def _bench(args: argparse.Namespace, backend: Any, vocab_size: int) -> dict[str, Any]:
    requests = random_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                              vocab_size, args.seed, args.random_range_ratio)
    limit = args.max_concurrency
    results, duration_time = await run_benchmark(
        backend, requests, args.request_rate, (lambda _: limit) if limit else None, args.seed,
        progress=not args.no_progress,
    )
    metrics = summarize(results, duration_time)
    print(format_summary(metrics), flush=True)
    failures = [r.error for r in results if not r.success]
    if failures:
        print(f"first failure: {failures[0]}", file=sys.stderr)
    if args.result_file:
        settings = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str))}
        with open(args.result_file, "w") as file:
            json.dump(result_json(metrics, settings, results), file)
    return metrics


async def _bench_http(args: argparse.Namespace) -> dict[str, Any]:
    backend = HttpBackend(args.base_url)
    try:
        card = await backend.model_card()
        backend.model = card["id"]
        vocab_size = args.vocab_size or card.get("vocab_size")
        if not vocab_size:
            raise ValueError("the server does not report vocab_size: give --vocab-size")
        return await _bench(args, backend, vocab_size)
    finally:
        await backend.close()


def _bench_in_process(args: argparse.Namespace) -> dict[str, Any]:
    from engine.entrypoints.serve import load_tokenizer, start_engine
    from engine.entrypoints.serve_args import engine_config
    from telemetry.sidecar import process as sidecar_process

    sidecar = client = None
    try:
        sidecar = sidecar_process.start_from_args(args)
        config = engine_config(args, sidecar_process.telemetry_address(args, sidecar))
        vocab_size = args.vocab_size or load_tokenizer(args.model).vocab_size
        client = start_engine(config, args.cpu_threads)
        return asyncio.run(_bench(args, InProcessBackend(client), vocab_size))
    finally:
        if client is not None:
            client.shutdown()
        if sidecar is not None:
            sidecar.stop()


def main(argv: list[str] | None = None) -> int:
    import logging

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(name)s] "
                        "%(message)s", datefmt="%m-%d %H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        _check_args(args)
        metrics = _bench_in_process(args) if args.in_process else asyncio.run(_bench_http(args))
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"iterscope bench: {exc}", file=sys.stderr)
        return 1
    return 0 if metrics["num_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
