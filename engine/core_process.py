"""The engine core in a process of its own, and the client that talks to it.

    client (frontend)                              engine-core process (spawned)
    PUSH  ipc://DIR/input  --AddRequest/Abort/Shutdown/Probe-->  PULL
    PULL  ipc://DIR/output <--EngineReady/Failed/Outputs/ProbeReply--  PUSH

Both lanes are lossless, and the client never waits on the engine: a request that finds
the input lane full (ZMQ's high-water marks: the engine has stopped reading) is refused with
EngineBusyError, a control message (abort, shutdown) is kept and sent by the reader thread
once the engine reads again; the engine waits on a full output lane. The client binds both
sockets before the engine connects. Every frame the client sends is first decoded with the
engine's own decoder, so a value of a wrong type is rejected at submission instead of
reaching the engine; a frame the engine still cannot read rejects its request (or is
dropped) and never ends the engine.

The engine loop drains its input without blocking while it has work and waits for input when
idle; it sends one EngineOutputs per iteration that produced tokens, and an empty one at
least every PROGRESS_BEAT_S while it has work, so ``engine_state`` can tell stalled from
running. It exits on Shutdown (aborting what is left), or when its parent dies.

The client's reader thread routes outputs to one RequestStream per request, usable from
threads (``get`` / iteration) or from asyncio (``aget`` / ``async for``; the stream binds to
the event loop it was created in). It watches the process too: when the engine dies, every
waiter gets EngineDeadError within about 0.1 s.

The engine process imports no prometheus_client or opentelemetry and logs nothing per
iteration; ``probe()`` reports its loaded modules and log-record count so a test can check.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import multiprocessing
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import zmq

from engine.config import EngineConfig
from engine.core import EngineCore, RequestOutput, build_engine_core
from engine.request import FinishReason, Request, SamplingParams
from engine.scheduler import RequestRejectedError, check_request_fits

logger = logging.getLogger(__name__)

POLL_INTERVAL_MS = 100  # how often the client's reader checks that the engine is alive
IDLE_POLL_MS = 1000  # how often an idle engine checks that its parent is alive
BLOCKED_POLL_MS = 10  # work waits but nothing could be scheduled: do not spin flat out
# An engine with work sends at least this often (an empty EngineOutputs when its iterations
# produce no tokens, as long prefills do), so the client can tell a working engine from a
# stuck one by the age of its last message.
PROGRESS_BEAT_S = 1.0
DEFAULT_STALL_AFTER_S = 30.0  # requests in flight and no message for this long: stalled


# Client -> engine --------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_ns: int = 0  # time.monotonic_ns() at the frontend; 0 = when the engine reads it
    traceparent: str = ""


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]
    finish_reason: int = int(FinishReason.ABORT)  # STOP when the frontend matched a stop string


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


class Probe(msgspec.Struct, tag="probe", array_like=True):
    pass


EngineInput = AddRequest | AbortRequests | Shutdown | Probe


# Engine -> client --------------------------------------------------------------------------


class EngineReady(msgspec.Struct, tag="ready", array_like=True):
    pid: int
    model_name: str
    startup_lines: list[str]
    block_size: int
    num_kv_blocks: int
    max_model_len: int


class EngineFailed(msgspec.Struct, tag="failed", array_like=True):
    error: str


class EngineOutputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[RequestOutput]


class ProbeReply(msgspec.Struct, tag="probe_reply", array_like=True):
    top_level_modules: list[str]
    num_log_records: int  # since ready; counted only with config.test_count_log_records
    iteration: int


EngineMessage = EngineReady | EngineFailed | EngineOutputs | ProbeReply


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no more outputs will come."""


class EngineBusyError(RuntimeError):
    """The engine is not reading its input lane (it is stuck or stopped): a new request is
    refused at once rather than queued without bound."""


# The engine-core process -------------------------------------------------------------------


class _LogRecordCounter(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.num_records = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.num_records += 1


def run_engine_core(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    load_model: Any = None,
    runner_class: Any = None,
) -> None:
    """Entry point of the engine-core process (also usable in a thread for debugging)."""
    counter = _LogRecordCounter()
    if config.test_count_log_records:
        logging.getLogger().addHandler(counter)
        logging.getLogger().setLevel(logging.DEBUG)
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.connect(output_address)
    encoder = msgspec.msgpack.Encoder()
    core = None
    try:
        try:
            core, model = build_engine_core(config, load_model, runner_class)
            core.publisher = _make_publisher(
                config, core, config.served_model_name or model.config.name)
        except Exception as error:  # a start-up failure the client must see (e.g. story 5)
            outputs.send(encoder.encode(EngineFailed(f"{type(error).__name__}: {error}")))
            return
        ready = EngineReady(
            os.getpid(),
            model.config.name,
            core.startup_lines(),
            config.block_size,
            core.kv_plan.num_blocks,
            core.kv_plan.max_model_len,
        )
        outputs.send(encoder.encode(ready))
        counter.num_records = 0
        _EngineLoop(core, inputs, outputs, counter).run()
    finally:
        if core is not None:
            core.publisher.close()
        inputs.close(linger=0)
        outputs.close(linger=1000)
        context.term()
        _remove_lanes_if_orphaned(input_address)


def _remove_lanes_if_orphaned(input_address: str) -> None:
    """A client that was killed (SIGKILL) could not remove the private directory of the
    lanes' sockets; its engine, the last one using them, does."""
    parent = multiprocessing.parent_process()
    if parent is not None and not parent.is_alive() and input_address.startswith("ipc://"):
        shutil.rmtree(os.path.dirname(input_address[len("ipc://"):]), ignore_errors=True)


def _make_publisher(config: EngineConfig, core: EngineCore, model_name: str) -> Any:
    if config.telemetry_address is None:
        return core.publisher
    from telemetry.lane.publisher import ZmqPublisher

    return ZmqPublisher(
        config.telemetry_address,
        config.engine_index,
        facts=core.facts(model_name),
        curve_keys_dir=config.telemetry_curve_keys_dir,
        curve_engine_name=config.telemetry_curve_engine_name,
        sndhwm=config.telemetry_sndhwm,
        queue_capacity=config.telemetry_queue_capacity,
    )


class _EngineLoop:
    def __init__(self, core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket, counter):
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.counter = counter
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineInput)
        self.parent_pid = os.getppid()
        self.running = True
        self.last_sent_s = time.monotonic()

    def run(self) -> None:
        while self.running and os.getppid() == self.parent_pid:
            timeout_ms = IDLE_POLL_MS
            if self.core.has_work:
                timeout_ms = 0 if self.core.num_scheduled_reqs else BLOCKED_POLL_MS
            if self.inputs.poll(timeout_ms):
                self._drain_inputs()
            if self.running and self.core.has_work:
                request_outputs = self._step()
                now = time.monotonic()
                if request_outputs or now - self.last_sent_s >= PROGRESS_BEAT_S:
                    self._send(EngineOutputs(request_outputs))

    def _step(self) -> list[RequestOutput]:
        """One iteration; an error in it ends the engine, and the clients hear why."""
        try:
            return self.core.step()
        except Exception as error:
            self._send(EngineFailed(f"the engine loop failed: {type(error).__name__}: {error}"))
            raise

    def _drain_inputs(self) -> None:
        while self.running:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = self.decoder.decode(frame)
            except msgspec.DecodeError as error:  # ValidationError too: a value of a wrong type
                self._reject_undecodable(frame, error)
                continue
            self._handle(message)

    def _reject_undecodable(self, frame: bytes, error: msgspec.DecodeError) -> None:
        """A frame the engine cannot read never ends the engine: a request it can still name
        is rejected with the reason, anything else is dropped. (The client checks every frame
        before sending, so only a foreign sender gets here.)"""
        try:
            fields = msgspec.msgpack.decode(frame)
        except (msgspec.DecodeError, RecursionError):  # nested deeper than the stack
            return
        if isinstance(fields, list) and len(fields) > 1 and fields[0] == "add" and isinstance(
                fields[1], str):
            reason = f"undecodable request: {error}"
            self._send(EngineOutputs([RequestOutput(fields[1], [], True, None, 0, reason)]))

    def _handle(self, message: EngineInput) -> None:
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, AbortRequests):
            reason = _finish_reason(message.finish_reason)
            aborted = [self.core.abort_request(rid, reason) for rid in message.request_ids]
            self._send(EngineOutputs([output for output in aborted if output is not None]))
        elif isinstance(message, Probe):
            modules = sorted({name.split(".")[0] for name in sys.modules})
            reply = ProbeReply(modules, self.counter.num_records, self.core.iteration)
            self._send(reply)
        else:
            self._shutdown()

    def _add(self, message: AddRequest) -> None:
        try:
            request = Request(
                message.request_id,
                message.prompt_token_ids,
                message.sampling_params,
                arrival_ns=message.arrival_ns,
                traceparent=message.traceparent,
            )
            self.core.add_request(request)
        except ValueError as error:
            rejected = RequestOutput(message.request_id, [], True, None, 0, str(error))
            self._send(EngineOutputs([rejected]))

    def _shutdown(self) -> None:
        """Graceful: abort what is left so every waiter hears the end, then stop."""
        aborted = [self.core.abort_request(request_id) for request_id in list(self.core.requests)]
        if aborted:
            self._send(EngineOutputs([output for output in aborted if output is not None]))
            self.core.step()  # schedules nothing; publishes the aborts' finish milestones
        self.running = False

    def _send(self, message: Any) -> None:
        """Lossless while the client lives; if the parent dies while the lane is full, stop
        instead of blocking forever."""
        frame = self.encoder.encode(message)
        self.last_sent_s = time.monotonic()
        while True:
            try:
                self.outputs.send(frame, zmq.NOBLOCK)
                return
            except zmq.Again:
                if os.getppid() != self.parent_pid:
                    raise SystemExit("the engine's client process is gone") from None
                self.outputs.poll(IDLE_POLL_MS, zmq.POLLOUT)


def _finish_reason(value: int) -> FinishReason:
    """The abort's finish reason; an unknown one (a foreign sender) is a plain abort."""
    try:
        return FinishReason(value)
    except ValueError:
        return FinishReason.ABORT


# The client --------------------------------------------------------------------------------


class RequestStream:
    """Outputs of one request, in order, ending with a finished one.

    Created inside a running asyncio loop, it is awaited (``aget``, ``async for``); created
    elsewhere, it is read from threads (``get``, ``for``). Errors arrive as exceptions:
    RequestRejectedError (the engine refused it) or EngineDeadError.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None
        self._queue: Any = asyncio.Queue() if self._loop else queue.Queue()
        self.finished = False

    def put(self, item: RequestOutput | Exception) -> None:
        """Called by the client's reader thread (``deliver`` hands over many at once)."""
        deliver([(self, item)])

    def _unwrap(self, item: RequestOutput | Exception) -> RequestOutput:
        if isinstance(item, Exception):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def get(self, timeout: float | None = None) -> RequestOutput:
        if self._loop is not None:
            raise RuntimeError("this stream belongs to an asyncio loop: use aget()")
        return self._unwrap(self._queue.get(timeout=timeout))

    async def aget(self) -> RequestOutput:
        if self._loop is None:
            raise RuntimeError("this stream was made outside asyncio: use get()")
        return self._unwrap(await self._queue.get())

    def __iter__(self) -> Iterator[RequestOutput]:
        while not self.finished:
            yield self.get()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            yield await self.aget()


def deliver(deliveries: list[tuple[RequestStream, RequestOutput | Exception]]) -> None:
    """Hand each item to its stream, waking each event loop once for all of its streams:
    one iteration's outputs for N requests cost one wake-up of the frontend's loop, not N."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in deliveries:
        if stream._loop is None:
            stream._queue.put(item)
        else:
            by_loop.setdefault(stream._loop, []).append((stream._queue, item))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | Exception]]) -> None:
    for stream_queue, item in items:
        stream_queue.put_nowait(item)


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
        self._input = self._context.socket(zmq.PUSH)
        self._input.bind(input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.bind(output_address)
        self._encoder = msgspec.msgpack.Encoder()
        self._input_decoder = msgspec.msgpack.Decoder(EngineInput)
        self._decoder = msgspec.msgpack.Decoder(EngineMessage)
        self._input_lock = threading.Lock()
        self._pending_frames: collections.deque[bytes] = collections.deque()
        self.last_message_s = time.monotonic()  # when the engine was last heard from
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
        self.process.start()
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
                    f"the engine process exited during start-up (exit code {self.process.exitcode})"
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
        frame = self._encoder.encode(message)  # fails here, before any state, if unencodable
        try:
            self._input_decoder.decode(frame)  # the engine's own check, before it gets there
        except msgspec.ValidationError as error:  # e.g. SamplingParams(seed="7")
            raise RequestRejectedError(f"request {request_id!r}: {error}") from None
        stream = RequestStream(request_id)
        with self._streams_lock:
            self._raise_if_dead()
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in flight")
            if not self._streams:  # an idle engine owes no message: the stall clock starts now
                self.last_message_s = time.monotonic()
            self._streams[request_id] = stream
        try:
            self._send_frame(frame)
        except BaseException:
            with self._streams_lock:
                self._streams.pop(request_id, None)
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

    def engine_state(self, stall_after_s: float = DEFAULT_STALL_AFTER_S) -> str:
        """"dead" (the process is gone), "stalled" (requests in flight and no message from
        the engine for ``stall_after_s``; it beats every PROGRESS_BEAT_S while it works),
        "running" (requests in flight) or "idle". Cheap: no message to the engine."""
        if not self.is_alive:
            return "dead"
        if not self._streams:
            return "idle"
        if time.monotonic() - self.last_message_s > stall_after_s:
            return "stalled"
        return "running"

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def _send(self, message: Any) -> None:
        """A control message (abort, probe, shutdown): sent now, or, while the engine is not
        reading its lane, kept and sent by the reader thread once it reads again. Never
        blocks the caller (the frontend's event loop)."""
        frame = self._encoder.encode(message)
        with self._input_lock:
            if not self._pending_frames and self._try_send(frame):
                return
            self._pending_frames.append(frame)

    def _send_frame(self, frame: bytes) -> None:
        """A request: sent now or refused with EngineBusyError; never waits (a PUSH socket
        with no reader would block a plain send forever)."""
        self._raise_if_dead()
        if not self.process.is_alive():
            raise EngineDeadError(f"the engine process died (exit code {self.process.exitcode})")
        with self._input_lock:
            if self._try_send(frame):
                return
        raise EngineBusyError(
            f"the engine is not taking requests: {len(self._streams)} are in flight and its "
            f"input lane is full (last heard from {time.monotonic() - self.last_message_s:.0f} "
            "s ago)")

    def _try_send(self, frame: bytes) -> bool:
        try:
            self._input.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def _flush_pending(self) -> None:
        """Reader thread: send the control messages the full lane held back, in order."""
        with self._input_lock:
            while self._pending_frames and self._try_send(self._pending_frames[0]):
                self._pending_frames.popleft()

    def _raise_if_dead(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error

    # Outputs -----------------------------------------------------------------------------

    def _read_outputs(self) -> None:
        while not self._closing.is_set():
            if self._pending_frames:
                self._flush_pending()
            if self._output.poll(POLL_INTERVAL_MS):
                self.last_message_s = time.monotonic()
                self._dispatch(self._decoder.decode(self._output.recv()))
            elif not self.process.is_alive():
                self._drain_outputs()
                reason = "shut down" if self._shutting_down else "died"
                self._mark_dead(
                    f"the engine process {reason} (pid {self.process.pid}, exit code "
                    f"{self.process.exitcode})"
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
        deliveries = []
        with self._streams_lock:
            for output in message.outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue
                if output.finished:
                    del self._streams[output.request_id]
                error = RequestRejectedError(output.error) if output.error else None
                deliveries.append((stream, error or output))
        deliver(deliveries)

    def _mark_dead(self, text: str) -> None:
        with self._streams_lock:
            self._dead_error = EngineDeadError(text)
            streams, self._streams = list(self._streams.values()), {}
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
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EngineCoreClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
