"""The CPU paged-decode attention kernel (paged_decode.c): built with gcc once, called by ctypes.

The torch decode path copies every sequence's blocks into a contiguous buffer before its two
batched matmuls; on a CPU that copy is about half the decode attention time. The C kernel reads
keys and values in place through the block table instead. Built on first use for this machine
(engine/model/kernels/cpu_build.py); `KERNEL.load()` returns None, and attention keeps the
torch path, when there is no compiler or the build fails; `build_error()` says why.
ITERSCOPE_CPU_KERNELS=0 turns the kernel off.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.model.kernels import cpu_build

SOURCE = Path(__file__).with_name("paged_decode.c")
MAX_GROUP = 16  # bounds compiled into paged_decode.c
MAX_HEAD_DIM = 256
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the C enum


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the compiled bounds and dtypes cover this model (any block size works)."""
    return (
        dtype in DTYPE_CODES
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim <= MAX_HEAD_DIM
    )


def build(compiler: str, cache_dir: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """The library built from SOURCE in cache_dir. extra_flags: e.g.
    ("-DPAGED_DECODE_PORTABLE",) for the plain-C path, or ("-mno-avx512f",) for the AVX2 path
    on an AVX-512 CPU (tests, bench/paged_decode_kernel.py)."""
    return cpu_build.build(compiler, cache_dir, SOURCE, extra_flags)


def open_library(path: Path) -> ctypes.CDLL:
    """Load a built library and declare its functions' signatures."""
    library = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.vector_path.restype = ctypes.c_int
    library.vector_path.argtypes = []
    library.paged_decode.restype = None
    library.paged_decode.argtypes = [
        ptr,
        i64,
        ptr,
        ptr,
        ptr,
        i64,
        ptr,
        ptr,
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int,
    ]
    return library


# load() builds it on first use; None (build_error() says why) means torch's path.
KERNEL = cpu_build.CpuKernel(
    SOURCE,
    open_library,
    cpu_build.prefetch_flags(*cpu_build.this_cpu()),
)


def paged_decode(
    library: ctypes.CDLL,
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """out[b] = softmax(q[b] K_b^T * scale) V_b for one query token per sequence.

    q, out: [B, H, D] with contiguous rows (any stride between sequences); key_cache,
    value_cache: contiguous [num_blocks, KVH, block_size, D]; block_table: int64 [B, max_blocks]
    contiguous; seq_lens: int64 [B], each >= 1 and covered by its table row. The caller checks
    shapes (this is the hot path); the kernel trusts them.
    """
    num_seqs, num_heads, head_dim = q.shape
    library.paged_decode(
        q.data_ptr(),
        q.stride(0),
        key_cache.data_ptr(),
        value_cache.data_ptr(),
        block_table.data_ptr(),
        block_table.shape[1],
        seq_lens.data_ptr(),
        out.data_ptr(),
        out.stride(0),
        num_seqs,
        num_heads,
        key_cache.shape[1],
        head_dim,
        key_cache.shape[2],
        scale,
        DTYPE_CODES[q.dtype],
        torch.get_num_threads(),
    )
