"""The sidecar's end of the lane: a ZMQ PULL socket feeding an Ingest from one thread.

    LaneLoop receives frames in batches, stamps each batch with one ``time.monotonic_ns()``
             and hands the frames to ``Ingest.on_frame`` (telemetry/sidecar/ingest.py); ticks
             the Ingest about every TICK_INTERVAL_S; counts the lane's disconnects and failed
             handshakes (from the socket's monitor) through ``Ingest.count_lane_disconnect``
             and ``count_lane_handshake_failure``, and says what a failed handshake means

Invariants:
- One thread runs ``run()``: every Ingest call, and so every sink call, comes from it, in
  arrival order. ``stop()`` is the only call safe from another thread or a signal handler.
- ``check_address`` (cli.py calls it first) takes ipc:// always, and a tcp:// bind only on
  a loopback address unless the caller means it (``allow_remote``).
- Memory is bounded before decoding: at most ``rcvhwm`` messages queue in ZMQ, and a peer
  sending a frame over GUARD_FRAME_BYTES is cut off as soon as the frame's size is read.
- On stop, what ZMQ already received is ingested (for up to DRAIN_LIMIT_S) before the
  socket closes: no later message could report that gap.
- Other sockets feeding the same Ingest (``subscribers``: the FPM subscriber,
  telemetry/sidecar/fpm_socket.py) are polled, drained and closed by this thread too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import zmq
from zmq.utils.monitor import parse_monitor_message

from telemetry.sidecar.ingest import MAX_FRAME_BYTES, TICK_INTERVAL_S, Ingest

GUARD_FRAME_BYTES = 16 * MAX_FRAME_BYTES  # beyond this ZMQ cuts the sender off (memory guard)
DEFAULT_RCVHWM = 65536  # messages; ~100 B each, so at most a few MiB queued
RECV_BATCH = 4096
DRAIN_LIMIT_S = 2.0  # at stop, at most this long ingesting what is already received
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
# A sender that fails its handshake retries every 100 ms or so (ZMQ's reconnect interval):
# the first few are said, then one line a minute at most, with the count.
HANDSHAKE_LINES_AT_ONCE = 3
HANDSHAKE_LINE_INTERVAL_S = 60.0
T = TypeVar("T")
logger = logging.getLogger("iterscope.sidecar")


def check_address(
    address: str, bind: bool, allow_remote: bool = False, what: str = "telemetry address"
) -> None:
    """ipc:// always; tcp:// only on a loopback address unless ``allow_remote``. ``what``
    names the address in the error (the lane's, an FPM producer's)."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("ipc", "tcp"):
        raise ValueError(f"{what} must be ipc://PATH or tcp://HOST:PORT, got {address!r}")
    if scheme == "tcp" and bind and not allow_remote:
        host = rest.rsplit(":", 1)[0].strip("[]")
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(
                f"binding {address!r} makes the telemetry lane reachable from other hosts; "
                "use 127.0.0.1, or pass --allow-remote to mean it"
            )


class Subscriber(Protocol):
    """Another socket feeding the Ingest (the FPM subscriber): polled beside the lane's."""

    socket: zmq.Socket

    def receive_batch(self, now_ns: int) -> int: ...

    def close(self) -> None: ...


def receive_batch(recv: Callable[[int], T], handle: Callable[[T, int], object], now_ns: int) -> int:
    """Hand up to RECV_BATCH messages already received (``recv(zmq.NOBLOCK)``: a socket's
    recv or recv_multipart) to ``handle``, each stamped ``now_ns``; how many there were."""
    for num_received in range(RECV_BATCH):
        try:
            message = recv(zmq.NOBLOCK)
        except zmq.Again:
            return num_received
        handle(message, now_ns)
    return RECV_BATCH


class LaneLoop:
    """A PULL socket feeding an Ingest, with ticks, until ``stop()``. One thread runs ``run()``."""

    def __init__(
        self,
        address: str,
        ingest: Ingest,
        bind: bool = True,
        rcvhwm: int = DEFAULT_RCVHWM,
        tick_interval_s: float = TICK_INTERVAL_S,
        context: zmq.Context | None = None,
        curve_keys_dir: str | None = None,
        subscribers: Sequence[Subscriber] = (),
    ) -> None:
        """``curve_keys_dir``: accept only engines holding CURVE keys listed there (tcp lanes
        across hosts; see telemetry/lane/curve.py). ``subscribers``: other sockets feeding
        ``ingest``, polled here and closed when ``run()`` returns."""
        self.address = address
        self.ingest = ingest
        self._subscribers = list(subscribers)
        self._tick_interval_ns = int(tick_interval_s * 1e9)
        self._stopped = threading.Event()
        self._context = context or zmq.Context.instance()
        self._curve = bool(curve_keys_dir)
        self._socket = self._context.socket(zmq.PULL)
        if curve_keys_dir:
            from telemetry.lane.curve import configure_server

            configure_server(self._socket, curve_keys_dir)
        self._socket.setsockopt(zmq.RCVHWM, rcvhwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Memory guard: a peer sending frames far above the oversize limit is disconnected
        # as soon as the frame's size is read. ZMQ drops that frame without a word; the
        # disconnect is what can be counted (see count_lane_disconnect).
        self._socket.setsockopt(zmq.MAXMSGSIZE, GUARD_FRAME_BYTES)
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED)
        # per cause (the monitor's event), when a failed handshake was last logged and how
        # many there were: a second sender failing for another cause is said at once
        self._handshakes: dict[int, list[float]] = {}
        if bind:
            self._socket.bind(address)
        else:
            self._socket.connect(address)

    def run(self) -> None:
        """Receive, decode and dispatch until stopped; the socket is closed on return."""
        socket, monitor = self._socket, self._monitor
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        for subscriber in self._subscribers:
            poller.register(subscriber.socket, zmq.POLLIN)
        poll_ms = max(1, self._tick_interval_ns // 1_000_000)
        next_tick_ns = time.monotonic_ns()
        try:
            while not self._stopped.is_set():
                ready = dict(poller.poll(poll_ms))
                if socket in ready:
                    self._receive_batch(time.monotonic_ns())
                if monitor in ready:
                    self._count_disconnects()
                for subscriber in self._subscribers:
                    if subscriber.socket in ready:
                        subscriber.receive_batch(time.monotonic_ns())
                now_ns = time.monotonic_ns()
                if now_ns >= next_tick_ns:
                    self.ingest.tick(now_ns)
                    next_tick_ns = now_ns + self._tick_interval_ns
            self._drain()
            self._count_disconnects()
        finally:
            socket.disable_monitor()
            monitor.close(linger=0)
            socket.close(linger=0)
            for subscriber in self._subscribers:
                subscriber.close()
            if self._curve:
                from telemetry.lane.curve import stop_server_auth

                stop_server_auth(self._context)

    def _receive_batch(self, now_ns: int) -> int:
        """Ingest up to RECV_BATCH frames already received, stamped ``now_ns``; how many."""
        return receive_batch(self._socket.recv, self.ingest.on_frame, now_ns)

    def _count_disconnects(self) -> None:
        while True:
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)  # [event, endpoint]
            except zmq.Again:
                return
            event = parse_monitor_message(frames)["event"]
            if event & HANDSHAKE_FAILED:
                self.ingest.count_lane_handshake_failure()
                self._say_handshake_failure(event)
            else:
                self.ingest.count_lane_disconnect()

    def _say_handshake_failure(self, event: int) -> None:
        """What a failed handshake means, where nothing else would say it: a sender refused
        by the handshake never gets a message through, so no engine shows up, no seq gap
        counts it, and the sender itself only counts drops it reports to nobody. Per cause,
        the first HANDSHAKE_LINES_AT_ONCE, then one line a minute (a refused sender retries
        every 100 ms or so); the count is of handshakes, not senders."""
        said = self._handshakes.setdefault(event, [0.0, 0])
        said[1] += 1
        now_s = time.monotonic()
        if said[1] > HANDSHAKE_LINES_AT_ONCE and now_s - said[0] < HANDSHAKE_LINE_INTERVAL_S:
            return
        said[0] = now_s
        if not self._curve:
            why = (
                "not a ZMQ sender, or one with CURVE keys (start this sidecar with the same "
                "--curve-keys-dir)"
            )
        elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            why = (
                "its CURVE key is not among the engine keys this sidecar trusts (give it one "
                "made by `iterscope curve-keys` in this sidecar's --curve-keys-dir)"
            )
        else:
            why = (
                "no CURVE keys (start our engine with --telemetry-curve-keys-dir, vLLM with "
                "ITERSCOPE_CURVE_KEYS_DIR: docs/deploy.md), or keys made for another sidecar "
                "(its server.key is not this sidecar's)"
            )
        logger.warning(
            "a sender to %s failed the lane's handshake (failed handshakes of this kind so "
            "far: %d): %s. Its messages are refused: its engine does not show up here "
            "(iterscope_lane_handshake_failures_total)",
            self.address,
            said[1],
            why,
        )

    def _drain(self) -> None:
        """On stop, ingest what ZMQ already received (up to DRAIN_LIMIT_S): closing the
        socket would drop it, and no later message could report that gap."""
        deadline_ns = time.monotonic_ns() + int(DRAIN_LIMIT_S * 1e9)
        receivers = [self._receive_batch] + [s.receive_batch for s in self._subscribers]
        for receive in receivers:
            while (now_ns := time.monotonic_ns()) < deadline_ns:
                if receive(now_ns) < RECV_BATCH:
                    break

    def stop(self) -> None:
        """Ask ``run()`` to return (safe from a signal handler or another thread)."""
        self._stopped.set()
