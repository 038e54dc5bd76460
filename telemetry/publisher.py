"""Engine side of the telemetry lane: send, never block, count what could not be sent.

One ZMQ PUSH socket (connected to the sidecar's PULL) carries iteration records from the
engine loop and heartbeats from a small thread of this module; a lock serialises the two
(uncontended in practice: the heartbeat sends once a second). ``ZMQ_IMMEDIATE`` keeps
messages from queueing for a sidecar that is not there, and a full queue raises
``zmq.Again``: the message is dropped, counted, and the count rides in the next message that
is sent. Nothing here logs, formats or allocates per iteration beyond the encoded bytes.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

import zmq

from telemetry.record import Heartbeat, IterationRecord, make_encoder

DEFAULT_SNDHWM = 8192  # messages; ~60 B each, so at most about 0.5 MiB queued
HEARTBEAT_INTERVAL_S = 1.0
CONNECT_WAIT_MS = 100  # once, at start-up


class NullPublisher:
    """Telemetry off: the same calls, nothing sent."""

    last_iteration = 0

    def publish(self, record: IterationRecord) -> None:
        self.last_iteration = record.iteration

    def note_queues(self, num_waiting: int, num_running: int) -> None:
        pass

    def close(self) -> None:
        pass


class ZmqPublisher:
    """Publishes IterationRecords and Heartbeats for one engine on one address."""

    def __init__(
        self,
        address: str,
        engine_index: int,
        facts: dict | None = None,
        sndhwm: int = DEFAULT_SNDHWM,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        context: zmq.Context | None = None,
        curve_keys_dir: str | None = None,
        curve_engine_name: str = "engine",
    ) -> None:
        """``facts``: static Heartbeat fields (model_name, device_name, block_size, ...).

        ``curve_keys_dir``: authenticate and encrypt with ZMQ CURVE as engine
        ``curve_engine_name`` (for tcp lanes across hosts; see telemetry/curve.py)."""
        self.engine_index = engine_index
        self.num_dropped_total = 0
        self.num_sent_total = 0
        self.last_iteration = 0
        self._num_waiting = 0
        self._num_running = 0
        self._facts = dict(facts or {}, pid=os.getpid())
        self._seq = itertools.count(1)
        self._dropped_since_sent = 0
        self._lock = threading.Lock()
        self._encoder = make_encoder()
        self._ctx = context or zmq.Context.instance()
        self._socket = self._ctx.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, sndhwm)
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._socket.setsockopt(zmq.LINGER, 0)
        if curve_keys_dir:
            from telemetry.curve import configure_client

            try:
                configure_client(self._socket, curve_keys_dir, curve_engine_name)
            except (OSError, ValueError):
                self._socket.close(linger=0)
                raise
        self._socket.connect(address)
        # With ZMQ_IMMEDIATE a send before the connection completes is dropped: give a
        # listening sidecar a moment, so the first heartbeat is not reported as lost.
        self._socket.poll(CONNECT_WAIT_MS, zmq.POLLOUT)
        self._closed = threading.Event()
        self._heartbeat_interval_s = heartbeat_interval_s
        self._thread = threading.Thread(
            target=self._heartbeat_loop, name="iterscope-heartbeat", daemon=True
        )
        self._thread.start()

    def publish(self, record: IterationRecord) -> None:
        """Stamp ``seq`` and ``num_dropped`` on the record and send it without blocking."""
        self.last_iteration = record.iteration
        self._num_waiting = record.num_waiting_reqs
        self._num_running = record.num_running_reqs
        with self._lock:
            record.seq = next(self._seq)
            record.num_dropped = self._dropped_since_sent
            self._send(self._encoder.encode(record))

    def note_queues(self, num_waiting: int, num_running: int) -> None:
        """Queue lengths changed outside an iteration (a request arrived while idle)."""
        self._num_waiting = num_waiting
        self._num_running = num_running

    def send_heartbeat(self) -> None:
        with self._lock:
            ts_ns = time.monotonic_ns()
            heartbeat = Heartbeat(
                engine_index=self.engine_index,
                seq=next(self._seq),
                ts_ns=ts_ns,
                wall_ns=time.time_ns(),
                last_iteration=self.last_iteration,
                num_waiting_reqs=self._num_waiting,
                num_running_reqs=self._num_running,
                num_dropped=self._dropped_since_sent,
                **self._facts,
            )
            self._send(self._encoder.encode(heartbeat))

    def _send(self, frame: bytes) -> None:
        """Caller holds the lock."""
        try:
            self._socket.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            self._dropped_since_sent += 1
            self.num_dropped_total += 1
        else:
            self._dropped_since_sent = 0
            self.num_sent_total += 1

    def _heartbeat_loop(self) -> None:
        while not self._closed.is_set():
            self.send_heartbeat()
            self._closed.wait(self._heartbeat_interval_s)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2)
        with self._lock:
            self._socket.close(linger=0)
