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

On the source's regular call (``has_requests()``, ``record()``; or, where no handler is
installed yet, one of the next HOOK_TRIES) a StopWatch wraps those handlers, so that a stop
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
HOOK_TRIES = 100  # has_requests() calls that look for vLLM's handlers before giving up
logger = logging.getLogger("vllm.iterscope")  # vLLM's handler and format


class StopWatch:
    """Closes the lane (``close``) when vLLM is told to stop; ``in_flight`` says how many
    requests are unfinished, ``drains``: whether vLLM finishes them before it stops.
    ``waiting`` is true while the source's regular call (the busy loop's ``has_requests()``,
    the plugin's ``record()``) has something to do here (hook the handlers, or close once
    drained): one attribute read a call else."""

    def __init__(self, close: Callable[[], None], in_flight: Callable[[], int], drains: bool):
        self._close = close
        self._in_flight = in_flight
        self._drains = drains
        self._tries_left = HOOK_TRIES
        self.waiting = True

    def on_loop(self, has_requests: bool) -> None:
        """The source's regular call, with whether requests are unfinished."""
        if self._tries_left:
            self._tries_left -= 1
            if threading.current_thread() is not threading.main_thread():
                self._tries_left = 0  # no handler can be set from here
            elif hook_stop_signals(self.on_stop_signal):
                self._tries_left = 0
            self.waiting = self._tries_left > 0
        elif not has_requests:  # draining, and drained
            self.waiting = False
            self._close()

    def on_stop_signal(self) -> None:
        """A stop signal, before vLLM's handler runs (in the main thread)."""
        if self._drains and self._in_flight():
            self.waiting = True  # closed once the loop says nothing is left
        else:
            self._close()


def hook_stop_signals(on_stop: Callable[[], None]) -> int:
    """Have each stop signal's installed handler call ``on_stop`` first; how many there were."""
    num_hooked = 0
    for signum in STOP_SIGNALS:
        previous = signal.getsignal(signum)
        if callable(previous) and previous is not signal.default_int_handler:
            signal.signal(signum, _calling_first(on_stop, previous))
            num_hooked += 1
    return num_hooked


def _calling_first(on_stop: Callable[[], None], previous: Callable[[int, Any], Any]):
    def handler(signum: int, frame: Any) -> Any:
        try:
            on_stop()
        except Exception:  # vLLM's handler runs whatever happens here
            logger.exception("iterscope: closing the lane at a stop signal failed")
        return previous(signum, frame)

    return handler
