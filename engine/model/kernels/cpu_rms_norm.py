"""The CPU residual-add + RMSNorm kernel (rms_norm.c): built with gcc once, called by ctypes.

torch runs a layer's residual add and the RMSNorm after it as about eight ops (an upcast, a
power, a mean, an rsqrt, two products, a cast, the add), 13 us on 16 rows of SmolLM2; the
kernel makes one pass over each row, 5 us, and a serving step has 61 of them: about 4% of a
decode step and of a prefill iteration (docs/performance.md). Built on first use for this
machine (engine/model/kernels/cpu_build.py); `KERNEL.load()` returns None, and the decoder
keeps torch's ops, when there is no compiler or the build fails; `build_error()` says why.
ITERSCOPE_CPU_KERNELS=0 turns it off.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.model.kernels import cpu_build

SOURCE = Path(__file__).with_name("rms_norm.c")
MAX_DIM = 16384  # compiled into rms_norm.c
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the C enum


def supports(dtype: torch.dtype, hidden_size: int) -> bool:
    return dtype in DTYPE_CODES and hidden_size <= MAX_DIM


def open_library(path: Path) -> ctypes.CDLL:
    """Load a built library and declare its function's signature."""
    library = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.add_rms_norm.restype = None
    library.add_rms_norm.argtypes = [
        *(ptr, ptr, ptr, ptr),  # residual, delta (NULL: none), out, weight
        *(i64, i64, ctypes.c_float),  # rows, dim, eps
        *(ctypes.c_int, ctypes.c_int),  # dtype, threads
    ]
    return library


# load() builds it on first use; None (build_error() says why) means torch's path.
KERNEL = cpu_build.CpuKernel(SOURCE, open_library)


def add_rms_norm(
    library: ctypes.CDLL,
    residual: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """``residual += delta`` in place (unless None), then the RMSNorm of ``residual``, new.

    residual, delta: contiguous [rows, dim] of one dtype (DTYPE_CODES), weight: [dim], dim <=
    MAX_DIM. The caller checks (this is the hot path); the kernel trusts them."""
    out = torch.empty_like(residual)
    rows, dim = residual.shape
    library.add_rms_norm(
        residual.data_ptr(),
        None if delta is None else delta.data_ptr(),
        out.data_ptr(),
        weight.data_ptr(),
        rows,
        dim,
        eps,
        DTYPE_CODES[residual.dtype],
        torch.get_num_threads(),
    )
    return out
