"""Engine side of the telemetry lane: hand off, never block, count what could not be sent.

The engine loop's only cost per iteration is ``publish``: a bounded ``deque.append`` of the
record it filled (no encoding, no syscall, no lock). A sender thread of this module owns the
socket and the encoder: every ``SEND_INTERVAL_S`` it stamps, encodes and sends what is
queued, and about once a second it sends a Heartbeat (at ``close``, a last one that says
so). Torch releases the GIL in its kernels, so this work overlaps the forward pass instead
of sitting between two of them. The period is long on purpose: on a CPU where torch uses
every core, each wake-up of another thread stalls a parallel region. Waking every 2 ms cost
the engine about 5% of its throughput (bench/telemetry_throughput.py), and even every 20 ms
cost `iterscope serve` on a 2-core CPU ~5% of its output tok/s against every 100 ms
(docs/performance.md): engines whose torch threads hold every core (ours on CPU, vLLM's
engine core) send every CPU_ENGINE_SEND_INTERVAL_S, the rest every SEND_INTERVAL_S, which
keeps a record's way to /metrics within 50 ms.

    engine thread                 sender thread (owns socket + encoder)
    publish(record) --deque-->    seq = next; num_dropped = seq - last_sent_seq - 1
                                  encode, send(NOBLOCK) --ZMQ PUSH--> sidecar

Loss is always counted and always visible as a ``msg_seq`` gap:
- queue full (sender starved): the engine thread counts the record; the sender gives it a
  seq number that is never sent;
- ``zmq.Again`` (sidecar absent, slow or stopped; ``ZMQ_IMMEDIATE`` keeps messages from
  queueing for a sidecar that is not there): the frame is dropped.
Either way the next message sent carries ``num_dropped`` = the size of the gap before it.

A sidecar meets an engine only by a heartbeat (its facts and clock anchor) and rejects the
records that come before one. So after a send failed (no sidecar, or a new one restarting),
the first message that gets through is a heartbeat: a record waits for the socket to take a
heartbeat first (``_reintroduce``), and a restarted sidecar loses none of what it receives.
"""

from __future__ import annotations

import collections
import os
import tempfile
import threading
import time

import zmq

from telemetry.lane.record import Heartbeat, IterationRecord, make_encoder

DEFAULT_SNDHWM = 8192  # frames in ZMQ's queue; ~60 B each, about 0.5 MiB
DEFAULT_QUEUE_CAPACITY = 16384  # records waiting for the sender thread
HEARTBEAT_INTERVAL_S = 1.0
SEND_INTERVAL_S = 0.02  # the sender thread's wake-up period
CPU_ENGINE_SEND_INTERVAL_S = 0.1  # where the engine's torch threads hold every core
CLOSE_LINGER_MS = 1000  # at close, how long ZMQ may take to deliver what it holds
# Once, at start-up, in the sender thread: how long its first send waits for the connection
# (a send before it completes is dropped, ZMQ_IMMEDIATE); a sidecar started just before the
# engine on a busy machine can take longer than 100 ms to accept it (the first heartbeat was
# lost at one start in three: "1 telemetry messages lost" on an idle engine).
CONNECT_WAIT_MS = 1000
CONNECT_POLL_MS = 20  # close() cuts the wait short within this


def default_address() -> str:
    """The sidecar's default lane: a per-user ipc path, not reachable from other hosts, no
    collision between users."""
    return f"ipc://{tempfile.gettempdir()}/iterscope-{os.getuid()}/telemetry.sock"


class NullPublisher:
    """Telemetry off: the same calls, nothing sent."""

    last_iteration = 0

    def publish(self, record: IterationRecord) -> None:
        self.last_iteration = record.iteration

    def note_queues(self, num_waiting: int, num_running: int, step_tokens: int = 0) -> None:
        pass

    def flush(self, timeout_s: float = 5.0) -> bool:
        return True

    def close(self, stop_requested: bool = False) -> None:
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
        queue_capacity: int = DEFAULT_QUEUE_CAPACITY,
        send_interval_s: float = SEND_INTERVAL_S,
    ) -> None:
        """``facts``: static Heartbeat fields (model_name, device_name, block_size, ...).

        ``curve_keys_dir``: authenticate and encrypt with ZMQ CURVE as engine
        ``curve_engine_name`` (for tcp lanes across hosts; see telemetry/lane/curve.py)."""
        self.engine_index = engine_index
        self.last_iteration = 0
        # Written by the sender thread only.
        self.num_sent_total = 0
        self.num_dropped_total = 0
        self._next_seq = 1
        self._last_sent_seq = 0
        self._num_queue_full_counted = 0
        self._peer_unsure = False  # a send failed: a heartbeat must get through first
        self._stop_requested = False  # close() says it before the sender thread reads it
        self._encoder = make_encoder()
        # Written by the engine thread only.
        self._num_queue_full = 0
        self._num_waiting = 0
        self._num_running = 0
        self._step_tokens = 0
        self._queue: collections.deque = collections.deque()
        self._queue_capacity = queue_capacity
        self._facts = dict(facts or {}, pid=os.getpid())
        self._heartbeat_interval_s = heartbeat_interval_s
        self._send_interval_s = send_interval_s
        # A context of its own unless given one: close() terminates it, which returns once
        # ZMQ has written what the socket holds (the closing heartbeat), up to CLOSE_LINGER_MS.
        # vLLM kills its engine core a moment after its stop signal: a heartbeat left in a
        # shared context's queue was lost with the process (the sidecar then said "dead").
        self._own_context = zmq.Context() if context is None else None
        try:
            self._socket = _connect(
                context or self._own_context, address, sndhwm, curve_keys_dir, curve_engine_name
            )
        except BaseException:
            if self._own_context is not None:
                self._own_context.term()
            raise
        self._closed = threading.Event()
        self._wake = threading.Event()  # flush() and close() cut the sender's sleep short
        self._thread = threading.Thread(target=self._run, name="iterscope-telemetry", daemon=True)
        self._thread.start()

    # Engine thread ------------------------------------------------------------------------

    def publish(self, record: IterationRecord) -> None:
        """Queue the record for the sender thread; O(1), never blocks. The sender stamps
        ``msg_seq`` and ``num_dropped``. Heartbeats report the last iteration that scheduled
        work, so a loop that spins without scheduling anything reads as stalled."""
        if record.num_prefill_tokens or record.num_decode_tokens:
            self.last_iteration = record.iteration
        self._num_waiting = record.num_waiting_reqs
        self._num_running = record.num_running_reqs
        self._step_tokens = 0
        if len(self._queue) < self._queue_capacity:
            self._queue.append(record)
        else:
            self._num_queue_full += 1

    def note_queues(self, num_waiting: int, num_running: int, step_tokens: int = 0) -> None:
        """Queue lengths changed outside a record: a request arrived while idle, or an
        iteration was scheduled (``step_tokens``: the tokens it computes, said by heartbeats
        until its record is published)."""
        self._num_waiting = num_waiting
        self._num_running = num_running
        self._step_tokens = step_tokens

    def update_facts(self, **facts: object) -> None:
        """Static Heartbeat fields learnt after start-up (a vLLM server's KV pool size).
        The dict is replaced, not changed, so the sender thread never sees it half-updated."""
        self._facts = {**self._facts, **facts}

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything published so far was sent or counted as dropped."""
        done = threading.Event()
        self._queue.append(done)
        self._wake.set()
        return done.wait(timeout_s)

    def close(self, stop_requested: bool = False) -> None:
        """Send what is queued and a closing heartbeat (the last message: the sidecar and
        explain read the silence after it as a shutdown, not a death, where nothing is in
        flight or ``stop_requested``: the engine was told to stop), then stop the sender
        thread and close the socket, waiting up to CLOSE_LINGER_MS for ZMQ to write the frames
        it still holds (where the publisher has its own context)."""
        if self._closed.is_set():  # closed already (an exit hook after the stop watch)
            return
        self._stop_requested = stop_requested
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self._socket.close(linger=CLOSE_LINGER_MS)
        own_context, self._own_context = self._own_context, None
        if own_context is not None:
            own_context.term()  # returns once the frames the socket held are written

    # Sender thread ------------------------------------------------------------------------

    def _run(self) -> None:
        self._wait_for_connection()
        # First a heartbeat: the sidecar meets an engine by it, and counts records before it
        # as lost (those published while the sender waited for the connection).
        self._send_heartbeat()
        next_heartbeat_s = time.monotonic() + self._heartbeat_interval_s
        while True:
            closing = self._closed.is_set()
            self._send_queued()
            if closing:  # the last message: the sidecar reads the silence after it as a close
                self._send_heartbeat(closing=True, stop_requested=self._stop_requested)
                return
            if time.monotonic() >= next_heartbeat_s:
                self._send_heartbeat()
                next_heartbeat_s = time.monotonic() + self._heartbeat_interval_s
            self._wake.wait(self._send_interval_s)
            self._wake.clear()

    def _wait_for_connection(self) -> None:
        """Up to CONNECT_WAIT_MS for the sidecar to accept the connection, unless closed."""
        for _ in range(CONNECT_WAIT_MS // CONNECT_POLL_MS):
            if self._closed.is_set() or self._socket.poll(CONNECT_POLL_MS, zmq.POLLOUT):
                return

    def _send_queued(self) -> None:
        queue = self._queue
        while queue:
            item = queue.popleft()
            if type(item) is threading.Event:  # a flush marker
                self._count_queue_full()
                item.set()
                continue
            if self._peer_unsure:
                self._reintroduce()
            item.msg_seq = self._take_seq()
            item.num_dropped = item.msg_seq - self._last_sent_seq - 1
            self._send(item)
        self._count_queue_full()

    def _reintroduce(self) -> None:
        """After a failed send, a heartbeat before the next record, as soon as the socket
        takes one (a sidecar connected): the sidecar meets the engine by it. Until then the
        record is sent and dropped as before; a connection completing between this check and
        the record's send lets one record through first, which that sidecar rejects."""
        if self._socket.poll(0, zmq.POLLOUT):
            self._send_heartbeat()

    def _count_queue_full(self) -> None:
        """Records the engine thread could not queue take seq numbers that are never sent,
        after the records that were queued before them."""
        num_queue_full = self._num_queue_full  # read once: the engine thread adds to it
        num_new = num_queue_full - self._num_queue_full_counted
        if num_new:
            self._num_queue_full_counted = num_queue_full
            self._next_seq += num_new
            self.num_dropped_total += num_new

    def _send_heartbeat(self, closing: bool = False, stop_requested: bool = False) -> None:
        ts_ns = time.monotonic_ns()
        seq = self._take_seq()
        heartbeat = Heartbeat(
            engine_index=self.engine_index,
            msg_seq=seq,
            ts_ns=ts_ns,
            wall_ns=time.time_ns(),
            last_iteration=self.last_iteration,
            num_waiting_reqs=self._num_waiting,
            num_running_reqs=self._num_running,
            num_dropped=seq - self._last_sent_seq - 1,
            **self._facts,
            step_tokens=self._step_tokens,
            closing=closing,
            stop_requested=stop_requested,
        )
        self._send(heartbeat)

    def _take_seq(self) -> int:
        seq = self._next_seq
        self._next_seq = seq + 1
        return seq

    def _send(self, message: IterationRecord | Heartbeat) -> None:
        try:
            self._socket.send(self._encoder.encode(message), zmq.NOBLOCK)
        except zmq.Again:
            self.num_dropped_total += 1
            self._peer_unsure = True
        else:
            self._last_sent_seq = message.msg_seq
            self.num_sent_total += 1
            if type(message) is Heartbeat:
                self._peer_unsure = False


def _connect(
    context: zmq.Context,
    address: str,
    sndhwm: int,
    curve_keys_dir: str | None,
    curve_engine_name: str,
) -> zmq.Socket:
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(zmq.SNDHWM, sndhwm)
    socket.setsockopt(zmq.IMMEDIATE, 1)
    socket.setsockopt(zmq.LINGER, 0)
    if curve_keys_dir:
        from telemetry.lane.curve import configure_client

        try:
            configure_client(socket, curve_keys_dir, curve_engine_name)
        except (OSError, ValueError):
            socket.close(linger=0)
            raise
    socket.connect(address)  # completed while the sender thread waits (CONNECT_WAIT_MS)
    return socket
