"""Feeding a sink by hand the way Ingest does (telemetry/sidecar/ingest.py): each message with
its engine's view, a heartbeat's clock anchor taken in first, the rest of the message applied
to the view once the sink has seen it (telemetry/sidecar/engine_view.py). No seq checks: a
test may send what Ingest would reject (a record before any heartbeat, seq 0)."""

from __future__ import annotations

import weakref

from telemetry.lane.record import Heartbeat, IterationRecord
from telemetry.sidecar.engine_view import EngineView
from telemetry.sidecar.sink import EngineStatus, Sink

_views: weakref.WeakKeyDictionary[Sink, dict[int, EngineView]] = weakref.WeakKeyDictionary()


def view_of(sink: Sink, engine_index: int) -> EngineView:
    """The view this module keeps for ``sink``'s engine ``engine_index``."""
    views = _views.setdefault(sink, {})
    if engine_index not in views:
        views[engine_index] = EngineView(engine_index)
    return views[engine_index]


def send(sink: Sink, *messages: IterationRecord | Heartbeat) -> None:
    for message in messages:
        view = view_of(sink, message.engine_index)
        if isinstance(message, Heartbeat):
            view.take_anchor(message)
            sink.on_heartbeat(message, view)
            view.apply_heartbeat(message)
        else:
            sink.on_iteration(message, view)
            view.apply_iteration(message)


def set_status(sink: Sink, engine_index: int, status: EngineStatus, now_ns: int) -> None:
    """As Ingest reports a transition: the view holds it before ``on_status`` is called."""
    view_of(sink, engine_index).status = status
    sink.on_status(engine_index, status, now_ns)
