"""Block pool: reference counts, the free queue, LRU eviction and prefix-cache hits.

The property test drives the request-level API with random requests drawn from a tiny
alphabet (so prefixes repeat) and keeps a shadow copy of what was "written" into each block:
the whole prefix its K/V was computed after, since K/V depend on every earlier token. A prefix
hit must return blocks written after exactly the request's own prefix.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import block_pool
from engine.block_pool import BlockPool, hash_block
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
                prefix = tuple(token_ids[: (index + 1) * BLOCK_SIZE])
                assert written[block_id] == prefix  # a hit is exactly the cached prefix
            num_new_tokens = len(token_ids) - len(hits) * BLOCK_SIZE
            if pool.admit(request, hits, num_new_tokens):
                assert request.block_ids[: len(hits)] == hits
                assert request.num_computed_tokens == len(hits) * BLOCK_SIZE
                # "Compute" the new tokens: the shadow copy records what each block holds.
                for index in range(len(hits), len(request.block_ids)):
                    prefix = token_ids[: (index + 1) * BLOCK_SIZE]
                    written[request.block_ids[index]] = tuple(prefix)
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


def test_hash_chains_the_whole_prefix():
    first = hash_block(None, (1, 2, 3, 4))
    assert len(first) == 32
    assert hash_block(first, (5, 6, 7, 8)) != hash_block(
        hash_block(None, (9, 9, 9, 9)), (5, 6, 7, 8)
    )
    assert hash_block(None, (5, 6, 7, 8)) != hash_block(first, (5, 6, 7, 8))


def cache_request(pool: BlockPool, request_id: str, token_ids: list[int]) -> Request:
    request = make_request(request_id, token_ids)
    assert pool.admit(request, [], request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    pool.cache_computed_blocks(request, 0)
    return request


@pytest.mark.parametrize(
    "colliding_hash",
    [
        lambda parent, tokens: hash(
            tokens
        ),  # ignores the parent: equal blocks after other prefixes
        lambda parent, tokens: b"same",  # every block collides
    ],
)
def test_a_hash_collision_never_returns_another_prefix(monkeypatch, colliding_hash):
    """The verification on a hit (parent hash and token ids) holds even when hashes collide."""
    monkeypatch.setattr(block_pool, "hash_block", colliding_hash)
    pool = BlockPool(8, BLOCK_SIZE)
    first = cache_request(pool, "a", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    second = cache_request(pool, "c", [9, 9, 9, 9, 0, 0, 0, 0, 0])
    # Block 1 of "a" holds (5, 6, 7, 8) computed after (1, 2, 3, 4), not after (9, 9, 9, 9).
    hits = pool.match_prefix([9, 9, 9, 9, 5, 6, 7, 8, 0], max_blocks=2)
    assert hits == second.block_ids[:1] or hits == []
    assert first.block_ids[1] not in hits
    assert pool.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 1], max_blocks=2) in (
        first.block_ids[:2],
        first.block_ids[:1],
        [],
    )
