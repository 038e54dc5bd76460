"""The CPU prefill attention kernel (prefill_attention.c): built with gcc once, called by ctypes.

torch's prefill path (engine/model/attention.py) pads a span's chunks to one length, gathers
a cached prefix out of the blocks, transposes the queries into groups and runs two batched
matmuls per 64 query positions with a causal bias: about 2 ms a layer for four 270-token
prompts of SmolLM2 in bfloat16, 3 ms in float32. The kernel reads every chunk's keys through
its block table, skips the keys after each query's position and needs no padding, one call per
layer for all of a step's prefill chunks. Its scratch (kept by attention, grown to the
largest step) holds each chunk's keys and values widened to float32: 8 bytes per position of
context, kv head and dim (SmolLM2, 4 chunks of 270: 1.6 MiB; one chunk 8,192 positions into
a prompt of a model with 8 kv heads of 128: 64 MiB). Built on first use for this machine
(engine/model/kernels/cpu_build.py); `KERNEL.load()` returns None, and attention keeps the torch
path, when there is no compiler or the build fails; `build_error()` says why.
ITERSCOPE_CPU_KERNELS=0 turns it off.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.model.kernels import cpu_build

SOURCE = Path(__file__).with_name("prefill_attention.c")
LANES = 16  # head_dim must be a multiple of the kernel's vector width
MAX_HEAD_DIM = 256  # compiled into prefill_attention.c
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the C enum


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the compiled bounds and dtypes cover this model (any block size works)."""
    return (
        dtype in DTYPE_CODES
        and num_heads % num_kv_heads == 0
        and head_dim % LANES == 0
        and head_dim <= MAX_HEAD_DIM
    )


def open_library(path: Path) -> ctypes.CDLL:
    """Load a built library and declare its functions' signatures."""
    library = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.prefill_scratch_floats.restype = i64
    library.prefill_scratch_floats.argtypes = [ptr, ptr, i64, i64, i64, i64]
    library.prefill_attention.restype = None
    library.prefill_attention.argtypes = [
        *(ptr, i64, ptr, ptr),  # q, q_stride, key_cache, value_cache
        *(ptr, i64),  # block_table, max_blocks
        *(ptr, ptr, ptr, i64),  # token_starts, starts, lengths, num_chunks
        *(ptr, i64, ptr),  # out, out_stride, scratch
        *(i64, i64, i64, i64),  # num_heads, num_kv_heads, head_dim, block_size
        *(ctypes.c_float, ctypes.c_int, ctypes.c_int),  # scale, dtype, threads
    ]
    return library


# load() builds it on first use; None (build_error() says why) means torch's path.
KERNEL = cpu_build.CpuKernel(SOURCE, open_library)


def scratch_floats(
    library: ctypes.CDLL, chunks: torch.Tensor, num_kv_heads: int, head_dim: int, threads: int
) -> int:
    """Float32 elements of scratch one call over ``chunks`` needs (the same for every layer)."""
    return library.prefill_scratch_floats(
        chunks[1].data_ptr(), chunks[2].data_ptr(), chunks.shape[1], num_kv_heads, head_dim, threads
    )


def prefill_attention(
    library: ctypes.CDLL,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    chunks: torch.Tensor,
    out: torch.Tensor,
    scratch: torch.Tensor,
    scale: float,
    threads: int,
) -> None:
    """out[t] = softmax(q[t] K^T * scale) V, causal, for every query row of every chunk.

    q, out: [T, H, D] with contiguous rows (any stride between tokens); key_cache,
    value_cache: contiguous [num_blocks, KVH, block_size, D] holding the chunks' own K/V
    already; block_table: contiguous int64 [n, max_blocks], chunk c's blocks; chunks:
    contiguous int64 [3, n]: each chunk's first row in q, its first position, its length;
    scratch: float32 of at least scratch_floats(...) elements. The caller checks them
    (check_prefill_tables, once per step; this is the hot path); the kernel trusts them.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    library.prefill_attention(
        q.data_ptr(),
        q.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        block_table.data_ptr(),
        block_table.shape[1],
        chunks[0].data_ptr(),
        chunks[1].data_ptr(),
        chunks[2].data_ptr(),
        chunks.shape[1],
        out.data_ptr(),
        out.stride(0),
        scratch.data_ptr(),
        num_heads,
        key_cache.shape[1],
        head_dim,
        key_cache.shape[2],
        scale,
        DTYPE_CODES[q.dtype],
        threads,
    )
