"""The C residual-add + RMSNorm kernel (engine/model/kernels/rms_norm.c) against torch's ops,
built for this machine, for AVX2 and for SSE only, and its use by the decoder (with
ITERSCOPE_CPU_KERNELS=0 the decoder keeps torch's ops)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.kernels import cpu_rms_norm
from engine.model.loader import build_tiny_model
from tests.helpers.cpu_kernels import build_names, load_build, prefill_then_decode_logits

EPS = 1e-5


@pytest.fixture(scope="module", params=build_names())
def library(request, tmp_path_factory):
    return load_build(request.param, cpu_rms_norm, tmp_path_factory)


def torch_reference(residual, delta, weight):
    summed = residual if delta is None else residual + delta
    return summed, F.rms_norm(summed, (summed.shape[-1],), weight, EPS)


# 1 and 16 rows stay on the calling thread, 100 is spread over threads; 67 is no vector width.
@pytest.mark.parametrize("rows", [1, 16, 100])
@pytest.mark.parametrize("dim", [576, 67])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [True, False])
def test_the_kernel_computes_what_torch_does(library, rows, dim, dtype, with_delta):
    generator = torch.Generator().manual_seed(rows * dim)
    residual = (torch.randn(rows, dim, generator=generator) * 3).to(dtype)
    delta = torch.randn(rows, dim, generator=generator).to(dtype) if with_delta else None
    weight = (torch.rand(dim, generator=generator) + 0.5).to(dtype)
    expected_residual, expected = torch_reference(residual, delta, weight)
    before = residual.clone()
    got = cpu_rms_norm.add_rms_norm(library, residual, delta, weight, EPS)
    # the add is elementwise with the same rounding: exact
    assert torch.equal(residual, expected_residual)
    assert with_delta or torch.equal(residual, before)
    if dtype == torch.float32:  # only the sum's order differs
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        return
    # bf16: one rounding after the weight, as torch: equal but where the float32 sum's order
    # moves a value across a rounding boundary (one bf16 step)
    differ = got != expected
    assert differ.float().mean() < 0.001
    torch.testing.assert_close(got[differ].float(), expected[differ].float(), rtol=2**-7, atol=0)


def test_a_nan_stays_a_nan(library):
    residual = torch.ones(2, 576, dtype=torch.bfloat16)
    residual[1, 3] = float("nan")
    got = cpu_rms_norm.add_rms_norm(
        library, residual, None, torch.ones(576, dtype=torch.bfloat16), EPS
    )
    assert not got[0].isnan().any() and got[1].isnan().all()


def runner_logits(monkeypatch, dtype: str, kernel: bool) -> tuple[bool, torch.Tensor]:
    """Prefill two prompts, then one decode step of both, on a tiny Qwen3 (its q/k norms stay
    torch's): whether the decoder took the kernel, and every logit."""
    from engine.runner import ModelRunner

    if not kernel:
        monkeypatch.setattr(cpu_rms_norm.KERNEL, "load", lambda: None)
    runner = ModelRunner(build_tiny_model("qwen3", seed=2, dtype=dtype), 32, 4, "cpu")
    logits = prefill_then_decode_logits(runner)
    return runner.decoder.norm_kernel is not None, logits


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_decoder_with_the_kernel_gives_torchs_logits(monkeypatch, dtype):
    took_kernel, ours = runner_logits(monkeypatch, dtype, kernel=True)
    assert took_kernel
    took_it_anyway, reference = runner_logits(monkeypatch, dtype, kernel=False)
    assert not took_it_anyway
    atol = 1e-4 if dtype == "float32" else 0.05  # the sums' order; bf16: a rounding step
    torch.testing.assert_close(ours, reference, atol=atol, rtol=0)


def test_kernels_off_keeps_torchs_ops(monkeypatch):
    monkeypatch.setenv("ITERSCOPE_CPU_KERNELS", "0")
    assert cpu_rms_norm.KERNEL.load() is None
    assert build_tiny_model("llama", seed=0).decoder.norm_kernel is None
