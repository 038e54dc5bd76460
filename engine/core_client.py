"""The client of the engine-core process: starts it, sends it requests, routes its outputs.

The client never waits on the engine: a request that finds the input channel full (the engine
has stopped reading) is refused with EngineBusyError, a control message (abort, shutdown) is
kept and sent by the reader thread once the engine reads again (engine/core_input_channel.py).
The client binds both sockets before the engine connects.

The reader thread routes outputs to one RequestStream per request (engine/request_stream.py)
and watches the process: when the engine dies, every waiter gets EngineDeadError within about
0.1 s (POLL_INTERVAL_MS).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import zmq

from engine.config import EngineConfig
from engine.core_input_channel import InputChannel
from engine.core_messages import (
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineMessage,
    EngineOutputs,
    EngineReady,
    Probe,
    ProbeReply,
    Shutdown,
)
from engine.core_process import run_engine_core
from engine.cpu_allocator import engine_environment
from engine.request import FinishReason, SamplingParams
from engine.request_stream import RequestStream, deliver
from engine.scheduler import RequestRejectedError, check_request_fits

logger = logging.getLogger(__name__)

POLL_INTERVAL_MS = 100  # how often the client's reader checks that the engine is alive
DEFAULT_STALL_AFTER_S = 30.0  # requests in flight and no message, or no token, this long: stalled


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no more outputs will come."""


class EngineBusyError(RuntimeError):
    """The engine is not reading its input channel (it is stuck or stopped): a new request is
    refused at once rather than queued without bound."""


class EngineCoreClient:
    """Starts the engine-core process and talks to it; thread-safe and asyncio-friendly.

    ``load_model`` / ``runner_class`` replace the real model (tests pass picklable fakes).
    """

    def __init__(
        self,
        config: EngineConfig,
        load_model: Any = None,
        runner_class: Any = None,
        startup_timeout_s: float = 600.0,
    ) -> None:
        self.config = config
        self._dir = tempfile.mkdtemp(prefix="iterscope-engine-")
        input_address = f"ipc://{self._dir}/input"
        output_address = f"ipc://{self._dir}/output"
        self._context = zmq.Context()
        self._input_channel = InputChannel(self._context, input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.bind(output_address)
        self._decoder = msgspec.msgpack.Decoder(EngineMessage)
        self.last_message_s = time.monotonic()  # when the engine was last heard from
        # When a request in flight last got a token, or the in-flight set last became
        # non-empty if later: a spinning engine (work waits, nothing is ever scheduled) still
        # sends its progress beats, so only this clock tells it from a working one.
        self.last_output_s = self.last_message_s
        self.big_step_s = 0.0  # what its last message said a big iteration it began may take
        self._longest_gap_s = 0.0  # the longest wait between its messages since last_output_s
        self._num_tokens: dict[str, int] = {}  # per request in flight: prompt + output tokens
        self._streams: dict[str, RequestStream] = {}
        self._streams_lock = threading.Lock()
        self._probe_replies: queue.Queue[ProbeReply] = queue.Queue()
        self._dead_error: EngineDeadError | None = None
        self._closing = threading.Event()
        self._shutting_down = False
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(
            target=run_engine_core,
            args=(config, input_address, output_address, load_model, runner_class),
            name="iterscope-engine-core",
            daemon=True,
        )
        with _environment(engine_environment(config.device, dict(os.environ))):
            self.process.start()  # the spawned process takes this environment
        try:
            self.ready = self._wait_ready(startup_timeout_s)
        except BaseException:
            self._stop_process(timeout_s=1.0)
            self._close_sockets()
            raise
        for line in self.ready.startup_lines:
            logger.info(line)
        self._reader = threading.Thread(
            target=self._read_outputs, name="iterscope-engine-client", daemon=True
        )
        self._reader.start()

    # Start-up --------------------------------------------------------------------------

    def _wait_ready(self, timeout_s: float) -> EngineReady:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._output.poll(POLL_INTERVAL_MS):
                message = self._decoder.decode(self._output.recv())
                if isinstance(message, EngineFailed):
                    raise RuntimeError(f"the engine failed to start: {message.error}")
                if isinstance(message, EngineReady):
                    return message
            elif not self.process.is_alive():
                raise EngineDeadError(
                    f"the engine process exited during start-up "
                    f"({exit_text(self.process.exitcode)})"
                )
        raise TimeoutError(f"the engine did not start within {timeout_s:.0f} s")

    # Requests ----------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        traceparent: str = "",
    ) -> RequestStream:
        """Submit a request; RequestRejectedError now if it could never run."""
        request_id = request_id or uuid.uuid4().hex
        if not prompt_token_ids:
            raise RequestRejectedError(f"request {request_id!r}: the prompt is empty")
        ready = self.ready
        check_request_fits(
            request_id,
            len(prompt_token_ids),
            sampling_params.max_tokens,
            ready.max_model_len,
            ready.block_size,
            ready.num_kv_blocks,
        )
        message = AddRequest(
            request_id, list(prompt_token_ids), sampling_params, time.monotonic_ns(), traceparent
        )
        try:
            frame = self._input_channel.encode_request(message)
        except msgspec.ValidationError as error:
            raise RequestRejectedError(f"request {request_id!r}: {error}") from None
        stream = RequestStream(request_id)
        with self._streams_lock:
            self._raise_if_dead()
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in flight")
            if not self._streams:  # an idle engine owes nothing: the stall clocks start now
                self.last_message_s = self.last_output_s = time.monotonic()
                self._longest_gap_s = 0.0
            self._streams[request_id] = stream
            self._num_tokens[request_id] = len(prompt_token_ids)
        try:
            self._send_frame(frame)
        except BaseException:
            with self._streams_lock:
                self._streams.pop(request_id, None)
                self._num_tokens.pop(request_id, None)
            raise
        return stream

    def abort(
        self, request_ids: str | list[str], finish_reason: FinishReason = FinishReason.ABORT
    ) -> None:
        """Stop requests; each stream ends with `finish_reason` (default "abort"; "stop" when
        the frontend matched a stop string), which the telemetry records too. Unknown ids are
        ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self._send(AbortRequests(list(request_ids), int(FinishReason(finish_reason))))

    def probe(self, timeout_s: float = 10.0) -> ProbeReply:
        """The engine process's loaded top-level modules and log-record count (for tests)."""
        self._send(Probe())
        return self._probe_replies.get(timeout=timeout_s)

    @property
    def is_alive(self) -> bool:
        return self._dead_error is None and self.process.is_alive()

    def engine_status(self, stall_after_s: float = DEFAULT_STALL_AFTER_S) -> str:
        """ "dead", "stalled", "running" (requests in flight) or "idle": engine_health's state."""
        return self.engine_health(stall_after_s)[0]

    def engine_health(self, stall_after_s: float = DEFAULT_STALL_AFTER_S) -> tuple[str, str]:
        """The engine's state and, where it is dead or stalled, what is wrong, in words.

        "dead": the process is gone. "stalled", with requests in flight, either way:
        - no message from the engine for ``stall_after_s``, or for the time an iteration
          bigger than any before may take, where its last message said one was starting (it
          beats every PROGRESS_BEAT_S between iterations while it works);
        - messages come, but no request in flight has got a token for ``stall_after_s``
          (counted from when the in-flight set became non-empty, if later): an engine that
          iterates without scheduling anything, as when leaked KV blocks leave requests
          waiting forever. Finishes and errors without a token (aborts, rejections) do not
          count, as a spinning engine still answers them. Prefilling (or recomputing) every
          token in flight, at most the KV cache's, in iterations of --max-num-batched-tokens
          may give no token for longer: it gets twice the longest wait between messages since
          the last token for each such iteration, and a big iteration under way its time.
        "running": requests in flight, else "idle". Cheap: no message to the engine."""
        if not self.is_alive:
            return "dead", "the engine is not running"
        if not self._streams:
            return "idle", ""
        now = time.monotonic()
        big_step_s = self.big_step_s
        silent_s = now - self.last_message_s
        num_in_flight = len(self._streams)
        if silent_s > max(stall_after_s, big_step_s):
            return "stalled", (
                f"the engine has sent nothing, so produced nothing, for {silent_s:.0f} s with "
                f"{num_in_flight} requests in flight"
            )
        no_output_s = now - self.last_output_s
        if no_output_s > max(stall_after_s, self._prefill_allowance_s()) + big_step_s:
            return "stalled", (
                f"the engine has produced no output for {no_output_s:.0f} s with "
                f"{num_in_flight} requests in flight, though it still iterates (last message "
                f"{silent_s:.0f} s ago)"
            )
        return "running", ""

    def _prefill_allowance_s(self) -> float:
        """How long prefilling the tokens in flight may take with no token for any request:
        twice the longest wait between messages since the last token, for each iteration of
        --max-num-batched-tokens those tokens need (at most the KV cache's tokens)."""
        with self._streams_lock:
            num_tokens = sum(self._num_tokens.values())
        num_tokens = min(num_tokens, self.ready.num_kv_blocks * self.ready.block_size)
        budget = max(1, self.config.max_num_batched_tokens or 1)
        return 2 * self._longest_gap_s * -(-num_tokens // budget)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def _send(self, message: Any) -> None:
        """A control message (abort, probe, shutdown): sent now or kept for the reader thread
        to send; never blocks the caller (the frontend's event loop)."""
        self._input_channel.send_control(message)

    def _send_frame(self, frame: bytes) -> None:
        """A request: sent now or refused with EngineBusyError; never waits (a PUSH socket
        with no reader would block a plain send forever)."""
        self._raise_if_dead()
        if not self.process.is_alive():
            raise EngineDeadError(f"the engine process died ({exit_text(self.process.exitcode)})")
        if self._input_channel.try_send(frame):
            return
        raise EngineBusyError(
            f"the engine is not taking requests: {len(self._streams)} are in flight and its "
            f"input channel is full (last heard from {time.monotonic() - self.last_message_s:.0f} "
            "s ago)"
        )

    def _raise_if_dead(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error

    # Outputs -----------------------------------------------------------------------------

    def _read_outputs(self) -> None:
        while not self._closing.is_set():
            self._input_channel.flush_pending()  # the control messages a full channel held back
            if self._output.poll(POLL_INTERVAL_MS):
                now = time.monotonic()
                if self._streams:  # (add_request restarts the clock when they appear)
                    self._longest_gap_s = max(self._longest_gap_s, now - self.last_message_s)
                self.last_message_s = now
                self._dispatch(self._decoder.decode(self._output.recv()))
            elif not self.process.is_alive():
                self._drain_outputs()
                reason = "shut down" if self._shutting_down else "died"
                self._mark_dead(
                    f"the engine process {reason} (pid {self.process.pid}, "
                    f"{exit_text(self.process.exitcode)})"
                )
                return

    def _drain_outputs(self) -> None:
        while self._output.poll(0):
            self._dispatch(self._decoder.decode(self._output.recv()))

    def _dispatch(self, message: EngineMessage) -> None:
        if isinstance(message, ProbeReply):
            self._probe_replies.put(message)
            return
        if isinstance(message, EngineFailed):  # the loop failed after start-up
            self._mark_dead(message.error)
            return
        if not isinstance(message, EngineOutputs):
            return
        self.big_step_s = message.big_step_s  # until the next message
        deliveries = []
        got_tokens = False
        with self._streams_lock:
            for output in message.outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                if output.new_token_ids:
                    got_tokens = True
                    num_tokens = self._num_tokens.get(output.request_id, 0)
                    self._num_tokens[output.request_id] = num_tokens + len(output.new_token_ids)
                if output.finished:
                    del self._streams[output.request_id]
                    self._num_tokens.pop(output.request_id, None)
                error = RequestRejectedError(output.error) if output.error else None
                deliveries.append((stream, error or output))
            if got_tokens:
                self.last_output_s = time.monotonic()
                self._longest_gap_s = 0.0
        deliver(deliveries)

    def _mark_dead(self, text: str) -> None:
        """No more outputs will come: every stream ends with ``text``, and, unless this
        process asked for it, the log says so (the server lives on, answering 503)."""
        with self._streams_lock:
            self._dead_error = EngineDeadError(text)
            streams, self._streams = list(self._streams.values()), {}
            self._num_tokens = {}
        if not self._shutting_down:
            logger.error(
                "%s; %d requests in flight end with an error, new ones are refused (503) and "
                "/health says dead: restart the server",
                text,
                len(streams),
            )
        deliver([(stream, EngineDeadError(text)) for stream in streams])

    # Shutdown ----------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Graceful: the engine aborts what is left (streams end with "abort") and exits."""
        self._shutting_down = True
        if self._dead_error is None and self.process.is_alive():
            with contextlib.suppress(EngineDeadError, zmq.ZMQError):
                self._send(Shutdown())
        self.process.join(timeout_s)
        self._stop_process(timeout_s=2.0)
        self._reader.join(timeout=timeout_s)
        self._closing.set()
        self._reader.join(timeout=2.0)
        if self._dead_error is None:
            self._mark_dead("the engine was shut down")
        self._close_sockets()

    def _stop_process(self, timeout_s: float) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout_s)

    def _close_sockets(self) -> None:
        self._input_channel.close()
        self._output.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EngineCoreClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


@contextlib.contextmanager
def _environment(added: dict[str, str]) -> Iterator[None]:
    """``added`` in os.environ while the block runs, then the environment as it was."""
    before = {name: os.environ.get(name) for name in added}
    os.environ.update(added)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def exit_text(exitcode: int | None) -> str:
    """``exit code 1``, or ``killed by SIGKILL`` for a process a signal ended (multiprocessing
    reports it as minus the signal's number)."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
