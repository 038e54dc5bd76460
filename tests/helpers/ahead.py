"""The live set-ups slowest to start, started ahead: a real `vllm serve` takes 45-70 s to
be ready on 2 cores and vLLM's real-scheduler checks of five versions ~50 s, most of it Python
imports on one core (each of a serve's three processes imports torch and vLLM in turn), while
the fast tests before their modules leave a core idle. The paged decode kernel's other builds
(tests/test_cpu_paged_decode.py: ~8-10 s of gcc each) start ahead the same way.

A test module marks the context manager that starts and stops its stack with ``@ahead(fixture,
tmp_name)``: ``start(tmp_dir, param, **vllm_kwargs)`` yields the stack its fixture ``fixture``
(parametrized or not: then param is None) hands the tests; vllm_kwargs (niceness,
ready_timeout_s) go to bench.vllm_server.start_vllm, or to what else the stack runs vLLM in.
When the session starts, tests/conftest.py calls ``start_ahead``: every marked stack a
selected test uses is started in one background thread, one after the other in the tests'
order, its vLLM processes at the lowest CPU priority (nice 19: they take only what the tests
leave) and with no deadline of its own. The fixture then
``take``s it: the stack started ahead once its start has ended (an error in that start fails
the fixture as it would have in line), or, when none was started ahead, one started then.

Invariant: a stack is started ahead only while the machine has MIN_AVAILABLE_BYTES free (a
serve holds ~2.7 GiB), so a smaller machine loses only the head start; a stack started ahead
and never taken (a session cut short) is stopped when the session ends.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

MIN_AVAILABLE_BYTES = 8 << 30
# What a stack started ahead passes to bench.vllm_server.start_vllm: the lowest priority,
# and a deadline that only the session's own ends (it may wait behind busy tests for minutes).
AHEAD_VLLM_KWARGS = {"niceness": 19, "ready_timeout_s": 3600.0}

Start = Callable[..., contextlib.AbstractContextManager[dict]]


@dataclass(frozen=True)
class Marked:
    start: Start
    fixture: str
    tmp_name: str


MARKED: list[Marked] = []
_started: dict[tuple[Start, Any], concurrent.futures.Future] = {}


def ahead(fixture: str, tmp_name: str) -> Callable[[Start], Start]:
    """Mark ``start`` as the stack of the fixture named ``fixture`` in its module."""

    def mark(start: Start) -> Start:
        MARKED.append(Marked(start, fixture, tmp_name))
        return start

    return mark


def wanted(items: list[pytest.Item]) -> list[tuple[Marked, Any]]:
    """Each marked stack and param a selected test uses, in the order of the tests."""
    found: list[tuple[Marked, Any]] = []
    for item in items:
        module = getattr(getattr(item, "module", None), "__name__", None)
        for marked in MARKED:
            if module != marked.start.__module__ or marked.fixture not in item.fixturenames:
                continue
            callspec = getattr(item, "callspec", None)
            param = callspec.params.get(marked.fixture) if callspec else None
            if (marked, param) not in found:
                found.append((marked, param))
    return found


def start_ahead(items: list[pytest.Item], tmp_path_factory: pytest.TempPathFactory) -> None:
    """Start every marked stack the selected ``items`` use, one at a time, in the background."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ahead")
    for marked, param in wanted(items):
        tmp = tmp_path_factory.mktemp(marked.tmp_name)  # here: mktemp is not thread-safe
        _started[(marked.start, param)] = pool.submit(_enter, marked.start, tmp, param)
    pool.shutdown(wait=False)


def _enter(start: Start, tmp: Path, param: Any) -> tuple[contextlib.ExitStack, dict] | None:
    """The stack entered, with what exits it; None when memory is short."""
    if available_bytes() < MIN_AVAILABLE_BYTES:
        return None
    exits = contextlib.ExitStack()
    return exits, exits.enter_context(start(tmp, param, **AHEAD_VLLM_KWARGS))


@contextlib.contextmanager
def take(start: Start, param: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The stack the marked ``start`` made for ``param``: the one started ahead, or one
    started now."""
    future = _started.pop((start, param), None)
    entered = future.result() if future is not None else None
    if entered is None:
        (marked,) = [marked for marked in MARKED if marked.start is start]
        with start(tmp_path_factory.mktemp(marked.tmp_name), param) as stack:
            yield stack
        return
    exits, stack = entered
    with exits:
        yield stack


def stop_untaken() -> None:
    """Stop the stacks started ahead that no fixture took (waiting for their start)."""
    while _started:
        _, future = _started.popitem()
        with contextlib.suppress(Exception):
            entered = future.result()
            if entered is not None:
                entered[0].close()


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0
