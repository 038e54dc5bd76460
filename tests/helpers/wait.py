"""Waiting for something observable instead of sleeping a fixed time."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    condition: Callable[[], T],
    timeout_s: float,
    what: str | Callable[[], str],
    interval_s: float = 0.05,
) -> T:
    """Call ``condition`` every ``interval_s`` until it returns something truthy, and return
    that. After ``timeout_s`` raise AssertionError naming ``what`` (a string, or a function
    called then, e.g. to add a log's tail). An exception from ``condition`` (a process that
    exited, say) ends the wait at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        outcome = condition()
        if outcome:
            return outcome
        if time.monotonic() >= deadline:
            description = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout_s} s waiting for {description}")
        time.sleep(interval_s)
