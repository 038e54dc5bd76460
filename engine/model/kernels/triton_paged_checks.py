"""The argument contract of the Triton launches in triton_paged.py, checked in plain Python.

A launch reads and writes through raw pointers and strides, so a shape, dtype, device or
stride it does not expect would read or write the wrong memory instead of failing. These
checks raise ValueError first. They only read tensor metadata (no device sync), so a checked
launch can still be captured in a CUDA graph. Values are not checked: seq_lens >= 1 and each
block-table row covering its sequence are the caller's contract.
"""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_decode_args(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Raise ValueError unless the shapes, dtypes, devices and strides fit paged_decode."""
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
