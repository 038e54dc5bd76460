"""Paged attention in torch (CPU and CUDA): K/V live in fixed-size blocks, read via block tables.

Cache layout, per layer (one tensor for K, one for V):

    key_cache[block_id, offset, kv_head, :]      block_id in [0, num_blocks), offset < block_size

    position p of a request  ->  slot = block_ids[p // block_size] * block_size + p % block_size
    key_cache.view(num_blocks * block_size, kv_heads, head_dim)[slot] is that position's key

A step's tokens are laid out flat, decode tokens first:

    tokens  [d0 d1 ... dB-1 | prefill request a (q_len_a) | prefill request b | ...]

Decode tokens (one new token per request) are attended together: their blocks are gathered
into one [B, max_blocks * block_size] buffer and masked past each request's length. Each prefill
request (q_len > 1, maybe on top of a cached prefix or earlier chunks) is attended on its own
with a causal mask aligned to its last position. New K/V are written to the cache first, so
every query sees its own key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """One request's chunk of q_len > 1 tokens at flat indices [token_start, token_end).

    kv_slots is None when the chunk starts at position 0: its keys are exactly the chunk's own
    fresh K/V, so plain causal attention applies. Otherwise kv_slots lists the cache slots of
    positions [0, end) and mask[i, j] says query i may see position j.
    """

    token_start: int
    token_end: int
    kv_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once, shared by all layers."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    num_decode_tokens: int  # tokens [0, num_decode_tokens) are single-token decodes
    decode_block_tables: torch.Tensor | None  # [B, max_blocks] (padded with block 0)
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_blocks * block_size]: key is valid
    prefills: list[PrefillSpan]


class PagedAttention:
    """Writes a step's new K/V into the cache and attends through the block tables."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group_size = num_heads // num_kv_heads
        self.scale = head_dim**-0.5
        self.decode_key_buffer: torch.Tensor | None = None
        self.decode_value_buffer: torch.Tensor | None = None

    def begin_step(self, meta: AttentionMetadata, key_cache: torch.Tensor) -> None:
        """Allocate the decode gather buffers once per step; every layer reuses them."""
        if meta.decode_block_tables is None:
            self.decode_key_buffer = self.decode_value_buffer = None
            return
        num_rows = meta.decode_block_tables.numel()
        block_numel = key_cache[0].numel()
        shape = (num_rows, block_numel)
        self.decode_key_buffer = key_cache.new_empty(shape)
        self.decode_value_buffer = key_cache.new_empty(shape)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] -> attention output [T, H * D]."""
        num_blocks, block_size = key_cache.shape[:2]
        flat_keys = key_cache.view(num_blocks * block_size, self.num_kv_heads, self.head_dim)
        flat_values = value_cache.view(num_blocks * block_size, self.num_kv_heads, self.head_dim)
        flat_keys.index_copy_(0, meta.slot_mapping, k)
        flat_values.index_copy_(0, meta.slot_mapping, v)
        out = torch.empty_like(q)
        num_decodes = meta.num_decode_tokens
        if num_decodes:
            out[:num_decodes] = self._decode(q[:num_decodes], key_cache, value_cache, meta)
        for span in meta.prefills:
            start, end = span.token_start, span.token_end
            if span.kv_slots is None:
                out[start:end] = self._prefill(q[start:end], k[start:end], v[start:end], None)
            else:
                keys = flat_keys.index_select(0, span.kv_slots)
                values = flat_values.index_select(0, span.kv_slots)
                out[start:end] = self._prefill(q[start:end], keys, values, span.mask)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _decode(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One query per request against its gathered blocks: [B, H, D] -> [B, H, D]."""
        block_tables = meta.decode_block_tables
        num_reqs, max_blocks = block_tables.shape
        block_size = key_cache.shape[1]
        context_len = max_blocks * block_size
        flat_ids = block_tables.view(-1)
        keys = torch.index_select(
            key_cache.view(key_cache.shape[0], -1), 0, flat_ids, out=self.decode_key_buffer
        ).view(num_reqs, context_len, self.num_kv_heads, self.head_dim)
        values = torch.index_select(
            value_cache.view(value_cache.shape[0], -1), 0, flat_ids, out=self.decode_value_buffer
        ).view(num_reqs, context_len, self.num_kv_heads, self.head_dim)
        grouped_q = q.view(num_reqs, self.num_kv_heads, self.group_size, self.head_dim)
        # scores [B, KVH, G, L]: each KV head serves its group of query heads without a copy.
        scores = torch.matmul(grouped_q * self.scale, keys.permute(0, 2, 3, 1))
        scores = scores.masked_fill_(~meta.decode_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, values.transpose(1, 2))
        return out.view(num_reqs, self.num_heads, self.head_dim)

    def _prefill(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q [Lq, H, D] against keys/values [Lk, KVH, D]; causal when mask is None (Lq == Lk)."""
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
            enable_gqa=self.group_size > 1,
        )
        return out.squeeze(0).transpose(0, 1)
