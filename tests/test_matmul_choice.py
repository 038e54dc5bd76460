"""Which matmul a CPU Linear runs (engine/model/matmul_choice.py): the kernel's own conditions,
the kinds measured before, and a timing at start-up on the others. The timings' values are
never asserted (noisy machines); what is tested is that both paths are timed and that the
choice, whatever the timing says, is followed and said."""

from __future__ import annotations

import json

import pytest
import torch

from engine.model import linear, matmul_choice
from engine.model.kernels import cpu_build, cpu_matmul
from engine.model.loader import build_tiny_model
from engine.model.matmul_choice import Calibration

VENDOR, FLAGS = cpu_build.this_cpu()
HAS_VECTORS = cpu_matmul.has_its_vectors(FLAGS)
needs_vectors = pytest.mark.skipif(not HAS_VECTORS, reason="the kernel needs AVX2+FMA or AVX-512")
KERNEL_FASTER = Calibration(decode_ratio=0.7, prefill_ratio=0.9)
ONEDNN_FASTER = Calibration(decode_ratio=1.2, prefill_ratio=1.0)


@pytest.fixture
def unmeasured_kind(monkeypatch):
    """This CPU's flags under a vendor the kernel was not measured on (GenuineIntel)."""
    monkeypatch.setattr(cpu_build, "this_cpu", lambda: ("GenuineIntel", FLAGS))


def timed(monkeypatch, calibration: Calibration | None) -> list:
    """The timing answers ``calibration``; returns the dtypes it was asked for."""
    asked: list = []

    def answer(dtype):
        asked.append(dtype)
        return calibration

    monkeypatch.setattr(matmul_choice, "calibration", answer)
    return asked


def test_the_choice_rule():
    assert Calibration(0.95, 1.10).kernel_wins
    assert not Calibration(0.96, 0.5).kernel_wins  # not faster where decode streams weights
    assert not Calibration(0.5, 1.11).kernel_wins  # much slower at prefill (oneDNN on AMX)
    assert KERNEL_FASTER.text() == (
        "timed on this CPU kind: the kernel took 0.70x oneDNN's time at 16 rows, 0.90x at 256"
    )
    kept = Calibration(0.7, 0.9, kept_in="/c/m.json")
    assert kept.text() == KERNEL_FASTER.text() + "; kept in /c/m.json, delete it to time again"


def test_the_kernels_own_conditions():
    amd, intel = "AuthenticAMD", "GenuineIntel"
    avx512, bf16, avx2 = {"avx2", "avx512f"}, {"avx2", "avx512f", "avx512_bf16"}, {"avx2", "fma"}
    for vendor in (amd, intel):
        assert cpu_matmul.why_not(vendor, avx512, torch.float32, 576) is None
        assert cpu_matmul.why_not(vendor, avx2, torch.float32, 576) is None
        assert cpu_matmul.why_not(vendor, bf16, torch.bfloat16, 576) is None
        assert cpu_matmul.why_not(vendor, avx512, torch.bfloat16, 576) == (
            "bfloat16 needs AVX512_BF16"
        )
        assert cpu_matmul.why_not(vendor, bf16, torch.bfloat16, 577).endswith("even input size")
        assert cpu_matmul.why_not(vendor, bf16, torch.float16, 576) == "not for torch.float16"
        no_fma = cpu_matmul.why_not(vendor, {"avx", "avx2", "sse4_2"}, torch.float32, 576)
        assert no_fma.startswith("needs AVX2 with FMA, or AVX-512")
    assert cpu_matmul.measured_kind(amd, avx512) and cpu_matmul.measured_kind(amd, avx2)
    assert not cpu_matmul.measured_kind(intel, avx512)
    assert not cpu_matmul.measured_kind(intel, avx2)


def test_a_measured_kind_is_not_timed(monkeypatch):
    monkeypatch.setattr(cpu_build, "this_cpu", lambda: ("AuthenticAMD", {"avx2", "fma"}))
    asked = timed(monkeypatch, ONEDNN_FASTER)
    assert matmul_choice.why_not_here(torch.float32, 576) is None
    assert matmul_choice.note_here(torch.float32) == ""
    assert asked == []


def test_what_the_kernel_cannot_take_is_not_timed(monkeypatch):
    monkeypatch.setattr(cpu_build, "this_cpu", lambda: ("GenuineIntel", {"avx2", "fma"}))
    asked = timed(monkeypatch, KERNEL_FASTER)
    assert matmul_choice.why_not_here(torch.bfloat16, 576) == "bfloat16 needs AVX512_BF16"
    monkeypatch.setattr(cpu_build, "this_cpu", lambda: ("GenuineIntel", {"sse4_2"}))
    assert matmul_choice.why_not_here(torch.float32, 576).startswith("needs AVX2 with FMA")
    assert asked == []


def test_another_kind_follows_its_timing(monkeypatch, unmeasured_kind):
    asked = timed(monkeypatch, KERNEL_FASTER)
    assert matmul_choice.why_not_here(torch.float32, 576) is None
    assert matmul_choice.note_here(torch.float32) == f" ({KERNEL_FASTER.text()})"
    timed(monkeypatch, ONEDNN_FASTER)
    assert matmul_choice.why_not_here(torch.float32, 576) == (
        f"oneDNN's is faster here ({ONEDNN_FASTER.text()})"
    )
    assert matmul_choice.note_here(torch.float32) == ""
    timed(monkeypatch, None)
    monkeypatch.setattr(cpu_matmul.KERNEL, "build_error", lambda: "no C compiler")
    assert matmul_choice.why_not_here(torch.float32, 576) == (
        "not measured on this CPU kind, and not timed: no C compiler"
    )
    assert set(asked) == {torch.float32}  # the dtype asked for, the timing cached per dtype


@needs_vectors
@pytest.mark.parametrize("calibration", [KERNEL_FASTER, ONEDNN_FASTER])
def test_a_linear_layer_takes_the_faster_layout_and_computes_the_same(
    monkeypatch, unmeasured_kind, calibration
):
    timed(monkeypatch, calibration)
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 64, generator=generator)
    layer = linear.Linear(weight, torch.randn(96, generator=generator))
    assert (layer.panels is not None) == calibration.kernel_wins
    assert (layer.packed is not None) == (not calibration.kernel_wins)
    x = torch.randn(5, 64, generator=generator)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, weight, layer.bias))


@needs_vectors
def test_the_start_up_line_says_what_the_timing_chose(monkeypatch, unmeasured_kind):
    timed(monkeypatch, KERNEL_FASTER)
    line = build_tiny_model("llama", seed=0).decoder.cpu_kernels_line()
    assert line.endswith(f"RoPE + K/V store, matmul ({KERNEL_FASTER.text()})")
    timed(monkeypatch, ONEDNN_FASTER)
    line = build_tiny_model("llama", seed=0).decoder.cpu_kernels_line()
    assert line.endswith(
        f"RoPE + K/V store; torch's ops for matmul: oneDNN's is faster here "
        f"({ONEDNN_FASTER.text()})"
    )


@needs_vectors
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_timing_runs_both_paths(monkeypatch, dtype):
    """On synthetic weights of a given size (small here); each ratio is a real timing."""
    if dtype == torch.bfloat16 and "avx512_bf16" not in FLAGS:
        pytest.skip("the kernel takes bfloat16 only with AVX512_BF16")
    monkeypatch.setattr(matmul_choice, "CALIBRATION_REPEATS", 1)
    calls = {"kernel": 0, "onednn": 0}
    for name, module, attr in (
        ("kernel", cpu_matmul, "matmul"),
        ("onednn", matmul_choice, "packed_product"),
    ):
        real = getattr(module, attr)

        def counted(*args, real=real, name=name, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, attr, counted)
    found = matmul_choice.measure(cpu_matmul.KERNEL.load(), dtype, 12 << 20)
    n, k = matmul_choice.WEIGHT_SHAPE
    weights = (12 << 20) // (n * k * dtype.itemsize)
    # Two passes each (a warm-up, one timed) over every weight at 16 rows, one at 256.
    assert calls == {"kernel": 2 * weights + 2, "onednn": 2 * weights + 2}
    assert 0 < found.decode_ratio < float("inf") and 0 < found.prefill_ratio < float("inf")


@pytest.mark.parametrize(
    ("size", "expected"),
    [("32768K", 64 << 20), ("96M", 192 << 20), ("1024K", 64 << 20), ("512M", 256 << 20)],
)
def test_the_weights_timed_are_twice_the_last_level_cache(monkeypatch, tmp_path, size, expected):
    path = tmp_path / "size"
    path.write_text(size + "\n")
    monkeypatch.setattr(matmul_choice, "L3_SIZE_PATH", path)
    assert matmul_choice.weight_bytes() == expected
    monkeypatch.setattr(matmul_choice, "L3_SIZE_PATH", tmp_path / "missing")
    assert matmul_choice.weight_bytes() == matmul_choice.MIN_WEIGHT_BYTES


@needs_vectors
def test_the_bench_prints_its_figures(capsys):
    from bench import matmul_choice as bench

    assert bench.main(["--rounds", "1"]) == 0
    figures = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert len(figures["decode_ratios"]) == len(figures["kernel_chosen"]) == 1
    assert figures["measured_kind"] == cpu_matmul.measured_kind(VENDOR, FLAGS)


@pytest.fixture
def kept_timings(monkeypatch, tmp_path):
    """The kernel cache (where timings are kept) in tmp_path, every timing fake and counted,
    no timing cached in the process before or after."""
    monkeypatch.setenv("ITERSCOPE_KERNEL_CACHE", str(tmp_path))
    measured: list = []

    def fake_measure(library, dtype, total_bytes):
        measured.append(dtype)
        return KERNEL_FASTER

    monkeypatch.setattr(matmul_choice, "measure", fake_measure)
    matmul_choice.calibration.cache_clear()
    yield measured
    matmul_choice.calibration.cache_clear()


@needs_vectors
def test_a_timing_is_kept_so_every_later_process_chooses_alike(kept_timings, tmp_path):
    first = matmul_choice.calibration(torch.float32)
    path = matmul_choice.kept_path(torch.float32)
    assert path.parent == tmp_path and first.kept_in == str(path)
    assert (first.decode_ratio, first.prefill_ratio) == (0.7, 0.9)
    matmul_choice.calibration.cache_clear()  # a later process
    assert matmul_choice.calibration(torch.float32) == first
    assert kept_timings == [torch.float32]  # timed once
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


@needs_vectors
def test_a_kept_timing_that_cannot_be_read_is_timed_again(kept_timings):
    path = matmul_choice.kept_path(torch.float32)
    path.write_text('{"decode_ratio": 0.7')  # cut short
    assert matmul_choice.calibration(torch.float32).kept_in == str(path)
    assert kept_timings == [torch.float32]
    assert matmul_choice.read_kept(path).decode_ratio == 0.7


@needs_vectors
def test_a_timing_that_cannot_be_kept_is_used_and_said_so(kept_timings, monkeypatch, tmp_path):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("ITERSCOPE_KERNEL_CACHE", str(tmp_path / "a-file" / "cache"))  # no dir
    found = matmul_choice.calibration(torch.float32)
    assert found == KERNEL_FASTER and found.kept_in == ""
    assert "kept" not in found.text()


def test_what_a_kept_timing_depends_on(monkeypatch):
    here = matmul_choice.kept_path(torch.float32)
    assert matmul_choice.kept_path(torch.bfloat16) != here
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    assert matmul_choice.kept_path(torch.float32) != here
    monkeypatch.undo()
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: "flags : avx2 fma")
    assert matmul_choice.kept_path(torch.float32) != here
