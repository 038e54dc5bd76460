"""Triton paged-decode attention and the KV-cache store on CUDA: the host-side launches.

Cache layout (engine/model/attention.py), one tensor for K and one for V per layer:

    cache[block_id, kv_head, offset, dim]      contiguous, head-major inside a block

    position p of sequence b  ->  block block_table[b, p // block_size], offset p % block_size

paged_decode launches the decode kernel over (B, KVH, num_splits) and, with num_splits > 1,
the merge of the splits over (B, H); store_kv launches the store over (T, KVH). The kernels,
their algorithm and numerics: triton_paged_kernels.py. Arguments are checked first
(triton_paged_checks.py); nothing here syncs with the device, so a launch can be captured in
a CUDA graph.

Dtypes: float32, bfloat16, float16; q, caches and out share one dtype. Float32 dots run in
IEEE precision, 16-bit ones on tensor cores (_dot_dtype picks the dot dtype per launch).

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
"""

from __future__ import annotations

import functools
import os

import torch

from engine.model.kernels.triton_paged_checks import check_decode_args, check_store_args

try:
    import triton
    import triton.language as tl

    from engine.model.kernels.triton_paged_kernels import (
        merge_splits_kernel,
        paged_decode_kernel,
        store_kv_kernel,
    )
except ImportError:  # the CPU-only runtime may lack triton; available() is then False
    triton = None

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
    _check_triton()
    check_decode_args(q, key_cache, value_cache, block_table, seq_lens, out)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    if num_splits is None:
        num_splits = _pick_num_splits(q.device, num_seqs * num_kv_heads, block_table.shape[1])
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    group = num_heads // num_kv_heads
    dot_dtype = _dot_dtype(q.dtype)
    split_out, split_lse = _split_scratch(out, num_splits)
    paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        out,
        split_out,
        split_lse,
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
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
        merge_splits_kernel[(num_seqs, num_heads)](
            split_out,
            split_lse,
            out,
            out.stride(0),
            out.stride(1),
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
    _check_triton()
    check_store_args(k, v, key_cache, value_cache, slot_blocks, slot_offsets)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    store_kv_kernel[(num_tokens, num_kv_heads)](
        k,
        v,
        key_cache,
        value_cache,
        slot_blocks,
        slot_offsets,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        HEAD_DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim),
    )


def _split_scratch(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the splits write and the merge reads: float32 partial outputs [B, H, splits, D]
    and log-sum-exps [B, H, splits]. One split writes out itself and never touches the lse
    argument, so out stands in for both."""
    if num_splits == 1:
        return out, out
    num_seqs, num_heads, head_dim = out.shape
    split_out = torch.empty(
        (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=out.device
    )
    split_lse = torch.empty(
        (num_seqs, num_heads, num_splits), dtype=torch.float32, device=out.device
    )
    return split_out, split_lse


def _check_triton() -> None:
    if triton is None:
        raise ValueError("triton is not installed (pip install triton)")


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
