"""The paged KV cache's bookkeeping: a fixed set of blocks, reference counts, a free queue in
LRU order and a prefix cache keyed by chained block hashes.

A request's block table maps positions to blocks (block_size = 4 here):

    token_ids   t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
    block_ids   [    7     ,      2      ,   5   ]      position p -> block_ids[p // 4]
    hash        h7 = H(None, t0..t3)   h2 = H(h7, t4..t7)   (block 5 is not full: no hash)

Invariants:
- Every block is either in use (ref_count > 0) or in the free queue (ref_count == 0), never
  both; num_used_blocks + num_free_blocks == num_blocks.
- A block gets a hash only when it is full and all its tokens' K/V are computed. The hash of
  block i chains the hash of block i-1 with block i's token ids, so one hash names a whole
  prefix. It is SHA-256, not Python's hash(): ints are not salted there, so a crafted prompt
  could collide with another tenant's prefix and read its K/V. A hit is also verified against
  the stored parent hash and token ids.
- Free blocks keep their hash and stay findable (a later request may revive them) until the
  free queue hands them out again: the queue pops the least recently freed block first (LRU
  eviction), and a request's blocks are freed tail first so its prefix outlives its tail.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from engine.kv_planning import cdiv
from engine.request import Request


def hash_block(parent_hash: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """Chained SHA-256 of a full block: the parent's 32-byte digest (none for the first
    block), then the token ids as 8-byte ints. The lengths differ, so a first block can never
    pass for a later one."""
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids))
    return digest.digest()


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        # Free block ids, least recently freed first. OrderedDict: O(1) pop, append and removal.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self.num_used_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks not in use, including cached ones that may still be revived."""
        return len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    # Block level -------------------------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks off the free queue (LRU first), evicting their hashes."""
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks, {len(self._free)} are free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            block_ids.append(block_id)
        self.num_used_blocks += num_blocks
        return block_ids

    def acquire(self, block_ids: list[int]) -> None:
        """Add a reference to blocks already holding K/V (prefix hits), reviving free ones."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
                self.num_used_blocks += 1
            block.ref_count += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block, tail first; unreferenced blocks join the queue."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count < 1:
                raise ValueError(f"block {block_id} freed more often than it was allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                self.num_used_blocks -= 1

    def match_prefix(self, token_ids: list[int], max_blocks: int) -> list[int]:
        """Block ids holding the longest cached prefix of ``token_ids`` (full blocks only)."""
        hit_block_ids: list[int] = []
        parent_hash = None
        size = self.block_size
        for index in range(min(max_blocks, len(token_ids) // size)):
            block_tokens = tuple(token_ids[index * size : (index + 1) * size])
            block_hash = hash_block(parent_hash, block_tokens)
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent_hash != parent_hash or block.token_ids != block_tokens:
                break  # a hash collision: not our prefix
            hit_block_ids.append(block_id)
            parent_hash = block_hash
        return hit_block_ids

    def cache_block(
        self, block_id: int, parent_hash: bytes | None, token_ids: tuple[int, ...]
    ) -> bytes:
        """Register a full, computed block under its chained hash; returns the hash."""
        block = self.blocks[block_id]
        block.block_hash = hash_block(parent_hash, token_ids)
        block.parent_hash = parent_hash
        block.token_ids = token_ids
        # Two requests may have computed the same block; the first one stays findable.
        self._cached.setdefault(block.block_hash, block_id)
        return block.block_hash

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
        block.block_hash = None
        block.parent_hash = None
        block.token_ids = ()

    # Request level -----------------------------------------------------------------------

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """New blocks ``request`` needs to hold K/V for ``num_new_tokens`` more tokens."""
        num_tokens = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(num_tokens, self.block_size) - len(request.block_ids))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the request's block table for ``num_new_tokens``; False if blocks run out."""
        num_needed = self.num_blocks_needed(request, num_new_tokens)
        if num_needed > len(self._free):
            return False
        request.block_ids.extend(self.allocate(num_needed))
        return True

    def admit(self, request: Request, hit_block_ids: list[int], num_new_tokens: int) -> bool:
        """Give a waiting request its prefix hits plus blocks for ``num_new_tokens`` tokens.

        On success the request's block table is hits + new blocks and its computed tokens
        are the hit tokens. Hits that sit in the free queue are not counted as free here.
        """
        num_hit_tokens = len(hit_block_ids) * self.block_size
        num_needed = cdiv(num_hit_tokens + num_new_tokens, self.block_size) - len(hit_block_ids)
        num_revived = sum(1 for block_id in hit_block_ids if block_id in self._free)
        if num_needed > len(self._free) - num_revived:
            return False
        self.acquire(hit_block_ids)
        request.block_ids = list(hit_block_ids) + self.allocate(num_needed)
        request.num_computed_tokens = num_hit_tokens
        return True

    def cache_computed_blocks(self, request: Request, num_computed_before: int) -> None:
        """Hash the request's blocks that became full and computed since num_computed_before."""
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        block_ids = request.block_ids
        for index in range(num_computed_before // size, request.num_computed_tokens // size):
            parent_hash = self.blocks[block_ids[index - 1]].block_hash if index else None
            if index and parent_hash is None:
                return  # a hole in the chain: hashing on would name this block a first block
            block_tokens = tuple(request.token_ids[index * size : (index + 1) * size])
            self.cache_block(block_ids[index], parent_hash, block_tokens)

    def free_request(self, request: Request) -> None:
        self.free(request.block_ids)
        request.block_ids = []
