"""The vLLM mapping (telemetry/sources/vllm_records.py) on stand-ins shaped like vLLM 0.32's
stats, and how every reader shows the fields vLLM does not give. The real vLLM runs in
test_vllm_live.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from telemetry.analysis.timeline import EngineTimeline
from telemetry.analysis.tune import fit_iteration_time
from telemetry.lane.record import (
    EVENT_FINISHED,
    EVENT_FIRST_TOKEN,
    EVENT_TTFT_SENT,
    FINISH_REASONS,
    UNKNOWN_ELAPSED,
    UNKNOWN_KV_TOKENS,
    UNKNOWN_PREFILL_REQS,
    UNKNOWN_WAITING_REASONS,
    Heartbeat,
    IterationRecord,
    SpecDecodeCounts,
    make_decoder,
    make_encoder,
)
from telemetry.lane.record import heartbeat as lane_heartbeat
from telemetry.sidecar.iteration_line import format_iteration_line
from telemetry.sidecar.sinks.prometheus import PrometheusSink
from telemetry.sources.vllm_records import RecordMaker, engine_facts, milestone, num_in_flight
from tests.helpers.otel import OtlpHttpReceiver, by_name, http_sink
from tests.helpers.sink_feed import send


def scheduler_stats(running=2, waiting=1, skipped=1, usage=0.5, details=None, queries=32, hits=16):
    return SimpleNamespace(
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        num_skipped_waiting_reqs=skipped,
        kv_cache_usage=usage,
        iteration_details=details,
        prefix_cache_stats=SimpleNamespace(queries=queries, hits=hits),
    )


def details(ctx_reqs=1, ctx_tokens=100, gen_reqs=2, gen_tokens=2, elapsed_ms=12.5):
    return SimpleNamespace(
        num_ctx_requests=ctx_reqs,
        num_ctx_tokens=ctx_tokens,
        num_generation_requests=gen_reqs,
        num_generation_tokens=gen_tokens,
        elapsed_ms=elapsed_ms,
        is_dummy=False,
    )


def iteration_stats(
    generated=3,
    computed=100,
    itls=(0.01, 0.01),
    preempted=0,
    finished=(),
    timestamp=None,
    ttfts=None,
):
    """vLLM's IterationStats of a step; ``ttfts`` None: a vLLM without
    time_to_first_tokens_iter."""
    stats = SimpleNamespace(
        num_generation_tokens=generated,
        prompt_token_stats=SimpleNamespace(computed=computed),
        inter_token_latencies_iter=list(itls),
        num_preempted_reqs=preempted,
        finished_requests=list(finished),
        iteration_timestamp=time.time() if timestamp is None else timestamp,
    )
    if ttfts is not None:
        stats.time_to_first_tokens_iter = list(ttfts)
    return stats


def finished(reason=1, e2e=2.0, queued=0.25, prefill=0.5, decode=1.0, outputs=16):
    return SimpleNamespace(
        finish_reason=reason,
        request_id="cmpl-1",
        e2e_latency=e2e,
        num_prompt_tokens=100,
        num_preemptions=1,
        num_generation_tokens=outputs,
        queued_time=queued,
        prefill_time=prefill,
        decode_time=decode,
        inference_time=prefill + decode,
        num_cached_tokens=32,
    )


def test_a_step_with_iteration_details_maps_every_count():
    maker = RecordMaker(engine_index=3, num_gpu_blocks=101)  # 100 usable + the null block
    record = maker.make(scheduler_stats(details=details()), iteration_stats(preempted=1))
    assert (record.engine_index, record.iteration) == (3, 1)
    assert (record.num_prefill_reqs, record.num_prefill_tokens) == (1, 100)
    assert (record.num_decode_reqs, record.num_decode_tokens) == (2, 3)
    assert record.elapsed_ns == 12_500_000
    assert (record.num_running_reqs, record.num_waiting_reqs) == (2, 2)  # deferred ones too
    assert (record.num_kv_blocks_used, record.num_kv_blocks_free) == (50, 50)
    assert (record.num_prefix_query_tokens, record.num_prefix_hit_tokens) == (32, 16)
    assert record.num_preemptions == 1
    assert record.unknown == UNKNOWN_WAITING_REASONS | UNKNOWN_KV_TOKENS
    assert maker.make(scheduler_stats(details=details()), None).iteration == 2


def test_without_details_the_batch_split_and_time_are_unknown():
    record = RecordMaker(0, 11).make(scheduler_stats(), iteration_stats(computed=64))
    assert record.unknown & UNKNOWN_PREFILL_REQS and record.unknown & UNKNOWN_ELAPSED
    assert (record.num_prefill_tokens, record.num_decode_tokens) == (64, 3)
    assert record.num_decode_reqs == 2  # requests that produced a non-first token
    assert record.elapsed_ns == 0


def test_calls_that_report_no_step_make_no_record():
    maker = RecordMaker(0, 11)
    drained = scheduler_stats(running=0, waiting=0, skipped=0, usage=0.0)
    assert maker.make(drained, None) is None
    dummy = details()
    dummy.is_dummy = True
    assert maker.make(scheduler_stats(details=dummy), None) is None
    assert maker.iteration == 0
    # a prefill chunk without outputs, requests running: a step all the same
    assert maker.make(scheduler_stats(), None).iteration == 1
    # unless vLLM sends details, which every step that scheduled tokens then carries
    assert RecordMaker(0, 11, iteration_details=True).make(scheduler_stats(), None) is None
    assert num_in_flight(scheduler_stats(waiting=3, skipped=2, running=4)) == (5, 4)


def test_speculative_decoding_stats_ride_on_the_record_and_a_step_without_drafts_has_none():
    stats = scheduler_stats(details=details())
    stats.spec_decoding_stats = SimpleNamespace(
        num_spec_tokens=3,
        num_drafts=2,
        num_draft_tokens=6,
        num_accepted_tokens=4,
        num_accepted_tokens_per_pos=[2, 1, 1],
        num_draft_tokens_per_pos=[2, 2, 2],
    )
    record = RecordMaker(0, 11).make(stats, iteration_stats(generated=6))
    assert record.spec_decode == SpecDecodeCounts(2, 6, 4, [2, 1, 1])
    stats.spec_decoding_stats = None  # vLLM's value for a step that scored no draft
    assert RecordMaker(0, 11).make(stats, iteration_stats()).spec_decode is None
    assert RecordMaker(0, 11).make(scheduler_stats(), iteration_stats()).spec_decode is None


def test_missing_attributes_degrade_to_zero_instead_of_raising():
    record = RecordMaker(0).make(SimpleNamespace(num_running_reqs=1), SimpleNamespace())
    assert record.num_running_reqs == 1 and record.num_kv_blocks_used == 0


def test_finished_requests_become_milestones_at_vllm_times():
    now_wall = time.time()
    stats = iteration_stats(finished=[finished()], timestamp=now_wall)
    record = RecordMaker(0, 11).make(scheduler_stats(), stats)
    (m,) = record.milestones
    assert m.event == EVENT_FIRST_TOKEN | EVENT_FINISHED
    assert FINISH_REASONS[m.finish_reason] == "length"
    offset_ns = time.time_ns() - time.monotonic_ns()
    assert abs(m.finished_ns + offset_ns - now_wall * 1e9) < 50e6  # on this process's clock
    assert m.finished_ns - m.arrival_ns == 2_000_000_000
    assert m.finished_ns - m.first_token_ns == 1_000_000_000
    assert m.first_token_ns - m.first_scheduled_ns == 500_000_000
    assert (m.num_prompt_tokens, m.num_cached_tokens, m.num_output_tokens) == (100, 32, 16)
    assert (m.num_preemptions, m.request_id) == (1, "cmpl-1")
    assert m.prefill_chunks == [(m.first_scheduled_ns, m.first_token_ns, 100 - 32)]


def ttft_counts(sink: PrometheusSink) -> tuple[float, float, float]:
    """TTFT histogram (count, sum), and the cached prompt tokens counted, of engine 0."""
    families = {f.name: f for f in sink.collector.collect()}
    samples = {s.name: s.value for s in families["iterscope_time_to_first_token_seconds"].samples}
    cached = families["iterscope_prompt_tokens_cached"].samples[0].value
    return (
        samples["iterscope_time_to_first_token_seconds_count"],
        samples["iterscope_time_to_first_token_seconds_sum"],
        cached,
    )


def test_ttfts_reach_the_histogram_at_the_first_token_and_once():
    """vLLM gives the plugin each TTFT when the first token comes, without the request:
    observed then, and not again when the request finishes."""
    maker = RecordMaker(0, 11)
    sink = PrometheusSink(CollectorRegistry())
    record = maker.make(scheduler_stats(), iteration_stats(ttfts=[0.25, 0.5]))
    assert record.first_token_latencies_ns == [250_000_000, 500_000_000]
    send(sink, record)
    assert ttft_counts(sink) == (2, 0.75, 0)
    done = maker.make(scheduler_stats(), iteration_stats(finished=[finished()], ttfts=[]))
    (m,) = done.milestones
    assert m.event == EVENT_FIRST_TOKEN | EVENT_FINISHED | EVENT_TTFT_SENT
    assert done.first_token_latencies_ns == []
    send(sink, done)
    assert ttft_counts(sink) == (2, 0.75, 32)  # the cached tokens still counted, once
    # a vLLM that sends no TTFTs per step: observed at the finish, as before
    older = PrometheusSink(CollectorRegistry())
    send(older, RecordMaker(0, 11).make(scheduler_stats(), iteration_stats(finished=[finished()])))
    assert ttft_counts(older) == (1, 2.0 - 1.0, 32)  # e2e - decode time


def test_a_vllm_request_becomes_a_trace_with_its_phases():
    receiver = OtlpHttpReceiver()
    try:
        sink = http_sink(receiver.endpoint)
        maker = RecordMaker(0, 11)
        send(sink, lane_heartbeat(0, 1, time.monotonic_ns(), time.time_ns(), num_running_reqs=1))
        send(sink, maker.make(scheduler_stats(), iteration_stats(finished=[finished()])))
        sink.close()
        spans = receiver.wait_for(4)
    finally:
        receiver.close()
    assert sorted(span.name for span in spans) == ["decode", "llm_request", "prefill", "queued"]
    (root,) = by_name(spans, "llm_request")
    assert root.end_ns - root.start_ns == 2_000_000_000
    (prefill,) = by_name(spans, "prefill")
    assert prefill.end_ns - prefill.start_ns == 500_000_000


def test_a_request_aborted_before_its_first_token_has_no_first_token_time():
    m = milestone(finished(reason=2, outputs=0, decode=0.0, prefill=0.0), 10_000_000_000)
    assert m.event == EVENT_FINISHED and m.first_token_ns == 0 and m.first_scheduled_ns == 0
    assert FINISH_REASONS[m.finish_reason] == "abort"
    assert milestone(finished(reason=4), 10**10).finish_reason == 4  # repetition


def test_unknown_survives_the_wire_and_old_frames_decode_as_known():
    record = RecordMaker(0, 11).make(scheduler_stats(), iteration_stats())
    decoded = make_decoder().decode(make_encoder().encode(record))
    assert decoded.unknown == record.unknown != 0
    # a frame from before `unknown` (and the fields added after it), after the tag
    names = [field.name for field in msgspec.structs.fields(IterationRecord)]
    old_frame = msgspec.msgpack.encode(msgspec.to_builtins(record)[: 1 + names.index("unknown")])
    assert make_decoder().decode(old_frame).unknown == 0


@pytest.mark.parametrize("interval", [1, 8])
def test_a_prefill_cadence_is_a_fact_of_the_engine_and_old_heartbeats_have_none(interval):
    """vLLM's --prefill-schedule-interval rides on the heartbeats (explain's action for
    requests it holds names its value); 1, vLLM's default, is no cadence and is not sent."""
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(
            max_num_seqs=4, max_num_batched_tokens=512, prefill_schedule_interval=interval
        )
    )
    facts = engine_facts(config, 63, "vllm-scheduler", "0.32.0+cpu")
    assert facts.get("prefill_schedule_interval", 0) == (8 if interval == 8 else 0)
    assert facts["engine_version"] == "vllm 0.32.0+cpu"
    beat = lane_heartbeat(0, 1, 5, 6, **facts)
    assert make_decoder().decode(make_encoder().encode(beat)).prefill_schedule_interval == (
        beat.prefill_schedule_interval
    )
    # a heartbeat from a sender before the field decodes with no cadence
    names = [field.name for field in msgspec.structs.fields(Heartbeat)]
    cut = 1 + names.index("prefill_schedule_interval")
    old_frame = msgspec.msgpack.encode(msgspec.to_builtins(beat)[:cut])
    assert make_decoder().decode(old_frame).prefill_schedule_interval == 0


@pytest.mark.parametrize("num_speculative_tokens", [None, 3])
def test_speculative_decodings_draft_length_is_a_fact_of_the_engine(num_speculative_tokens):
    """vLLM's --speculative-config rides on the heartbeats (its num_speculative_tokens), so a
    recording says the engine speculates even where its proposer never found a draft; none
    (vLLM's default) is not sent, and a heartbeat from before the field decodes with 0."""
    spec = None if num_speculative_tokens is None else SimpleNamespace(num_speculative_tokens=3)
    facts = engine_facts(SimpleNamespace(speculative_config=spec), 63, "vllm-scheduler", "0.32.0")
    assert facts.get("num_speculative_tokens", 0) == (num_speculative_tokens or 0)
    beat = lane_heartbeat(0, 1, 5, 6, **facts)
    assert make_decoder().decode(make_encoder().encode(beat)).num_speculative_tokens == (
        num_speculative_tokens or 0
    )
    names = [field.name for field in msgspec.structs.fields(Heartbeat)]
    old_frame = msgspec.msgpack.encode(
        msgspec.to_builtins(beat)[: 1 + names.index("num_speculative_tokens")]
    )
    assert make_decoder().decode(old_frame).num_speculative_tokens == 0


def unknown_record(**fields) -> IterationRecord:
    record = RecordMaker(0, 11).make(scheduler_stats(**fields), iteration_stats())
    record.msg_seq = 1
    return record


def test_the_iteration_line_says_unknown_instead_of_zero():
    line = format_iteration_line(unknown_record())
    assert "unknown context requests" in line
    assert "iteration elapsed time: unknown" in line
    assert "blocks, unknown tokens)" in line
    assert "100 context tokens" in line


def test_prometheus_shows_unknown_fields_as_absent_or_unknown():
    sink = PrometheusSink(CollectorRegistry())
    send(sink, unknown_record(waiting=3, skipped=0))
    families = {f.name: f for f in sink.collector.collect()}
    by_reason = {
        s.labels["reason"]: s.value
        for s in families["iterscope_requests_waiting_by_reason"].samples
    }
    assert by_reason == {"unknown": 3}
    assert not families["iterscope_kv_tokens"].samples
    # no time was measured: no series (an empty one would read as no iterations)
    assert not families["iterscope_iteration_duration_seconds"].samples
    assert families["iterscope_iteration_tokens"].samples
    assert sink.engines[0].engine.totals.num_kv_blocked_iterations == 0


def test_tune_refuses_untimed_records_and_names_the_vllm_flag():
    records = [unknown_record() for _ in range(20)]
    heartbeat = lane_heartbeat(0, 1, 1, 1)
    with pytest.raises(ValueError, match="--enable-logging-iteration-details"):
        fit_iteration_time(EngineTimeline(0, records, [heartbeat]))


def test_explain_reads_vllm_records_without_inventing_reasons_or_leaks():
    """Blocks used with kv tokens unknown are no leak; waiting has no reason to report."""
    from telemetry.analysis.episodes import Thresholds, detect_episodes
    from telemetry.analysis.summary import format_summary, summarize

    records = []
    for i in range(400):
        record = unknown_record(running=2, waiting=3, skipped=0, usage=0.9)
        record.iteration, record.start_ns = i + 1, i * 50_000_000
        records.append(record)
    heartbeat = lane_heartbeat(
        0,
        1,
        0,
        10**18,
        num_waiting_reqs=3,
        num_running_reqs=2,
        block_size=16,
        num_kv_blocks_total=10,
    )
    timeline = EngineTimeline(0, records, [heartbeat])
    episodes = detect_episodes(timeline, Thresholds())
    kinds = {episode.kind for episode in episodes}
    assert "kv_leak" not in kinds
    (waiting,) = [episode for episode in episodes if episode.kind == "waiting"]
    assert "reason not reported" in waiting.title
    assert "KV capacity" not in waiting.evidence
    assert "reasons: not reported by the source;" in waiting.evidence
    summary = " ".join(format_summary(summarize(timeline)))
    assert "reasons not reported by the source" in summary


def test_the_dtype_and_max_model_len_are_facts_of_the_engine():
    """So a KV action can quote kv-plan for the engine exactly (explain, live findings)."""
    config = SimpleNamespace(
        model_config=SimpleNamespace(dtype="torch.bfloat16", max_model_len=4096)
    )
    facts = engine_facts(config, 63, "vllm-scheduler", "0.32.0")
    assert (facts["dtype"], facts["max_model_len"]) == ("bfloat16", 4096)
    beat = make_decoder().decode(make_encoder().encode(lane_heartbeat(0, 1, 5, 6, **facts)))
    assert (beat.dtype, beat.max_model_len) == ("bfloat16", 4096)
    assert "dtype" not in engine_facts(SimpleNamespace(), 63, "vllm-scheduler", "0.32.0")
