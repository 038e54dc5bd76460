"""Block pool: reference counts, the free queue, LRU eviction and prefix-cache hits.

The property test drives the request-level API with random requests drawn from a tiny
alphabet (so prefixes repeat) and keeps a shadow copy of what was "written" into each block;
a prefix hit must return blocks whose written tokens are exactly the request's tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_pool import BlockPool
from engine.request import Request, SamplingParams

BLOCK_SIZE = 4


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(max_tokens=1))


def check_invariants(pool: BlockPool, live: dict[str, Request]) -> None:
    expected_refs = [0] * pool.num_blocks
    for request in live.values():
        for block_id in request.block_ids:
            expected_refs[block_id] += 1
    for block in pool.blocks:
        assert block.ref_count == expected_refs[block.block_id]
        assert (block.ref_count > 0) != pool.is_free(block.block_id)
    assert pool.num_used_blocks + pool.num_free_blocks == pool.num_blocks
    assert pool.num_used_blocks == sum(1 for refs in expected_refs if refs)


operations = st.lists(
    st.tuples(
        st.sampled_from(["admit", "admit", "finish"]),
        st.lists(st.integers(0, 2), min_size=1, max_size=14),
        st.integers(0, 50),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 12), ops=operations)
def test_block_pool_properties(num_blocks, ops):
    pool = BlockPool(num_blocks, BLOCK_SIZE, enable_prefix_caching=True)
    written: dict[int, tuple[int, ...]] = {}  # block id -> tokens computed into it
    live: dict[str, Request] = {}
    for step, (kind, token_ids, pick) in enumerate(ops):
        if kind == "finish" and live:
            request = live.pop(sorted(live)[pick % len(live)])
            pool.free_request(request)
        elif kind == "admit":
            request = make_request(f"r{step}", token_ids)
            max_blocks = (len(token_ids) - 1) // BLOCK_SIZE
            hits = pool.match_prefix(request.token_ids, max_blocks)
            for index, block_id in enumerate(hits):
                block_tokens = tuple(token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE])
                assert written[block_id] == block_tokens  # a hit is exactly the cached tokens
            num_new_tokens = len(token_ids) - len(hits) * BLOCK_SIZE
            if pool.admit(request, hits, num_new_tokens):
                assert request.block_ids[: len(hits)] == hits
                assert request.num_computed_tokens == len(hits) * BLOCK_SIZE
                # "Compute" the new tokens: the shadow copy records what each block holds.
                for index in range(len(hits), len(request.block_ids)):
                    chunk = token_ids[index * BLOCK_SIZE : (index + 1) * BLOCK_SIZE]
                    written[request.block_ids[index]] = tuple(chunk)
                before = request.num_computed_tokens
                request.num_computed_tokens = len(token_ids)
                pool.cache_computed_blocks(request, before)
                live[request.request_id] = request
            else:
                assert request.block_ids == [] and num_new_tokens > 0
        check_invariants(pool, live)


def test_freed_prefix_is_revived_and_evicted_in_lru_order():
    pool = BlockPool(4, BLOCK_SIZE)
    first = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert pool.admit(first, [], first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    pool.cache_computed_blocks(first, 0)
    pool.free_request(first)
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 0
    # The full blocks stay findable while free, and a hit revives them.
    hits = pool.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 10], max_blocks=2)
    assert len(hits) == 2
    again = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 10])
    assert pool.admit(again, hits, 1)
    assert pool.num_used_blocks == 3
    pool.free_request(again)
    # Allocating everything evicts every hash: nothing is findable afterwards.
    pool.allocate(4)
    assert pool.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 10], max_blocks=2) == []


def test_tail_blocks_are_evicted_before_the_prefix():
    pool = BlockPool(3, BLOCK_SIZE)
    request = make_request("a", list(range(1, 10)))  # 2 full blocks + 1 partial
    assert pool.admit(request, [], request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    pool.cache_computed_blocks(request, 0)
    prefix_block, second_block, tail_block = request.block_ids
    pool.free_request(request)
    assert pool.allocate(1) == [tail_block]
    assert pool.allocate(1) == [second_block]
    assert pool.match_prefix(list(range(1, 10)), max_blocks=2) == [prefix_block]


def test_hash_collision_is_not_a_hit():
    pool = BlockPool(2, BLOCK_SIZE)
    request = make_request("a", [1, 2, 3, 4, 5])
    assert pool.admit(request, [], 5)
    request.num_computed_tokens = 5
    pool.cache_computed_blocks(request, 0)
    pool.blocks[request.block_ids[0]].token_ids = (9, 9, 9, 9)  # as if another prefix collided
    assert pool.match_prefix([1, 2, 3, 4, 5], max_blocks=1) == []


def test_double_free_is_an_error():
    pool = BlockPool(2, BLOCK_SIZE)
    block_ids = pool.allocate(1)
    pool.free(block_ids)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free(block_ids)
    with pytest.raises(ValueError, match="cannot allocate 3 blocks"):
        pool.allocate(3)
