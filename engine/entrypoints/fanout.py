"""``n`` > 1: one engine request per choice, their outputs interleaved as they come.

Each choice is an engine request of its own on the same prompt. Choices admitted in the same
iteration each compute the prompt; one admitted later finds its full KV blocks in the prefix
cache. With a seed, choice i draws with
seed + i, as in vLLM: the choices differ from one another, and the same request with the same
seed gets the same choices again.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import TypeVar

from engine.request import SamplingParams

Item = TypeVar("Item")
_END = object()


def choice_request_id(request_id: str, index: int) -> str:
    return f"{request_id}-{index}"


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The sampling parameters of choice `index`."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=params.seed + index)


@dataclasses.dataclass
class _Failure:
    error: Exception


async def interleave(streams: list[AsyncIterator[Item]]) -> AsyncIterator[Item]:
    """The items of all streams in the order they arrive. The first error raised by any of
    them is raised here; when this ends early (an error, the consumer stops or is cancelled),
    every stream still running is cancelled, so its own cleanup (an engine abort) runs."""
    arrivals: asyncio.Queue = asyncio.Queue()

    async def pump(stream: AsyncIterator[Item]) -> None:
        try:
            async for item in stream:
                arrivals.put_nowait(item)
        except Exception as error:
            arrivals.put_nowait(_Failure(error))
        else:
            arrivals.put_nowait(_END)

    tasks = [asyncio.ensure_future(pump(stream)) for stream in streams]
    try:
        num_running = len(tasks)
        while num_running:
            item = await arrivals.get()
            if item is _END:
                num_running -= 1
            elif isinstance(item, _Failure):
                raise item.error
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
