"""What attention needs for one step, built by the runner once and shared by all layers.

A step's tokens are laid out flat, decode tokens first:

    tokens  [d0 d1 ... dB-1 | prefill request a (q_len_a) | prefill request b | ...]

Every token has a slot in the paged KV cache (engine/model/attention.py): the block and the
offset its position's K/V go to. Decode tokens (one new token per request) are attended
together through one block table; each prefill span (one or more chunks that start at the
same position) is attended in one call.

gather_rows turns block ids into rows of the head-major cache, block_id * num_kv_heads +
kv_head (why head-major: engine/model/attention.py).

The C kernels read through their tables without bounds checks, so check_decode_tables and
check_prefill_tables verify them every step before they run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSpan:
    """Prefill chunks (q_len > 1 each) back to back at flat indices [token_start, token_end),
    attended in one call: each is ``lengths[i]`` tokens of its request from position ``start``
    on, the same ``start`` for all (lengths equal, or close enough that padding each to the
    longest costs little).

    start 0: fresh prompts, whose keys are exactly their own new K/V. Otherwise each chunk
    also sees its cached context, positions [0, start): a prefix cache hit (a chat template)
    or earlier chunks; prefix_rows [n, kv_heads, blocks] are the gather rows
    (block_id * num_kv_heads + kv_head) of the blocks holding it, one row of blocks per chunk.
    """

    token_start: int
    token_end: int
    start: int = 0
    lengths: list[int] = field(default_factory=list)  # the chunks' lengths, in order
    padding: tuple[torch.Tensor, torch.Tensor] | None = None  # attention's, for unequal lengths
    prefix_rows: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once, shared by all layers."""

    slot_blocks: torch.Tensor  # [num_tokens] block id of each new token's position
    slot_offsets: torch.Tensor  # [num_tokens] offset inside that block
    num_decode_tokens: int  # tokens [0, num_decode_tokens) are single-token decodes
    decode_block_table: torch.Tensor | None  # int64 [B, max_blocks], rows padded with block 0
    decode_seq_lens: torch.Tensor | None  # int64 [B]: positions to attend, the new one included
    prefills: list[PrefillSpan]
    # The prefill chunks one by one, for the CPU prefill kernel (on the CPU whatever the
    # device): int64 [3, n] each chunk's first flat index, first position and length, and
    # int64 [n, max_blocks] the blocks holding its positions [0, start + length), padded with 0.
    prefill_chunks: torch.Tensor | None = None
    prefill_block_table: torch.Tensor | None = None


def gather_rows(block_ids: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[..., num_blocks] block ids -> [..., kv_heads, num_blocks] rows of the head-major cache."""
    heads = torch.arange(num_kv_heads, device=block_ids.device)[:, None]
    return block_ids.unsqueeze(-2) * num_kv_heads + heads


def check_decode_tables(meta: AttentionMetadata, num_blocks: int, block_size: int) -> None:
    """The C kernel trusts its tables (a bad one reads out of bounds): check them per step."""
    table, seq_lens = meta.decode_block_table, meta.decode_seq_lens
    num_decodes = meta.num_decode_tokens
    if (
        table.dtype != torch.long
        or seq_lens.dtype != torch.long
        or table.shape[0] != num_decodes
        or seq_lens.shape != (num_decodes,)
        or not table.is_contiguous()
        or not seq_lens.is_contiguous()
    ):
        raise ValueError(
            f"decode tables must be contiguous int64 [{num_decodes}, max_blocks] and "
            f"[{num_decodes}], got {table.dtype} {tuple(table.shape)} and {seq_lens.dtype} "
            f"{tuple(seq_lens.shape)}"
        )
    if int(seq_lens.min()) < 1 or int(seq_lens.max()) > table.shape[1] * block_size:
        raise ValueError(f"decode seq_lens {seq_lens.tolist()} outside [1, table capacity]")
    if int(table.min()) < 0 or int(table.max()) >= num_blocks:
        raise ValueError(f"decode block table holds ids outside [0, {num_blocks})")


def check_prefill_tables(
    meta: AttentionMetadata, num_tokens: int, num_blocks: int, block_size: int
) -> None:
    """The C prefill kernel trusts its tables (a bad one reads out of bounds): check them."""
    chunks, table = meta.prefill_chunks, meta.prefill_block_table
    num_chunks = len(table) if table is not None else -1
    if (
        chunks is None
        or table is None
        or chunks.dtype != torch.long
        or table.dtype != torch.long
        or chunks.shape != (3, num_chunks)
        or not chunks.is_contiguous()
        or not table.is_contiguous()
    ):
        raise ValueError(
            "prefill tables must be contiguous int64 [3, n] and [n, max_blocks], got "
            f"{None if chunks is None else (chunks.dtype, tuple(chunks.shape))} and "
            f"{None if table is None else (table.dtype, tuple(table.shape))}"
        )
    token_starts, starts, lengths = chunks
    if (
        int(lengths.min()) < 1
        or int(starts.min()) < 0
        or int(token_starts.min()) < 0
        or int((token_starts + lengths).max()) > num_tokens
        or int((starts + lengths).max()) > table.shape[1] * block_size
    ):
        raise ValueError(f"prefill chunks {chunks.tolist()} outside the step or their tables")
    if int(table.min()) < 0 or int(table.max()) >= num_blocks:
        raise ValueError(f"prefill block table holds ids outside [0, {num_blocks})")
