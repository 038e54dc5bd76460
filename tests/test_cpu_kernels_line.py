"""The start-up line naming the CPU kernels a model runs, and why any other does not
(engine/model/decoder.py cpu_kernels_line): a missing compiler must not pass unseen, as the
torch paths it leaves are slower."""

from __future__ import annotations

import pytest

from engine.model.kernels import cpu_matmul, cpu_prefill_attention
from engine.model.loader import build_tiny_model

NO_COMPILER = "no C compiler (set CC or install gcc)"


@pytest.fixture
def measured_kind(monkeypatch):
    """The matmul kernel's CPU kinds are chosen by measurement (cpu_matmul.measured_kind):
    this machine counts as one of them, whatever it is (float32 builds on any x86-64)."""
    monkeypatch.setattr(cpu_matmul, "measured_kind", lambda vendor, flags: True)


def test_every_kernel_named_where_all_build(measured_kind):
    line = build_tiny_model("llama", seed=0).decoder.cpu_kernels_line()
    assert line == (
        "CPU kernels: paged decode, prefill attention, RMSNorm, RoPE + K/V store, matmul"
    )


def test_a_kernel_that_did_not_build_says_why_and_what_it_takes_along(monkeypatch, measured_kind):
    monkeypatch.setattr(cpu_prefill_attention.KERNEL, "load", lambda: None)
    monkeypatch.setattr(cpu_prefill_attention.KERNEL, "build_error", lambda: NO_COMPILER)
    line = build_tiny_model("llama", seed=0).decoder.cpu_kernels_line()
    assert line == (
        "CPU kernels: paged decode, RMSNorm, matmul; torch's ops for prefill attention: "
        f"{NO_COMPILER}; RoPE + K/V store: needs both attention kernels"
    )


def test_kernels_turned_off(monkeypatch):
    monkeypatch.setenv("ITERSCOPE_CPU_KERNELS", "0")
    line = build_tiny_model("llama", seed=0).decoder.cpu_kernels_line()
    assert line == "CPU kernels: none (ITERSCOPE_CPU_KERNELS=0): torch's ops run"


def test_a_dtype_without_kernels():
    line = build_tiny_model("llama", seed=0, dtype="float16").decoder.cpu_kernels_line()
    assert line.startswith("CPU kernels: none; torch's ops for paged decode: not for this")
