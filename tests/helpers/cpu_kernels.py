"""The builds of a CPU kernel (engine/model/kernels) that tests hold to a reference: this
machine's own, as the engine loads it, and the narrower vector code gcc makes of the same
source for CPUs without AVX-512 (AVX2) or without AVX at all (SSE)."""

from __future__ import annotations

import ctypes
import platform
import shutil
from types import ModuleType

import torch

from engine.model.kernels import cpu_build

NARROWER_BUILDS = {
    "avx2": ("-mno-avx512f",),
    "sse": ("-mno-avx512f", "-mno-avx2", "-mno-avx", "-mno-fma"),
}


def build_names(narrower: tuple[str, ...] = ("avx2", "sse")) -> list[str]:
    """ "native", then those of ``narrower`` this CPU can run (x86-64 only)."""
    names = ["native"]
    if platform.machine() != "x86_64":
        return names
    flags = set(cpu_build.cpu_flags().split())
    if "avx2" in narrower and {"avx2", "fma"} <= flags:
        names.append("avx2")
    if "sse" in narrower:
        names.append("sse")
    return names


def load_build(name: str, kernel: ModuleType, tmp_path_factory) -> ctypes.CDLL:
    """The kernel module's library: its own load() for "native", else built here."""
    if name == "native":
        loaded = kernel.KERNEL.load()
        assert loaded is not None, kernel.KERNEL.build_error()
        return loaded
    compiler = shutil.which("gcc")
    assert compiler, "gcc is required: the CPU kernels are built with it"
    cache = tmp_path_factory.mktemp(f"{kernel.SOURCE.stem}-{name}")
    path = cpu_build.build(compiler, cache, kernel.SOURCE, NARROWER_BUILDS[name])
    return kernel.open_library(path)


def prefill_then_decode_logits(runner) -> torch.Tensor:
    """Two prompts (10 and 15 tokens) prefilled but for their last token, then one decode
    step of both, on the runner of a tiny model with 32 blocks of 4: every logit."""
    from engine.request import Request, SamplingParams

    requests = []
    for i, n in enumerate([9, 14]):
        request = Request(f"r{i}", [(7 * i + t) % 200 for t in range(n + 1)], SamplingParams())
        request.block_ids = [31 - 8 * i - j for j in range(5)]
        requests.append(request)
    prefill = runner.compute_logits([(r, len(r.token_ids) - 1) for r in requests])
    for r in requests:
        r.num_computed_tokens = len(r.token_ids) - 1
    decode = runner.compute_logits([(r, 1) for r in requests])
    return torch.cat([*prefill, *decode])
