"""The episodes' texts where a source does not report a figure: KV usage (FPM reports no KV
blocks) and why requests wait are said to be not reported, never read as a measured 0; the
waiting reasons in words (telemetry/analysis/episodes/queues.py and liveness.py)."""

from __future__ import annotations

from scenarios import synthetic
from scenarios.synthetic import Simulator, arrivals

from telemetry.analysis.episodes import detect_episodes
from telemetry.analysis.episodes.liveness import waiting_reasons_text
from telemetry.analysis.timeline import NS_PER_S, EngineTimeline, build_timelines
from telemetry.lane.record import (
    UNKNOWN_KV_BLOCKS,
    UNKNOWN_PREEMPTIONS,
    UNKNOWN_WAITING_REASONS,
    IterationRecord,
    iteration_record,
)

NUM_ITERATIONS = 30
STEP_NS = NS_PER_S // 10  # 30 iterations 0.1 s apart: 3 s of waiting


def waiting_records(
    unknown: int, num: int = NUM_ITERATIONS, first: int = 1, **fields: int
) -> list[IterationRecord]:
    """``num`` iterations from iteration ``first``: four requests decoding and three waiting
    for --max-num-seqs in each, the cache half full (10 of 20 blocks) where the source reports
    it, unless ``fields`` say otherwise."""
    counts = {
        "num_decode_reqs": 4,
        "num_decode_tokens": 4,
        "num_running_reqs": 4,
        "num_waiting_reqs": 3,
        "num_waiting_seq_limit_reqs": 3,
        "num_kv_blocks_used": 0 if unknown & UNKNOWN_KV_BLOCKS else 10,
        "num_kv_blocks_free": 0 if unknown & UNKNOWN_KV_BLOCKS else 10,
        **fields,
    }
    return [
        iteration_record(
            0, n, n, start_ns=n * STEP_NS, elapsed_ns=STEP_NS // 2, unknown=unknown, **counts
        )
        for n in range(first, first + num)
    ]


def timeline_of(records: list[IterationRecord]) -> EngineTimeline:
    return build_timelines(records)[0]


def the_episode(records: list[IterationRecord], kind: str):
    (episode,) = [e for e in detect_episodes(timeline_of(records)) if e.kind == kind]
    return episode


def test_a_sequence_limit_with_kv_unreported_draws_no_conclusion_from_kv():
    waiting = the_episode(waiting_records(UNKNOWN_KV_BLOCKS), "waiting")
    assert waiting.title == "Requests waiting: --max-num-seqs"
    assert waiting.evidence.endswith("; KV usage not reported")
    assert "KV usage peak" not in waiting.evidence
    assert waiting.setting.startswith(
        "Raise --max-num-seqs: KV usage is not reported by the source, so whether the cache "
        "had room is not known; "
    )
    assert "peak" not in waiting.setting and waiting.numbers["peak_usage"] is None


def test_a_sequence_limit_with_kv_reported_reads_its_peak():
    waiting = the_episode(waiting_records(0), "waiting")
    assert waiting.evidence.endswith("; KV usage peak 50.0%")
    assert "KV had room (peak 50.0%)" in waiting.setting
    assert waiting.numbers["peak_usage"] == 0.5


def test_an_unnamed_limit_with_kv_unreported_names_both_limits_and_how_to_tell():
    unknown = UNKNOWN_KV_BLOCKS | UNKNOWN_WAITING_REASONS | UNKNOWN_PREEMPTIONS
    records = waiting_records(unknown, num_waiting_seq_limit_reqs=0)
    waiting = the_episode(records, "waiting")
    assert waiting.evidence.endswith("; KV usage not reported")
    assert waiting.setting.startswith(
        "KV usage is not reported by the source either, so the limit is not known: if the "
        "engine's own metrics show its KV cache nearly full, the cache is the limit"
    )
    assert "0.0%" not in waiting.setting and "peaked" not in waiting.setting


def test_an_unnamed_limit_with_kv_reported_reads_the_limit_from_its_peak():
    """No limits among the facts (no heartbeat): the KV peak rules the cache in or out, and
    a cache half full is not led with (tests/test_waiting_unnamed.py: with the limits)."""
    records = waiting_records(UNKNOWN_WAITING_REASONS, num_waiting_seq_limit_reqs=0)
    waiting = the_episode(records, "waiting")
    assert waiting.setting.startswith(
        "KV usage peaked at 50.0%, short of full, so the cache is likely not the limit: "
        "--max-num-seqs or --max-num-batched-tokens is"
    )
    full = waiting_records(
        UNKNOWN_WAITING_REASONS, num_waiting_seq_limit_reqs=0, num_kv_blocks_used=19,
        num_kv_blocks_free=1,
    )  # fmt: skip
    assert the_episode(full, "waiting").setting.startswith(
        "The KV cache, inferred: KV usage peaked at 95.0% (the source does not say why "
        "requests wait). Raise "
    )


def test_a_preemption_storm_with_kv_unreported_says_so():
    records = waiting_records(UNKNOWN_KV_BLOCKS)
    for record in records[10:14]:
        record.num_preemptions = 1
    storm = the_episode(records, "preemption_storm")
    assert "4 preemptions in 4 iterations; KV usage not reported; " in storm.evidence


def spinning_records(unknown: int, **fields: int) -> list[IterationRecord]:
    """Iterations that schedule nothing while two requests wait."""
    return waiting_records(
        unknown,
        num_decode_reqs=0,
        num_decode_tokens=0,
        num_running_reqs=0,
        num_waiting_reqs=2,
        num_waiting_seq_limit_reqs=0,
        **fields,
    )


def test_a_spinning_engine_with_kv_and_reasons_unreported_says_so():
    stall = the_episode(spinning_records(UNKNOWN_KV_BLOCKS | UNKNOWN_WAITING_REASONS), "stall")
    assert stall.evidence.endswith(
        "waiting by reason at the end: not reported by the source; KV usage not reported"
    )
    assert "kv_leak cannot be found here" in stall.setting


def test_waiting_reasons_are_listed_in_words_without_the_zeros():
    records = spinning_records(0, num_waiting_kv_reqs=2, num_waiting_other_reqs=1)
    assert waiting_reasons_text(timeline_of(records), 0) == (
        "KV capacity 2, held back by the engine 1"
    )
    assert waiting_reasons_text(timeline_of(spinning_records(0)), 0) == "none"
    stall = the_episode(spinning_records(0), "stall")
    assert "waiting by reason at the end: none; KV usage 50.0%" in stall.evidence


def test_spinning_evidence_says_the_waiting_reasons_in_words():
    """The waiting requests by reason at the spin's end read as the other evidence does,
    counts of 0 left out: never a Python dict."""
    sim = Simulator(
        num_blocks=20, max_num_seqs=8, max_num_batched_tokens=512, cost=synthetic.STORY_COST
    )
    sim.add_requests(arrivals(4, 1), num_prompt=32, num_output=10)
    sim.add_requests([2.0], num_prompt=400, num_output=10)  # 25 blocks of 16 > 20
    sim.run(5)
    (stall,) = [e for e in detect_episodes(build_timelines(sim.messages)[0]) if e.kind == "stall"]
    assert "; waiting by reason at the end: KV capacity 1; KV usage " in stall.evidence
    assert not set("{}'") & set(stall.evidence), stall.evidence
    assert stall.setting.startswith("Check for leaked KV blocks (kv_leak)")
