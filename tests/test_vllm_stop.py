"""The scheduler source's stop watch (telemetry/sources/vllm_stop.py): a stop signal closes
the lane before vLLM's own handler runs, at once on an abort, once drained on a drain; the
default handlers stay. The real vLLM stopped by its operator: tests/test_vllm_spec_live.py."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from telemetry.sources.vllm_stop import HOOK_TRIES, STOP_SIGNALS, StopWatch


@pytest.fixture
def handlers():
    """vLLM's handlers as it installs them (a Python function per stop signal), each noting
    the signal; the process's own restored after."""
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    events: list[str] = []
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda number, frame: events.append(f"vllm {number}"))
    yield events
    for signum, handler in before.items():
        signal.signal(signum, handler)


def watch(events: list[str], in_flight: int = 0, drains: bool = False) -> StopWatch:
    return StopWatch(lambda: events.append("closed"), lambda: in_flight, drains)


def hooked_for_good(stop: StopWatch, has_requests: bool = False) -> None:
    """The source's regular calls until the watch stops looking at the handlers."""
    for _ in range(HOOK_TRIES):
        stop.on_loop(has_requests)


@pytest.mark.parametrize("signum", STOP_SIGNALS)
def test_a_stop_signal_closes_the_lane_before_vllms_handler_runs(handlers, signum):
    stop = watch(handlers, in_flight=3)  # an abort: the closing heartbeat says what it cuts
    assert stop.waiting
    stop.on_loop(has_requests=False)  # the busy loop's first question: hooked
    assert handlers == []
    hooked_for_good(stop)  # looked at again HOOK_TRIES times, not hooked twice
    assert not stop.waiting
    os.kill(os.getpid(), signum)
    assert handlers == ["closed", f"vllm {signum}"]


def test_a_drain_closes_the_lane_once_nothing_is_left(handlers):
    stop = watch(handlers, in_flight=2, drains=True)
    hooked_for_good(stop, has_requests=True)
    os.kill(os.getpid(), signal.SIGTERM)
    assert handlers == [f"vllm {signal.SIGTERM}"] and stop.waiting
    stop.on_loop(has_requests=True)  # still draining
    assert handlers == [f"vllm {signal.SIGTERM}"]
    stop.on_loop(has_requests=False)
    assert handlers == [f"vllm {signal.SIGTERM}", "closed"] and not stop.waiting


def test_an_idle_drain_closes_at_once(handlers):
    stop = watch(handlers, in_flight=0, drains=True)
    stop.on_loop(has_requests=False)
    os.kill(os.getpid(), signal.SIGTERM)
    assert handlers == ["closed", f"vllm {signal.SIGTERM}"]


def test_default_handlers_and_other_threads_are_left_alone():
    """An engine in the caller's own process (no vLLM handler) keeps Ctrl-C's
    KeyboardInterrupt and SIGTERM's default; off the main thread nothing can be hooked."""
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        stop = watch([])
        for _ in range(HOOK_TRIES):  # vLLM may install its handlers after the first call
            assert stop.waiting
            stop.on_loop(has_requests=False)
        assert not stop.waiting
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
    stop = watch([])
    thread = threading.Thread(target=stop.on_loop, args=(False,))
    thread.start()
    thread.join()
    assert not stop.waiting and signal.getsignal(signal.SIGTERM) is before[signal.SIGTERM]


def test_handlers_installed_after_the_first_calls_are_hooked(handlers):
    """vLLM 0.24-0.31 install their handlers after the scheduler is built: a call before
    that finds none and tries again."""
    installed = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    stop = watch(handlers)
    stop.on_loop(has_requests=False)
    for signum, handler in installed.items():
        signal.signal(signum, handler)
    assert stop.waiting
    hooked_for_good(stop)
    os.kill(os.getpid(), signal.SIGTERM)
    assert handlers == ["closed", f"vllm {signal.SIGTERM}"] and not stop.waiting


def test_a_handler_replaced_after_the_hook_is_hooked_again(handlers):
    """vLLM's API server installs a SIGTERM handler while it starts and its event loop's in
    its place when it serves: a plugin that hooked the first lost its hook, and a SIGTERM
    under load was "Engine stalled" for 77 s (QA, 1 run in 5)."""
    stop = watch(handlers)
    stop.on_loop(has_requests=False)  # a call while vLLM starts: its start-up handler hooked
    signal.signal(signal.SIGTERM, lambda number, frame: handlers.append("serving"))
    hooked_for_good(stop, has_requests=True)  # the calls of the first requests
    os.kill(os.getpid(), signal.SIGTERM)
    assert handlers == ["closed", "serving"]


def test_two_sources_in_one_process_each_hook_once(handlers):
    """Data-parallel ranks behind one API server: a plugin per engine, each hook once, each
    closing its lane, then vLLM's handler."""
    first = StopWatch(lambda: handlers.append("first closed"), lambda: 0, drains=False)
    second = StopWatch(lambda: handlers.append("second closed"), lambda: 0, drains=False)
    for _ in range(HOOK_TRIES):
        first.on_loop(has_requests=True)
        second.on_loop(has_requests=True)
    os.kill(os.getpid(), signal.SIGTERM)
    assert handlers == ["second closed", "first closed", f"vllm {signal.SIGTERM}"]


def test_a_failing_close_still_runs_vllms_handler(handlers):
    def fail() -> None:
        raise RuntimeError("socket gone")

    stop = StopWatch(fail, lambda: 0, drains=False)
    stop.on_loop(has_requests=False)
    os.kill(os.getpid(), signal.SIGTERM)
    assert handlers == [f"vllm {signal.SIGTERM}"]


def test_the_handlers_of_vllms_event_loop_are_hooked_and_still_run():
    """vLLM's API server handles SIGTERM on its event loop (loop.add_signal_handler), where
    the stat-logger plugin's record() runs: the loop's Python-level handler is wrapped, and
    the loop still runs its own callback after the lane closed."""
    import asyncio

    events: list[str] = []
    before = signal.getsignal(signal.SIGTERM)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, lambda: events.append("vllm shutdown"))
        try:
            stop = watch(events, in_flight=2)
            hooked_for_good(stop, has_requests=True)  # the plugin's first record() calls
            assert not stop.waiting
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):
                if "vllm shutdown" in events:
                    break
                await asyncio.sleep(0.01)
        finally:
            loop.remove_signal_handler(signal.SIGTERM)

    try:
        asyncio.run(serve())
    finally:
        signal.signal(signal.SIGTERM, before)
    assert events == ["closed", "vllm shutdown"]
