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
from telemetry.sidecar.lane_loop import DEFAULT_RCVHWM, RECV_BATCH, check_address


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
        recv, on_frames = self.socket.recv_multipart, self.engines.on_frames
        for num_received in range(RECV_BATCH):
            try:
                frames = recv(zmq.NOBLOCK)
            except zmq.Again:
                return num_received
            on_frames(frames, now_ns)
        return RECV_BATCH

    def close(self) -> None:
        self.socket.close(linger=0)
