"""A queue that formed while the engine was slowed from outside its batch says so, live and in
explain (telemetry/analysis/episodes/related.py)."""

from scenarios.synthetic import SCENARIOS

from telemetry.analysis.actions import SLOWED_FIRST_TEXT, finding_action
from telemetry.analysis.episodes import Thresholds, detect_episodes
from telemetry.analysis.episodes.related import SLOWED_QUEUE_TEXT
from telemetry.analysis.findings import build_findings
from telemetry.analysis.timeline import read_timelines
from tests.helpers.findings import replayed


def findings_of(name, tmp_path):
    path = SCENARIOS[name][0]().write(tmp_path / "recording.jsonl")
    (timeline,) = read_timelines([path])[0].values()
    return path, timeline, build_findings(timeline, detect_episodes(timeline), Thresholds())


def test_a_queue_that_formed_in_a_slowdown_frees_the_engine_first(tmp_path):
    """Every other iteration 5x slower for 90 s: the queue at the sequence limit costs most;
    its evidence and action say the slowdown came first, explain and live alike."""
    path, timeline, findings = findings_of("another job, the queue grows", tmp_path)
    assert [f.kind for f in findings] == ["waiting", "slow_decode"]
    waiting = findings[0]
    assert waiting.worst.evidence.endswith(SLOWED_QUEUE_TEXT)
    action = finding_action(timeline, waiting, Thresholds())
    assert action.startswith(SLOWED_FIRST_TEXT + "set --max-num-seqs ")
    (live,) = [f for f in replayed(path) if f.kind == "waiting_seq_limit"]
    assert live.evidence.endswith(SLOWED_QUEUE_TEXT) and live.action == action


def test_a_queue_with_no_slowdown_is_its_limit_s(tmp_path):
    _, timeline, findings = findings_of("story3 sequence limit", tmp_path)
    (waiting,) = [f for f in findings if f.kind == "waiting"]
    assert "slowed" not in waiting.worst.evidence
    assert finding_action(timeline, waiting, Thresholds()).startswith("Set --max-num-seqs")
