"""A weight matrix applied as x @ W.T (+ b). On CPU it is prepared once at load.

F.linear hands the BLAS a plain row-major weight on every call; oneDNN's blocked layout,
made once at load time (engine/model/onednn.py), is what its fast kernels read. What is
prepared depends on the dtype and on what the CPU can do:

- float32: packed. On an AVX2 EPYC, decode-sized matmuls of SmolLM2 run 2-2.6x faster
  packed (the 576 x 49152 head for 16 rows: 45 -> 17 ms; every shape of the model, 16 rows:
  48 -> 19 ms), and the result differs from F.linear only in the order of the float32 sums
  (about 1e-5 relative).
- bfloat16, on CPUs with bf16 support in oneDNN (AVX-512 BW/VL/DQ, or AVX-NE-CONVERT):
  packed, about 15% faster on AVX-512 BF16 CPUs, with the same results.
- bfloat16 on the others (AVX2): widened. There a bf16 matmul runs 3-7x slower than float32
  (measured on an AVX2 EPYC). The weight is kept as a float32 copy (twice the memory) and
  the input widened per call; the output is rounded back to bfloat16. A bf16 GEMM multiplies
  bf16 values exactly in float32 and accumulates in float32, so this is the same
  computation up to the order of the sums.

Before all of these, where the CPU matmul kernel runs (float32, and bfloat16 with
AVX512_BF16, on the AMD CPUs it was measured faster on, and on other CPUs with AVX2 and FMA
or AVX-512 where a timing at start-up finds it faster: engine/model/matmul_choice.py), the
weight is laid out in its panels instead. On an AMD CPU with AVX-512 a decode step's
matmuls stream the weights ~1.6x faster than oneDNN's; prefill's, compute-bound, take 2-5%
longer. With AVX2 both are faster (0.67-0.77x oneDNN's time at 16 rows, 0.88x at 1,024:
docs/performance.md).

Set ITERSCOPE_PACK_WEIGHTS=0 to keep every weight plain (no panels, neither packed nor
widened).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from engine.model import matmul_choice
from engine.model.kernels import cpu_matmul
from engine.model.onednn import pack_weight, packed_product, packing_available


def _packing_allowed(weight: torch.Tensor) -> bool:
    return os.environ.get("ITERSCOPE_PACK_WEIGHTS", "1") != "0" and weight.device.type == "cpu"


def _preparable(weight: torch.Tensor) -> bool:
    return (
        _packing_allowed(weight)
        and weight.dtype in (torch.float32, torch.bfloat16)
        and packing_available()
    )


@functools.cache
def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 at speed (oneDNN packs bf16 weights here)."""
    if not packing_available():
        return False
    try:
        pack_weight(torch.zeros(32, 32, dtype=torch.bfloat16))
    except RuntimeError:
        return False
    return True


class Linear:
    """Callable: x [..., in_features] -> [..., out_features], in x's dtype.

    ``gated``: the weight is a gate and an up projection stacked ([2 * out_features, in]),
    and the call returns silu(x . gate^T) * (x . up^T), the MLP's activation; the CPU matmul
    kernel computes it as it stores the products (one pass less over them), the other paths
    with torch's ops, rounded alike. Exactly one of ``weight``, ``panels``, ``packed`` and
    ``widened`` holds the weight.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False
    ) -> None:
        self.out_features, self.in_features = weight.shape
        if gated:
            if bias is not None or self.out_features % 2:
                raise ValueError("a gated Linear takes a stacked gate and up weight, no bias")
            self.out_features //= 2
        self.gated = gated
        self.bias = bias
        self.weight: torch.Tensor | None = weight
        self.panels: torch.Tensor | None = None  # the CPU matmul kernel's layout
        self.packed: torch.Tensor | None = None
        self.widened: torch.Tensor | None = None
        self.kernel = None  # the CPU matmul kernel's library, where it holds the panels
        if (
            _packing_allowed(weight)
            and matmul_choice.why_not_here(weight.dtype, self.in_features) is None
        ):
            self.kernel = cpu_matmul.KERNEL.load()
        if self.kernel is not None:
            self.panels = (cpu_matmul.pack_gated if gated else cpu_matmul.pack)(weight)
            self.bias = None if bias is None else bias.float()  # the kernel adds it in float32
            self.weight = None
            return
        if not _preparable(weight):
            return
        try:
            self.packed = pack_weight(weight)
        except RuntimeError:  # no bf16 support in this CPU
            self.widened = weight.float()
            self.bias = None if bias is None else bias.float()
        self.weight = None  # the packed or widened copy replaces it

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            if x.dtype != self.panels.dtype:
                raise TypeError(f"a {self.panels.dtype} Linear got a {x.dtype} input")
            rows = x.reshape(-1, self.in_features).contiguous()
            y = cpu_matmul.matmul(
                self.kernel, rows, self.panels, self.out_features, self.bias, self.gated
            )
            return y.view(*x.shape[:-1], self.out_features)
        y = self._product(x)
        if self.gated:
            gate, up = y.chunk(2, dim=-1)
            return F.silu(gate) * up
        return y

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.linear(x, self.weight, self.bias)
        if self.packed is not None:
            return packed_product(x, self.packed, self.bias)
        return F.linear(x.float(), self.widened, self.bias).to(x.dtype)
