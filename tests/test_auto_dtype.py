"""--dtype auto: bfloat16 only where the CPU computes it natively, and start-up says why."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import auto_dtype as auto_dtype_module
from engine.auto_dtype import auto_dtype, cpu_flags
from engine.config import EngineConfig

ZEN3_FLAGS = "fpu sse sse2 avx avx2 fma f16c bmi2 sha_ni vaes"
SAPPHIRE_RAPIDS_FLAGS = "fpu sse2 avx2 avx512f avx512bw avx512_bf16 amx_tile amx_bf16 amx_int8"


def cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(
        f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n\n"
        f"processor\t: 1\nflags\t\t: {flags}\n"
    )
    return path


def test_cpu_flags_reads_the_first_processor(tmp_path):
    assert cpu_flags(cpuinfo(tmp_path, ZEN3_FLAGS)) == set(ZEN3_FLAGS.split())
    assert cpu_flags(tmp_path / "missing") == set()


def test_auto_is_float32_on_a_cpu_without_native_bf16(tmp_path):
    dtype, why = auto_dtype("cpu", cpuinfo(tmp_path, ZEN3_FLAGS))
    assert dtype == "float32"
    assert "no native bfloat16" in why and "--dtype bfloat16" in why


def test_auto_is_bfloat16_on_a_cpu_with_avx512_bf16_or_amx(tmp_path):
    dtype, why = auto_dtype("cpu", cpuinfo(tmp_path, SAPPHIRE_RAPIDS_FLAGS))
    assert dtype == "bfloat16" and "amx_bf16, avx512_bf16" in why
    assert auto_dtype("cpu", cpuinfo(tmp_path, "avx2 avx512_bf16"))[0] == "bfloat16"


def test_auto_on_cuda_follows_compute_capability(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    assert auto_dtype("cuda")[0] == "bfloat16"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (7, 5))
    dtype, why = auto_dtype("cuda")
    assert dtype == "float16" and "compute capability 7.5" in why


@pytest.mark.parametrize(
    "flags, expected", [(ZEN3_FLAGS, "float32"), (SAPPHIRE_RAPIDS_FLAGS, "bfloat16")]
)
def test_engine_config_resolves_auto_and_names_it_at_startup(
    tmp_path, monkeypatch, flags, expected
):
    monkeypatch.setattr(auto_dtype_module, "CPUINFO", cpuinfo(tmp_path, flags))
    config = EngineConfig()
    assert config.torch_dtype_name == expected
    assert config.dtype_choice()[1].startswith(f"dtype {expected} (--dtype auto: ")


def test_an_explicit_dtype_is_kept_whatever_the_cpu():
    assert EngineConfig(dtype="bf16").dtype_choice() == (
        "bfloat16",
        "dtype bfloat16 (--dtype bfloat16)",
    )
