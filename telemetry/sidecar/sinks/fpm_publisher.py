"""``--fpm-port PORT``: the sidecar speaks forward-pass metrics (FPM) for the engines on its lane.

One ZMQ PUB socket bound on ``tcp://*:PORT`` publishes one FPM message per iteration record
the sidecar ingests from its lane (iterscope's engine, the vLLM scheduler and stat-logger
sources), built by telemetry/sidecar/fpm_encode.py, so Dynamo's planner or any FPM consumer
reads an iterscope-observed engine. The engine's hot path never sees it: it runs on the
sidecar's ingest thread, after the lane.

Each engine is one FPM stream: ``worker_id`` = ``--fpm-worker-id``, ``dp_rank`` = the engine
index, ``seq`` (and ``counter_id``) from 0 per engine, +1 per message. A stream that was
silent for HEARTBEAT_AFTER_NS gets a heartbeat (telemetry/sidecar/fpm_encode.py,
``idle_message``), as Dynamo's publisher does, while the sidecar holds the engine alive
(not dead): a dead engine's stream falls silent, which is how an FPM consumer learns it.

Invariants:
- Never blocks ingest: PUB drops a message for a subscriber whose queue holds
  ``--fpm-sndhwm`` messages; its seq is spent all the same, so the subscriber sees the
  loss as a seq gap (FPM's own convention: SGLang and Dynamo do the same).
  ``iterscope_fpm_messages_published_total`` counts what was handed to the socket.
- Engines whose own messages came in as FPM (``--fpm``: their ``source`` is fpm...) are
  not published again: a sidecar subscribed to its own port would loop.
- State is one small stream per engine Ingest tracks; an evicted engine's stream goes
  (the next engine at its index starts from seq 0: a restart to the consumer).
"""

from __future__ import annotations

import argparse
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from telemetry.lane.record import SOURCE_FPM, Heartbeat, IterationRecord
from telemetry.sidecar.arg_types import fixed_port, positive_int
from telemetry.sidecar.engine_view import SILENT_STATUSES, EngineView
from telemetry.sidecar.fpm_encode import frames, from_record, idle_message
from telemetry.sidecar.sink import Sink
from telemetry.sources.fpm import ForwardPassMetrics

HEARTBEAT_AFTER_NS = 1_000_000_000  # Dynamo's and SGLang's HEARTBEAT_INTERVAL
DEFAULT_SNDHWM = 10_000  # per subscriber; a message is about 400 bytes


@dataclass
class _Stream:
    """One engine's FPM stream: the seq of its next message and when it last sent one."""

    engine: EngineView
    next_seq: int = 0
    last_sent_ns: int = 0

    def take_seq(self, now_ns: int) -> int:
        """The seq of a message sent now."""
        seq, self.next_seq, self.last_sent_ns = self.next_seq, self.next_seq + 1, now_ns
        return seq


class FpmPublisherSink(Sink):
    """Publishes the lane's records as FPM messages on a bound PUB socket."""

    name = "fpm_publisher"

    def __init__(
        self,
        endpoint: str,
        worker_id: str,
        sndhwm: int = DEFAULT_SNDHWM,
        context: zmq.Context | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        """Binds ``endpoint`` (zmq.ZMQError when it cannot)."""
        self.worker_id = worker_id
        self.num_published = 0
        self._clock = clock
        self._streams: dict[int, _Stream] = {}
        self.socket = (context or zmq.Context.instance()).socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, sndhwm)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(endpoint)

    def on_heartbeat(self, heartbeat: Heartbeat, engine: EngineView) -> None:
        """An engine on the lane gets a stream when it first heartbeats (FPM ones never)."""
        if heartbeat.source.startswith(SOURCE_FPM):
            self._streams.pop(heartbeat.engine_index, None)
        elif heartbeat.engine_index not in self._streams:
            self._streams[heartbeat.engine_index] = _Stream(engine, last_sent_ns=self._clock())

    def on_iteration(self, record: IterationRecord, engine: EngineView) -> None:
        stream = self._streams.get(record.engine_index)
        if stream is not None:
            seq = stream.take_seq(self._clock())
            self._send(seq, from_record(record, self.worker_id, record.engine_index, seq))

    def tick(self, now_ns: int) -> None:
        """A heartbeat on each live engine's stream silent for HEARTBEAT_AFTER_NS."""
        clock_ns = self._clock()
        for stream in self._streams.values():
            engine = stream.engine
            if engine.status in SILENT_STATUSES:
                continue
            if clock_ns - stream.last_sent_ns >= HEARTBEAT_AFTER_NS:
                seq = stream.take_seq(clock_ns)
                message = idle_message(
                    self.worker_id,
                    engine.engine_index,
                    seq,
                    engine.num_waiting_reqs,
                    engine.num_running_reqs,
                )
                self._send(seq, message)

    def _send(self, seq: int, message: ForwardPassMetrics) -> None:
        """Hand the frames to the socket, which never blocks: a PUB drops for a subscriber
        at its high-water mark."""
        self.socket.send_multipart(frames(seq, message))
        self.num_published += 1

    def on_engine_removed(self, engine_index: int, silent_ns: int) -> None:
        self._streams.pop(engine_index, None)

    def sidecar_counters(self) -> dict[str, float]:
        return {"fpm_messages_published": float(self.num_published)}

    def close(self) -> None:
        self.socket.close(linger=0)


def default_worker_id() -> str:
    """``iterscope@HOST``: one sidecar per host is the common case; name each otherwise."""
    return f"iterscope@{socket.gethostname()}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("FPM publishing (Dynamo's planner and other consumers)")
    group.add_argument(
        "--fpm-port",
        type=fixed_port,
        default=None,
        metavar="PORT",
        help="publish one forward-pass metrics message per record of the lane's engines on "
        "tcp://*:PORT (docs/fpm.md; default: off)",
    )
    group.add_argument(
        "--fpm-worker-id",
        default=None,
        metavar="ID",
        help="the worker_id of the published messages; each engine is a dp_rank, its index "
        "(default: iterscope@HOSTNAME)",
    )
    group.add_argument(
        "--fpm-sndhwm",
        type=positive_int,
        default=DEFAULT_SNDHWM,
        metavar="N",
        help="messages queued per subscriber before PUB drops for it (a seq gap there; "
        "default: %(default)s)",
    )


def build(args: argparse.Namespace) -> FpmPublisherSink | None:
    if args.fpm_port is None:
        return None
    worker_id = args.fpm_worker_id or default_worker_id()
    try:
        return FpmPublisherSink(f"tcp://*:{args.fpm_port}", worker_id, args.fpm_sndhwm)
    except zmq.ZMQError as error:
        raise OSError(f"cannot publish FPM on port {args.fpm_port} (--fpm-port): {error}") from None
