"""What ``--dtype auto`` means on this machine: bfloat16 where the hardware computes it
natively, float32 elsewhere.

On a CPU, bfloat16 is fast only with native instructions (AVX512-BF16 or AMX); without them
engine/model/linear.py widens bfloat16 weights back to float32 for every matmul, so auto
stays float32 there. On CUDA, bfloat16 needs compute capability 8.0 (Ampere) or newer;
older cards get float16, which they compute natively. The reason travels with the choice,
so that start-up can say why and a user who wants the other one knows which flag to pass.
"""

from __future__ import annotations

from pathlib import Path

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo names of native bf16 support
CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: Path | None = None) -> set[str]:
    """The first processor's feature flags (from /proc/cpuinfo unless ``cpuinfo`` names
    another file); empty where there is no such file."""
    try:
        text = (cpuinfo or CPUINFO).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return set(value.split())
    return set()


def auto_dtype(device: str, cpuinfo: Path | None = None) -> tuple[str, str]:
    """(dtype name, why) for ``--dtype auto`` on ``device``."""
    if device == "cuda":
        return _auto_cuda_dtype()
    native = sorted(set(CPU_BF16_FLAGS) & cpu_flags(cpuinfo))
    if native:
        return "bfloat16", f"the CPU computes bfloat16 natively ({', '.join(native)})"
    return "float32", (
        f"the CPU has no native bfloat16 ({' or '.join(CPU_BF16_FLAGS)}); "
        "--dtype bfloat16 would be emulated through float32"
    )


def _auto_cuda_dtype() -> tuple[str, str]:
    import torch

    major, minor = torch.cuda.get_device_capability()
    if major >= 8:
        return "bfloat16", f"the GPU (compute capability {major}.{minor}) computes bfloat16"
    return "float16", (
        f"the GPU (compute capability {major}.{minor}) has no bfloat16; "
        "float16 is its native half precision"
    )
