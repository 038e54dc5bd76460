"""The CPU matmul kernel (matmul.c) for Linear layers: built with gcc once, called by ctypes.

Where it runs: CPUs of the kinds it was measured faster on, AMD with AVX-512 (a decode step's
weights stream ~1.6x faster than through oneDNN's packed matmul there: docs/performance.md)
and AMD with AVX2 (a decode step's matmuls 0.67-0.77x oneDNN's time), in float32, and in
bfloat16 where the CPU has AVX512_BF16. On other CPUs with AVX2 and FMA or AVX-512 the
engine times the kernel against oneDNN's packed matmul at start-up and runs the faster
(engine/model/matmul_choice.py); without those vectors Linear keeps oneDNN's packed weights
(engine/model/linear.py). The weights are laid out once, at load, in the kernel's panels
(``pack``); they replace oneDNN's copy, they do not add to it. ITERSCOPE_CPU_KERNELS=0 turns it off.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.model.kernels import cpu_build

SOURCE = Path(__file__).with_name("matmul.c")
PANEL = 16  # output columns a panel (matmul.c)
PANEL_PAIR = 32  # the output columns are padded up to a multiple of this
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the C enum
ACT_NONE, ACT_SILU_AND_MUL = 0, 1  # the C enum


def measured_kind(vendor: str, flags: set[str]) -> bool:
    """The CPU kinds the kernel was measured faster than oneDNN on: AMD with AVX-512, and AMD
    with AVX2 and FMA (its tiles of 6 rows there: matmul.c). Other kinds with its vectors
    time it at start-up (engine/model/matmul_choice.py)."""
    return vendor == "AuthenticAMD" and has_its_vectors(flags)


def has_its_vectors(flags: set[str]) -> bool:
    """The vectors the kernel's tiles are written and tested for: AVX-512, or AVX2 with FMA."""
    return "avx512f" in flags or {"avx2", "fma"} <= flags


def why_not(vendor: str, flags: set[str], dtype: torch.dtype, in_features: int) -> str | None:
    """Why the kernel cannot take a weight of ``dtype`` with ``in_features`` on this CPU
    (whether it is faster here is engine/model/matmul_choice.py's question), or None:
    float32 with its vectors; bfloat16 too where the CPU has AVX512_BF16 and the input size
    is even (a weight line holds pairs)."""
    if not has_its_vectors(flags):
        return "needs AVX2 with FMA, or AVX-512 (oneDNN's packed weights run)"
    if dtype == torch.float32:
        return None
    if dtype != torch.bfloat16:
        return f"not for {dtype}"
    if "avx512_bf16" not in flags:
        return "bfloat16 needs AVX512_BF16"
    return None if in_features % 2 == 0 else "bfloat16 needs an even input size"


def open_library(path: Path) -> ctypes.CDLL:
    """Load a built library and declare its functions' signatures."""
    library = ctypes.CDLL(str(path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    library.matmul.restype = ctypes.c_int
    library.matmul.argtypes = [
        *(ptr, i64, i64),  # x, rows, k
        *(ptr, i64),  # panels, n
        *(ptr, ptr),  # bias (float32, NULL: none), y
        *(ctypes.c_int, ctypes.c_int, ctypes.c_int),  # dtype, activation, threads
    ]
    return library


# load() builds it on first use; None (build_error() says why) means oneDNN's path.
KERNEL = cpu_build.CpuKernel(SOURCE, open_library, cpu_build.prefetch_flags(*cpu_build.this_cpu()))


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A [n, k] float32 or bf16 weight in the kernel's panels: float32 [P, k, 16], bf16
    [P, k/2, 16, 2] (k even), P = n rounded up to PANEL_PAIR, over PANEL; padding is zero."""
    return _panels(_padded(weight, PANEL_PAIR))


def pack_gated(weight: torch.Tensor) -> torch.Tensor:
    """The gate and up projections stacked ([2 * i, k]: gate rows, then up rows) in panels
    for ``matmul(..., gated=True)``: panel 2j holds gate columns 16j.., panel 2j + 1 the up
    columns beside them; each half padded to a multiple of PANEL."""
    gate, up = (_panels(_padded(half, PANEL)) for half in weight.chunk(2))
    return torch.stack((gate, up), dim=1).flatten(0, 1)


def _padded(weight: torch.Tensor, multiple: int) -> torch.Tensor:
    n, k = weight.shape
    if weight.dtype == torch.bfloat16 and k % 2:
        raise ValueError(f"a bfloat16 weight needs an even input size, got {k}")
    padded = torch.zeros(-(-n // multiple) * multiple, k, dtype=weight.dtype)
    padded[:n] = weight
    return padded


def _panels(padded: torch.Tensor) -> torch.Tensor:
    n, k = padded.shape
    if padded.dtype == torch.bfloat16:
        return padded.view(n // PANEL, PANEL, k // 2, 2).transpose(1, 2).contiguous()
    return padded.view(n // PANEL, PANEL, k).transpose(1, 2).contiguous()


def matmul(
    library: ctypes.CDLL,
    x: torch.Tensor,
    panels: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    gated: bool = False,
) -> torch.Tensor:
    """x [rows, k] contiguous, in the panels' dtype -> x . W^T (+ bias, float32 [n]) [rows, n];
    ``gated`` (panels from pack_gated, no bias): silu(x . gate^T) * (x . up^T) [rows, n], n
    the gate's columns, rounded as torch's ops round.

    The caller checks (this is the hot path); the kernel trusts them."""
    rows, k = x.shape
    y = torch.empty(rows, out_features, dtype=x.dtype)
    status = library.matmul(
        x.data_ptr(),
        rows,
        k,
        panels.data_ptr(),
        out_features,
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        DTYPE_CODES[x.dtype],
        ACT_SILU_AND_MUL if gated else ACT_NONE,
        torch.get_num_threads(),
    )
    if status:
        raise RuntimeError(f"the matmul kernel refused {x.dtype} {tuple(x.shape)}: {status}")
    return y
