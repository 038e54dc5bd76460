"""The sidecar's FPM subscriber: one ZMQ SUB socket connected to every ``--fpm`` endpoint.

FPM producers (SGLang, Dynamo, vLLM's pull request) bind a PUB socket; the sidecar connects
with an empty subscription and hands each message's frames to FpmEngines
(telemetry/sidecar/fpm_engines.py), which numbers and ingests them. The LaneLoop polls this
socket beside the lane's (telemetry/sidecar/lane_loop.py), so every Ingest call still comes
from its one thread.

Invariants:
- Memory is bounded before decoding: at most ``rcvhwm`` messages queue in ZMQ (a PUB drops
  beyond that, which shows as a seq gap), and a producer sending a frame over
  MAX_FRAME_BYTES is cut off as soon as the frame's size is read.
- Connecting reaches out to the producer, so any tcp:// host is allowed: the operator named
  it. Messages published before the connection is up are never received (PUB/SUB).
"""

from __future__ import annotations

from collections.abc import Sequence

import zmq

from telemetry.sidecar.fpm_engines import FpmEngines
from telemetry.sidecar.ingest import MAX_FRAME_BYTES
from telemetry.sidecar.lane_loop import DEFAULT_RCVHWM, check_address, receive_batch
from telemetry.sources.fpm import SEQ_BYTES


def endpoints_by_rank(endpoints: Sequence[str], num_dp_ranks: int) -> list[str]:
    """Each tcp://HOST:PORT endpoint as the ``num_dp_ranks`` endpoints PORT, PORT+1, ... of
    a producer that binds one port per data-parallel rank; ValueError for an ipc:// one
    (no port to add a rank to) or a port past 65535."""
    if num_dp_ranks < 1:
        raise ValueError(f"--fpm-dp-ranks must be at least 1, got {num_dp_ranks}")
    if num_dp_ranks == 1:
        return list(endpoints)
    expanded = []
    for endpoint in endpoints:
        host, sep, port = endpoint.rpartition(":")
        if not endpoint.startswith("tcp://") or not sep or not port.isdigit():
            raise ValueError(
                f"--fpm-dp-ranks {num_dp_ranks} needs tcp://HOST:PORT endpoints (one port per "
                f"rank from PORT on), got {endpoint!r}"
            )
        last_port = int(port) + num_dp_ranks - 1
        if last_port > 65535:
            raise ValueError(f"{endpoint!r} with {num_dp_ranks} ranks runs past port 65535")
        expanded += [f"{host}:{rank_port}" for rank_port in range(int(port), last_port + 1)]
    return expanded


class FpmSubscriber:
    """A SUB socket on the FPM endpoints feeding FpmEngines; ``receive_batch`` from the
    LaneLoop's thread only."""

    def __init__(
        self,
        endpoints: Sequence[str],
        engines: FpmEngines,
        context: zmq.Context | None = None,
        rcvhwm: int = DEFAULT_RCVHWM,
    ) -> None:
        """ValueError for an endpoint that is not ipc:// or tcp://."""
        for endpoint in endpoints:
            check_address(endpoint, bind=False, what="an --fpm endpoint")
        self.endpoints = list(endpoints)
        self.engines = engines
        self.socket = (context or zmq.Context.instance()).socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.setsockopt(zmq.RCVHWM, rcvhwm)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        for endpoint in self.endpoints:
            self.socket.connect(endpoint)
        self._recv = self.socket.recv
        self._next_topic: bytes | None = None  # an empty frame read where a topic may start

    def receive_batch(self, now_ns: int) -> int:
        """Ingest up to RECV_BATCH messages already received, stamped ``now_ns``; how many."""
        return receive_batch(self.receive_frames, self.engines.on_frames, now_ns)

    def receive_frames(self, flags: int) -> list[bytes]:
        """One message's frames: ``[topic, seq, payload]`` for a message shaped as FPM's, else
        the frames of a message of another shape, which decode_frames refuses ('malformed').

        Read as copies without asking each frame's more flag (pyzmq asks it for 0.55 us a
        frame, a zero-copy Frame costs 0.4: three times the copies themselves), from what
        an FPM message is: an empty topic, an 8-byte seq, then the payload, whose more flag
        alone is asked. So every well-formed message is read whole, whatever came before:
        - a topic that is not empty starts a message of another kind, read by its flags;
        - ZMQ delivers a message's frames together: a frame missing (zmq.Again) means the
          message ended;
        - an empty frame where the seq belongs, or an empty payload followed by more, may
          be the topic of the next message (the one before was cut short): it is kept as the
          next call's topic, and the frames before it are refused.
        A message cut short is therefore refused with its frames up to the next empty one,
        and a garbage message of several empty frames may be counted more than once."""
        topic = self._next_topic
        if topic is None:
            topic = self._recv(flags)  # zmq.Again: nothing queued
        else:
            self._next_topic = None
        if topic:
            return self._rest_of_message([topic])
        try:
            seq = self._recv(zmq.NOBLOCK)
        except zmq.Again:
            return [topic]
        if len(seq) != SEQ_BYTES:
            if seq:
                return self._rest_of_message([topic, seq])
            self._next_topic = seq
            return [topic]
        try:
            payload = self._recv(zmq.NOBLOCK)
        except zmq.Again:
            return [topic, seq]
        if not self._more():
            return [topic, seq, payload]
        if payload:
            return self._rest_of_message([topic, seq, payload])
        self._next_topic = payload
        return [topic, seq]

    def _more(self) -> bool:
        """Whether the frame received last has more after it."""
        return bool(self.socket.get(zmq.RCVMORE))

    def _rest_of_message(self, frames: list[bytes]) -> list[bytes]:
        """``frames`` (the last one received last) and the rest of their message."""
        while self._more():
            frames.append(self._recv(zmq.NOBLOCK))
        return frames

    def close(self) -> None:
        self.socket.close(linger=0)
