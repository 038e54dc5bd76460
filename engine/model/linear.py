"""A weight matrix applied as x @ W.T (+ b). On CPU in bfloat16 it is packed once for oneDNN.

F.linear hands oneDNN a plain row-major weight on every call, and oneDNN reorders it into
its blocked layout each time. Packing once at load time
(`torch.ops.mkldnn._reorder_linear_weight`, the op torch.compile's CPU freezing pass uses)
makes decode-sized matmuls about 15% faster on AVX-512 BF16 CPUs. In bfloat16 the results
are the same as F.linear. float32 is left unpacked: there the packed kernel rounds
differently (about 1e-4) and the parity tests hold float32 to transformers at 1e-4.
CPUs without AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT refuse the reorder; there the weight
stays plain. Set ITERSCOPE_PACK_WEIGHTS=0 to turn packing off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def _packing_available(weight: torch.Tensor) -> bool:
    return (
        os.environ.get("ITERSCOPE_PACK_WEIGHTS", "1") != "0"
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear:
    """Callable: x [..., in_features] -> [..., out_features]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.weight = weight
        self.packed: torch.Tensor | None = None
        if _packing_available(weight):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
                self.weight = None  # the packed copy replaces it
            except RuntimeError:
                self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [None], "")
