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
            check_address(endpoint, bind=False)
        self.endpoints = list(endpoints)
        self.engines = engines
        self.socket = (context or zmq.Context.instance()).socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.setsockopt(zmq.RCVHWM, rcvhwm)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        for endpoint in self.endpoints:
            self.socket.connect(endpoint)

    def receive_batch(self, now_ns: int) -> int:
        """Ingest up to RECV_BATCH messages already received, stamped ``now_ns``; how many."""
        return receive_batch(self.receive_frames, self.engines.on_frames, now_ns)

    def receive_frames(self, flags: int) -> list[bytes]:
        """One message's frames, as ``recv_multipart`` gives them at about 60% of its cost:
        a frame's own ``more`` flag instead of a getsockopt(RCVMORE) call per frame (ZMQ
        delivers a message's frames together, so once the first is here the rest are)."""
        frame = self.socket.recv(flags, copy=False)
        frames = [frame.bytes]
        while frame.more:
            frame = self.socket.recv(flags, copy=False)
            frames.append(frame.bytes)
        return frames

    def close(self) -> None:
        self.socket.close(linger=0)
