"""The core loop's per-iteration record, milestones, aborts and the test-only fault hooks."""

from __future__ import annotations

import importlib.metadata
import logging

import msgspec
import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.cpu_allocator import allocator_line
from engine.request import FinishReason, Request, SamplingParams
from engine.scheduler import RequestRejectedError
from engine.startup import build_engine_core
from telemetry.lane.record import (
    EVENT_FINISHED,
    EVENT_FIRST_TOKEN,
    FINISH_REASONS,
    IterationRecord,
    make_decoder,
    make_encoder,
)
from tests.helpers.fake_runner import FakeRunner, RecordingPublisher, load_fake_model, make_core
from tests.helpers.faults import StallingRunner, leak_blocks_per_finish


def make_request(request_id, prompt, max_tokens, traceparent=""):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return Request(request_id, list(prompt), params, traceparent=traceparent)


def drain(core):
    outputs = []
    while core.has_work:
        outputs += core.step()
    return outputs


def test_milestones_carry_the_lifecycle():
    core = make_core(num_blocks=16, max_num_batched_tokens=4)
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    core.add_request(make_request("a", list(range(1, 11)), 3, traceparent))
    drain(core)
    records = core.publisher.records
    milestones = [m for record in records for m in record.milestones]
    first, last = milestones
    assert first.event == EVENT_FIRST_TOKEN and first.finish_reason == -1
    assert first.num_output_tokens == 1 and first.traceparent == traceparent
    assert last.event == EVENT_FINISHED
    assert FINISH_REASONS[last.finish_reason] == "length"
    assert last.num_prompt_tokens == 10 and last.num_output_tokens == 3
    assert 0 < last.arrival_ns <= last.first_scheduled_ns <= last.first_token_ns
    assert last.first_token_ns <= last.finished_ns
    assert [chunk[2] for chunk in last.prefill_chunks] == [4, 4, 2]  # chunked by the budget
    # The first token comes in the iteration of the last prefill chunk.
    assert records[2].milestones == [first]
    assert [r.iteration for r in records] == list(range(1, len(records) + 1))


def test_one_token_request_sets_both_event_bits():
    core = make_core(num_blocks=16)
    core.add_request(make_request("a", [1, 2, 3], 1))
    drain(core)
    (milestone,) = core.publisher.records[0].milestones
    assert milestone.event == EVENT_FIRST_TOKEN | EVENT_FINISHED


def test_abort_finishes_request_and_reports_it_on_the_next_record():
    core = make_core(num_blocks=16)
    core.add_request(make_request("a", [1, 2, 3], 50))
    core.add_request(make_request("b", [4, 5, 6], 50))
    core.step()
    output = core.abort_request("a")
    assert (output.finished, output.finish_reason) == (True, "abort")
    assert core.abort_request("a") is None  # unknown ids are ignored
    core.step()
    record = core.publisher.records[-1]
    (milestone,) = [m for m in record.milestones if m.request_id == "a"]
    assert FINISH_REASONS[milestone.finish_reason] == "abort"
    assert record.num_running_reqs == 1
    core.abort_request("b")
    assert core.has_work  # the pending abort milestone still has to be published
    core.step()
    assert core.publisher.records[-1].milestones[0].request_id == "b"
    assert not core.has_work and core.pool.num_used_blocks == 0


def test_a_stop_string_abort_finishes_with_stop_in_the_output_and_the_record():
    core = make_core(num_blocks=16)
    core.add_request(make_request("a", [1, 2, 3], 50))
    core.step()
    output = core.abort_request("a", FinishReason.STOP)  # the frontend matched a stop string
    assert (output.finished, output.finish_reason) == (True, "stop")
    core.step()
    (milestone,) = core.publisher.records[-1].milestones
    assert FINISH_REASONS[milestone.finish_reason] == "stop"
    assert core.pool.num_used_blocks == 0


def test_prefix_cache_queries_and_hits_in_tokens():
    core = make_core(num_blocks=16)
    prompt = list(range(1, 11))  # 2 full blocks of 4 + 2 tokens
    core.add_request(make_request("a", prompt, 2))
    drain(core)
    core.add_request(make_request("b", prompt, 2))
    outputs = core.step()
    record = core.publisher.records[-1]
    assert (record.num_prefix_query_tokens, record.num_prefix_hit_tokens) == (10, 8)
    assert record.num_prefill_tokens == 2  # only the uncached tail was computed
    drain(core)
    assert outputs[0].num_cached_tokens == 8


def test_record_encodes_small_and_round_trips():
    core = make_core(num_blocks=16)
    core.add_request(make_request("a", [1, 2, 3], 4))
    drain(core)
    decode_record = core.publisher.records[1]
    assert decode_record.num_decode_tokens == 1 and not decode_record.milestones
    frame = make_encoder().encode(decode_record)
    assert len(frame) < 96
    assert make_decoder().decode(frame) == decode_record
    assert isinstance(msgspec.msgpack.decode(frame, type=IterationRecord), IterationRecord)


def test_queue_lengths_are_noted_when_a_request_arrives():
    core = make_core(num_blocks=16)
    core.add_request(make_request("a", [1, 2, 3], 2))
    core.add_request(make_request("b", [1, 2, 3], 2))
    assert core.publisher.queue_notes == [(1, 0, 0), (2, 0, 0)]


def test_queue_lengths_are_noted_as_an_iteration_starts_running():
    """Heartbeats sent during a long iteration say the queues it runs with and its size."""
    core = make_core(num_blocks=16, max_num_seqs=1)
    core.add_request(make_request("a", [1, 2, 3], 2))
    core.add_request(make_request("b", [1, 2, 3], 2))
    core.step()
    assert core.publisher.queue_notes[-1] == (1, 1, 3)  # a's 3 tokens in, b still waiting


def test_leaked_blocks_stay_used_with_nothing_running():
    core = make_core(num_blocks=16)
    leak_blocks_per_finish(core, 1)
    for index in range(3):
        core.add_request(make_request(f"r{index}", [1 + index, 2, 3, 4, 5], 2))
    drain(core)
    record = core.publisher.records[-1]
    assert record.num_running_reqs == 0 and record.num_waiting_reqs == 0
    assert record.num_kv_blocks_used == 3


def test_a_forward_pass_that_hangs_is_inside_its_iteration_time():
    core = make_core(num_blocks=16)
    core.runner = StallingRunner(core.runner, at_call=2, seconds=0.2)
    core.add_request(make_request("a", [1, 2, 3], 4))
    drain(core)
    stalled = core.publisher.records[1]
    assert stalled.iteration == 2 and stalled.elapsed_ns >= 200_000_000
    # the model's part of it is the forward pass: all of the hang, within the iteration
    assert 200_000_000 <= stalled.model_elapsed_ns <= stalled.elapsed_ns


def test_build_engine_core_plans_and_logs_startup_lines(caplog):
    config = EngineConfig(model="tiny", kv_cache_memory_bytes=1 << 20, max_model_len=2048)
    with caplog.at_level(logging.INFO, logger="engine.startup"):
        core, model = build_engine_core(config, load_fake_model, FakeRunner)
    bytes_per_token = 2 * 2 * 2 * 8 * 4  # layers x kv heads x head_dim x fp32, K and V
    assert core.kv_plan.num_blocks == (1 << 20) // (16 * bytes_per_token)
    assert (
        [r.getMessage() for r in caplog.records]
        == core.startup_lines()
        == [
            config.dtype_choice()[1],
            "Available KV cache memory: 0.00 GiB (1.0 MiB)",
            "KV cache size: 4,096 tokens",
            "Maximum concurrency for 2,048 tokens per request: 2.00x",
            allocator_line(),  # this process's: the test runner was not spawned with tcmalloc
            "CPU kernels: none (a fake runner)",  # the runner's own line
        ]
    )
    assert core.startup_lines()[-2].startswith("memory allocator: glibc malloc")
    facts = core.facts(model.config.name)
    assert facts["num_kv_blocks_total"] == 256
    assert facts["engine_version"] == f"iterscope {importlib.metadata.version('iterscope')}"
    core.add_request(make_request("a", [1, 2, 3], 3))
    assert len(drain(core)) == 3


def test_real_runner_greedy_output_equals_output_without_preemption():
    """A tiny random Llama on the real runner: batched, chunked and preempted requests
    produce exactly the tokens each produces alone in a roomy cache."""
    from engine.kv_planning import KvPlan
    from engine.model.loader import build_tiny_model
    from engine.runner import ModelRunner

    model = build_tiny_model("llama", seed=0)

    def run(prompts, num_blocks, max_num_seqs, max_num_batched_tokens):
        config = EngineConfig(
            model="tiny",
            block_size=4,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=num_blocks * 4,
        )
        plan = KvPlan(1, 4, num_blocks * 4, num_blocks, num_blocks * 4)
        runner = ModelRunner(model, num_blocks, 4, "cpu")
        core = EngineCore(config, runner, plan, model.config.eos_token_ids, RecordingPublisher())
        outputs = {}
        for index, prompt in enumerate(prompts):
            core.add_request(make_request(f"r{index}", prompt, 12))
            outputs[f"r{index}"] = []
        while core.has_work:
            for output in core.step():
                outputs[output.request_id] += output.new_token_ids
        return outputs, sum(record.num_preemptions for record in core.publisher.records)

    prompts = [list(range(10, 10 + n)) for n in (9, 5, 13, 7)] + [list(range(10, 19))]
    batched, num_preemptions = run(prompts, num_blocks=12, max_num_seqs=4, max_num_batched_tokens=8)
    assert num_preemptions > 0
    for index, prompt in enumerate(prompts):
        alone, _ = run([prompt], num_blocks=64, max_num_seqs=1, max_num_batched_tokens=64)
        assert batched[f"r{index}"] == alone["r0"]


def test_leaked_blocks_leave_work_waiting_for_kv_with_nothing_running():
    core = make_core(num_blocks=4)
    leak_blocks_per_finish(core, 2)
    core.add_request(make_request("a", [1, 2, 3, 4, 5], 2))
    drain(core)
    core.add_request(make_request("b", list(range(11, 20)), 2))  # needs 3 blocks, 2 are free
    core.step()
    record = core.publisher.records[-1]
    assert core.num_scheduled_reqs == 0 and core.has_work
    assert (record.num_running_reqs, record.num_waiting_kv_reqs) == (0, 1)
    assert (record.num_kv_blocks_used, record.num_kv_blocks_free) == (2, 2)


def test_token_ids_outside_the_vocabulary_are_rejected_not_fatal():
    core = make_core(num_blocks=16)
    core.vocab_size = 100
    with pytest.raises(RequestRejectedError, match=r"outside the model's vocabulary \(0..99\)"):
        core.add_request(make_request("a", [1, 2, 100], 2))
    with pytest.raises(RequestRejectedError):
        core.add_request(make_request("b", [-1, 2], 2))
    core.add_request(make_request("c", [1, 2, 99], 2))
    assert [o.request_id for o in drain(core) if o.finished] == ["c"]


def test_prefix_cache_off_counts_no_queries():
    core = make_core(num_blocks=16, enable_prefix_caching=False)
    for name in "ab":
        core.add_request(make_request(name, list(range(1, 40)), 2))
        drain(core)
    records = core.publisher.records
    assert sum(r.num_prefix_query_tokens for r in records) == 0
    assert sum(r.num_prefix_hit_tokens for r in records) == 0


def test_engine_index_outside_what_the_sidecar_accepts_is_a_config_error():
    with pytest.raises(
        ValueError, match=r"engine_index \(--engine-index\) must be a whole number in 0..4095"
    ):
        EngineConfig(engine_index=4096)
    with pytest.raises(ValueError, match="engine_index"):
        EngineConfig(engine_index=-1)


def test_heartbeat_facts_say_the_dtype_it_computes_in_and_its_max_model_len():
    """auto resolved for the device (kv-plan's --dtype auto would follow the checkpoint)."""
    core = make_core(num_blocks=16, max_model_len=128, dtype="auto", device="cpu")
    facts = core.facts("m")
    assert facts["dtype"] in ("float32", "bfloat16") and facts["dtype"] == (
        core.config.torch_dtype_name
    )
    assert facts["max_model_len"] == 128
