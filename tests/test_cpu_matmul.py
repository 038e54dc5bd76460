"""The CPU matmul kernel (engine/model/kernels/matmul.c) against a float64 reference: its
panel layout, both tiles (a few rows: decode; more: prefill) with their short last tiles,
padding columns, the bias, and bfloat16's rounding; in this machine's build and in the
narrower vector code gcc makes of it for CPUs without AVX-512. Linear layers hold their
weights in its panels on the CPU kinds it was measured on, and the logits stay those of
plain weights."""

from __future__ import annotations

import pytest
import torch

from engine.model import linear, matmul_choice
from engine.model.kernels import cpu_build, cpu_matmul
from engine.model.loader import build_tiny_model
from tests.helpers.cpu_kernels import build_names, load_build

HAS_BF16 = "avx512_bf16" in cpu_build.cpu_flags().split()
# rows: the small tile alone (1, 5, 16), the big one with a short last tile (17, 40), whole
# blocks and more (192, 200); columns: one panel short (50), padded to a panel pair (80)
ROWS = (1, 5, 7, 13, 16, 17, 40, 192, 200)  # 6, 12: the AVX2 tiles' edges
SHAPES = ((50, 64), (80, 63), (576, 576), (96, 1536))


@pytest.fixture(scope="module", params=build_names())
def library(request, tmp_path_factory):
    return load_build(request.param, cpu_matmul, tmp_path_factory)


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    want = x.double() @ weight.double().T
    return want if bias is None else want + bias.double()


def test_the_panels_hold_each_weight_where_the_kernel_reads_it():
    weight = torch.arange(40 * 6, dtype=torch.float32).view(40, 6)
    panels = cpu_matmul.pack(weight)
    assert panels.shape == (4, 6, 16)  # 40 columns padded to 64: 4 panels of 16
    assert panels[1, 5, 3] == weight[16 + 3, 5]
    assert not panels[2, :, 8:].any() and not panels[3].any()  # the padding is zero
    pairs = cpu_matmul.pack(weight.bfloat16())
    assert pairs.shape == (4, 3, 16, 2)
    assert pairs[1, 2, 3, 1] == weight[16 + 3, 5].bfloat16()
    with pytest.raises(ValueError, match="even input size"):
        cpu_matmul.pack(torch.zeros(16, 5, dtype=torch.bfloat16))


@pytest.mark.parametrize("with_bias", [False, True])
def test_float32_is_the_product_up_to_the_order_of_sums(library, with_bias):
    generator = torch.Generator().manual_seed(1)
    for n, k in SHAPES:
        weight = torch.randn(n, k, generator=generator) * 0.05
        bias = torch.randn(n, generator=generator) if with_bias else None
        panels = cpu_matmul.pack(weight)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=generator)
            got = cpu_matmul.matmul(library, x, panels, n, bias)
            assert got.shape == (rows, n)
            torch.testing.assert_close(got.double(), reference(x, weight, bias), rtol=0, atol=2e-5)


def test_no_rows_is_no_work(library):
    panels = cpu_matmul.pack(torch.ones(32, 8))
    assert cpu_matmul.matmul(library, torch.empty(0, 8), panels, 32, None).shape == (0, 32)


@pytest.mark.skipif(not HAS_BF16, reason="this CPU has no AVX512_BF16 (see the next test)")
def test_bfloat16_products_are_exact_and_the_result_rounded_once():
    library = cpu_matmul.KERNEL.load()
    generator = torch.Generator().manual_seed(2)
    for n, k in ((50, 64), (576, 576), (96, 1536)):
        weight = (torch.randn(n, k, generator=generator) * 0.05).bfloat16()
        bias = torch.randn(n, generator=generator)
        panels = cpu_matmul.pack(weight)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=generator).bfloat16()
            got = cpu_matmul.matmul(library, x, panels, n, bias)
            want = reference(x, weight, bias)
            assert got.dtype == torch.bfloat16
            # float32 sums in another order, then one rounding: within one bf16 step
            torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-5)


@pytest.mark.skipif(not HAS_BF16, reason="this CPU has no AVX512_BF16 (see the next test)")
def test_bfloat16_results_round_as_torch_rounds():
    """A zero weight leaves the float32 bias, rounded by the kernel: ties to even, values
    below bf16's smallest normal, infinities and NaN, in both tiles."""
    library = cpu_matmul.KERNEL.load()
    tie = 1.0 + 2**-8  # halfway between two bf16 values
    values = [tie, -tie, 1.0 + 3 * 2**-8, 1e-39, -3e-40, 3.4e38, float("inf"), float("nan")]
    bias = torch.tensor(values * 8)[:50]
    panels = cpu_matmul.pack(torch.zeros(50, 64, dtype=torch.bfloat16))
    for rows in (3, 40):
        got = cpu_matmul.matmul(
            library, torch.ones(rows, 64, dtype=torch.bfloat16), panels, 50, bias
        )
        want = bias.bfloat16().expand(rows, 50).contiguous()
        nan = want.isnan()  # any NaN (torch's own bits for it vary with its code path)
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))


@pytest.mark.skipif(HAS_BF16, reason="this CPU has AVX512_BF16 (see the tests before)")
def test_bfloat16_is_refused_by_a_build_without_avx512_bf16():
    library = cpu_matmul.KERNEL.load()
    panels = cpu_matmul.pack(torch.ones(32, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="refused"):
        cpu_matmul.matmul(library, torch.ones(1, 8, dtype=torch.bfloat16), panels, 32, None)


@pytest.fixture
def measured_kind(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "measured_kind", lambda vendor, flags: True)


def test_a_linear_layer_holds_its_weight_in_panels_and_computes_the_same(measured_kind):
    generator = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(100, 64, generator=generator), torch.randn(100, generator=generator)
    layer = linear.Linear(weight, bias)
    assert layer.panels is not None and layer.weight is None and layer.packed is None
    x = torch.randn(2, 3, 64, generator=generator)  # any leading shape
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight, bias))
    with pytest.raises(TypeError, match="bfloat16 input"):
        layer(x.bfloat16())


def test_no_panels_when_weights_are_kept_plain(measured_kind, monkeypatch):
    monkeypatch.setenv("ITERSCOPE_PACK_WEIGHTS", "0")
    assert linear.Linear(torch.ones(32, 8)).panels is None


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_model_in_panels_gives_the_logits_of_plain_weights(measured_kind, monkeypatch, dtype):
    from engine.runner import ModelRunner
    from tests.helpers.cpu_kernels import prefill_then_decode_logits

    in_panels = build_tiny_model("llama", seed=5, dtype=dtype)
    expect_panels = dtype == "float32" or HAS_BF16
    assert (in_panels.decoder.layers[0].qkv_proj.panels is not None) == expect_panels
    monkeypatch.setenv("ITERSCOPE_PACK_WEIGHTS", "0")
    plain = build_tiny_model("llama", seed=5, dtype=dtype)
    got = prefill_then_decode_logits(ModelRunner(in_panels, 32, 4, "cpu"))
    want = prefill_then_decode_logits(ModelRunner(plain, 32, 4, "cpu"))
    tolerance = 1e-4 if dtype == "float32" else 5e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=0)


def test_gated_panels_pair_each_gate_panel_with_its_up_panel():
    weight = torch.arange(2 * 20 * 4, dtype=torch.float32).view(40, 4)  # gate 20 rows, up 20
    panels = cpu_matmul.pack_gated(weight)
    assert panels.shape == (4, 4, 16)  # 20 columns -> 2 panels each, interleaved
    assert panels[0, 3, 5] == weight[5, 3] and panels[1, 3, 5] == weight[20 + 5, 3]
    assert panels[2, 1, 3] == weight[16 + 3, 1] and panels[3, 1, 3] == weight[20 + 16 + 3, 1]
    assert not panels[2, :, 4:].any() and not panels[3, :, 4:].any()  # the padding is zero


def gated_reference(library, x, weight):
    """silu(gate) * up with torch's ops over the kernel's own plain product (the same sums)."""
    n = weight.shape[0]
    gate, up = cpu_matmul.matmul(library, x, cpu_matmul.pack(weight), n, None).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def test_gated_float32_is_silu_of_the_gate_times_the_up(library):
    generator = torch.Generator().manual_seed(5)
    for i, k in ((40, 64), (1536, 576)):
        weight = torch.randn(2 * i, k, generator=generator) * 0.1
        panels = cpu_matmul.pack_gated(weight)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=generator)
            got = cpu_matmul.matmul(library, x, panels, i, None, gated=True)
            want = gated_reference(library, x, weight)
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not HAS_BF16, reason="this CPU has no AVX512_BF16")
def test_gated_bfloat16_rounds_as_torch_ops_do():
    library = cpu_matmul.KERNEL.load()
    generator = torch.Generator().manual_seed(6)
    for i, k in ((40, 64), (1536, 576)):
        weight = (torch.randn(2 * i, k, generator=generator) * 0.1).bfloat16()
        panels = cpu_matmul.pack_gated(weight)
        for rows in ROWS:
            x = torch.randn(rows, k, generator=generator).bfloat16()
            got = cpu_matmul.matmul(library, x, panels, i, None, gated=True)
            want = gated_reference(library, x, weight)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_gated_with_a_bias_is_refused(library):
    panels = cpu_matmul.pack_gated(torch.ones(64, 8))
    with pytest.raises(RuntimeError, match="refused"):
        cpu_matmul.matmul(library, torch.ones(2, 8), panels, 32, torch.zeros(32), gated=True)


@pytest.mark.parametrize("kernel_kind", [True, False])
def test_a_gated_linear_layer_is_the_mlp_activation(monkeypatch, kernel_kind):
    """On every path (the kernel's panels, oneDNN's or plain weights): silu(gate) * up."""
    monkeypatch.setattr(cpu_matmul, "measured_kind", lambda vendor, flags: kernel_kind)
    monkeypatch.setattr(matmul_choice, "calibration", lambda dtype: None)  # no timing: oneDNN
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(2 * 48, 64, generator=generator) * 0.1
    layer = linear.Linear(weight, gated=True)
    assert (layer.panels is not None) == kernel_kind and layer.out_features == 48
    x = torch.randn(3, 5, 64, generator=generator)
    gate, up = torch.nn.functional.linear(x, weight).chunk(2, dim=-1)
    torch.testing.assert_close(layer(x), torch.nn.functional.silu(gate) * up)
    with pytest.raises(ValueError, match="no bias"):
        linear.Linear(weight, torch.zeros(96), gated=True)
