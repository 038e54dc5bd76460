"""The load `iterscope bench` makes: a seeded random dataset, arrivals (Poisson at a request
rate, or all at once) and a concurrency limit that may change in time (the demo's ramp).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from engine.entrypoints.bench_backends import BenchRequest, RequestResult


def random_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    seed: int = 0,
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
    backend: Any,
    requests: list[BenchRequest],
    request_rate: float = math.inf,
    concurrency_at: Callable[[float], int] | None = None,
    seed: int = 0,
    progress: bool = True,
    stop_sending_after: float | None = None,
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
        return stop_sending_after is not None and (time.perf_counter() - start > stop_sending_after)

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
