"""The client's end of the engine's input channel: a PUSH socket that never blocks its caller.

ZMQ's high-water marks bound the channel: once the engine stops reading, a plain send on a PUSH
socket would wait forever. Nothing here waits. A request frame goes now or not at all
(try_send returns False and the client refuses the request). A control message (abort,
probe, shutdown) that finds the channel full is kept; flush_pending, called by the client's
reader thread, sends the kept ones in order once the engine reads again. While any control
message is kept, a new one queues behind it, so they never overtake each other.

The channel binds its socket before the engine connects. A request frame is first decoded with
the engine's own decoder (engine/core_messages.py), so a value the engine would refuse is
refused before it is sent.
"""

from __future__ import annotations

import collections
import threading

import msgspec
import zmq

from engine.core_messages import AbortRequests, AddRequest, EngineInput, Probe, Shutdown


class InputChannel:
    """Sends frames to the engine without blocking; thread-safe."""

    def __init__(self, context: zmq.Context, address: str) -> None:
        self._socket = context.socket(zmq.PUSH)
        self._socket.bind(address)
        self._encoder = msgspec.msgpack.Encoder()
        self._engine_decoder = msgspec.msgpack.Decoder(EngineInput)
        self._lock = threading.Lock()
        self._pending_frames: collections.deque[bytes] = collections.deque()

    def encode_request(self, message: AddRequest) -> bytes:
        """The request's frame; msgspec.ValidationError for a value the engine would refuse
        (e.g. SamplingParams(seed="7")), which no later check would catch before the engine."""
        frame = self._encoder.encode(message)  # fails here, before any state, if unencodable
        self._engine_decoder.decode(frame)
        return frame

    def try_send(self, frame: bytes) -> bool:
        """Send a request frame now; False, and nothing sent, while the channel is full."""
        with self._lock:
            return self._send_now(frame)

    def send_control(self, message: AbortRequests | Probe | Shutdown) -> None:
        """Send a control message now, or keep it for flush_pending while the channel is full."""
        frame = self._encoder.encode(message)
        with self._lock:
            if not self._pending_frames and self._send_now(frame):
                return
            self._pending_frames.append(frame)

    @property
    def num_pending(self) -> int:
        """Control messages kept back by a full channel."""
        return len(self._pending_frames)

    def flush_pending(self) -> None:
        """Send the kept control messages, in order, as far as the channel takes them."""
        if not self._pending_frames:
            return
        with self._lock:
            while self._pending_frames and self._send_now(self._pending_frames[0]):
                self._pending_frames.popleft()

    def close(self) -> None:
        self._socket.close(linger=0)

    def _send_now(self, frame: bytes) -> bool:
        try:
            self._socket.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True
