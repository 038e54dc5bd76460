"""The Triton kernels behind engine/model/kernels/triton_paged.py, which launches them.

Importing this module needs triton. The cache layout is triton_paged.py's.

paged_decode_kernel: one query token per sequence (flash-decoding style).
    Grid (B, KVH, num_splits). A program owns one (sequence, kv head) pair and the whole
    group of G = H // KVH query heads that read that kv head (query head h reads kv head
    h // G), so each key and value is loaded once per group. It walks its share of the
    sequence's blocks through the block table; per block it loads the block's keys
    [block_size, D], takes scores = q_group @ K^T (one tl.dot: the group is padded
    to 16 rows, the block to at least 16 positions), masks positions past the sequence's
    end, and folds the block into a running max, sum and output (online softmax), all
    accumulated in float32. With num_splits == 1 the program writes the normalised output.
    With num_splits > 1 (long contexts with few sequences: too few programs to fill the
    GPU) split s takes a contiguous slice of the blocks and writes its normalised partial
    output and log-sum-exp to a float32 scratch buffer.

merge_splits_kernel: grid (B, H); merges the splits weighted by exp(lse_s - max lse). A split
    with no positions left has lse = -inf and weight 0; split 0 always has a position since
    seq_len >= 1.

store_kv_kernel: grid (T, KVH); program (t, h) copies k[t, h] and v[t, h] (D elements each)
    to cache[slot_blocks[t], h, slot_offsets[t]]. A negative block id skips the token
    (padding rows of a fixed-size CUDA-graph batch).

Numerics: DOT_DTYPE and DOT_PRECISION come from the launch. Float32 dots run in IEEE float32
on FMA units (no TF32), so results match the torch path to ~1e-6. 16-bit dots run on tensor
cores (mma.sync m16n8k16 on sm_90) with float32 accumulation, and the probabilities are
rounded to the input dtype before the value dot, as the torch path's 16-bit softmax output
is. Compiled for sm_90 with 4 warps: 71-128 registers, no spills (ptxas -v).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_decode_kernel(
    q_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    out_ptr,
    split_out_ptr,
    split_lse_ptr,
    scale,
    q_stride_seq,
    q_stride_head,
    out_stride_seq,
    out_stride_head,
    cache_stride_block,
    cache_stride_head,
    cache_stride_offset,
    table_stride_seq,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    group_offs = tl.arange(0, GROUP_PAD)
    dim_offs = tl.arange(0, DIM_PAD)
    token_offs = tl.arange(0, BLOCK_PAD)
    heads = kv_head * GROUP + group_offs
    q_mask = (group_offs < GROUP)[:, None] & (dim_offs < HEAD_DIM)[None, :]
    q_rows = q_ptr + seq.to(tl.int64) * q_stride_seq + heads[:, None] * q_stride_head
    q = tl.load(q_rows + dim_offs[None, :], mask=q_mask, other=0.0).to(DOT_DTYPE)

    seq_len = tl.load(seq_lens_ptr + seq)
    num_blocks = tl.cdiv(seq_len, BLOCK_SIZE)
    blocks_per_split = tl.cdiv(num_blocks, NUM_SPLITS)
    first_block = split * blocks_per_split
    end_block = tl.minimum(first_block + blocks_per_split, num_blocks)

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table_row = block_table_ptr + seq.to(tl.int64) * table_stride_seq
    head_offset = kv_head.to(tl.int64) * cache_stride_head
    tile_offsets = token_offs[:, None] * cache_stride_offset + dim_offs[None, :]
    for block_index in range(first_block, end_block):
        block_id = tl.load(table_row + block_index).to(tl.int64)
        positions = block_index * BLOCK_SIZE + token_offs
        valid = (token_offs < BLOCK_SIZE) & (positions < seq_len)
        tile_mask = valid[:, None] & (dim_offs < HEAD_DIM)[None, :]
        base = block_id * cache_stride_block + head_offset
        keys = tl.load(key_cache_ptr + base + tile_offsets, mask=tile_mask, other=0.0)
        scores = tl.dot(q, tl.trans(keys.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
        scores *= scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp(running_max - new_max)
        probs = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        values = tl.load(value_cache_ptr + base + tile_offsets, mask=tile_mask, other=0.0)
        acc = acc * rescale[:, None] + tl.dot(
            probs.to(values.dtype).to(DOT_DTYPE),
            values.to(DOT_DTYPE),
            input_precision=DOT_PRECISION,
        )
        running_max = new_max

    head_mask = group_offs < GROUP
    if NUM_SPLITS == 1:
        result = acc / running_sum[:, None]
        out_rows = out_ptr + seq.to(tl.int64) * out_stride_seq + heads[:, None] * out_stride_head
        tl.store(out_rows + dim_offs[None, :], result.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # An empty split keeps sum 0: its output is 0 and its lse -inf (weight 0 in the merge).
        safe_sum = tl.where(running_sum > 0, running_sum, 1.0)
        result = acc / safe_sum[:, None]
        lse = tl.where(running_sum > 0, running_max + tl.log(safe_sum), float("-inf"))
        seq_heads = seq.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads
        split_rows = (seq_heads * NUM_SPLITS + split) * HEAD_DIM
        tl.store(split_out_ptr + split_rows[:, None] + dim_offs[None, :], result, mask=q_mask)
        tl.store(split_lse_ptr + seq_heads * NUM_SPLITS + split, lse, mask=head_mask)


@triton.jit
def merge_splits_kernel(
    split_out_ptr,
    split_lse_ptr,
    out_ptr,
    out_stride_seq,
    out_stride_head,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLIT_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_head = seq.to(tl.int64) * tl.num_programs(1) + head
    split_offs = tl.arange(0, SPLIT_PAD)
    dim_offs = tl.arange(0, DIM_PAD)
    split_mask = split_offs < NUM_SPLITS
    lse = tl.load(
        split_lse_ptr + seq_head * NUM_SPLITS + split_offs,
        mask=split_mask,
        other=float("-inf"),
    )
    weights = tl.exp(lse - tl.max(lse, axis=0))
    rows = (seq_head * NUM_SPLITS + split_offs) * HEAD_DIM
    mask = split_mask[:, None] & (dim_offs < HEAD_DIM)[None, :]
    partial = tl.load(split_out_ptr + rows[:, None] + dim_offs[None, :], mask=mask, other=0.0)
    result = tl.sum(partial * weights[:, None], axis=0) / tl.sum(weights, axis=0)
    out_row = out_ptr + seq.to(tl.int64) * out_stride_seq + head * out_stride_head
    tl.store(out_row + dim_offs, result.to(out_ptr.dtype.element_ty), mask=dim_offs < HEAD_DIM)


@triton.jit
def store_kv_kernel(
    k_ptr,
    v_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_blocks_ptr,
    slot_offsets_ptr,
    k_stride_token,
    k_stride_head,
    v_stride_token,
    v_stride_head,
    cache_stride_block,
    cache_stride_head,
    cache_stride_offset,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    block_id = tl.load(slot_blocks_ptr + token).to(tl.int64)
    offset = tl.load(slot_offsets_ptr + token).to(tl.int64)
    dim_offs = tl.arange(0, DIM_PAD)
    mask = dim_offs < tl.where(block_id >= 0, HEAD_DIM, 0)  # a negative block: no-op
    token64 = token.to(tl.int64)
    k_row = k_ptr + token64 * k_stride_token + kv_head * k_stride_head
    v_row = v_ptr + token64 * v_stride_token + kv_head * v_stride_head
    key = tl.load(k_row + dim_offs, mask=mask)
    value = tl.load(v_row + dim_offs, mask=mask)
    slot = (
        block_id * cache_stride_block + kv_head * cache_stride_head + offset * cache_stride_offset
    )
    tl.store(key_cache_ptr + slot + dim_offs, key, mask=mask)
    tl.store(value_cache_ptr + slot + dim_offs, value, mask=mask)
