"""Faults injected into a real engine from outside it: a forward pass that hangs, a device
that is slow at every pass (no fault, but multi-second iterations), and a scheduler that keeps
blocks of every finished request. The engine has no switch for either;
tests wrap its parts instead.

    runner_class = stalling(FakeRunner, at_call=3, seconds=3.0)   # picklable: fine for the
    runner_class = slowed(FakeRunner, seconds=2.5)                 # (every pass: slow, healthy)
    EngineCoreClient(config, load_fake_model, runner_class)        # engine-core process
    leak_blocks_per_finish(core, 2)                                # an in-process EngineCore
"""

from __future__ import annotations

import functools
import time
from typing import Any


class StallingRunner:
    """A runner whose ``at_call``-th execute() sleeps ``seconds`` first: the engine loop hangs
    inside one iteration with work in flight, while the publisher's thread keeps beating."""

    def __init__(self, inner: Any, at_call: int, seconds: float) -> None:
        self.inner = inner
        self.at_call = at_call
        self.seconds = seconds
        self.num_calls = 0

    def execute(self, scheduled: list) -> list:
        self.num_calls += 1
        if self.num_calls == self.at_call:
            time.sleep(self.seconds)
        return self.inner.execute(scheduled)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _build_stalling(runner_class: Any, at_call: int, seconds: float, *args: Any) -> Any:
    return StallingRunner(runner_class(*args), at_call, seconds)


def stalling(runner_class: Any, at_call: int, seconds: float) -> Any:
    """A ``runner_class`` for build_engine_core / EngineCoreClient whose runner stalls once."""
    return functools.partial(_build_stalling, runner_class, at_call, seconds)


class SlowRunner:
    """A runner whose every execute() takes ``seconds`` more: a healthy engine on a slow
    device (a CPU prefilling long prompts), whose iterations take seconds each."""

    def __init__(self, inner: Any, seconds: float) -> None:
        self.inner = inner
        self.seconds = seconds

    def execute(self, scheduled: list) -> list:
        time.sleep(self.seconds)
        return self.inner.execute(scheduled)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _build_slow(runner_class: Any, seconds: float, *args: Any) -> Any:
    return SlowRunner(runner_class(*args), seconds)


def slowed(runner_class: Any, seconds: float) -> Any:
    """A ``runner_class`` whose runner takes ``seconds`` more for every forward pass."""
    return functools.partial(_build_slow, runner_class, seconds)


def leak_blocks_per_finish(core: Any, num_blocks: int) -> None:
    """Every request that finishes from now on keeps its first ``num_blocks`` KV blocks for
    good: usage climbs while few requests run, as with a leak in the block bookkeeping."""
    scheduler = core.scheduler
    finish = scheduler._finish

    def finish_and_leak(request: Any, reason: Any, now_ns: int) -> None:
        scheduler.pool.acquire(request.block_ids[:num_blocks])
        finish(request, reason, now_ns)

    scheduler._finish = finish_and_leak
