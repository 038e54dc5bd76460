"""Feeding a sink by hand the way Ingest does (telemetry/sidecar/ingest.py): each message with
its engine's view, a heartbeat's clock anchor taken in first, the rest of the message applied
to the view once the sink has seen it (telemetry/sidecar/engine_view.py); losses counted on the
view and the pipeline's health as Ingest counts them. No seq checks: a test may send what
Ingest would reject (a record before any heartbeat, seq 0)."""

from __future__ import annotations

import weakref

from telemetry.lane.record import Heartbeat, IterationRecord
from telemetry.sidecar.engine_view import EngineStatus, EngineView
from telemetry.sidecar.pipeline_health import PipelineHealth
from telemetry.sidecar.sink import Sink

_views: weakref.WeakKeyDictionary[Sink, dict[int, EngineView]] = weakref.WeakKeyDictionary()
_health: weakref.WeakKeyDictionary[Sink, PipelineHealth] = weakref.WeakKeyDictionary()


def view_of(sink: Sink, engine_index: int) -> EngineView:
    """The view this module keeps for ``sink``'s engine ``engine_index``."""
    views = _views.setdefault(sink, {})
    if engine_index not in views:
        views[engine_index] = EngineView(engine_index)
    return views[engine_index]


def send(sink: Sink, *messages: IterationRecord | Heartbeat) -> None:
    for message in messages:
        view = view_of(sink, message.engine_index)
        view.num_messages += 1
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


def health_of(sink: Sink, sinks: list[Sink] | None = None) -> PipelineHealth:
    """The pipeline health this module attached to ``sink`` (with ``sinks``, default
    [sink]) the first time it was asked; count into it as Ingest does."""
    if sink not in _health:
        _health[sink] = PipelineHealth()
        sink.attach(_health[sink], sinks or [sink])
    return _health[sink]


def lose(sink: Sink, engine_index: int, num_lost: int) -> None:
    """As Ingest counts a seq gap: on the engine's view, before its next message."""
    view_of(sink, engine_index).num_dropped_total += num_lost


def conflict(sink: Sink, engine_index: int, pids: tuple[int, int]) -> None:
    """As Ingest counts two processes seen under one engine index."""
    view = view_of(sink, engine_index)
    view.num_engine_conflicts += 1
    view.conflicting_pids = pids
