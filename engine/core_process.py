"""The engine core in a process of its own (spawned by engine/core_client.py).

The engine loop drains its input channel without blocking while it has work and waits for input
when idle; it sends one EngineOutputs per iteration that produced tokens, and an empty one at
least every PROGRESS_BEAT_S while it has work, so the client can tell stalled from running.
It waits on a full output channel (lossless), exits on Shutdown (aborting what is left) or when
its parent dies. A frame it cannot read rejects its request (or is dropped) and never ends
the engine.

The engine process imports no prometheus_client or opentelemetry and logs nothing per
iteration; a Probe reports its loaded modules and log-record count so a test can check.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any

import msgspec
import zmq

from engine.config import EngineConfig
from engine.core import EngineCore, RequestOutput
from engine.core_messages import (
    PROGRESS_BEAT_S,
    AbortRequests,
    AddRequest,
    EngineFailed,
    EngineInput,
    EngineOutputs,
    EngineReady,
    Probe,
    ProbeReply,
)
from engine.request import FinishReason, Request
from engine.startup import build_engine_core

IDLE_POLL_MS = 1000  # how often an idle engine checks that its parent is alive
BLOCKED_POLL_MS = 10  # work waits but nothing could be scheduled: do not spin flat out


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
    """Entry point of the engine-core process (also usable in a thread for debugging).

    Ctrl-C in a terminal reaches the whole process group: the engine ignores it and lets its
    client shut it down (Shutdown, SIGTERM, or the client's death, which the loop notices),
    so a stopped server prints no engine traceback and loses no outputs in flight."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
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
    core = loop = None
    try:
        try:
            core, model = build_engine_core(config, load_model, runner_class)
            core.publisher = make_publisher(
                config, core, config.served_model_name or model.config.name
            )
        except Exception as error:  # e.g. the KV cache cannot hold one max-length request
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
        loop = _EngineLoop(core, inputs, outputs, counter)
        loop.run()
    finally:
        if core is not None:  # told to stop: a Shutdown ended the loop (not its parent's death)
            core.publisher.close(stop_requested=loop is not None and not loop.running)
        inputs.close(linger=0)
        outputs.close(linger=1000)
        context.term()
        _remove_channels_if_orphaned(input_address)


def _remove_channels_if_orphaned(input_address: str) -> None:
    """A client that was killed (SIGKILL) could not remove the private directory of the
    channels' sockets; its engine, the last one using them, does."""
    parent = multiprocessing.parent_process()
    if parent is not None and not parent.is_alive() and input_address.startswith("ipc://"):
        shutil.rmtree(os.path.dirname(input_address[len("ipc://") :]), ignore_errors=True)


def make_publisher(config: EngineConfig, core: EngineCore, model_name: str) -> Any:
    """The engine's telemetry publisher as ``config`` asks for it (the core's NullPublisher
    when no lane is set); benchmarks build theirs here too, so they measure the engine's."""
    if config.telemetry_address is None:
        return core.publisher
    from telemetry.lane.publisher import CPU_ENGINE_SEND_INTERVAL_S, SEND_INTERVAL_S, ZmqPublisher

    return ZmqPublisher(
        config.telemetry_address,
        config.engine_index,
        facts=core.facts(model_name),
        send_interval_s=CPU_ENGINE_SEND_INTERVAL_S if config.device == "cpu" else SEND_INTERVAL_S,
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
        core.on_big_step = self._say_big_step

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

    def _say_big_step(self, bound_s: float) -> None:
        """An iteration bigger than any before starts, which may take ``bound_s``: the client
        hears it first, since no progress beat can come until it ends."""
        self._send(EngineOutputs([], big_step_s=bound_s))

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
        if (
            isinstance(fields, list)
            and len(fields) > 1
            and fields[0] == "add"
            and isinstance(fields[1], str)
        ):
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
        """Lossless while the client lives; if the parent dies while the channel is full, stop
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
