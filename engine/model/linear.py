"""A weight matrix applied as x @ W.T (+ b). On CPU in bfloat16 it is prepared once at load.

bfloat16 on CPU takes one of two forms, chosen by what the CPU can do:

- packed, on CPUs with bf16 support in oneDNN (AVX-512 BW/VL/DQ, or AVX-NE-CONVERT):
  F.linear hands oneDNN a plain row-major weight on every call, and oneDNN reorders it into
  its blocked layout each time. Packing once at load time
  (`torch.ops.mkldnn._reorder_linear_weight`, the op torch.compile's CPU freezing pass uses)
  makes decode-sized matmuls about 15% faster on AVX-512 BF16 CPUs, with the same results.
- widened, on the others (AVX2): there a bf16 matmul runs 3-7x slower than float32 (measured
  on an AVX2 EPYC). The weight is kept as a float32 copy (twice the memory) and the input
  widened per call; the output is rounded back to bfloat16. A bf16 GEMM multiplies bf16
  values exactly in float32 and accumulates in float32, so this is the same computation up to
  the order of the sums.

float32 is left alone: there the packed kernel rounds differently (about 1e-4) and the parity
tests hold float32 to transformers at 1e-4. Set ITERSCOPE_PACK_WEIGHTS=0 to keep bfloat16
weights plain (neither packed nor widened).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F


def _prepare_bf16(weight: torch.Tensor) -> bool:
    return (
        os.environ.get("ITERSCOPE_PACK_WEIGHTS", "1") != "0"
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def pack_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's blocked layout of a bf16 weight; RuntimeError on CPUs without bf16 support."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, 32)


@functools.cache
def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 at speed (oneDNN packs bf16 weights here)."""
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        pack_bf16_weight(torch.zeros(32, 32, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


class Linear:
    """Callable: x [..., in_features] -> [..., out_features], in x's dtype.

    Exactly one of ``weight``, ``packed`` and ``widened`` holds the weight.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.weight: torch.Tensor | None = weight
        self.packed: torch.Tensor | None = None
        self.widened: torch.Tensor | None = None
        if not _prepare_bf16(weight):
            return
        try:
            self.packed = pack_bf16_weight(weight)
        except RuntimeError:  # no bf16 support in this CPU
            self.widened = weight.float()
            self.bias = None if bias is None else bias.float()
        self.weight = None  # the packed or widened copy replaces it

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.linear(x, self.weight, self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(
                x, self.packed, self.bias, "none", [None], ""
            )
        return F.linear(x.float(), self.widened, self.bias).to(x.dtype)
