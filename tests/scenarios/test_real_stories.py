"""Stories 1-3 on the real engine at small scale, recorded through the real sidecar.

Each scenario runs the real engine core (tiny random Llama, tiny KV cache) in this process,
publishing to an `iterscope sidecar --record` subprocess (tests/scenarios/real_engine.py;
recorded once per session, tests/conftest.py real_story, and shared with
test_live_findings.py); `explain` must then name the right episode, and report nothing on
the healthy run. Iteration
times on a shared CPU vary a lot, so the assertions are about what happened, not how fast.
"""

import re

import pytest

from telemetry.analysis.episodes import INFO, Thresholds, detect_episodes
from telemetry.analysis.explain import main, read_timelines
from telemetry.analysis.findings import build_findings
from telemetry.analysis.summary import summarize

pytestmark = pytest.mark.live


def explained(recording):
    timelines, _, num_bad = read_timelines([recording])
    assert num_bad == 0 and list(timelines) == [0]
    timeline = timelines[0]
    return timeline, detect_episodes(timeline)


def kinds(episodes):
    return {e.kind for e in episodes}


KV_WAIT_KINDS = {"kv_cliff", "kv_saturation", "preemption_storm"}


def top_finding(timeline, episodes, capsys, recording):
    """The first finding, checked to be the first the text prints."""
    findings = build_findings(timeline, episodes, Thresholds())
    assert findings
    assert main([str(recording)]) == 0
    first = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("  1. "))
    assert first.startswith(f"  1. {findings[0].title}: "), first
    return findings[0]


def only(episodes, kind):
    found = [e for e in episodes if e.kind == kind]
    assert found, f"no {kind} episode in {[(e.kind, e.evidence) for e in episodes]}"
    return found


@pytest.fixture(scope="module")
def batched(real_story):
    return real_story("story3-batched")


def test_healthy_batched_run_has_no_problem(batched):
    timeline, episodes = explained(batched)
    assert [e for e in episodes if e.severity != INFO] == [], [e.evidence for e in episodes]
    summary = summarize(timeline)
    assert summary.num_finished_reqs == 18
    assert summary.mean_batch_reqs > 2 and summary.max_batch_reqs >= 6
    assert summary.verdict.startswith("Batched") and "not queued" in summary.verdict
    # The last iteration returned every block: nothing held with nothing running.
    assert timeline.col("num_kv_blocks_used")[-1] == 0 and timeline.col("num_running_reqs")[-1] == 0


def test_story3_queued_by_max_num_seqs(real_story):
    timeline, episodes = explained(real_story("story3-queued"))
    summary = summarize(timeline)
    assert summary.max_running_reqs == 2 and summary.num_finished_reqs == 18
    assert "and queued" in summary.verdict and "mostly for --max-num-seqs" in summary.verdict
    assert summary.queue_time_p90 > 0
    assert not kinds(episodes) & {"stall", "kv_leak", "kv_cliff", "telemetry_gap"}


def test_story1_kv_cliff_with_counted_preemption(real_story, capsys):
    recording = real_story("story1")
    timeline, episodes = explained(recording)
    cliff = only(episodes, "kv_cliff")[0]
    assert cliff.numbers["usage_before"] >= 0.9 and cliff.numbers["running_before"] == 2
    assert cliff.numbers["num_preemptions"] >= 1
    assert "preempted" in cliff.explanation
    summary = summarize(timeline)
    assert summary.num_preemptions >= 1 and summary.peak_kv_usage == 1.0
    assert summary.max_waiting_reqs >= 1 and summary.waiting_reason_shares["KV capacity"] == 1.0
    assert not kinds(episodes) & {"stall", "kv_leak", "telemetry_gap"}
    top = top_finding(timeline, episodes, capsys, recording)
    assert top.kind in KV_WAIT_KINDS or top.worst.numbers.get("reason") == "waiting_kv", top.kind
    # The requests sent back to waiting cost their wait and their recompute: not nothing.
    assert top.cost > 0 and top.cost >= max(
        f.cost for f in build_findings(timeline, episodes, Thresholds())
    )


def test_story2_leak_hook(real_story, capsys):
    recording = real_story("story2")
    timeline, episodes = explained(recording)
    (leak,) = only(episodes, "kv_leak")
    assert leak.numbers["nothing_running"]
    assert leak.numbers["excess_blocks_last"] == timeline.col("num_kv_blocks_used")[-1] > 0
    assert not kinds(episodes) & {"stall", "kv_cliff", "telemetry_gap"}
    assert top_finding(timeline, episodes, capsys, recording).kind == "kv_leak"


def test_stall_hook(real_story, capsys):
    recording = real_story("stall")
    timeline, episodes = explained(recording)
    (stall,) = only(episodes, "stall")
    assert stall.numbers["inside_iteration"] and stall.numbers["frozen_iteration"] == 39
    assert stall.numbers["stall_time_s"] >= 5.9
    assert stall.numbers["stall_threshold_s"] == 5.0  # the live sidecar's floor
    assert not kinds(episodes) & {"kv_leak", "kv_cliff", "telemetry_gap", "idle"}
    assert "most of the time went inside that iteration" in stall.explanation
    assert re.search(r"took [\d.]+ s \((\d+ prompt tokens, )?\d+ decoding\)", stall.explanation)
    assert "hung" not in stall.explanation
    assert top_finding(timeline, episodes, capsys, recording).kind == "stall"
