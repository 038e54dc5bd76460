"""The live sidecar's findings on a recording (its replay through the Ingest a live sidecar
runs) against `explain`'s on the same recording: one implementation of each rule, so the two
must agree (tests/test_live_findings.py; the real vLLM recordings of the vLLM tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from telemetry.analysis.actions import episode_action
from telemetry.analysis.episodes import INFO, Thresholds, detect_episodes
from telemetry.analysis.findings import episode_cost
from telemetry.analysis.live_findings import LiveFinding, finding_kind
from telemetry.analysis.timeline import EngineTimeline, read_timelines
from telemetry.sidecar.replay import replay
from telemetry.sidecar.sink import Sink


class Findings(Sink):
    """Every live finding a replay reported, in the order first reported."""

    def __init__(self) -> None:
        self.events: list[tuple[str, LiveFinding]] = []

    def on_finding(self, event, engine) -> None:
        self.events.append((event.what, event.finding))

    @property
    def findings(self) -> list[LiveFinding]:
        return list({id(f): f for _, f in self.events}.values())


def replayed(path: Path, **kwargs) -> list[LiveFinding]:
    sink = Findings()
    replay(path, [sink], **kwargs)
    return sink.findings


def explained(timeline: EngineTimeline, thresholds: Thresholds | None = None) -> list[tuple]:
    """explain's problem episodes as (kind as live names it, opening iteration, cost)."""
    rows = []
    for episode in detect_episodes(timeline, thresholds):
        if episode.severity == INFO:
            continue
        kind = finding_kind(episode)  # a silence is "dead", as live
        row = int(timeline.col("start_ns").searchsorted(episode.start_ns))
        iteration = int(timeline.col("iteration")[row]) if row < timeline.num_iterations else 0
        if kind == "stall" and "frozen_iteration" in episode.numbers:
            iteration = episode.numbers["frozen_iteration"]
        if kind == "dead":  # live names the last iteration before the silence
            before = int(timeline.col("end_ns").searchsorted(episode.start_ns, side="right"))
            iteration = int(timeline.col("iteration")[before - 1]) if before else 0
        rows.append((kind, iteration, episode_cost(timeline, episode, thresholds or Thresholds())))
    return sorted(rows)


def assert_same_findings(expected: list[tuple], live: list[LiveFinding]) -> None:
    """Each finding of explain's (``expected``, as ``explained`` gives them) is one of the
    live ones: its kind, its opening iteration within one, its cost within 5%."""
    got = sorted((f.kind, f.iteration, f.cost) for f in live)
    assert [k for k, _, _ in got] == [k for k, _, _ in expected], (expected, got)
    for (kind, iteration, cost), (_, live_iteration, live_cost) in zip(expected, got, strict=True):
        assert abs(live_iteration - iteration) <= 1, (kind, iteration, live_iteration)
        assert live_cost == pytest.approx(cost, rel=0.05, abs=0.01), (kind, cost, live_cost)


# Kinds whose action is the engine's status (the sidecar's stall rule, a silence), not drawn
# from the iterations: every other kind's action is computed from the same records live and
# in explain (actions.py, action_basis).
STATUS_KINDS = ("stall", "dead")


def assert_same_actions(timeline: EngineTimeline, live: list[LiveFinding]) -> None:
    """Each live finding but the status kinds has the action explain gives its episode
    (`explain --all`), word for word."""
    actions = {
        (finding_kind(episode), episode.start_ns): episode_action(timeline, episode, Thresholds())
        for episode in detect_episodes(timeline)
    }
    for finding in live:
        if finding.kind not in STATUS_KINDS:
            assert finding.action == actions[finding.kind, finding.start_ns], finding.kind


def assert_replay_agrees_with_explain(path: Path) -> list[LiveFinding]:
    """The replayed sidecar finds, on a real engine's recording at ``path`` (one engine),
    what explain finds in it, with the same actions; its findings."""
    (timeline,) = read_timelines([path])[0].values()
    live = replayed(path)
    assert_same_findings(explained(timeline), live)
    assert_same_actions(timeline, live)
    return live
