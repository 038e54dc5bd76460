"""Triton kernels for CUDA: paged-decode attention and the KV-cache store.

Cache layout (engine/model/attention.py), one tensor for K and one for V per layer:

    cache[block_id, kv_head, offset, dim]      contiguous, head-major inside a block

    position p of sequence b  ->  block block_table[b, p // block_size], offset p % block_size

paged_decode: one query token per sequence (flash-decoding style).
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
    output and log-sum-exp to a float32 scratch buffer; a second kernel, grid (B, H),
    merges the splits weighted by exp(lse_s - max lse). A split with no positions left has
    lse = -inf and weight 0; split 0 always has a position since seq_len >= 1.

store_kv: grid (T, KVH); program (t, h) copies k[t, h] and v[t, h] (D elements each) to
    cache[slot_blocks[t], h, slot_offsets[t]]. A negative block id skips the token (padding
    rows of a fixed-size CUDA-graph batch).

Dtypes: float32, bfloat16, float16; q, caches and out share one dtype. Float32 dots run in
IEEE float32 on FMA units (no TF32), so results match the torch path to ~1e-6. 16-bit dots
run on tensor cores (mma.sync m16n8k16 on sm_90) with float32 accumulation, and the
probabilities are rounded to the input dtype before the value dot, as the torch path's 16-bit
softmax output is. Compiled for sm_90 with 4 warps: 71-128 registers, no spills (ptxas -v).

What the tests prove and what they do not (tests/test_triton_paged.py):
- Under Triton's interpreter (TRITON_INTERPRET=1, numpy on CPU tensors) the kernels run
  against plain float64 attention: indexing, masking, GQA mapping, online softmax, the
  split merge and the store are checked. Triton 3.9's interpreter multiplies bfloat16 dot
  operands as their raw uint16 bits, so under the interpreter bfloat16 dots are widened to
  float32 first (exact, see _dot_dtype); the compiled kernel keeps bfloat16 operands.
- Every variant is compiled to a cubin for sm_90 (H100/H200) with Triton's bundled ptxas,
  without a GPU, and the 16-bit ones are checked to use tensor-core instructions.
- Nothing proves the compiled kernels' results or speed on a GPU; test_compiled_on_cuda runs
  the same cases compiled when CUDA is present.

Shapes are validated by `check_decode_args` / `check_store_args` (plain Python, no device
sync): seq_lens >= 1 and each table row covering its sequence are the caller's contract.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only runtime may lack triton; available() is then False
    triton = None

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
MIN_DOT_SIZE = 16  # tl.dot needs every dimension >= 16
MIN_BLOCKS_PER_SPLIT = 16  # a split reads at least this many blocks (256 tokens at size 16)


def available(device: torch.device | str) -> bool:
    """True only for a CUDA device with triton importable and ITERSCOPE_TRITON not 0."""
    try:
        if torch.device(device).type != "cuda" or triton is None:
            return False
        if os.environ.get("ITERSCOPE_TRITON", "1") == "0":
            return False
        return torch.cuda.is_available()
    except Exception:
        return False


def paged_decode(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> None:
    """out[b] = softmax(q[b] K_b^T * scale) V_b for one query token per sequence.

    q, out [B, H, D] with contiguous rows; caches contiguous [num_blocks, KVH, block_size, D];
    block_table int32/int64 [B, max_blocks]; seq_lens int32/int64 [B], each >= 1 and covered
    by its table row. num_splits None picks the split count from the table width and the
    number of SMs (no device sync, so the call can be captured in a CUDA graph).
    """
    check_decode_args(q, key_cache, value_cache, block_table, seq_lens, out)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    if num_splits is None:
        num_splits = _pick_num_splits(q.device, num_seqs * num_kv_heads, block_table.shape[1])
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    group = num_heads // num_kv_heads
    dot_dtype = _dot_dtype(q.dtype)
    split_out = out
    split_lse = out  # unused when num_splits == 1 (the kernel does not touch it)
    if num_splits > 1:
        split_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        split_lse = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device
        )
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, key_cache, value_cache, block_table, seq_lens, out, split_out, split_lse,
        scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        block_table.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        GROUP_PAD=_padded(group),
        DIM_PAD=_padded(head_dim),
        BLOCK_PAD=_padded(block_size),
        NUM_SPLITS=num_splits,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            split_out, split_lse, out, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim,
            DIM_PAD=triton.next_power_of_2(head_dim),
            NUM_SPLITS=num_splits,
            SPLIT_PAD=triton.next_power_of_2(num_splits),
        )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """key_cache[slot_blocks[t], :, slot_offsets[t]] = k[t] (and v); a block id < 0 skips t.

    k, v [T, KVH, D] with contiguous rows (any stride between tokens and heads, e.g. views
    into a fused qkv output); caches contiguous [num_blocks, KVH, block_size, D].
    """
    check_store_args(k, v, key_cache, value_cache, slot_blocks, slot_offsets)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, key_cache, value_cache, slot_blocks, slot_offsets,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim),
    )


def check_decode_args(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Raise ValueError unless the shapes, dtypes, devices and strides fit paged_decode."""
    _check_triton()
    _check_rank(q=q, out=out, rank=3)
    _check_cache_pair(key_cache, value_cache, q.dtype, q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out must match q: got {tuple(out.shape)} {out.dtype} on {out.device}, "
            f"q is {tuple(q.shape)} {q.dtype} on {q.device}"
        )
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[1]
    if head_dim != key_cache.shape[3]:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {key_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    for name, tensor in (("q", q), ("out", out)):
        if tensor.stride(2) != 1 or tensor.stride(1) != head_dim:
            raise ValueError(f"{name} rows [H, D] must be contiguous, strides {tensor.stride()}")
    _check_index(block_table, "block_table", 2, num_seqs, q.device)
    _check_index(seq_lens, "seq_lens", 1, num_seqs, q.device)
    if block_table.stride(1) != 1:
        raise ValueError(f"block_table rows must be contiguous, strides {block_table.stride()}")
    if seq_lens.stride(0) != 1 and num_seqs > 1:
        raise ValueError("seq_lens must be contiguous")


def check_store_args(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """Raise ValueError unless the shapes, dtypes, devices and strides fit store_kv."""
    _check_triton()
    _check_rank(k=k, v=v, rank=3)
    _check_cache_pair(key_cache, value_cache, k.dtype, k.device)
    expected = (k.shape[0], *key_cache.shape[1:2], key_cache.shape[3])
    for name, tensor in (("k", k), ("v", v)):
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name} must be [T, KVH, D] = {expected}, got {tuple(tensor.shape)}")
        if tensor.dtype != key_cache.dtype or tensor.device != key_cache.device:
            raise ValueError(
                f"{name} is {tensor.dtype} on {tensor.device}, the cache "
                f"{key_cache.dtype} on {key_cache.device}"
            )
        if tensor.stride(2) != 1:
            raise ValueError(f"{name} head rows must be contiguous, strides {tensor.stride()}")
    for name, index in (("slot_blocks", slot_blocks), ("slot_offsets", slot_offsets)):
        _check_index(index, name, 1, k.shape[0], k.device)
        if index.stride(0) != 1 and k.shape[0] > 1:
            raise ValueError(f"{name} must be contiguous")


def _check_triton() -> None:
    if triton is None:
        raise ValueError("triton is not installed (pip install triton)")


def _check_rank(rank: int, **tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.dim() != rank:
            raise ValueError(f"{name} must have {rank} dims, got shape {tuple(tensor.shape)}")


def _check_cache_pair(
    key_cache: torch.Tensor, value_cache: torch.Tensor, dtype: torch.dtype, device: torch.device
) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} not supported; use one of {SUPPORTED_DTYPES}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if cache.dim() != 4:
            raise ValueError(
                f"{name} must be [num_blocks, KVH, block_size, D], got {tuple(cache.shape)}"
            )
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if cache.dtype != dtype or cache.device != device:
            raise ValueError(
                f"{name} is {cache.dtype} on {cache.device}, expected {dtype} on {device}"
            )
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache {tuple(value_cache.shape)} != key_cache {tuple(key_cache.shape)}"
        )


def _check_index(
    index: torch.Tensor, name: str, rank: int, num_rows: int, device: torch.device
) -> None:
    if index.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {index.dtype}")
    if index.dim() != rank or index.shape[0] != num_rows:
        raise ValueError(
            f"{name} must have {rank} dims and {num_rows} rows, got {tuple(index.shape)}"
        )
    if index.device != device:
        raise ValueError(f"{name} is on {index.device}, expected {device}")


def _padded(size: int) -> int:
    """A tl.dot dimension: a power of two, at least 16."""
    return max(MIN_DOT_SIZE, triton.next_power_of_2(size))


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """The dtype the dots run in: the input's, except bfloat16 under the interpreter.

    Float32 dots run in IEEE precision (no TF32); 16-bit ones on tensor cores with the default
    precision setting (which only affects float32 operands).

    Triton 3.9's interpreter keeps bfloat16 as raw uint16 bits and its tl.dot multiplies
    those bits as integers; widening to float32 first is exact, so the interpreted kernel
    computes what the compiled bfloat16 dot (float32 accumulation) computes.
    """
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        return tl.float32
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[
        dtype
    ]


def _pick_num_splits(device: torch.device, num_programs: int, max_blocks: int) -> int:
    """Split long tables across enough programs to cover the SMs once; 1 when already full."""
    if device.type != "cuda":
        return 1
    num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    wanted = -(-num_sms // num_programs)  # ceil
    return max(1, min(wanted, max_blocks // MIN_BLOCKS_PER_SPLIT))


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, seq_lens_ptr, out_ptr,
        split_out_ptr, split_lse_ptr,
        scale,
        q_stride_seq, q_stride_head, out_stride_seq, out_stride_head,
        cache_stride_block, cache_stride_head, cache_stride_offset,
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
                probs.to(values.dtype).to(DOT_DTYPE), values.to(DOT_DTYPE),
                input_precision=DOT_PRECISION,
            )
            running_max = new_max

        head_mask = group_offs < GROUP
        if NUM_SPLITS == 1:
            result = acc / running_sum[:, None]
            out_rows = (
                out_ptr + seq.to(tl.int64) * out_stride_seq + heads[:, None] * out_stride_head
            )
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
    def _merge_splits_kernel(
        split_out_ptr, split_lse_ptr, out_ptr, out_stride_seq, out_stride_head,
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
            split_lse_ptr + seq_head * NUM_SPLITS + split_offs, mask=split_mask,
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
    def _store_kv_kernel(
        k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, slot_blocks_ptr, slot_offsets_ptr,
        k_stride_token, k_stride_head, v_stride_token, v_stride_head,
        cache_stride_block, cache_stride_head, cache_stride_offset,
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
            block_id * cache_stride_block + kv_head * cache_stride_head
            + offset * cache_stride_offset
        )
        tl.store(key_cache_ptr + slot + dim_offs, key, mask=mask)
        tl.store(value_cache_ptr + slot + dim_offs, value, mask=mask)
