"""tests/helpers/ahead.py: a stack started ahead is the one its fixture takes, started once,
stopped once; an error in its start reaches the fixture; without memory (or without a start
ahead) the fixture starts it itself; a stack no fixture took stops with the session."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import ahead

EVENTS: list[tuple[str, object, dict]] = []


@contextlib.contextmanager
def fake_stack(tmp: Path, param: object, **kwargs) -> Iterator[dict]:
    EVENTS.append(("start", param, kwargs))
    if param == "broken":
        raise RuntimeError("the server exited")
    try:
        yield {"param": param, "tmp": tmp}
    finally:
        EVENTS.append(("stop", param, kwargs))


def item(fixtures: list[str], params: dict | None = None):
    """A stand-in for a collected test of this module."""
    return SimpleNamespace(
        module=SimpleNamespace(__name__=__name__),
        fixturenames=fixtures,
        callspec=SimpleNamespace(params=params) if params is not None else None,
    )


@pytest.fixture
def marked(monkeypatch):
    """fake_stack marked for the fixture "fake", nothing started ahead yet, memory enough."""
    monkeypatch.setattr(ahead, "MARKED", [ahead.Marked(fake_stack, "fake", "fake")])
    monkeypatch.setattr(ahead, "_started", {})
    monkeypatch.setattr(ahead, "available_bytes", lambda: ahead.MIN_AVAILABLE_BYTES)
    EVENTS.clear()
    return ahead.MARKED[0]


def started_ahead(items, tmp_path_factory) -> None:
    ahead.start_ahead(items, tmp_path_factory)
    for future in list(ahead._started.values()):
        future.exception()  # the background start has ended


def test_each_stack_and_param_a_selected_test_uses_once_in_test_order(marked):
    items = [
        item(["other"]),
        item(["fake"], {"fake": "b"}),
        item(["fake", "x"], {"fake": "a", "x": 1}),
        item(["fake"], {"fake": "b"}),
    ]
    assert ahead.wanted(items) == [(marked, "b"), (marked, "a")]
    assert ahead.wanted([item(["fake"])]) == [(marked, None)]  # not parametrized


def test_the_fixture_takes_the_stack_started_ahead_at_low_priority(marked, tmp_path_factory):
    started_ahead([item(["fake"], {"fake": "a"})], tmp_path_factory)
    assert EVENTS == [("start", "a", ahead.AHEAD_VLLM_KWARGS)]
    with ahead.take(fake_stack, "a", tmp_path_factory) as stack:
        assert stack["param"] == "a" and stack["tmp"].name.startswith("fake")
        assert len(EVENTS) == 1  # not started again
    assert EVENTS[-1] == ("stop", "a", ahead.AHEAD_VLLM_KWARGS)
    ahead.stop_untaken()
    assert len(EVENTS) == 2  # stopped once


def test_an_error_in_the_start_ahead_fails_the_fixture(marked, tmp_path_factory):
    started_ahead([item(["fake"], {"fake": "broken"})], tmp_path_factory)
    with pytest.raises(RuntimeError, match="the server exited"):
        with ahead.take(fake_stack, "broken", tmp_path_factory):
            pass


def test_without_memory_or_a_start_ahead_the_fixture_starts_it(
    marked, tmp_path_factory, monkeypatch
):
    monkeypatch.setattr(ahead, "available_bytes", lambda: ahead.MIN_AVAILABLE_BYTES - 1)
    started_ahead([item(["fake"], {"fake": "a"})], tmp_path_factory)
    assert EVENTS == []
    for param in ("a", "never started ahead"):
        with ahead.take(fake_stack, param, tmp_path_factory) as stack:
            assert stack["param"] == param
        assert EVENTS[-2:] == [("start", param, {}), ("stop", param, {})]


def test_a_stack_no_fixture_took_stops_with_the_session(marked, tmp_path_factory):
    started_ahead([item(["fake"], {"fake": "a"})], tmp_path_factory)
    ahead.stop_untaken()
    assert [event[0] for event in EVENTS] == ["start", "stop"]
    assert ahead._started == {}


def test_available_bytes_reads_the_machine():
    assert ahead.available_bytes() > 0
