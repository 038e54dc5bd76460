"""The CPU rotary-embedding + KV-store kernel (rope_store.c): built with gcc once, called by
ctypes.

Between a layer's fused q/k/v projection and attention, torch runs the rotation of queries and
keys (engine/model/rope.py: slices, a product, a concatenation, an addcmul) and two index_put
stores of keys and values into the paged cache: about a dozen ops, ~1 ms of a 16-request
decode step of SmolLM2 over its 30 layers. The kernel does all of it in one pass over each
token. The decoder uses it when attention reads keys and values only from the cache (its CPU
decode and prefill kernels), as the rotated keys then exist nowhere else. Built on first use
for this machine (engine/model/kernels/cpu_build.py); `KERNEL.load()` returns None, and the
decoder keeps torch's ops, when there is no compiler or the build fails; `build_error()` says
why. ITERSCOPE_CPU_KERNELS=0 turns it off.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.model.kernels import cpu_build

SOURCE = Path(__file__).with_name("rope_store.c")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the C enum
MAX_HEAD_DIM = 256  # compiled into rope_store.c


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    return dtype in DTYPE_CODES and head_dim % 2 == 0 and head_dim <= MAX_HEAD_DIM


def open_library(path: Path) -> ctypes.CDLL:
    """Load a built library and declare its function's signature."""
    library = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.rope_store.restype = None
    library.rope_store.argtypes = [
        *(ptr, i64, ptr, i64, ptr, i64),  # q, k, v sources and their row strides
        *(ptr, ptr, ptr, ptr, ptr),  # cos, sin, q_out, key_cache, value_cache
        *(ptr, ptr),  # slot_blocks, slot_offsets
        *(i64, i64, i64, i64, i64),  # tokens, heads, kv heads, head_dim, block_size
        *(ctypes.c_int, ctypes.c_int),  # dtype, threads
    ]
    return library


# load() builds it on first use; None (build_error() says why) means torch's ops.
KERNEL = cpu_build.CpuKernel(SOURCE, open_library)


def check_slots(
    slot_blocks: torch.Tensor, slot_offsets: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """The kernel writes where the slots say without a bounds check: check them, per step."""
    num_tokens = slot_blocks.shape[0]
    if (
        slot_blocks.dtype != torch.long
        or slot_offsets.dtype != torch.long
        or slot_offsets.shape != (num_tokens,)
        or not slot_blocks.is_contiguous()
        or not slot_offsets.is_contiguous()
    ):
        raise ValueError(
            f"slots must be contiguous int64 [{num_tokens}], got {slot_blocks.dtype} "
            f"{tuple(slot_blocks.shape)} and {slot_offsets.dtype} {tuple(slot_offsets.shape)}"
        )
    if num_tokens and (
        int(slot_blocks.min()) < 0
        or int(slot_blocks.max()) >= num_blocks
        or int(slot_offsets.min()) < 0
        or int(slot_offsets.max()) >= block_size
    ):
        raise ValueError(f"slots outside [0, {num_blocks}) x [0, {block_size})")


def rope_store(
    library: ctypes.CDLL,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    threads: int,
) -> torch.Tensor:
    """The rotated queries [T, H, D] (new, contiguous); the rotated keys and the values are
    written into the caches at each token's slot.

    q [T, H, D], k and v [T, KVH, D]: heads contiguous inside a row, any stride between
    tokens; cos, sin: contiguous [T, 1, D] (rope.rope_cos_sin); caches contiguous
    [num_blocks, KVH, block_size, D]; all of one dtype (DTYPE_CODES); slots checked by
    check_slots this step (this is the hot path; the kernel trusts them)."""
    num_tokens, num_heads, head_dim = q.shape
    q_out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype)
    library.rope_store(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        k.stride(0),
        v.data_ptr(),
        v.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        q_out.data_ptr(),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        slot_blocks.data_ptr(),
        slot_offsets.data_ptr(),
        num_tokens,
        num_heads,
        k.shape[1],
        head_dim,
        key_cache.shape[2],
        DTYPE_CODES[q.dtype],
        threads,
    )
    return q_out
