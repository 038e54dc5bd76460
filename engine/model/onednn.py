"""oneDNN's packed Linear weights on CPU: the blocked layout its fast kernels read, made once
(`torch.ops.mkldnn._reorder_linear_weight`, the op torch.compile's CPU freezing pass uses),
and the product over it. Used by Linear (engine/model/linear.py) and by the timing that
chooses between it and the CPU matmul kernel (engine/model/matmul_choice.py)."""

from __future__ import annotations

import torch


def packing_available() -> bool:
    """Whether this torch has oneDNN and its Linear packing op."""
    return torch.backends.mkldnn.is_available() and hasattr(
        torch.ops.mkldnn, "_reorder_linear_weight"
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout of a float32 or bf16 weight (for batches around 32 rows; any
    number of rows works); RuntimeError for bf16 on CPUs without bf16 support."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 32)


def packed_product(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x . W^T (+ bias) over a weight from ``pack_weight``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [None], "")
