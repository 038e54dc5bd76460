"""Scheduler properties under random arrivals with a KV cache small enough to force preemption.

Runs the real EngineCore (scheduler + block pool) on the fake runner, whose next token is a
function of the history it reads back through the block tables, so a greedy output equal to
the single-request reference means batching, chunking, prefix hits and preemption by
recompute changed nothing.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core import EngineCore
from engine.request import Request, SamplingParams
from engine.scheduler import RequestRejectedError
from tests.helpers.fake_runner import BLOCK_SIZE, make_core, reference_output


def make_request(request_id, prompt, max_tokens, ignore_eos=True) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=ignore_eos)
    return Request(request_id, list(prompt), params)


def check_step(core: EngineCore) -> None:
    record = core.publisher.records[-1]
    config = core.config
    assert record.num_prefill_tokens + record.num_decode_tokens <= (config.max_num_batched_tokens)
    assert record.num_prefill_reqs + record.num_decode_reqs <= config.max_num_seqs
    assert record.num_running_reqs == len(core.scheduler.running) <= config.max_num_seqs
    split = (
        record.num_waiting_kv_reqs,
        record.num_waiting_seq_limit_reqs,
        record.num_waiting_budget_reqs,
    )
    assert sum(split) == record.num_waiting_reqs == len(core.scheduler.waiting)
    running = core.scheduler.running
    assert record.num_kv_tokens == sum(request.num_computed_tokens for request in running)
    assert record.num_kv_blocks_used + record.num_kv_blocks_free == core.pool.num_blocks
    refs = [0] * core.pool.num_blocks
    for request in running:
        for block_id in request.block_ids:
            refs[block_id] += 1
    assert [block.ref_count for block in core.pool.blocks] == refs
    assert all(not request.block_ids for request in core.scheduler.waiting)


def run_to_completion(core: EngineCore, arrivals: dict[int, list[Request]], max_steps=3000):
    outputs: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    step = 0
    while core.has_work or any(key >= step for key in arrivals):
        for request in arrivals.get(step, []):
            core.add_request(request)
            outputs[request.request_id] = []
        if core.has_work:
            for output in core.step():
                outputs[output.request_id] += output.new_token_ids
                if output.finished:
                    finished[output.request_id] = output.finish_reason
            check_step(core)
        step += 1
        assert step < max_steps, "requests did not finish"
    return outputs, finished


request_specs = st.lists(
    st.tuples(
        st.lists(st.integers(1, 3), min_size=1, max_size=20),  # prompt (shared prefixes likely)
        st.integers(1, 12),  # max_tokens
        st.integers(0, 8),  # arrival step
        st.booleans(),  # ignore_eos
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=120, deadline=None)
@given(
    num_blocks=st.integers(4, 12),
    max_num_seqs=st.integers(1, 4),
    budget=st.integers(1, 24),
    chunked=st.booleans(),
    caching=st.booleans(),
    specs=request_specs,
)
def test_scheduler_properties(num_blocks, max_num_seqs, budget, chunked, caching, specs):
    max_model_len = min(num_blocks * BLOCK_SIZE, 40)
    budget = max(budget, max_num_seqs, 0 if chunked else max_model_len)
    core = make_core(
        num_blocks,
        max_num_seqs,
        budget,
        max_model_len,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=caching,
    )
    arrivals: dict[int, list[Request]] = {}
    expected: dict[str, list[int]] = {}
    for index, (prompt, max_tokens, arrival_step, ignore_eos) in enumerate(specs):
        request = make_request(f"r{index}", prompt, max_tokens, ignore_eos)
        if len(prompt) + max_tokens > max_model_len:
            try:
                core.scheduler.check_request(request.request_id, len(prompt), max_tokens)
            except RequestRejectedError:
                continue
            raise AssertionError("an impossible request was accepted")
        arrivals.setdefault(arrival_step, []).append(request)
        expected[request.request_id] = reference_output(
            prompt, max_tokens, max_model_len, ignore_eos=ignore_eos
        )
    outputs, finished = run_to_completion(core, arrivals)
    assert outputs == expected
    assert set(finished) == set(expected)
    assert core.pool.num_used_blocks == 0
    assert core.scheduler.num_kv_tokens == 0


def test_preempted_requests_produce_the_same_greedy_output():
    core = make_core(num_blocks=8, max_num_seqs=4, max_num_batched_tokens=16)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [2, 3, 4, 5, 6], [3, 1, 2], [1, 2, 3, 4, 9, 9]]
    arrivals = {0: [make_request(f"r{i}", p, 14) for i, p in enumerate(prompts)]}
    outputs, _ = run_to_completion(core, arrivals)
    records = core.publisher.records
    assert sum(record.num_preemptions for record in records) > 0
    finishes = [m for record in records for m in record.milestones if m.finished_ns]
    assert any(milestone.num_preemptions > 0 for milestone in finishes)
    assert any(milestone.preempted_ns for milestone in finishes)
    for index, prompt in enumerate(prompts):
        assert outputs[f"r{index}"] == reference_output(prompt, 14, 32, ignore_eos=True)


def test_waiting_attributed_to_sequence_limit():
    core = make_core(num_blocks=16, max_num_seqs=1)
    core.add_request(make_request("a", [1, 2, 3], 4))
    core.add_request(make_request("b", [1, 2, 3], 4))
    core.step()
    record = core.publisher.records[-1]
    assert (record.num_running_reqs, record.num_waiting_seq_limit_reqs) == (1, 1)
    assert record.num_waiting_kv_reqs == record.num_waiting_budget_reqs == 0


def test_waiting_attributed_to_token_budget_and_chunked_prefill():
    core = make_core(num_blocks=16, max_num_seqs=4, max_num_batched_tokens=8)
    core.add_request(make_request("a", list(range(1, 21)), 2))
    core.add_request(make_request("b", [1, 2], 2))
    core.step()
    record = core.publisher.records[-1]
    assert (record.num_prefill_reqs, record.num_prefill_tokens) == (1, 8)
    assert record.num_waiting_budget_reqs == 1
    chunks = []
    while core.has_work:
        core.step()
        chunks.append(core.publisher.records[-1].num_prefill_tokens)
    assert chunks[:2] == [8, 4 + 2]  # the rest of a's prompt, then b's prompt in the same pass


def test_waiting_attributed_to_kv_capacity():
    core = make_core(num_blocks=4, max_num_seqs=4)
    core.add_request(make_request("a", list(range(1, 12)), 4))  # 3 of 4 blocks
    core.add_request(make_request("b", list(range(1, 9)), 4))  # needs 2 more
    core.step()
    record = core.publisher.records[-1]
    assert (record.num_running_reqs, record.num_waiting_kv_reqs) == (1, 1)
    assert record.num_kv_blocks_used == 3


def test_generation_and_context_counts():
    core = make_core(num_blocks=16)
    core.add_request(make_request("a", [1, 2, 3, 4, 5], 3))
    core.step()
    core.add_request(make_request("b", [3, 2, 1], 3))
    core.step()
    record = core.publisher.records[-1]
    assert (record.num_prefill_reqs, record.num_prefill_tokens) == (1, 3)
    assert (record.num_decode_reqs, record.num_decode_tokens) == (1, 1)


def test_impossible_requests_are_rejected_at_submission():
    core = make_core(num_blocks=4, max_model_len=64)
    too_long = make_request("long", [1] * 60, 8)
    try:
        core.add_request(too_long)
    except RequestRejectedError as error:
        assert "exceeds max_model_len (64)" in str(error)
    else:
        raise AssertionError("accepted a request longer than max_model_len")
    too_big = make_request("big", [1] * 17, 2)  # 19 tokens = 5 blocks of 4, the cache has 4
    try:
        core.add_request(too_big)
    except RequestRejectedError as error:
        assert "need 5 KV blocks but the whole cache has 4" in str(error)
    else:
        raise AssertionError("accepted a request bigger than the KV cache")
    assert not core.has_work
