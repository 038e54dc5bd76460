"""Close a vLLM source's lane as vLLM is told to stop.

The scheduler source: vLLM's API server stops its engine core with SIGTERM and, its shutdown
timeout being 0 by default, kills it a moment later (vLLM 0.32: within the second, while its
executor tears down). The scheduler's own ``shutdown`` comes after the executor's, so it never
ran: the lane went silent and the sidecar called a planned stop a death ("Engine down",
IterscopeEngineDown). vLLM installs its SIGTERM and SIGINT handlers in the engine core's main
thread before its busy loop starts (before the scheduler is built on 0.32, after it on
0.24-0.31), and the loop asks the scheduler ``has_requests()`` before it waits for work.

The stat-logger plugin: vLLM's API server handles the same signals on its event loop, where
the plugin's ``record()`` runs after each step; it stops the engine core (an abort kills it)
and then waits for its HTTP clients, so the plugin's heartbeats went on saying requests in
flight that no step would ever end: "Engine stalled" for as long as the clients held on, with
a stack dump as the action.

On the source's first HOOK_TRIES regular calls (``has_requests()``, ``record()``) a StopWatch
wraps those handlers, and again any handler installed in the place of one it wrapped (vLLM's
API server installs one while it starts and its event loop's when it serves: a plugin that
hooked only the first lost its hook, and a stop was "Engine stalled" again), so that a stop
signal closes the lane (its closing heartbeat, saying the engine was told to stop:
record.is_clean_close) before vLLM's handler runs. An abort (vLLM's default) closes it at
once, the heartbeat saying the requests it cuts off (a shutdown's, not a death's: the sidecar
calls the engine closed); a drain (``--shutdown-timeout`` above 0) with requests in flight
closes it at the first regular call that says none is left. The handler vLLM's event loop
installs (asyncio's, uvloop's) is a Python callable too, and the loop still runs its own
callbacks after the wrapper.

Only handlers someone installed are wrapped (vLLM's): the default ones (SIG_DFL, Python's
KeyboardInterrupt for SIGINT) of an engine run in the caller's own process stay as they are.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# The source's regular calls (has_requests(), record()) that hook vLLM's handlers, each time
# again where one was replaced since: vLLM's API server installs a handler of its own while it
# starts, and its event loop's in its place when it serves.
HOOK_TRIES = 100
logger = logging.getLogger("vllm.iterscope")  # vLLM's handler and format


class StopWatch:
    """Closes the lane (``close``) when vLLM is told to stop; ``in_flight`` says how many
    requests are unfinished, ``drains``: whether vLLM finishes them before it stops.
    ``waiting`` is true while the source's regular call (the busy loop's ``has_requests()``,
    the plugin's ``record()``) has something to do here (hook the handlers, HOOK_TRIES calls,
    or close once drained): one attribute read a call else."""

    def __init__(self, close: Callable[[], None], in_flight: Callable[[], int], drains: bool):
        self._close = close
        self._in_flight = in_flight
        self._drains = drains
        self._tries_left = HOOK_TRIES
        self._draining = False
        self.waiting = True

    def on_loop(self, has_requests: bool) -> None:
        """The source's regular call, with whether requests are unfinished."""
        if self._tries_left:
            self._tries_left -= 1
            if threading.current_thread() is not threading.main_thread():
                self._tries_left = 0  # no handler can be set from here
            else:
                hook_stop_signals(self.on_stop_signal)
        if self._draining and not has_requests:  # drained
            self._draining = False
            self._close()
        self.waiting = self._tries_left > 0 or self._draining

    def on_stop_signal(self) -> None:
        """A stop signal, before vLLM's handler runs (in the main thread)."""
        if self._drains and self._in_flight():
            self._draining = self.waiting = True  # closed once the loop says nothing is left
        else:
            self._close()


def hook_stop_signals(on_stop: Callable[[], None]) -> None:
    """Have each stop signal's installed handler call ``on_stop`` first, unless it does
    already (a handler replaced since is hooked again)."""
    for signum in STOP_SIGNALS:
        previous = signal.getsignal(signum)
        if (
            callable(previous)
            and previous is not signal.default_int_handler
            and not _calls(previous, on_stop)
        ):
            signal.signal(signum, _calling_first(on_stop, previous))


def _calls(handler: Any, on_stop: Callable[[], None]) -> bool:
    """Whether ``handler`` is a chain of hooks (several engines' sources in one process) one of
    which calls ``on_stop``."""
    while hasattr(handler, "iterscope_on_stop"):
        if handler.iterscope_on_stop == on_stop:
            return True
        handler = handler.iterscope_previous
    return False


def _calling_first(on_stop: Callable[[], None], previous: Callable[[int, Any], Any]):
    def handler(signum: int, frame: Any) -> Any:
        try:
            on_stop()
        except Exception:  # vLLM's handler runs whatever happens here
            logger.exception("iterscope: closing the lane at a stop signal failed")
        return previous(signum, frame)

    handler.iterscope_on_stop = on_stop
    handler.iterscope_previous = previous
    return handler
