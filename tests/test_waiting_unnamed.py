"""The waiting finding's action where the source does not say why requests wait (vLLM's
stat-logger plugin): the limit is inferred from what the episode's iterations and the engine's
facts do say, and said to be inferred (telemetry/analysis/episodes/queues.py,
_unnamed_limit_action). QA: a vLLM 0.32 served with --max-num-seqs 2 through the plugin, 2
running in nearly every iteration while requests waited and KV usage at 1.7%, was told to
raise the KV cache first."""

from __future__ import annotations

from telemetry.analysis.episodes import detect_episodes
from telemetry.analysis.timeline import NS_PER_S, build_timelines
from telemetry.lane.record import (
    UNKNOWN_KV_BLOCKS,
    UNKNOWN_KV_TOKENS,
    UNKNOWN_PREFILL_REQS,
    UNKNOWN_WAITING_REASONS,
    IterationRecord,
    heartbeat,
)
from tests.test_episode_text import waiting_records

STEP_NS = NS_PER_S // 10  # iterations 0.1 s apart: 30 of them are 3 s of waiting
PLUGIN = UNKNOWN_WAITING_REASONS | UNKNOWN_KV_TOKENS  # the plugin with iteration details
WHY = "(vLLM's stat-logger plugin cannot say why requests wait)"


def plugin_records(
    num: int, first: int = 1, unknown: int = PLUGIN, **fields: int
) -> list[IterationRecord]:
    """``num`` iterations from iteration ``first``: 4 decoding and 3 waiting, why not said, 2
    of 100 KV blocks in use, unless ``fields`` say otherwise."""
    kv = {"num_kv_blocks_used": 2, "num_kv_blocks_free": 98}
    if unknown & UNKNOWN_KV_BLOCKS:
        kv = {"num_kv_blocks_used": 0, "num_kv_blocks_free": 0}
    return waiting_records(unknown, num, first, **{"num_waiting_seq_limit_reqs": 0, **kv, **fields})


def waiting_actions(records: list[IterationRecord], **facts) -> list[str]:
    """The waiting episodes' actions, first first, on an engine whose heartbeat says
    ``facts`` (the plugin's, with --max-num-seqs 4 and --max-num-batched-tokens 2048)."""
    facts = {
        "source": "vllm-stat-logger",
        "max_num_seqs": 4,
        "max_num_batched_tokens": 2048,
        "block_size": 16,
        "num_kv_blocks_total": 100,
        **facts,
    }
    beat = heartbeat(0, 0, STEP_NS // 2, 10**18, **facts)
    (timeline,) = build_timelines([beat, *records]).values()
    assert not timeline.waiting_reasons_known
    episodes = sorted(
        (e for e in detect_episodes(timeline) if e.kind == "waiting"), key=lambda e: e.start_ns
    )
    assert all(e.title == "Requests waiting: reason not reported" for e in episodes)
    return [e.setting for e in episodes]


def test_running_at_max_num_seqs_in_nearly_every_waiting_iteration_is_the_sequence_limit():
    """As in the QA recording: running dips below the limit for the step between a request's
    finish and the next one's admission."""
    records = plugin_records(30)
    for record in records[9:11]:
        record.num_running_reqs = 3
    (action,) = waiting_actions(records)
    assert action.startswith(
        "The sequence limit, inferred: 4 running, the --max-num-seqs limit, in 28 of the 30 "
        f"iterations while requests waited {WHY}. Raise --max-num-seqs (now 4): KV had room "
        "(peak 2.0%); `iterscope tune"
    )
    assert "kv-cache-memory" not in action and "KV usage peaked" not in action


def test_the_sequence_limit_is_read_from_the_episodes_own_iterations():
    """Two waiting episodes apart: the first at the sequence limit, the second not; each
    action reads its own iterations, not the whole recording."""
    records = [
        *plugin_records(30),
        *plugin_records(30, first=31, num_running_reqs=1, num_waiting_reqs=0),
        *plugin_records(30, first=61, num_running_reqs=1, num_decode_reqs=1),
    ]
    first, second = waiting_actions(records)
    assert first.startswith(
        "The sequence limit, inferred: 4 running, the --max-num-seqs limit, in every "
        f"iteration while requests waited {WHY}. Raise --max-num-seqs (now 4)"
    )
    assert second.startswith(
        "Not an admission limit, inferred: neither --max-num-seqs nor "
        "--max-num-batched-tokens was reached while requests waited (at most 1 running of "
        "--max-num-seqs 4; at most 4 tokens a step of --max-num-batched-tokens 2048) and KV "
        f"usage peaked at 2.0%, short of full, so they do not explain the wait {WHY}. Find "
        "what holds the requests back"
    )
    assert "the cache is the limit" not in second and "Raise" not in second


def test_steps_at_max_num_batched_tokens_are_the_token_budget():
    records = plugin_records(
        30, num_running_reqs=2, num_decode_reqs=1, num_decode_tokens=1, num_prefill_reqs=1,
        num_prefill_tokens=2047,
    )  # fmt: skip
    (action,) = waiting_actions(records)
    assert action.startswith(
        "The token budget, inferred: 2048 tokens scheduled, the --max-num-batched-tokens "
        f"limit, in every iteration while requests waited {WHY}. Raise "
        "--max-num-batched-tokens (now 2048) for more throughput"
    )


def test_a_nearly_full_cache_below_both_limits_is_the_cache():
    records = plugin_records(30, num_running_reqs=2, num_kv_blocks_used=95, num_kv_blocks_free=5)
    (action,) = waiting_actions(records)
    assert action.startswith(
        "The KV cache, inferred: KV usage peaked at 95.0%; at most 2 running of "
        "--max-num-seqs 4; at most 4 tokens a step of --max-num-batched-tokens 2048 "
        f"{WHY}. Raise --kv-cache-memory-bytes"
    )


def test_with_kv_unreported_the_sequence_limit_is_still_inferred():
    (action,) = waiting_actions(plugin_records(30, unknown=PLUGIN | UNKNOWN_KV_BLOCKS))
    assert action.startswith(
        "The sequence limit, inferred: 4 running, the --max-num-seqs limit, in every "
        f"iteration while requests waited {WHY}. Raise --max-num-seqs (now 4): KV usage is "
        "not reported by the source (vllm-stat-logger), so whether the cache had room is not "
        "known"
    )


def test_with_kv_unreported_and_neither_limit_reached_the_cache_or_a_hold_remains():
    records = plugin_records(30, unknown=PLUGIN | UNKNOWN_KV_BLOCKS, num_running_reqs=2)
    (action,) = waiting_actions(records)
    assert action.startswith(
        "Neither --max-num-seqs nor --max-num-batched-tokens was reached while requests "
        "waited (at most 2 running of --max-num-seqs 4; at most 4 tokens a step of "
        f"--max-num-batched-tokens 2048; {WHY[1:-1]}), and KV usage is not reported by the "
        "source (vllm-stat-logger) either: if the engine's own metrics show its KV cache "
        "nearly full, the cache is the limit"
    )
    assert "If they do not, no admission limit explains the wait: find what holds" in action


def test_without_the_steps_token_counts_the_budget_stays_open():
    """The plugin without iteration details counts a prompt in the step that finishes it:
    the steps' tokens say nothing of the budget, which stays a candidate."""
    records = plugin_records(30, unknown=PLUGIN | UNKNOWN_PREFILL_REQS, num_running_reqs=2)
    (action,) = waiting_actions(records)
    assert action.startswith(
        "KV usage peaked at 2.0%, short of full, so the cache is likely not the limit (at most "
        "2 running of --max-num-seqs 4): --max-num-batched-tokens is (`iterscope tune"
    )


def test_without_the_limits_among_the_facts_both_stay_open_behind_the_kv_peak():
    (action,) = waiting_actions(plugin_records(30), max_num_seqs=0, max_num_batched_tokens=0)
    assert action.startswith(
        "KV usage peaked at 2.0%, short of full, so the cache is likely not the limit: "
        "--max-num-seqs or --max-num-batched-tokens is (`iterscope tune"
    )
